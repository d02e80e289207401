// The deterministic reduction of a reduce-scatter (docs/format.md, "Lossless collectives",
// "Reduction order"): the same additions in the same order whatever the transport, the coding or
// the machine, so that two runs, or a compressed run and its uncompressed twin, agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ciera/collectives.hpp"
#include "ciera/dtype.hpp"

namespace ciera::collectives {

// out[i] = round(parts[0][i] + parts[1][i] + ... + parts[W-1][i]) (divided by W for kAvg before
// the rounding): BF16 and FP16 widened to FP32, every addition an FP32 addition (round to
// nearest, ties to even) in rank order, the result rounded to `dtype` once (nearest even; NaN
// stays NaN). `parts[p]` and `out` hold `values` values of `dtype`; `out` may be one of them.
void reduce_in_rank_order(DType dtype, ReduceOp op, std::span<const std::byte* const> parts,
                          std::byte* out, uint64_t values);

struct ReductionKernels;
// The same with one SIMD target's kernels (collectives/kernels.hpp; tests run every target).
void reduce_in_rank_order(const ReductionKernels& kernels, DType dtype, ReduceOp op,
                          std::span<const std::byte* const> parts, std::byte* out, uint64_t values);

}  // namespace ciera::collectives
