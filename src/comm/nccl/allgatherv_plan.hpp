// How the NCCL transport runs one allgatherv (NCCL has no AllGatherV): the NCCL calls every
// rank makes, and the output ranges it writes. Pure host logic, the same on every rank (it
// depends only on counts and displacements, which all ranks pass alike), tested without a GPU.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ciera::nccl::detail {

// One ncclBroadcast: rank `root`'s `bytes` bytes land at out + `offset` on every rank.
struct BroadcastStep {
  int root = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A byte range of the output that the call writes.
struct OutputRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct AllgathervPlan {
  // Equal counts, rank-major and contiguous (displs[r] = displs[0] + r * counts[0]): one
  // ncclAllGather of `allgather_bytes` per rank into out + `allgather_offset`.
  bool single_allgather = false;
  uint64_t allgather_bytes = 0;
  uint64_t allgather_offset = 0;
  // Otherwise one broadcast per rank that contributes bytes, in rank order, in one NCCL group.
  std::vector<BroadcastStep> broadcasts;
  // Every range the call writes, sorted and merged where they touch. A staged output is copied
  // back from these ranges only: the gaps between them belong to the caller.
  std::vector<OutputRange> written;
  // One past the last byte written: how much staging an output needs.
  uint64_t extent = 0;

  bool empty() const { return written.empty(); }
};

// Throws std::invalid_argument if counts or displs do not hold `size` entries, a range ends
// past 2^64, or two ranks' ranges overlap.
AllgathervPlan plan_allgatherv(std::span<const uint64_t> counts, std::span<const uint64_t> displs,
                               int size);

}  // namespace ciera::nccl::detail
