// What the rANS kernels (kernels_impl.inc) include, outside the anonymous namespace each SIMD
// target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics as maybe-uninitialized (a known false positive).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "common/bytes.hpp"
#include "entropy/rans_kernels.hpp"

namespace ciera::entropy {
using Kernels = RansKernels;
}  // namespace ciera::entropy
