// Characterisation of exponent changes during training (paper §2, observations O2-O4): how many
// values change exponent from one step to the next, and how many blocks and FSDP shards hold at
// least one such change, by parameter type. docs/analysis.md defines every statistic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ciera/dtype.hpp"

namespace ciera {

// Parameter categories of the paper's Figure 4 (§2.4), plus dense FFN and everything else.
enum class ShardType : uint8_t {
  kExpertFfn = 0,  // routed and shared experts
  kAttention,      // q/k/v/o and MLA projections
  kRouter,         // routing gate (and Qwen2-MoE's shared-expert gate)
  kNorm,           // RMSNorm / LayerNorm weights, q_norm / k_norm included
  kEmbedding,      // token embedding and LM head
  kDenseFfn,       // an MLP outside the MoE blocks (DeepSeek's first dense layers)
  kOther,
};
inline constexpr size_t kShardTypeCount = 7;

// "expert_ffn", "attention", "router", "norm", "embedding", "dense_ffn", "other".
std::string_view to_string(ShardType type);

// Classifies a parameter name of the Hugging Face transformers MoE families (OLMoE, Mixtral,
// Qwen2-MoE, DeepSeek V2/V3, MiniCPM-MoE, Llama 4), in the 5.x fused-expert layout and the older
// per-expert one. Wrapper components (`_fsdp_wrapped_module.`, `module.`, `_orig_mod.`,
// `_checkpoint_wrapped_module.`) are ignored wherever they appear.
ShardType classify_parameter(std::string_view name);

// The world sizes W and block sizes B the statistics are computed for. A tensor of n values is
// split FSDP-style into W shards of ceil(n / W) values (the last ones short or empty), and each
// shard into blocks of B values (the last one partial). Empty lists are allowed: then only the
// element counts are computed.
struct ChangeGrid {
  std::vector<uint32_t> worlds = {4, 8, 16, 32};
  std::vector<uint32_t> block_values = {64, 128, 256, 512, 1024};

  // Throws ConfigError for a zero W or B.
  void validate() const;
  size_t cells() const { return worlds.size() * block_values.size(); }
  size_t cell(size_t world_index, size_t block_index) const {
    return world_index * block_values.size() + block_index;
  }
};

// Counts over one or more snapshot transitions of one or more tensors. Plain sums, so that
// aggregates weight every value, block and shard equally (never a mean of rates).
struct ChangeCounts {
  ChangeCounts() = default;
  explicit ChangeCounts(const ChangeGrid& grid);

  uint64_t transitions = 0;     // tensor transitions summed in
  uint64_t values = 0;          // values compared
  uint64_t changed_values = 0;  // values whose exponent field differs
  // Per (W, B) cell, indexed by ChangeGrid::cell: blocks, and blocks with a changed value.
  std::vector<uint64_t> blocks, changed_blocks;
  // Per W: shards holding at least one value, and those with a changed value.
  std::vector<uint64_t> shards, changed_shards;

  double element_change_rate() const;
  double block_change_rate(size_t cell) const;
  double shard_change_rate(size_t world_index) const;
  // Adds `other`, which must come from the same grid (or be empty).
  ChangeCounts& operator+=(const ChangeCounts& other);
};

// Compares the exponent fields of two snapshots of one tensor (little-endian values of `dtype`,
// equal sizes). Sign and mantissa bits are ignored: NaN payloads, -0 vs +0 are no change.
ChangeCounts count_exponent_changes(DType dtype, std::span<const std::byte> before,
                                    std::span<const std::byte> after, const ChangeGrid& grid);

class ChangeTally;  // exponent_changes.cpp: the shards and blocks counted so far

// count_exponent_changes fed piece by piece: the two snapshots arrive as consecutive pieces that
// may end anywhere, inside a block or a shard, so that a caller reading a large tensor from disk
// holds only a window of it and can report progress inside it. The counts are those of
// count_exponent_changes on the whole snapshots, however they are cut.
class ChunkedChangeCounter {
 public:
  ChunkedChangeCounter(DType dtype, uint64_t num_values, ChangeGrid grid = {});
  ~ChunkedChangeCounter();
  ChunkedChangeCounter(ChunkedChangeCounter&& other) noexcept;
  ChunkedChangeCounter& operator=(ChunkedChangeCounter&& other) noexcept;

  // The next values of both snapshots: equal sizes, whole values, not past num_values (throws
  // ConfigError otherwise, adding nothing).
  void add(std::span<const std::byte> before, std::span<const std::byte> after);

  DType dtype() const { return dtype_; }
  uint64_t num_values() const { return num_values_; }
  uint64_t values_added() const { return values_added_; }
  // The counts of the whole snapshots; throws ConfigError while values are still to be added.
  const ChangeCounts& counts() const;

 private:
  DType dtype_;
  uint64_t num_values_;
  uint64_t values_added_ = 0;
  ChangeGrid grid_;
  ChangeCounts counts_;
  std::unique_ptr<ChangeTally> tally_;
};

// Fed successive snapshots of one tensor, e.g. after every optimizer step. Keeps one byte of
// exponent per value; the first snapshot is the baseline.
class ExponentChangeCounter {
 public:
  // The first `warmup_steps` transitions are counted per step but left out of total().
  ExponentChangeCounter(DType dtype, uint64_t num_values, ChangeGrid grid = {},
                        uint32_t warmup_steps = 0);

  // `values` holds num_values values (throws ConfigError otherwise). Returns the counts of the
  // transition from the previous snapshot (all zero for the first); valid until the next call.
  const ChangeCounts& observe(std::span<const std::byte> values);

  DType dtype() const { return dtype_; }
  uint64_t num_values() const { return num_values_; }
  const ChangeGrid& grid() const { return grid_; }
  uint32_t warmup_steps() const { return warmup_steps_; }
  // Transitions observed so far (snapshots minus one, or 0).
  uint64_t transitions() const { return changed_values_per_step_.size(); }
  // Sum over the transitions after warmup.
  const ChangeCounts& total() const { return total_; }
  // Changed values of every transition, warmup included.
  std::span<const uint64_t> changed_values_per_step() const { return changed_values_per_step_; }

 private:
  DType dtype_;
  uint64_t num_values_;
  ChangeGrid grid_;
  uint32_t warmup_steps_;
  bool have_baseline_ = false;
  std::vector<uint8_t> exponents_;  // of the previous snapshot
  ChangeCounts last_, total_;
  std::vector<uint64_t> changed_values_per_step_;
};

// Sums of ChangeCounts over many tensors and steps: per step (1 = first transition), per step
// and shard type, and over the steps after warmup, overall and by shard type.
class ChangeStatistics {
 public:
  ChangeStatistics(ChangeGrid grid, uint32_t warmup_steps);

  // `step` >= 1; steps may arrive in any order and tensor by tensor.
  void add(uint32_t step, ShardType type, const ChangeCounts& counts);

  const ChangeGrid& grid() const { return grid_; }
  uint32_t warmup_steps() const { return warmup_steps_; }
  uint32_t steps() const { return static_cast<uint32_t>(per_step_.size()); }
  const ChangeCounts& step(uint32_t step) const;
  const ChangeCounts& step(uint32_t step, ShardType type) const;
  const ChangeCounts& total() const { return total_; }
  // A `type` outside ShardType's values is a ConfigError (here and in step(step, type)).
  const ChangeCounts& total(ShardType type) const;

 private:
  ChangeGrid grid_;
  uint32_t warmup_steps_;
  ChangeCounts empty_;
  std::vector<ChangeCounts> per_step_;
  std::vector<std::vector<ChangeCounts>> per_step_by_type_;
  ChangeCounts total_;
  std::vector<ChangeCounts> total_by_type_;
};

}  // namespace ciera
