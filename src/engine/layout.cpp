#include <optional>
#include <string>
#include <vector>

#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "common/checked.hpp"

namespace ciera {

BucketLayout BucketLayout::fsdp_split(std::string name, DType dtype,
                                      std::vector<uint64_t> param_values, int ranks,
                                      ShardPolicy policy) {
  if (ranks < 1) throw ConfigError("fsdp_split: ranks must be positive");
  BucketLayout layout;
  layout.name = std::move(name);
  layout.dtype = dtype;
  layout.policy.assign(param_values.size(), policy);
  layout.shard_values.assign(static_cast<size_t>(ranks), std::vector<uint64_t>(param_values.size()));
  for (size_t k = 0; k < param_values.size(); ++k) {
    const uint64_t per_rank = (param_values[k] + ranks - 1) / ranks;
    for (int r = 0; r < ranks; ++r) {
      const uint64_t first = std::min(param_values[k], per_rank * r);
      layout.shard_values[r][k] = std::min(param_values[k], first + per_rank) - first;
    }
  }
  return layout;
}

uint64_t BucketLayout::rank_values(int rank) const {
  uint64_t n = 0;
  for (uint64_t v : shard_values.at(static_cast<size_t>(rank))) n += v;
  return n;
}

uint64_t BucketLayout::rank_bytes(int rank) const {
  return rank_values(rank) * dtype_info(dtype).value_bytes;
}

uint64_t BucketLayout::total_bytes() const { return rank_offset(ranks()); }

uint64_t BucketLayout::rank_offset(int rank) const {
  uint64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += rank_bytes(r);
  return offset;
}

void BucketLayout::validate() const {
  const std::string who = "bucket '" + name + "'";
  if (!is_valid_dtype_code(static_cast<uint8_t>(dtype))) throw ConfigError(who + ": unknown dtype");
  // The ranks agree on their layouts as lines of key=value (engine/agreement.cpp): a name with a
  // line break in it could add a line of its own and hide a difference.
  for (const char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      throw ConfigError(who + ": a bucket name holds no control characters (line breaks included)");
    }
  }
  if (shard_values.empty()) throw ConfigError(who + ": no ranks");
  for (size_t r = 0; r < shard_values.size(); ++r) {
    if (shard_values[r].size() != policy.size()) {
      throw ConfigError(who + ": rank " + std::to_string(r) + " lists " +
                        std::to_string(shard_values[r].size()) + " shards for " +
                        std::to_string(policy.size()) + " parameters");
    }
  }
  for (ShardPolicy p : policy) {
    if (!is_shard_policy(p)) {
      throw ConfigError(who + ": unknown policy");
    }
  }
  // Every size the engine derives (rank_bytes, rank_offset, total_bytes) fits in 64 bits: a
  // wrapped one would gather a few bytes where the layout names 2^64 of them.
  std::vector<uint64_t> rank_sizes;
  for (const std::vector<uint64_t>& shards : shard_values) {
    const std::optional<uint64_t> bytes = checked_scaled_sum(shards, dtype_info(dtype).value_bytes);
    if (!bytes) {
      throw ConfigError(who + ": rank " + std::to_string(rank_sizes.size()) +
                        "'s shards are more than 2^64 - 1 bytes");
    }
    rank_sizes.push_back(*bytes);
  }
  if (!checked_scaled_sum(rank_sizes, 1)) {
    throw ConfigError(who + ": the ranks' shards are more than 2^64 - 1 bytes");
  }
}

}  // namespace ciera
