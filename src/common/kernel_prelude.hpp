// What every layer's kernels (src/<layer>/kernels_impl.inc) need before their own includes, in
// each SIMD target's generated file (cmake/kernels_target.cpp.in): the intrinsics of the target's
// flags, and one warning switched off.
#pragma once

#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics (_mm512_cvtepi16_epi8, those xxHash uses) as
// maybe-uninitialized, a known false positive. A diagnostic pragma holds for the rest of the
// translation unit, so the kernels that follow this header compile without it.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
