// What the format kernels (kernels_impl.inc) include, outside the anonymous namespace each SIMD
// target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <cstring>
#include <new>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics (_mm512_cvtepi16_epi8, those xxHash uses) as
// maybe-uninitialized (a known false positive).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// xxHash's implementation inlined and compiled for this target (the content checksum kernels).
#define XXH_INLINE_ALL
#if defined(CIERA_SCALAR_ONLY)
#define XXH_VECTOR 0  // XXH_SCALAR: no SIMD in the scalar target
#endif
#include <xxhash.h>

#include "format/changes.hpp"
#include "format/kernels.hpp"

namespace ciera::format {
using Kernels = PlaneKernels;
}  // namespace ciera::format
