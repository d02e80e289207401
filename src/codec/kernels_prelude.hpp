// What the fine-coding kernels (kernels_impl.inc) include, outside the anonymous namespace each
// SIMD target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "codec/fine_kernels.hpp"

namespace ciera::codec {
using Kernels = FineKernels;
}  // namespace ciera::codec
