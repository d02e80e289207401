// The reduction itself is the layer's kernels (kernels_impl.inc), one copy per SIMD target; this
// file picks the dtype's.
#include "collectives/reduction.hpp"

#include "collectives/kernels.hpp"

namespace ciera::collectives {

void reduce_in_rank_order(DType dtype, ReduceOp op, std::span<const std::byte* const> parts,
                          std::byte* out, uint64_t values) {
  reduce_in_rank_order(reduction_kernels(), dtype, op, parts, out, values);
}

void reduce_in_rank_order(const ReductionKernels& kernels, DType dtype, ReduceOp op,
                          std::span<const std::byte* const> parts, std::byte* out,
                          uint64_t values) {
  const bool average = op == ReduceOp::kAvg;
  switch (dtype) {
    case DType::kBF16:
      return kernels.reduce_bf16(parts.data(), parts.size(), average, out, values);
    case DType::kFP16:
      return kernels.reduce_fp16(parts.data(), parts.size(), average, out, values);
    case DType::kFP32:
      return kernels.reduce_fp32(parts.data(), parts.size(), average, out, values);
  }
}

}  // namespace ciera::collectives
