// Benefit-driven selective compression, paper §3.2.
//
// Where this departs from the paper, and why:
//  * The expected payload takes the smaller of the paper's block mode and our fine mode
//    (the codec's expected_payload_bytes), since the encoder sends whichever is smaller.
//  * The paper prints g_i = Comm(S_i) - Comm(S_s+m + S_bm + q_i S_e) + T_hash + T_cmp + T_decmp;
//    codec time is a cost, so it is subtracted here (the "+" would favour slow codecs).
//  * Comm() is taken at the shard's bucket size: shards of one layer travel in one collective
//    (as FSDP gathers them), so compressing one shard saves Comm(bucket) - Comm(bucket - saved),
//    not Comm(S_i) - Comm(S'_i), which would count the collective's latency once per shard.
//  * The engine's compressed rounds cost one size exchange and one verdict exchange per bucket
//    (docs/format.md, Engine protocol). A bucket whose chosen shards do not pay for them is
//    dropped and the ranking repeated, so a budget never goes to a bucket that would run slower.
//  * Three choices per shard (with allow_delta): raw, ciera and delta (value-delta frames, whose
//    cache is the previous values: value_bytes per value on every rank, against one byte per
//    value for exponents). This is a multiple-choice knapsack; its standard greedy walks each
//    shard's upper convex hull of (memory, gain) from raw, ranking every hull step by its
//    incremental gain per incremental byte. Ranking delta by its total gain per byte instead
//    would leave a shard at ciera when the budget could upgrade it, or skip cheap ciera shards
//    for one expensive delta shard. Leftover budget then goes to any upgrade that still fits
//    (a choice off the hull, or a step the greedy had to pass over).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "ciera/error.hpp"
#include "ciera/selection.hpp"

namespace ciera {
namespace {

std::string format_seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g ms", s * 1e3);
  return text;
}

}  // namespace

double compressed_round_overhead_s(const CostModel& model) {
  // The two extra small collectives of a compressed round (envelope sizes, verdicts), each
  // priced as an allgather of 64 bytes per rank, whatever the number of parameters.
  return 2 * model.allgather.seconds(64.0 * model.world_size);
}

size_t Selection::chosen_count() const {
  return size_t(std::count_if(shards.begin(), shards.end(), [](const ShardChoice& c) { return c.chosen; }));
}

ShardPolicy Selection::policy(size_t bucket, size_t param) const {
  return policy(0, bucket, param);
}

ShardPolicy Selection::policy(size_t group, size_t bucket, size_t param) const {
  for (const ShardChoice& c : shards) {
    if (c.shard.group == group && c.shard.bucket == bucket && c.shard.param == param)
      return c.policy;
  }
  return ShardPolicy::kRaw;
}

size_t Selection::count(ShardPolicy policy) const {
  return size_t(std::count_if(shards.begin(), shards.end(), [&](const ShardChoice& c) { return c.policy == policy; }));
}

namespace {

// One candidate's expected wire bytes, memory and times under one stream kind, summed or
// maximised over ranks as ShardChoice describes. `payload_bytes(n)`: one rank's expected payload.
template <typename PayloadBytes>
PolicyEstimate estimate(const ShardCandidate& c, const CodecConfig& codec, const CodecThroughput& speed,
                        const CostModel& model, double bucket_bytes, PayloadBytes&& payload_bytes) {
  const size_t world = c.shard_values.size();
  const double vb = dtype_info(c.dtype).value_bytes;
  PolicyEstimate e;
  double raw_bytes = 0;
  uint64_t largest_shard = 0;
  for (size_t r = 0; r < world; ++r) {
    const uint64_t n = c.shard_values[r];
    largest_shard = std::max(largest_shard, n);
    raw_bytes += double(n) * vb;
    e.expected_wire_bytes += payload_bytes(n);
    uint64_t memory = codec_cache_bytes(codec, n, /*sender=*/true);
    double peer_bytes = 0;
    for (size_t p = 0; p < world; ++p) {
      if (p == r) continue;
      memory += codec_cache_bytes(codec, c.shard_values[p], /*sender=*/false);
      peer_bytes += double(c.shard_values[p]) * vb;
    }
    e.memory_bytes = std::max(e.memory_bytes, memory);
    if (speed.decode_bytes_per_s > 0) e.decode_s = std::max(e.decode_s, peer_bytes / speed.decode_bytes_per_s);
  }
  if (speed.encode_bytes_per_s > 0) e.encode_s = double(largest_shard) * vb / speed.encode_bytes_per_s;
  const double saved_bytes = raw_bytes - e.expected_wire_bytes;
  e.comm_saved_s = model.allgather.seconds(bucket_bytes) - model.allgather.seconds(bucket_bytes - saved_bytes);
  return e;
}

// A shard gathered `times` more times in the step with its values unchanged since its previous
// gather on the same engine (FSDP2's backward re-gather of a layer resharded to the forward's
// group): `e` becomes per step, adding `again`, the estimate of one such gather, `times` times.
void add_regathers(PolicyEstimate& e, uint32_t times, const PolicyEstimate& again) {
  e.expected_wire_bytes += times * again.expected_wire_bytes;
  e.comm_saved_s += times * again.comm_saved_s;
  e.encode_s += times * again.encode_s;
  e.decode_s += times * again.decode_s;
}

void finish_estimate(PolicyEstimate& e, bool overlap, bool empty, const CodecThroughput& speed, DType dtype) {
  e.gain_s = e.comm_saved_s - e.decode_s - (overlap ? 0.0 : e.encode_s);
  e.score = e.memory_bytes ? e.gain_s / double(e.memory_bytes) : 0.0;
  if (!e.unavailable.empty()) return;
  if (empty) {
    e.unavailable = "empty";
  } else if (speed.encode_bytes_per_s <= 0 || speed.decode_bytes_per_s <= 0) {
    e.unavailable = std::string("codec not measured for ") + std::string(dtype_name(dtype));
  } else if (e.gain_s <= 0) {
    e.unavailable = "no gain (" + format_seconds(e.gain_s) + ")";
  }
}

// A shard's options as (memory, gain) points: index 0 raw, 1 ciera, 2 delta.
struct Option {
  ShardPolicy policy;
  uint64_t memory_bytes;
  double gain_s;
};

std::vector<Option> options_of(const ShardChoice& c) {
  std::vector<Option> options = {{ShardPolicy::kRaw, 0, 0.0}};
  if (c.reason.empty()) options.push_back({ShardPolicy::kCiera, c.memory_bytes, c.gain_s});
  if (c.delta.unavailable.empty()) options.push_back({ShardPolicy::kDelta, c.delta.memory_bytes, c.delta.gain_s});
  return options;
}

// One step along a shard's hull: from option `from` to option `to` (indices into its options).
struct Step {
  size_t shard;
  size_t from, to;
  uint64_t memory_bytes;  // incremental
  double gain_s;          // incremental
  double score() const { return memory_bytes ? gain_s / double(memory_bytes) : std::numeric_limits<double>::infinity(); }
};

// The upper convex hull of `options` from raw (index 0): from the current point, the option of
// more memory and more gain with the steepest slope (ties: the smaller memory), until none is left.
void hull_steps(size_t shard, const std::vector<Option>& options, std::vector<Step>& steps) {
  size_t at = 0;
  for (;;) {
    size_t best = 0;
    double best_slope = 0;
    for (size_t i = 1; i < options.size(); ++i) {
      if (options[i].memory_bytes < options[at].memory_bytes || options[i].gain_s <= options[at].gain_s) continue;
      const uint64_t dm = options[i].memory_bytes - options[at].memory_bytes;
      const double slope = dm ? (options[i].gain_s - options[at].gain_s) / double(dm) : std::numeric_limits<double>::infinity();
      if (best == 0 || slope > best_slope ||
          (slope == best_slope && options[i].memory_bytes < options[best].memory_bytes)) {
        best = i;
        best_slope = slope;
      }
    }
    if (best == 0) return;
    steps.push_back({shard, at, best, options[best].memory_bytes - options[at].memory_bytes,
                     options[best].gain_s - options[at].gain_s});
    at = best;
  }
}

std::string chosen_reason(ShardPolicy policy) { return policy == ShardPolicy::kDelta ? "chosen: delta" : "chosen"; }

// The throughputs the selector divides by: finite and >= 0 (0: not measured). A NaN would make
// a shard's coding cost NaN, which the gain's max(0, ...) reads as free.
void check_throughputs(const CostModel& model, size_t group) {
  for (const CodecThroughput* kind : {model.codec, model.delta_codec}) {
    for (size_t d = 0; d < 3; ++d) {
      for (const double v :
           {kind[d].detect_bytes_per_s, kind[d].encode_bytes_per_s, kind[d].decode_bytes_per_s}) {
        if (!(std::isfinite(v) && v >= 0)) {
          throw ConfigError("select_shards: cost model " + std::to_string(group) +
                            " has a codec throughput of " + std::to_string(v) +
                            " bytes/s (must be finite and >= 0; 0 is not measured)");
        }
      }
    }
  }
}

// A candidate list select_shards can price: no shard listed twice, each in a group of the
// given cost models with one shard size per rank of it, change rates in [0, 1], a finite
// delta_bits_per_value.
void check_candidates(std::span<const ShardCandidate> candidates,
                      std::span<const CostModel> models) {
  // A shard listed twice would be charged to the budget twice, and Selection::policy() would
  // answer for the first listing only.
  std::set<std::tuple<size_t, size_t, size_t>> listed;
  for (const ShardCandidate& c : candidates) {
    if (!listed.emplace(c.group, c.bucket, c.param).second) {
      throw ConfigError("select_shards: shard " + c.name + " (group " + std::to_string(c.group) +
                        ", bucket " + std::to_string(c.bucket) + ", parameter " +
                        std::to_string(c.param) + ") is listed twice");
    }
    if (c.group >= models.size()) {
      throw ConfigError("select_shards: shard " + c.name + " is in group " +
                        std::to_string(c.group) + ", but " + std::to_string(models.size()) +
                        " cost model(s) were given");
    }
    const size_t world = size_t(models[c.group].world_size);
    if (c.shard_values.size() != world) {
      throw ConfigError("select_shards: shard " + c.name + " lists " +
                        std::to_string(c.shard_values.size()) +
                        " ranks, the cost model of its group " + std::to_string(world));
    }
    for (const double rate : {c.block_change_rate, c.value_change_rate}) {
      if (!(rate >= 0 && rate <= 1)) {
        throw ConfigError("select_shards: shard " + c.name + " has change rate " + std::to_string(rate) +
                          ", outside [0, 1]");
      }
    }
    if (std::isnan(c.delta_bits_per_value) || std::isinf(c.delta_bits_per_value)) {
      throw ConfigError("select_shards: shard " + c.name + " has delta_bits_per_value " +
                        std::to_string(c.delta_bits_per_value));
    }
  }
}

// The candidates' buckets, per group: (group, bucket) numbered densely, in that order, each
// with its raw bytes (every rank's shards) and the overhead of its compressed rounds in a step.
class Buckets {
 public:
  Buckets(std::span<const ShardCandidate> candidates, std::span<const CostModel> models) {
    for (const ShardCandidate& c : candidates) ids_.emplace(std::pair(c.group, c.bucket), 0);
    for (auto& [key, id] : ids_) {
      id = round_overhead_s_.size();
      round_overhead_s_.push_back(compressed_round_overhead_s(models[key.first]));
    }
    // Every gather of a bucket in the step pays the overhead (gains are per step too).
    std::vector<uint32_t> regathers(size(), 0);
    raw_bytes_.assign(size(), 0.0);
    for (const ShardCandidate& c : candidates) {
      regathers[of(c)] = std::max(regathers[of(c)], c.regathers);
      const double vb = dtype_info(c.dtype).value_bytes;
      for (const uint64_t n : c.shard_values) raw_bytes_[of(c)] += double(n) * vb;
    }
    for (size_t b = 0; b < size(); ++b) round_overhead_s_[b] *= 1 + regathers[b];
  }

  size_t size() const { return ids_.size(); }
  size_t of(const ShardCandidate& c) const { return ids_.at(std::pair(c.group, c.bucket)); }
  double raw_bytes(size_t b) const { return raw_bytes_[b]; }
  double round_overhead_s(size_t b) const { return round_overhead_s_[b]; }

 private:
  std::map<std::pair<size_t, size_t>, size_t> ids_;
  std::vector<double> round_overhead_s_;
  std::vector<double> raw_bytes_;
};

// Candidate `c`'s choice, priced: its exponent-reuse estimate (and why it is unavailable, if
// it is) and its delta estimate, per step; `bucket_bytes` the raw bytes of its bucket.
ShardChoice priced(const ShardCandidate& c, const CostModel& model, const SelectorOptions& options,
                   double bucket_bytes) {
  ShardChoice choice;
  choice.shard = c;
  const double vb = dtype_info(c.dtype).value_bytes;
  for (const uint64_t n : c.shard_values) choice.raw_bytes += double(n) * vb;
  const bool empty = choice.raw_bytes == 0;

  CodecConfig ciera_codec = options.codec;
  ciera_codec.stream_kind = StreamKind::kExponentReuse;
  ciera_codec.dtype = c.dtype;
  PolicyEstimate ciera =
      estimate(c, ciera_codec, model.throughput(c.dtype), model, bucket_bytes, [&](uint64_t n) {
        return expected_payload_bytes(options.codec, c.dtype, n, c.block_change_rate,
                                      c.value_change_rate);
      });
  // A re-gather finds no exponent changed: sign and mantissa travel again, with an empty bitmap.
  add_regathers(
      ciera, c.regathers,
      estimate(c, ciera_codec, model.throughput(c.dtype), model, bucket_bytes, [&](uint64_t n) {
        return expected_payload_bytes(options.codec, c.dtype, n, 0.0, 0.0);
      }));
  finish_estimate(ciera, options.overlap, empty, model.throughput(c.dtype), c.dtype);
  choice.expected_wire_bytes = ciera.expected_wire_bytes;
  choice.comm_saved_s = ciera.comm_saved_s;
  choice.encode_s = ciera.encode_s;
  choice.decode_s = ciera.decode_s;
  choice.gain_s = ciera.gain_s;
  choice.memory_bytes = ciera.memory_bytes;
  choice.score = ciera.score;
  choice.reason = ciera.unavailable;

  if (!options.allow_delta) {
    choice.delta.unavailable = "delta not allowed";
    return choice;
  }
  CodecConfig delta_codec = options.codec;
  delta_codec.stream_kind = StreamKind::kValueDelta;
  delta_codec.dtype = c.dtype;
  const CodecThroughput& speed = model.delta_throughput(c.dtype);
  choice.delta = estimate(c, delta_codec, speed, model, bucket_bytes, [&](uint64_t n) {
    return expected_delta_payload_bytes(n, c.delta_bits_per_value);
  });
  // A re-gather finds no value changed: a frame of nothing but its header.
  add_regathers(choice.delta, c.regathers,
                estimate(c, delta_codec, speed, model, bucket_bytes,
                         [&](uint64_t n) { return expected_delta_payload_bytes(n, 0.0); }));
  if (c.delta_bits_per_value < 0) choice.delta.unavailable = "value changes not measured";
  finish_estimate(choice.delta, options.overlap, empty, speed, c.dtype);
  return choice;
}

// The option each shard of `selection` holds (an index into its `shard_options`) when the
// `steps` (ranked) are taken in turn while they fit the budget, skipping the shards of
// `dropped` buckets, and then each shard in `shard_order` takes the best upgrade that still
// fits; and the cache bytes that takes.
struct Allocation {
  std::vector<size_t> at;
  uint64_t used = 0;
};

Allocation allocate(const Selection& selection,
                    const std::vector<std::vector<Option>>& shard_options,
                    const std::vector<Step>& steps, const std::vector<size_t>& shard_order,
                    const Buckets& buckets, const std::vector<bool>& dropped, uint64_t budget) {
  uint64_t used = 0;
  std::vector<size_t> at(selection.shards.size(), 0);
  for (const Step& s : steps) {
    if (dropped[buckets.of(selection.shards[s.shard].shard)] || at[s.shard] != s.from) continue;
    if (s.memory_bytes > budget - used) continue;  // and its later steps
    used += s.memory_bytes;
    at[s.shard] = s.to;
  }
  for (const size_t i : shard_order) {
    if (dropped[buckets.of(selection.shards[i].shard)]) continue;
    const std::vector<Option>& o = shard_options[i];
    size_t best = at[i];
    for (size_t k = 1; k < o.size(); ++k) {
      if (o[k].gain_s > o[best].gain_s && o[k].memory_bytes >= o[at[i]].memory_bytes &&
          o[k].memory_bytes - o[at[i]].memory_bytes <= budget - used) {
        best = k;
      }
    }
    used += o[best].memory_bytes - o[at[i]].memory_bytes;
    at[i] = best;
  }
  return {std::move(at), used};
}

}  // namespace

Selection select_shards(std::span<const ShardCandidate> candidates, const CostModel& model,
                        const SelectorOptions& options) {
  return select_shards(candidates, std::span<const CostModel>(&model, 1), options);
}

Selection select_shards(std::span<const ShardCandidate> candidates,
                        std::span<const CostModel> models, const SelectorOptions& options) {
  options.codec.validate();
  for (size_t g = 0; g < models.size(); ++g) check_throughputs(models[g], g);
  check_candidates(candidates, models);
  const Buckets buckets(candidates, models);
  Selection selection;
  selection.budget_bytes = options.cache_budget_bytes;
  selection.shards.reserve(candidates.size());
  for (const ShardCandidate& c : candidates) {
    selection.shards.push_back(
        priced(c, models[c.group], options, buckets.raw_bytes(buckets.of(c))));
  }

  // Every shard's hull steps, ranked by incremental gain per incremental byte; ties by
  // (group, bucket, param), then along the hull.
  std::vector<std::vector<Option>> shard_options;
  std::vector<Step> steps;
  for (size_t i = 0; i < selection.shards.size(); ++i) {
    shard_options.push_back(options_of(selection.shards[i]));
    hull_steps(i, shard_options.back(), steps);
  }
  std::stable_sort(steps.begin(), steps.end(), [&](const Step& x, const Step& y) {
    if (x.score() != y.score()) return x.score() > y.score();
    const ShardCandidate& a = selection.shards[x.shard].shard;
    const ShardCandidate& b = selection.shards[y.shard].shard;
    return std::tie(a.group, a.bucket, a.param) < std::tie(b.group, b.bucket, b.param);
  });
  // Upgrades off the ranking, tried in the same shard order.
  std::vector<size_t> shard_order;
  for (const Step& s : steps) {
    if (s.from == 0) shard_order.push_back(s.shard);
  }

  std::vector<bool> bucket_dropped(buckets.size(), false);
  for (;;) {
    const auto [at, used] = allocate(selection, shard_options, steps, shard_order, buckets,
                                     bucket_dropped, options.cache_budget_bytes);
    std::vector<double> bucket_gain(buckets.size(), 0.0);
    std::vector<bool> bucket_chosen(buckets.size(), false);
    for (size_t i = 0; i < selection.shards.size(); ++i) {
      ShardChoice& c = selection.shards[i];
      const size_t b = buckets.of(c.shard);
      const Option& o = shard_options[i][at[i]];
      c.policy = o.policy;
      c.chosen = o.policy != ShardPolicy::kRaw;
      c.chosen_memory_bytes = o.memory_bytes;
      c.chosen_gain_s = o.gain_s;
      if (shard_options[i].size() == 1) continue;  // no option: its reason says why
      if (bucket_dropped[b]) {
        c.reason = "bucket gain below its round overhead (" +
                   format_seconds(buckets.round_overhead_s(b)) + ")";
      } else if (c.chosen) {
        c.reason = chosen_reason(c.policy);
        bucket_gain[b] += o.gain_s;
        bucket_chosen[b] = true;
      } else {
        c.reason = "over budget";
      }
    }
    bool dropped_any = false;
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (bucket_chosen[b] && bucket_gain[b] <= buckets.round_overhead_s(b))
        bucket_dropped[b] = dropped_any = true;
    }
    if (dropped_any) continue;  // the freed budget may go to shards of other buckets
    selection.cache_bytes = used;
    selection.gain_s = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (bucket_gain[b] > 0) selection.gain_s += bucket_gain[b] - buckets.round_overhead_s(b);
    }
    return selection;
  }
}

}  // namespace ciera
