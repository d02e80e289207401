// What the fine-coding kernels (kernels_impl.inc) include, outside the anonymous namespace each
// SIMD target's copy is compiled in (cmake/kernels_target.cpp.in).
#pragma once

#include "common/kernel_prelude.hpp"
#include "codec/differences.hpp"
#include "codec/kernels.hpp"

namespace ciera::codec {
using Kernels = CodecKernels;
}  // namespace ciera::codec
