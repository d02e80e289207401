// Benefit-driven selective compression (paper §3.2): a cost model measured on the real transport
// and codec, warmup statistics of how often each shard's exponents (and values) change, and the
// selector that compresses a shard only where the time it saves beats the time it costs, ranked by
// gain per byte of codec cache, under a memory budget. Beyond the paper it can choose, per shard,
// among three policies: raw, ciera (exponent reuse) and delta (value-delta frames, which cache
// the previous values: more memory, far fewer bytes when values barely move).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"  // expected_payload_bytes, codec_cache_bytes
#include "ciera/config.hpp"
#include "ciera/dtype.hpp"
#include "ciera/error.hpp"
#include "ciera/transport.hpp"

namespace ciera {

// ---- Cost model ---------------------------------------------------------------------------------

// One measured point of Comm(): a collective whose output totals `bytes` took `seconds`.
struct CommSample {
  double bytes = 0;
  double seconds = 0;
};

// Comm(bytes): time of one allgather over all ranks as a function of the bytes it gathers (the
// output size). Piecewise-linear through the measured samples (made monotone: a larger collective
// is never assumed faster), beyond them the least-squares alpha-beta line, anchored at the last
// sample so the curve stays continuous, and below them the same slope down to the fitted latency
// (never above the first sample).
class CommCurve {
 public:
  CommCurve() = default;
  // Throws ConfigError if there are fewer than two distinct sizes, or a size or time is negative
  // or not finite.
  static CommCurve fit(std::vector<CommSample> samples);

  double seconds(double bytes) const;
  double alpha_s() const { return alpha_s_; }                    // fitted latency
  double bytes_per_s() const { return bytes_per_s_; }            // fitted bandwidth
  const std::vector<CommSample>& samples() const { return samples_; }
  bool empty() const { return samples_.empty(); }

 private:
  std::vector<CommSample> samples_;
  double alpha_s_ = 0;
  double bytes_per_s_ = 0;
};

// Codec speed of this machine for one dtype, in bytes of raw shard per second. Change detection
// is fused into encoding in this codec (split_detect), so `encode` includes it; `detect` is the
// detection pass alone, reported for the characterisation (paper O5).
struct CodecThroughput {
  double detect_bytes_per_s = 0;
  double encode_bytes_per_s = 0;
  double decode_bytes_per_s = 0;
};

struct CostModel {
  int world_size = 1;
  CommCurve allgather;
  // Zero throughput means "not measured" and makes the selector skip the dtype.
  const CodecThroughput& throughput(DType dtype) const { return codec[index(dtype)]; }
  CodecThroughput& throughput(DType dtype) { return codec[index(dtype)]; }
  // The same for value-delta streams (the delta policy); zero: delta is not considered.
  const CodecThroughput& delta_throughput(DType dtype) const { return delta_codec[index(dtype)]; }
  CodecThroughput& delta_throughput(DType dtype) { return delta_codec[index(dtype)]; }

  CodecThroughput codec[3];        // by dtype: BF16, FP16, FP32 (see index())
  CodecThroughput delta_codec[3];  // by dtype, value-delta streams

 private:
  // DType values are wire codes starting at 1; anything else is a bug of the caller.
  static size_t index(DType dtype) {
    const size_t i = static_cast<size_t>(dtype) - 1;
    if (i >= 3) throw ConfigError("CostModel: unknown dtype code " + std::to_string(int(dtype)));
    return i;
  }
};

// Times allgatherv of total sizes `sizes_bytes` (each split evenly over the ranks) `repeats` times
// and keeps the median per size; every rank gets the same curve (each sample is the slowest rank's
// median). Collective: all ranks call it with the same arguments.
CommCurve measure_allgather(Transport& transport, std::span<const uint64_t> sizes_bytes,
                            int repeats = 5);
// Default sizes for measure_allgather: powers of four from 4 KiB up to `largest_bytes`, and at
// least two of them (4 and 16 KiB where `largest_bytes` is smaller).
std::vector<uint64_t> default_probe_sizes(uint64_t largest_bytes);

// Encodes and decodes a synthetic shard of `values` values (sparse ±1 exponent steps at
// `change_rate` per value, as after warmup, and half the mantissas moving by one unit) with
// `config` (its stream_kind too) and returns this machine's throughput. Local.
CodecThroughput measure_codec(const CodecConfig& config, uint64_t values = 1 << 20,
                              double change_rate = 0.005, int repeats = 5);

// The whole cost model of this job, the same on every rank: Comm() of `transport` up to
// `largest_bytes` (default_probe_sizes) and the codec's throughput for each of `dtypes`, both
// stream kinds, the slowest rank's. Collective.
CostModel measure_cost_model(Transport& transport, uint64_t largest_bytes, std::span<const DType> dtypes,
                             const CodecConfig& codec, int repeats = 5);

// Makes a locally measured value the same on every rank: the maximum over ranks (a time) or the
// minimum (a throughput), so that every rank's selector sees identical inputs.
double agree_max(Transport& transport, double value);
double agree_min(Transport& transport, double value);

// ---- Warmup statistics --------------------------------------------------------------------------

// How often the exponents of one parameter's shards changed between consecutive observations.
// Counts are sums over observations (and, after merge, over ranks): rates are ratios of sums.
struct ShardChangeCounts {
  uint64_t observations = 0;    // step transitions seen
  uint64_t values = 0;          // values compared, summed over observations
  uint64_t blocks = 0;          // blocks compared, summed over observations
  uint64_t changed_values = 0;  // values whose exponent differed from the previous observation
  uint64_t changed_blocks = 0;  // blocks with at least one changed exponent (q_i of §3.2)
  // With a monitor that tracks values (else 0):
  uint64_t changed_patterns = 0;  // values whose bit pattern differed from the previous observation
  // The estimated size of each observed step's value-delta section of this shard, in bits
  // (ChangeMonitor, "Value-delta estimate"), summed.
  uint64_t value_delta_bits = 0;

  double value_change_rate() const { return values ? double(changed_values) / double(values) : 0; }
  double block_change_rate() const { return blocks ? double(changed_blocks) / double(blocks) : 0; }
  double pattern_change_rate() const { return values ? double(changed_patterns) / double(values) : 0; }
  // Bits per value of a value-delta section (ShardCandidate::delta_bits_per_value).
  double delta_bits_per_value() const { return values ? double(value_delta_bits) / double(values) : 0; }
  void merge(const ShardChangeCounts& other);
};

// Watches this rank's shards of one bucket from step to step, blocks cut as the codec cuts them.
// Memory: one byte per local value (the previous exponents), plus with `track_values` the previous
// values (value_bytes per value), which the delta policy's statistics need (changed_patterns,
// value_delta_bits). Not thread-safe.
class ChangeMonitor {
 public:
  ChangeMonitor(DType dtype, std::vector<uint64_t> shard_values, uint32_t block_values,
                bool track_values = false);

  // `shards` is this rank's input to the bucket's gather: its shards, concatenated. The first call
  // only records exponents.
  void observe(std::span<const std::byte> shards);
  const std::vector<ShardChangeCounts>& counts() const { return counts_; }
  void clear_counts();  // keeps the last exponents, so the next observe() counts again
  size_t memory_bytes() const { return previous_.size() + previous_values_.size(); }
  bool tracks_values() const { return track_values_; }

 private:
  void count_value_changes(std::span<const std::byte> shards);

  DType dtype_;
  std::vector<uint64_t> shard_values_;
  uint32_t block_values_;
  bool track_values_;
  std::vector<std::byte> previous_values_;  // with track_values_
  std::vector<uint8_t> previous_;
  std::vector<uint8_t> current_;
  std::vector<ShardChangeCounts> counts_;
  bool primed_ = false;
};

// Sums `counts` over all ranks, in place (one allgather). Collective.
void merge_counts_across_ranks(Transport& transport, std::vector<ShardChangeCounts>& counts);

// Expected value-delta frame of a shard of `values` values whose section costs
// `section_bits_per_value` (measured: ShardChangeCounts::delta_bits_per_value): the payload header
// plus the section. 0 for an empty shard (nothing is sent for it but its length). A negative rate
// (not measured) counts as 0; a NaN or infinite one is a ConfigError.
double expected_delta_payload_bytes(uint64_t values, double section_bits_per_value);

// ---- Selector -----------------------------------------------------------------------------------

// One parameter of one bucket, as the selector sees it. Every rank passes identical candidates.
struct ShardCandidate {
  // The engine (process group) the shard is gathered by: an index into the cost models given to
  // select_shards. FSDP2 may gather a layer on more than one group (reshard_after_forward=N);
  // each group's engine holds its own state, and one budget covers all of them.
  size_t group = 0;
  size_t bucket = 0;
  size_t param = 0;
  std::string name;  // for the table
  std::string type;  // shard type (expert_ffn, attention, ...), for the table
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shard_values;  // [rank]: values of this parameter held by each rank
  double block_change_rate = 1;        // q_i: fraction of blocks whose exponents change per step
  double value_change_rate = 1;        // fraction of values whose exponent changes per step
  // Bits per value of the shard's value-delta section, measured (ShardChangeCounts::
  // delta_bits_per_value from a monitor that tracks values); negative: not measured, and the
  // delta policy is not considered for this shard.
  double delta_bits_per_value = -1;
  // Further gathers of the shard in a step on this group with its values unchanged since the
  // previous one (FSDP2's backward re-gather of a layer resharded after forward to the same
  // group: 1; the root, or a post-forward group: 0). Exponent reuse sends sign and mantissa
  // again for them, delta frames only a header; the estimates (ShardChoice) are then per step.
  uint32_t regathers = 0;
};

struct SelectorOptions {
  // Bytes of codec state one rank may hold (encoder copy of its exponents plus the caches of its
  // peers' exponents). Counted per rank with the largest state; never exceeded.
  uint64_t cache_budget_bytes = std::numeric_limits<uint64_t>::max();
  // Detection and encoding overlap compute (§3.3); off: their time is on the critical path too.
  bool overlap = true;
  CodecConfig codec;  // block size and detection mode (dtype comes from each candidate)
  // Also consider the delta policy (value-delta frames; their cache is the previous values) for
  // shards whose delta_bits_per_value was measured. Off: the paper's two-way choice.
  bool allow_delta = false;
};

// One policy's expected cost and benefit for one shard (the fields of ShardChoice, for delta).
struct PolicyEstimate {
  double expected_wire_bytes = 0;  // all ranks' payloads
  double comm_saved_s = 0;
  double encode_s = 0;
  double decode_s = 0;
  double gain_s = 0;
  uint64_t memory_bytes = 0;  // codec state on the rank that holds the most
  double score = 0;           // gain_s / memory_bytes
  std::string unavailable;    // why this policy is not an option ("" if it is)
};

// Times and bytes are per gather, or per step (the first gather and shard.regathers more) when
// the shard is gathered again in the step; raw_bytes is always one gather's.
struct ShardChoice {
  ShardCandidate shard;
  double raw_bytes = 0;            // all ranks' shards of the parameter: S_i
  double expected_wire_bytes = 0;  // S_sm + S_bitmap + exponent section + headers, all ranks
  double comm_saved_s = 0;         // Comm(bucket) - Comm(bucket with this shard compressed)
  double encode_s = 0;             // detection + encoding of the slowest rank's shard
  double decode_s = 0;             // decoding the peers' shards on the slowest rank
  double gain_s = 0;               // g_i (seconds)
  uint64_t memory_bytes = 0;       // M_i: codec state on the rank that holds the most
  double score = 0;                // g_i / M_i (seconds per byte)
  // The fields above are the ciera policy's (exponent reuse); these the delta policy's, computed
  // when SelectorOptions::allow_delta is on.
  PolicyEstimate delta;
  ShardPolicy policy = ShardPolicy::kRaw;  // the choice
  bool chosen = false;                     // policy != kRaw
  uint64_t chosen_memory_bytes = 0;        // the chosen policy's memory_bytes (0 for raw)
  double chosen_gain_s = 0;                // the chosen policy's gain_s (0 for raw)
  std::string reason;                      // why chosen or not, for the table
};

struct Selection {
  std::vector<ShardChoice> shards;  // in candidate order
  uint64_t cache_bytes = 0;         // sum of chosen_memory_bytes
  uint64_t budget_bytes = 0;
  double gain_s = 0;                // sum of the chosen gains, minus bucket round overheads

  size_t chosen_count() const;
  // The engine policy of `bucket`'s parameter `param` (raw when not a candidate), in group 0
  // or in `group`.
  ShardPolicy policy(size_t bucket, size_t param) const;
  ShardPolicy policy(size_t group, size_t bucket, size_t param) const;
  size_t count(ShardPolicy policy) const;
};

// Extra latency a bucket pays once any of its shards is compressed: the engine's compressed
// rounds add a payload-size exchange and a verdict exchange (docs/format.md, Engine protocol).
double compressed_round_overhead_s(const CostModel& model);

// §3.2. g_i = Comm(S_i) - Comm(S_sm + S_bitmap + q_i S_e) - T_decode (minus T_detect + T_encode
// when overlap is off), where Comm is the marginal cost inside the shard's bucket; rank by
// g_i / M_i, take shards while the budget lasts, skip g_i <= 0. A bucket whose chosen gains do
// not pay its compressed-round overhead is dropped whole and the ranking runs again without it.
// With allow_delta, each shard has up to three choices (raw, ciera, delta) and the ranking is
// the multiple-choice knapsack greedy: per shard, the steps along the upper convex hull of its
// (memory, gain) choices, all ranked by incremental gain per incremental byte, so a shard can be
// upgraded from ciera to delta when the budget allows; then leftover budget goes to any upgrade
// that still fits. The budget is never exceeded.
// Deterministic: ties are broken by (bucket, param). Throws ConfigError on inconsistent input.
Selection select_shards(std::span<const ShardCandidate> candidates, const CostModel& model,
                        const SelectorOptions& options);
// The same over shards of several groups, each priced with its group's cost model
// (models[candidate.group]: its transport and world size), ranked together under one budget:
// the budget is this rank's codec state in all its engines. Buckets are per group.
Selection select_shards(std::span<const ShardCandidate> candidates,
                        std::span<const CostModel> models, const SelectorOptions& options);

}  // namespace ciera
