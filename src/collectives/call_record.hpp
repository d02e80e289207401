// The records ranks exchange around each lossless collective (docs/format.md, "Lossless
// collectives"): before the data, a call record per rank saying what it is doing and how many
// bytes each part it sends takes; after it, a verdict per rank saying whether every part it
// received decoded. Every rank reads every rank's record, so a disagreement is found, and named
// the same way, on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ciera/collectives.hpp"
#include "ciera/dtype.hpp"

namespace ciera::collectives {

enum class CallKind : uint8_t { kReduceScatter = 1, kAlltoallv = 2 };
std::string_view call_kind_name(CallKind kind);

struct CallRecord {
  CallKind kind = CallKind::kReduceScatter;
  DType dtype = DType::kBF16;
  ReduceOp op = ReduceOp::kSum;       // reduce-scatter only (0 for alltoallv)
  bool rejected = false;              // this rank refused its own arguments (it throws why)
  uint64_t sequence = 0;              // this rank's count of earlier calls
  // A call moves its parts in rounds: slice `round` of every part in round `round` (slice_of),
  // so that coding one round overlaps the exchange of the previous one (docs/format.md,
  // "Lossless collectives", "Rounds").
  uint32_t round = 0;
  uint64_t slice_values = 0;
  std::vector<uint64_t> part_values;  // per peer: values of the whole part sent to it
  // Per peer: bytes of this round's slice of the part as sent. A slice is raw exactly when this
  // is its values' size (the sender codes a slice only when that is strictly smaller), so no
  // flag is needed.
  std::vector<uint64_t> part_bytes;
  std::vector<uint64_t> expected_values;  // per peer: values this rank expects from it
  // The coded frames' settings (CollectivesConfig), which every rank's decoder holds its peers'
  // frames to: a difference is a ConfigError naming the setting, not a failed decode.
  uint32_t block_values = 0;
  bool content_checksum = false;
  // This rank leaves the call to its caller's own reduce-scatter (pass_through_reduce_scatter):
  // its parts are all 0 values, and every rank must say the same.
  bool passes_through = false;
};

// Bytes of one rank's record among `world` ranks.
size_t call_record_bytes(int world);
void write_call_record(const CallRecord& record, std::span<std::byte> out);
// Rank `from`'s record. Throws FormatError if `in` is not a record of this version for `world`
// ranks, CommError naming `from` if it arrived damaged (its checksum).
CallRecord read_call_record(std::span<const std::byte> in, int world, int from);

// Slice `round` of a part of `values` values (docs/format.md, "Rounds"): with S = slice_values
// and an edge E = max(1, S / 4), a part of more than 2E values is a first slice of E values,
// ceil((values - 2E) / S) slices of at most S between them (as even as whole values allow: the
// first ones one value longer) and a last slice of E; a shorter part is E values and the rest.
// The edges are short because only the first slice's coding and the last one's decoding and
// reduction are not hidden behind the transport (collectives.cpp).
struct Slice {
  uint64_t begin = 0;   // of the part's values
  uint64_t values = 0;  // 0: the part has no slice in this round
};
Slice slice_of(uint64_t values, uint32_t round, uint64_t slice_values);
// Rounds a part of `values` values takes (0 for none); a call takes its longest part's.
uint64_t rounds_of(uint64_t values, uint64_t slice_values);

// What every rank throws when `rank`'s record says it refused its own arguments: the call, and
// `reason` (that rank's error text, as the ranks exchange it; "" if not known).
std::string refusal_text(std::span<const CallRecord> records, size_t rank,
                         const std::string& reason);

// What every rank throws when some ranks' records pass the call through and others' do not:
// the ranks on each side, and each passing rank's `reasons[r]` (as the ranks exchange them; the
// span may be empty where they are not known).
std::string pass_through_text(std::span<const CallRecord> records,
                              std::span<const std::string> reasons);

// Checks every rank's record (rank order) against the others: the same kind, dtype, op,
// sequence, round, slice size, block size, checksum setting and pass-through on every rank, what
// each rank sends each peer is what that peer expects (for a reduce-scatter: parts of one size
// everywhere), and no slice larger than raw. Throws ConfigError (FormatError for an impossible
// size, a reduce-scatter record whose parts differ in size, or slices of 0 values) with the same
// text on every rank.
void check_agreement(std::span<const CallRecord> records);

// After the data: whether every part this rank received decoded (and why not), and this rank's
// time for the call so far, so that every rank feeds the adaptive switch the same slowest time.
struct Verdict {
  bool ok = true;
  double seconds = 0;
  std::string message;  // cut to fit the record
};
size_t verdict_bytes();
void write_verdict(const Verdict& verdict, std::span<std::byte> out);
// Rank `from`'s verdict; CommError naming `from` if it arrived damaged (its checksum),
// FormatError naming `from` if it is not verdict_bytes() long or its seconds are not a time
// (negative, NaN, infinite or above 10^9).
Verdict read_verdict(std::span<const std::byte> in, int from);

}  // namespace ciera::collectives
