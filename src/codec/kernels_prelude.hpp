// What the fine-coding kernels (kernels_impl.inc) include, outside the anonymous namespace each
// SIMD target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include "common/kernel_prelude.hpp"
#include "codec/fine_kernels.hpp"

namespace ciera::codec {
using Kernels = FineKernels;
}  // namespace ciera::codec
