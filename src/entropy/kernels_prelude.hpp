// What the rANS kernels (kernels_impl.inc) include, outside the anonymous namespace each SIMD
// target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <bit>
#include <cstddef>

#include "common/bytes.hpp"
#include "common/kernel_prelude.hpp"
#include "entropy/histogram.hpp"
#include "entropy/kernels.hpp"

namespace ciera::entropy {
using Kernels = EntropyKernels;
}  // namespace ciera::entropy
