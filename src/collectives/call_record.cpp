#include "collectives/call_record.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "ciera/error.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "common/text.hpp"

namespace ciera::collectives {
namespace {

constexpr uint32_t kRecordMagic = 0x31434C43;  // "CLC1", little-endian
// 2: a coded slice is frames of frame_values values; 3: short first and last slices (slice_of);
// 4: the frames' block size and checksum setting, checked to agree; 5: records and verdicts
// carry checksums (a record damaged in transit steered the receiver's reading of the data); 6:
// flag bit 2, passes through (a version-5 peer would read such a record as a call of 0 values,
// which an empty call of its own would agree with).
constexpr uint8_t kVersion = 6;
constexpr uint32_t kKnownFlags = 7;  // rejected, content checksum, passes through
constexpr size_t kHeaderBytes = 48;
// Checksum fields: a record's u64 XXH3-64, a verdict's u32 low half, each over the whole with the
// field itself 0.
constexpr size_t kRecordChecksumAt = 40;
constexpr size_t kVerdictChecksumAt = 4;
constexpr size_t kPeerBytes = 24;
constexpr size_t kVerdictMessageBytes = 240;
// The most seconds a verdict may give for a call (about 32 years): read_verdict.
constexpr double kMaxVerdictSeconds = 1e9;

uint8_t* at(std::span<std::byte> s, size_t offset) {
  return reinterpret_cast<uint8_t*>(s.data()) + offset;
}
const uint8_t* at(std::span<const std::byte> s, size_t offset) {
  return reinterpret_cast<const uint8_t*>(s.data()) + offset;
}

std::string describe(const CallRecord& r) {
  std::string text =
      std::string(call_kind_name(r.kind)) + " of " + std::string(dtype_name(r.dtype));
  if (r.kind == CallKind::kReduceScatter) {
    text += " (" + std::string(reduce_op_name(r.op)) + ", " +
            std::to_string(r.part_values.front()) + " values per rank)";
  }
  return text;
}

// The checksum of a record or verdict `in` whose checksum field (`field_bytes` at `offset`) is
// taken as 0: XXH3-64 of it, streamed around the field (no copy: every rank reads W records of
// 48 + 24·W bytes a round).
uint64_t sealed_checksum(std::span<const std::byte> in, size_t offset, size_t field_bytes) {
  static constexpr std::byte kZeros[8] = {};
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, in.data(), offset);
  XXH3_64bits_update(&state, kZeros, field_bytes);
  XXH3_64bits_update(&state, in.data() + offset + field_bytes, in.size() - offset - field_bytes);
  return XXH3_64bits_digest(&state);
}

std::string damaged(const char* what, int from) {
  return std::string("lossless collectives: the ") + what + " from rank " + std::to_string(from) +
         " arrived damaged (its checksum does not match): the transport corrupted it";
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// The first and last slices' length (docs/format.md, "Rounds").
uint64_t edge_of(uint64_t slice_values) { return std::max<uint64_t>(1, slice_values / 4); }

}  // namespace

uint64_t rounds_of(uint64_t values, uint64_t slice_values) {
  const uint64_t edge = edge_of(slice_values);
  if (values <= 2 * edge) return ceil_div(values, edge);  // 0, 1 or 2
  return 2 + ceil_div(values - 2 * edge, slice_values);
}

Slice slice_of(uint64_t values, uint32_t round, uint64_t slice_values) {
  const uint64_t edge = edge_of(slice_values);
  const uint64_t rounds = rounds_of(values, slice_values);
  if (round >= rounds) return {values, 0};
  if (round == 0) return {0, std::min(values, edge)};
  if (round == rounds - 1) {  // the last edge (of a part of up to 2E values: the rest after E)
    const uint64_t last = std::min(values - edge, edge);
    return {values - last, last};
  }
  const uint64_t body = values - 2 * edge, slices = rounds - 2, j = round - 1;
  const uint64_t even = body / slices, longer = body % slices;  // the first `longer` get one more
  return {edge + j * even + std::min(j, longer), even + (j < longer ? 1 : 0)};
}

std::string_view call_kind_name(CallKind kind) {
  return kind == CallKind::kReduceScatter ? "reduce_scatter" : "alltoallv";
}

size_t call_record_bytes(int world) {
  return kHeaderBytes + kPeerBytes * static_cast<size_t>(world);
}

// Layout: magic u32, version u8, kind u8, dtype u8, op u8, world u32, flags u32 (bit 0: rejected,
// bit 1: content checksum, bit 2: passes through), sequence u64, round u32, block values u32, slice
// values u64, checksum u64, then per peer: values sent u64, bytes of this round's slice sent u64,
// values expected u64.
void write_call_record(const CallRecord& r, std::span<std::byte> out) {
  const auto world = static_cast<uint32_t>(r.part_values.size());
  store_le32(at(out, 0), kRecordMagic);
  *at(out, 4) = kVersion;
  *at(out, 5) = static_cast<uint8_t>(r.kind);
  *at(out, 6) = static_cast<uint8_t>(r.dtype);
  *at(out, 7) = static_cast<uint8_t>(r.op);
  store_le32(at(out, 8), world);
  store_le32(at(out, 12), (r.rejected ? 1u : 0u) | (r.content_checksum ? 2u : 0u) |
                              (r.passes_through ? 4u : 0u));
  store_le64(at(out, 16), r.sequence);
  store_le32(at(out, 24), r.round);
  store_le32(at(out, 28), r.block_values);
  store_le64(at(out, 32), r.slice_values);
  for (uint32_t p = 0; p < world; ++p) {
    uint8_t* peer = at(out, kHeaderBytes + kPeerBytes * p);
    store_le64(peer, r.part_values[p]);
    store_le64(peer + 8, r.part_bytes[p]);
    store_le64(peer + 16, r.expected_values[p]);
  }
  store_le64(at(out, kRecordChecksumAt), 0);
  store_le64(at(out, kRecordChecksumAt),
             sealed_checksum({out.data(), call_record_bytes(static_cast<int>(world))},
                             kRecordChecksumAt, 8));
}

CallRecord read_call_record(std::span<const std::byte> in, int world, int from) {
  // The checksum before the header's fields: a damaged magic, version or rank count is damage,
  // not another build (whose records of this size would not hold this checksum either).
  if (in.size() == call_record_bytes(world) &&
      load_le64(at(in, kRecordChecksumAt)) != sealed_checksum(in, kRecordChecksumAt, 8)) {
    throw CommError(damaged("call record", from));
  }
  if (in.size() != call_record_bytes(world) || load_le32(at(in, 0)) != kRecordMagic ||
      *at(in, 4) != kVersion || load_le32(at(in, 8)) != static_cast<uint32_t>(world)) {
    throw FormatError("lossless collectives: a peer's call record is not a version-" +
                      std::to_string(kVersion) + " record for " + std::to_string(world) +
                      " ranks (a different CIERA build, or a transport "
                      "shared with another protocol)");
  }
  const uint8_t kind = *at(in, 5), dtype = *at(in, 6), op = *at(in, 7);
  if ((kind != 1 && kind != 2) || !is_valid_dtype_code(dtype) || op > 1 ||
      (load_le32(at(in, 12)) & ~kKnownFlags) != 0) {
    throw FormatError(
        "lossless collectives: a peer's call record has an unknown kind, dtype, op or flag");
  }
  CallRecord r;
  r.kind = static_cast<CallKind>(kind);
  r.dtype = static_cast<DType>(dtype);
  r.op = static_cast<ReduceOp>(op);
  r.rejected = (load_le32(at(in, 12)) & 1) != 0;
  r.content_checksum = (load_le32(at(in, 12)) & 2) != 0;
  r.passes_through = (load_le32(at(in, 12)) & 4) != 0;
  r.sequence = load_le64(at(in, 16));
  r.round = load_le32(at(in, 24));
  r.block_values = load_le32(at(in, 28));
  r.slice_values = load_le64(at(in, 32));
  r.part_values.resize(static_cast<size_t>(world));
  r.part_bytes.resize(static_cast<size_t>(world));
  r.expected_values.resize(static_cast<size_t>(world));
  for (size_t p = 0; p < static_cast<size_t>(world); ++p) {
    const uint8_t* peer = at(in, kHeaderBytes + kPeerBytes * p);
    r.part_values[p] = load_le64(peer);
    r.part_bytes[p] = load_le64(peer + 8);
    r.expected_values[p] = load_le64(peer + 16);
  }
  return r;
}

std::string refusal_text(std::span<const CallRecord> records, size_t rank,
                         const std::string& reason) {
  return "lossless collectives: rank " + std::to_string(rank) + " refused its arguments to its " +
         std::string(call_kind_name(records[rank].kind)) + " call " +
         std::to_string(records[rank].sequence) +
         (reason.empty() ? " (rank " + std::to_string(rank) + "'s error says why)" : ": " + reason);
}

std::string pass_through_text(std::span<const CallRecord> records,
                              std::span<const std::string> reasons) {
  std::vector<size_t> ran, passed;
  std::string why;
  for (size_t r = 0; r < records.size(); ++r) {
    (records[r].passes_through ? passed : ran).push_back(r);
    if (records[r].passes_through && r < reasons.size() && !reasons[r].empty()) {
      why += "; rank " + std::to_string(r) + ": " + reasons[r];
    }
  }
  auto named = [](const std::vector<size_t>& ranks) {
    std::string text = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t k = 0; k < ranks.size(); ++k) text += (k ? ", " : "") + std::to_string(ranks[k]);
    return text;
  };
  // The kind and call number of the ranks that run the call (a pass-through is always a
  // reduce-scatter's, but a rank that runs may be in an alltoallv: then both kinds are named).
  const CallRecord& running = records[ran.empty() ? 0 : ran.front()];
  const bool same_kind = running.kind == CallKind::kReduceScatter;
  return "lossless collectives: " + std::string(call_kind_name(running.kind)) + " call " +
         std::to_string(running.sequence) + " runs on " + named(ran) + ", but " + named(passed) +
         (passed.size() == 1 ? " passes" : " pass") + (same_kind ? " it" : " a reduce_scatter") +
         " through to the caller's own (every rank must make the same choice)" + why;
}

void check_agreement(std::span<const CallRecord> records) {
  for (size_t r = 0; r < records.size(); ++r) {
    if (records[r].rejected) throw ConfigError(refusal_text(records, r, ""));
  }
  for (const CallRecord& record : records) {
    if (record.passes_through != records.front().passes_through) {
      throw ConfigError(pass_through_text(records, {}));
    }
  }
  const CallRecord& first = records.front();
  // Every rank's own record holds its validated CollectivesConfig.slice_values (at least 1), so 0
  // is a broken peer's; it would divide by zero in slice_of.
  if (first.slice_values == 0) {
    throw FormatError("lossless collectives: rank 0's call record gives slices of 0 values");
  }
  for (size_t r = 1; r < records.size(); ++r) {
    const CallRecord& other = records[r];
    if (other.sequence != first.sequence) {
      throw ConfigError("lossless collectives: rank " + std::to_string(r) + " is at its call " +
                        std::to_string(other.sequence) + ", rank 0 at its call " +
                        std::to_string(first.sequence) +
                        " (ranks must make the same calls in order)");
    }
    if (other.round != first.round || other.slice_values != first.slice_values) {
      throw ConfigError("lossless collectives: call " + std::to_string(first.sequence) + ": rank " +
                        std::to_string(r) + " is in round " + std::to_string(other.round) +
                        " of slices of " + std::to_string(other.slice_values) +
                        " values, rank 0 in round " + std::to_string(first.round) + " of " +
                        std::to_string(first.slice_values) +
                        " (CollectivesConfig.slice_values must match)");
    }
    if (other.block_values != first.block_values ||
        other.content_checksum != first.content_checksum) {
      const bool blocks = other.block_values != first.block_values;
      auto setting = [&](const CallRecord& c) {
        return blocks ? std::to_string(c.block_values)
                      : std::string(c.content_checksum ? "on" : "off");
      };
      throw ConfigError("lossless collectives: call " + std::to_string(first.sequence) + ": rank " +
                        std::to_string(r) + " codes with " +
                        (blocks ? "block_values " : "content_checksum ") + setting(other) +
                        ", rank 0 with " + setting(first) + " (CollectivesConfig." +
                        (blocks ? "block_values" : "content_checksum") + " must match)");
    }
    const bool same_size = first.kind != CallKind::kReduceScatter ||
                           other.part_values.front() == first.part_values.front();
    if (other.kind != first.kind || other.dtype != first.dtype || other.op != first.op ||
        !same_size) {
      throw ConfigError("lossless collectives: call " + std::to_string(first.sequence) +
                        " differs between ranks: rank 0 runs a " + describe(first) + ", rank " +
                        std::to_string(r) + " a " + describe(other));
    }
  }
  // A reduce-scatter's record gives every peer a part of its output's size and expects as much
  // from each (write_call_record's callers): other sizes are a broken peer's, whose parts would
  // set the call's rounds (rounds_of its longest part) for every rank.
  if (first.kind == CallKind::kReduceScatter) {
    const uint64_t n = first.part_values.front();
    for (size_t r = 0; r < records.size(); ++r) {
      for (size_t p = 0; p < records.size(); ++p) {
        const uint64_t sent = records[r].part_values[p], expected = records[r].expected_values[p];
        if (sent != n || expected != n) {
          throw FormatError("lossless collectives: rank " + std::to_string(r) +
                            "'s record of reduce_scatter call " + std::to_string(first.sequence) +
                            " sends rank " + std::to_string(p) + " " + std::to_string(sent) +
                            " values and expects " + std::to_string(expected) +
                            " from it, not the " + std::to_string(n) + " of every part");
        }
      }
    }
  }
  for (size_t from = 0; from < records.size(); ++from) {
    for (size_t to = 0; to < records.size(); ++to) {
      const uint64_t sent = records[from].part_values[to];
      const uint64_t expected = records[to].expected_values[from];
      if (sent != expected) {
        throw ConfigError("lossless collectives: " + std::string(call_kind_name(first.kind)) +
                          " call " + std::to_string(first.sequence) + ": rank " +
                          std::to_string(from) + " sends rank " + std::to_string(to) + " " +
                          std::to_string(sent) + " values, but rank " + std::to_string(to) +
                          " expects " + std::to_string(expected) + " from it");
      }
      const uint64_t slice = slice_of(sent, first.round, first.slice_values).values;
      const uint64_t bytes = records[from].part_bytes[to];
      const bool own = from == to;  // never sent: 0 bytes
      // bytes / value_bytes, not slice * value_bytes: a slice of 2^62 values or more would wrap.
      const uint32_t value_bytes = dtype_info(first.dtype).value_bytes;
      if (bytes / value_bytes > slice || (bytes / value_bytes == slice && bytes % value_bytes) ||
          (own ? bytes != 0 : (slice == 0) != (bytes == 0))) {
        throw FormatError("lossless collectives: rank " + std::to_string(from) +
                          "'s record gives its slice for rank " + std::to_string(to) + " " +
                          std::to_string(bytes) + " bytes for " + std::to_string(slice) +
                          " values in round " + std::to_string(first.round) +
                          " (a slice is never larger than raw)");
      }
    }
  }
}

size_t verdict_bytes() { return 16 + kVerdictMessageBytes; }

// Layout: ok u8, reserved 3 bytes (0), checksum u32, seconds f64, message (NUL-padded).
void write_verdict(const Verdict& v, std::span<std::byte> out) {
  std::memset(out.data(), 0, verdict_bytes());
  *at(out, 0) = v.ok ? 1 : 0;
  std::memcpy(at(out, 8), &v.seconds, sizeof v.seconds);
  const std::string_view message = utf8_prefix(v.message, kVerdictMessageBytes - 1);
  std::memcpy(at(out, 16), message.data(), message.size());
  store_le32(
      at(out, kVerdictChecksumAt),
      static_cast<uint32_t>(sealed_checksum({out.data(), verdict_bytes()}, kVerdictChecksumAt, 4)));
}

Verdict read_verdict(std::span<const std::byte> in, int from) {
  if (in.size() != verdict_bytes()) {
    throw FormatError("lossless collectives: the verdict from rank " + std::to_string(from) +
                      " is " + std::to_string(in.size()) + " bytes, not " +
                      std::to_string(verdict_bytes()));
  }
  if (load_le32(at(in, kVerdictChecksumAt)) !=
      static_cast<uint32_t>(sealed_checksum(in, kVerdictChecksumAt, 4))) {
    throw CommError(damaged("verdict", from));
  }
  Verdict v;
  v.ok = *at(in, 0) == 1;
  std::memcpy(&v.seconds, at(in, 8), sizeof v.seconds);
  // A rank's time for the call, from a steady clock: never negative, NaN or infinite, and far
  // below kMaxVerdictSeconds. Another value is a broken peer's, refused here rather than fed to
  // every rank's adaptive switch (a NaN breaks its medians' ordering); every rank reads every
  // verdict, so every rank refuses it alike.
  if (!(v.seconds >= 0 && v.seconds <= kMaxVerdictSeconds)) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", v.seconds);
    throw FormatError("lossless collectives: the verdict from rank " + std::to_string(from) +
                      " gives its time for the call as " + seconds +
                      " s (a broken or foreign peer: a time is 0 to 1e+09 s)");
  }
  const auto* text = reinterpret_cast<const char*>(at(in, 16));
  v.message.assign(text, strnlen(text, kVerdictMessageBytes));
  return v;
}

}  // namespace ciera::collectives
