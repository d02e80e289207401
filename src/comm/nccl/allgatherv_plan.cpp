#include "comm/nccl/allgatherv_plan.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace ciera::nccl::detail {

AllgathervPlan plan_allgatherv(std::span<const uint64_t> counts, std::span<const uint64_t> displs,
                               int size) {
  const auto ranks = static_cast<size_t>(size);
  if (size < 1 || counts.size() != ranks || displs.size() != ranks) {
    throw std::invalid_argument(
        "NCCL allgatherv: counts and displacements must hold one entry per rank (" +
        std::to_string(size) + "), not " + std::to_string(counts.size()) + " and " +
        std::to_string(displs.size()));
  }
  AllgathervPlan plan;
  std::vector<OutputRange> ranges;
  for (size_t r = 0; r < ranks; ++r) {
    if (counts[r] == 0)
      continue;  // every rank skips the same ranks: counts are the same everywhere
    if (displs[r] > std::numeric_limits<uint64_t>::max() - counts[r]) {
      throw std::invalid_argument("NCCL allgatherv: rank " + std::to_string(r) +
                                  "'s range ends past 2^64 bytes");
    }
    ranges.push_back({displs[r], counts[r]});
    plan.broadcasts.push_back({static_cast<int>(r), displs[r], counts[r]});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const OutputRange& a, const OutputRange& b) { return a.offset < b.offset; });
  for (const OutputRange& range : ranges) {
    if (!plan.written.empty()) {
      OutputRange& last = plan.written.back();
      if (range.offset < last.offset + last.bytes) {
        throw std::invalid_argument("NCCL allgatherv: two ranks' output ranges overlap at byte " +
                                    std::to_string(range.offset));
      }
      if (range.offset == last.offset + last.bytes) {
        last.bytes += range.bytes;
        continue;
      }
    }
    plan.written.push_back(range);
  }
  if (!plan.written.empty()) plan.extent = plan.written.back().offset + plan.written.back().bytes;

  // The engine's gathers of equal shards (and its fixed-size records) are plain allgathers: one
  // collective instead of `size` broadcasts.
  bool rank_major = counts[0] > 0;
  for (size_t r = 1; r < ranks && rank_major; ++r) {
    rank_major = counts[r] == counts[0] && displs[r] == displs[0] + r * counts[0];
  }
  if (rank_major) {
    plan.single_allgather = true;
    plan.allgather_bytes = counts[0];
    plan.allgather_offset = displs[0];
    plan.broadcasts.clear();
  }
  return plan;
}

}  // namespace ciera::nccl::detail
