// The reduction itself is the layer's kernels (kernels_impl.inc), one copy per SIMD target; this
// file picks the dtype's.
#include "collectives/reduction.hpp"

#include "collectives/kernels.hpp"
#include "common/float_mode.hpp"

namespace ciera::collectives {

void reduce_in_rank_order(DType dtype, ReduceOp op, std::span<const std::byte* const> parts,
                          std::byte* out, uint64_t values) {
  reduce_in_rank_order(reduction_kernels(), dtype, op, parts, out, values);
}

void reduce_in_rank_order(const ReductionKernels& kernels, DType dtype, ReduceOp op,
                          std::span<const std::byte* const> parts, std::byte* out,
                          uint64_t values) {
  // The definition's arithmetic whatever the thread's mode: a caller that flushes subnormals
  // (torch.set_flush_denormal(True)) would otherwise reduce unlike the pool's workers, and
  // which of them reduced a round depends on timing.
  const DefinedFloatingPoint defined;
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
