// Warmup statistics for selection: q_i, the fraction of a shard's blocks whose exponents change
// from one step to the next (paper §3.2, "offline-measured block change rate"), measured online
// on the shards as they are about to be gathered.
#include <algorithm>
#include <cstring>
#include <string>

#include "ciera/error.hpp"
#include "ciera/selection.hpp"
#include "format/planes.hpp"

namespace ciera {

void ShardChangeCounts::merge(const ShardChangeCounts& other) {
  // Every rank observes the same steps: the observation count is shared, not summed.
  observations = std::max(observations, other.observations);
  values += other.values;
  blocks += other.blocks;
  changed_values += other.changed_values;
  changed_blocks += other.changed_blocks;
}

ChangeMonitor::ChangeMonitor(DType dtype, std::vector<uint64_t> shard_values, uint32_t block_values)
    : dtype_(dtype), shard_values_(std::move(shard_values)), block_values_(block_values) {
  if (block_values_ == 0) throw ConfigError("ChangeMonitor: block_values must be positive");
  uint64_t total = 0;
  for (const uint64_t n : shard_values_) total += n;
  previous_.resize(total);
  current_.resize(total);
  counts_.resize(shard_values_.size());
}

void ChangeMonitor::observe(std::span<const std::byte> shards) {
  const size_t value_bytes = dtype_info(dtype_).value_bytes;
  if (shards.size() != previous_.size() * value_bytes) {
    throw ConfigError("ChangeMonitor: got " + std::to_string(shards.size()) + " bytes, expected " +
                      std::to_string(previous_.size() * value_bytes));
  }
  const format::PlaneKernels& k = format::kernels();
  const auto* values = reinterpret_cast<const uint8_t*>(shards.data());
  for (size_t first = 0; first < current_.size(); first += format::kMaxChunkValues) {
    const size_t count = std::min(format::kMaxChunkValues, current_.size() - first);
    format::extract_exponents(dtype_, k, values + first * value_bytes, count, current_.data() + first);
  }
  if (primed_) {
    uint64_t offset = 0;
    for (size_t p = 0; p < shard_values_.size(); ++p) {
      const uint64_t n = shard_values_[p];
      ShardChangeCounts& c = counts_[p];
      c.observations += 1;
      c.values += n;
      for (uint64_t b = 0; b < n; b += block_values_) {
        const uint64_t len = std::min<uint64_t>(block_values_, n - b);
        const uint8_t* now = current_.data() + offset + b;
        const uint8_t* before = previous_.data() + offset + b;
        c.blocks += 1;
        if (std::memcmp(now, before, len) == 0) continue;  // the common case after warmup
        c.changed_blocks += 1;
        for (uint64_t i = 0; i < len; ++i) c.changed_values += now[i] != before[i];
      }
      offset += n;
    }
  }
  previous_.swap(current_);
  primed_ = true;
}

void ChangeMonitor::clear_counts() { std::fill(counts_.begin(), counts_.end(), ShardChangeCounts{}); }

void merge_counts_across_ranks(Transport& transport, std::vector<ShardChangeCounts>& counts) {
  constexpr size_t kFields = 5;
  const size_t world = static_cast<size_t>(transport.size());
  std::vector<uint64_t> mine;
  mine.reserve(counts.size() * kFields);
  for (const ShardChangeCounts& c : counts) {
    mine.insert(mine.end(), {c.observations, c.values, c.blocks, c.changed_values, c.changed_blocks});
  }
  std::vector<uint64_t> all(mine.size() * world);
  transport.allgather(mine.data(), mine.size() * sizeof(uint64_t), all.data());
  for (ShardChangeCounts& c : counts) c = {};
  for (size_t r = 0; r < world; ++r) {
    for (size_t p = 0; p < counts.size(); ++p) {
      const uint64_t* f = all.data() + (r * counts.size() + p) * kFields;
      counts[p].merge({f[0], f[1], f[2], f[3], f[4]});
    }
  }
}

}  // namespace ciera
