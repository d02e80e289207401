// The plane kernels compiled for the 'avx512' target (flags set per file in CMakeLists.txt).
#include <cstring>
#include <new>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics (_mm512_cvtepi16_epi8, those xxHash uses) as
// maybe-uninitialized (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// xxHash's implementation inlined and compiled for this target (the content checksum kernels).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kAvx512Kernels = make_kernels("avx512");
}  // namespace ciera::format
