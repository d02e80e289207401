// The plane kernels compiled for the 'avx512' target (flags set per file in CMakeLists.txt).
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "format/kernels_targets.hpp"

// GCC 12 reports its own _mm512_cvtepi16_epi8 as maybe-uninitialized (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kAvx512Kernels = make_kernels("avx512");
}  // namespace ciera::format
