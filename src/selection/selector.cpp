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
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

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
  // Two extra collectives of a few bytes per rank and per parameter.
  return 2 * model.allgather.seconds(64.0 * model.world_size);
}

size_t Selection::chosen_count() const {
  return size_t(std::count_if(shards.begin(), shards.end(), [](const ShardChoice& c) { return c.chosen; }));
}

ShardPolicy Selection::policy(size_t bucket, size_t param) const {
  for (const ShardChoice& c : shards) {
    if (c.shard.bucket == bucket && c.shard.param == param) return c.chosen ? ShardPolicy::kCiera : ShardPolicy::kRaw;
  }
  return ShardPolicy::kRaw;
}

Selection select_shards(std::span<const ShardCandidate> candidates, const CostModel& model,
                        const SelectorOptions& options) {
  options.codec.validate();
  const size_t world = size_t(model.world_size);
  Selection selection;
  selection.budget_bytes = options.cache_budget_bytes;
  selection.shards.reserve(candidates.size());

  size_t buckets = 0;
  for (const ShardCandidate& c : candidates) {
    if (c.shard_values.size() != world) {
      throw ConfigError("select_shards: shard " + c.name + " lists " + std::to_string(c.shard_values.size()) +
                        " ranks, the cost model " + std::to_string(world));
    }
    for (const double rate : {c.block_change_rate, c.value_change_rate}) {
      if (!(rate >= 0 && rate <= 1)) {
        throw ConfigError("select_shards: shard " + c.name + " has change rate " + std::to_string(rate) +
                          ", outside [0, 1]");
      }
    }
    buckets = std::max(buckets, c.bucket + 1);
  }
  std::vector<double> bucket_raw_bytes(buckets, 0.0);
  for (const ShardCandidate& c : candidates) {
    const double vb = dtype_info(c.dtype).value_bytes;
    for (const uint64_t n : c.shard_values) bucket_raw_bytes[c.bucket] += double(n) * vb;
  }

  for (const ShardCandidate& c : candidates) {
    ShardChoice choice;
    choice.shard = c;
    const double vb = dtype_info(c.dtype).value_bytes;
    const uint64_t all_values = std::accumulate(c.shard_values.begin(), c.shard_values.end(), uint64_t{0});
    uint64_t largest_shard = 0;
    for (size_t r = 0; r < world; ++r) {
      const uint64_t n = c.shard_values[r];
      largest_shard = std::max(largest_shard, n);
      choice.raw_bytes += double(n) * vb;
      choice.expected_wire_bytes +=
          expected_payload_bytes(options.codec, c.dtype, n, c.block_change_rate, c.value_change_rate);
      uint64_t memory = codec_cache_bytes(options.codec, n, /*sender=*/true);
      double peer_bytes = 0;
      for (size_t p = 0; p < world; ++p) {
        if (p == r) continue;
        memory += codec_cache_bytes(options.codec, c.shard_values[p], /*sender=*/false);
        peer_bytes += double(c.shard_values[p]) * vb;
      }
      choice.memory_bytes = std::max(choice.memory_bytes, memory);
      const CodecThroughput& speed = model.throughput(c.dtype);
      if (speed.decode_bytes_per_s > 0) choice.decode_s = std::max(choice.decode_s, peer_bytes / speed.decode_bytes_per_s);
    }
    const CodecThroughput& speed = model.throughput(c.dtype);
    if (speed.encode_bytes_per_s > 0) choice.encode_s = double(largest_shard) * vb / speed.encode_bytes_per_s;
    const double bucket_bytes = bucket_raw_bytes[c.bucket];
    const double saved_bytes = choice.raw_bytes - choice.expected_wire_bytes;
    choice.comm_saved_s = model.allgather.seconds(bucket_bytes) - model.allgather.seconds(bucket_bytes - saved_bytes);
    choice.gain_s = choice.comm_saved_s - choice.decode_s - (options.overlap ? 0.0 : choice.encode_s);
    choice.score = choice.memory_bytes ? choice.gain_s / double(choice.memory_bytes) : 0.0;
    if (all_values == 0) {
      choice.reason = "empty";
    } else if (speed.encode_bytes_per_s <= 0 || speed.decode_bytes_per_s <= 0) {
      choice.reason = std::string("codec not measured for ") + std::string(dtype_name(c.dtype));
    } else if (choice.gain_s <= 0) {
      choice.reason = "no gain (" + format_seconds(choice.gain_s) + ")";
    }
    selection.shards.push_back(std::move(choice));
  }

  // Rank the profitable shards by gain per byte of cache; ties by (bucket, param).
  std::vector<size_t> order;
  for (size_t i = 0; i < selection.shards.size(); ++i) {
    if (selection.shards[i].reason.empty()) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ShardChoice& x = selection.shards[a];
    const ShardChoice& y = selection.shards[b];
    if (x.score != y.score) return x.score > y.score;
    if (x.shard.bucket != y.shard.bucket) return x.shard.bucket < y.shard.bucket;
    return x.shard.param < y.shard.param;
  });
  const double round_overhead_s = compressed_round_overhead_s(model);
  std::vector<bool> bucket_dropped(buckets, false);
  for (;;) {
    uint64_t used = 0;
    std::vector<double> bucket_gain(buckets, 0.0);
    std::vector<bool> bucket_chosen(buckets, false);
    for (const size_t i : order) {
      ShardChoice& c = selection.shards[i];
      c.chosen = false;
      if (bucket_dropped[c.shard.bucket]) {
        c.reason = "bucket gain below its round overhead (" + format_seconds(round_overhead_s) + ")";
      } else if (c.memory_bytes > options.cache_budget_bytes - used) {
        c.reason = "over budget";
      } else {
        c.chosen = true;
        c.reason = "chosen";
        used += c.memory_bytes;
        bucket_gain[c.shard.bucket] += c.gain_s;
        bucket_chosen[c.shard.bucket] = true;
      }
    }
    bool dropped_any = false;
    for (size_t b = 0; b < buckets; ++b) {
      if (bucket_chosen[b] && bucket_gain[b] <= round_overhead_s) bucket_dropped[b] = dropped_any = true;
    }
    if (dropped_any) continue;  // the freed budget may go to shards of other buckets
    selection.cache_bytes = used;
    selection.gain_s = 0;
    for (size_t b = 0; b < buckets; ++b) {
      if (bucket_gain[b] > 0) selection.gain_s += bucket_gain[b] - round_overhead_s;
    }
    return selection;
  }
}

}  // namespace ciera
