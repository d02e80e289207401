// The plane kernels compiled for the 'avx2' target (flags set per file in CMakeLists.txt).
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kAvx2Kernels = make_kernels("avx2");
}  // namespace ciera::format
