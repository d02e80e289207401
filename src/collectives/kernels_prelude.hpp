// What the reduction kernels (kernels_impl.inc) include, outside the anonymous namespace each
// SIMD target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include <algorithm>
#include <array>

#include "collectives/kernels.hpp"
#include "common/floats.hpp"
#include "common/kernel_prelude.hpp"

namespace ciera::collectives {
using Kernels = ReductionKernels;
}  // namespace ciera::collectives
