// What the format kernels (kernels_impl.inc) include, outside the anonymous namespace each SIMD
// target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <new>  // placement new of xxHash's state (checksum_reset)

#include "common/kernel_prelude.hpp"

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
