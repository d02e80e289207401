// Marks functions that the CPU code and the CUDA kernels (src/cuda/) share, so that both sides
// compute the same bytes from one definition. Plain inline functions in a host-only build.
#pragma once

#if defined(__CUDACC__)
#define CIERA_HD __host__ __device__
#else
#define CIERA_HD
#endif
