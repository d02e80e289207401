// The selection's collectives (measure_allgather, merge_counts_across_ranks) exchange buffers
// whose sizes follow from their arguments: ranks that passed different arguments would exchange
// buffers of different sizes, which MPI leaves undefined. Each first shares a digest of its
// arguments, and where the ranks differ every rank throws the same ConfigError.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ciera/error.hpp"
#include "ciera/transport.hpp"

namespace ciera::selection {

inline void agree_on_arguments(Transport& transport, const std::string& call,
                               std::span<const uint64_t> arguments) {
  uint64_t digest = 0xcbf29ce484222325ull;  // FNV-1a over the arguments' bytes
  for (const uint64_t a : arguments) {
    for (int b = 0; b < 8; ++b) digest = (digest ^ ((a >> (8 * b)) & 0xff)) * 0x100000001b3ull;
  }
  const uint64_t mine[2] = {arguments.size(), digest};
  std::vector<uint64_t> all(2 * static_cast<size_t>(transport.size()));
  transport.allgather(mine, sizeof mine, all.data());
  for (int r = 1; r < transport.size(); ++r) {
    const size_t at = 2 * static_cast<size_t>(r);
    if (all[at] != all[0] || all[at + 1] != all[1]) {
      throw ConfigError(call + ": rank " + std::to_string(r) +
                        " called it with other arguments than rank 0 (a collective: every rank "
                        "passes the same)");
    }
  }
}

}  // namespace ciera::selection
