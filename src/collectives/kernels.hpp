// The collectives layer's kernel table: the deterministic reduction of a reduce-scatter
// (reduction.hpp), compiled once per SIMD target (kernels_impl.inc) like the format, entropy
// and codec kernels. Every target computes the same additions in the same order, element by
// element, so every target's result is the same bits (tests/test_collectives.cpp checks each
// against the one-value-at-a-time definition).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/simd_targets.hpp"

namespace ciera::collectives {

// One SIMD target's reductions: out[i] = round(parts[0][i] + ... + parts[count - 1][i]), divided
// by `count` before the rounding when `average` (reduction.hpp). `parts` holds `count` (at least 1)
// pointers to `n` values each; `out` may be one of them. Pointers carry no alignment requirement.
struct ReductionKernels {
  const char* target;  // common::simd_target_name()
  void (*reduce_bf16)(const std::byte* const* parts, size_t count, bool average, std::byte* out,
                      uint64_t n);
  void (*reduce_fp16)(const std::byte* const* parts, size_t count, bool average, std::byte* out,
                      uint64_t n);
  void (*reduce_fp32)(const std::byte* const* parts, size_t count, bool average, std::byte* out,
                      uint64_t n);
};

// The kernels of the process's SIMD target (common::chosen_simd_target()).
const ReductionKernels& reduction_kernels();
// The kernels of `target`, which must be available (tests run every available target).
const ReductionKernels& reduction_kernels_for(common::SimdTarget target);

}  // namespace ciera::collectives
