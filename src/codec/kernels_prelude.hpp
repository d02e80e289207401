// What the fine-coding kernels (kernels_impl.inc) include, outside the anonymous namespace each
// SIMD target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics as maybe-uninitialized (a known false positive).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "codec/fine_kernels.hpp"

namespace ciera::codec {
using Kernels = FineKernels;
}  // namespace ciera::codec
