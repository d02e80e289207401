// The lossless collectives' wire (docs/format.md, "Lossless collectives") under the fuzzer: what a
// rank reads from its peers, in two parts that byte 0's bit 0 picks.
//
// Slices (bit 0 clear): a coded slice from the input, its frames' header checksums resealed
// (unless bits 4-5 are both set), through decode_slice into a guarded output: it must decode or
// throw FormatError (what collectives.cpp catches as the peer's failure), never write outside its
// output (decode_slice promises nothing of the output itself when it throws: a failed call's
// slice regions are scratch, or, for an alltoallv, documented as holding whatever arrived). Then
// the rest of the input (up to 64 frames) as values through encode_slice and back: the coded slice
// within coded_slice_bound, the values bit for bit, and an output a value too short or too long, or
// the coded slice a byte short, a FormatError.
//
//   byte 0: bit 0 clear, bits 1-2 dtype (mod 3), bit 3 content checksum, bits 4-5 both set: the
//   frames as they are; byte 1: block size (mod 4: 64, 100, 512, 4096); bytes 2-3: the output's
//   values (mod 5000); bytes 4-5: the coded slice's length L; L bytes of coded slice; a byte of
//   frame size for the round trip (1 + b below 200, else 256, 1000, 4097 or 2^17); its values.
//
// Records (bit 0 set): W = 2..4 ranks' call records and verdicts from the input, each sealed with
// its checksum (but those the masks leave as they are), read as every rank reads them
// (collectives.cpp, exchange_records and exchange_verdicts): every record, the refusals, then
// check_agreement, and every verdict. Only FormatError, ConfigError and CommError may come out;
// every rank must reach the same outcome (the same error, or acceptance); an accepted set must
// hold what the receivers rely on (each slice inside its part, never more bytes than raw, a
// reduce-scatter's parts of one size), and an accepted verdict a time in [0, 1e9] s.
//
//   byte 0: bit 0 set; byte 1: W - 2 (mod 3); byte 2: if bit 7 is set, bits 0-3 name the records
//   left unsealed; byte 3: the same for the verdicts; W call records (call_record_bytes(W) each),
//   then W verdicts (verdict_bytes() each), zero-filled where the input ends.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/transport.hpp"
#include "collectives/call_record.hpp"
#include "collectives/slice_coding.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "output_guard.hpp"
#include "payload_stream.hpp"

namespace {

using namespace ciera;
using Bytes = std::vector<std::byte>;
using collectives::CallKind;
using collectives::CallRecord;

// call_record.cpp's layout (docs/format.md): the checksum fields.
constexpr size_t kRecordChecksumAt = 40;
constexpr size_t kVerdictChecksumAt = 4;
constexpr uint32_t kBlocks[] = {64, 100, 512, 4096};

Bytes guarded(size_t n) { return Bytes(n + 2 * fuzz::kGuardBytes, fuzz::kGuard); }
std::byte* inside(Bytes& b) { return b.data() + fuzz::kGuardBytes; }
void check_guards(const Bytes& b) {
  for (size_t i = 0; i < fuzz::kGuardBytes; ++i) {
    if (b[i] != fuzz::kGuard || b[b.size() - 1 - i] != fuzz::kGuard) std::abort();
  }
}

// Whether decode_slice refuses `in` for `values` values with a FormatError (anything else
// escapes, and libFuzzer reports it); aborts on a write outside the output.
bool decodes(const CodecConfig& c, std::span<const std::byte> in, uint64_t values,
             Bytes* decoded = nullptr) {
  const size_t bytes = values * dtype_info(c.dtype).value_bytes;
  Bytes out = guarded(bytes);
  bool ok = true;
  try {
    collectives::decode_slice(c, in, {inside(out), bytes});
  } catch (const FormatError&) {
    ok = false;
  }
  check_guards(out);
  if (ok && decoded) decoded->assign(inside(out), inside(out) + bytes);
  return ok;
}

void fuzz_slices(const uint8_t* data, size_t size) {
  if (size < 6) return;
  CodecConfig c;
  c.dtype = static_cast<DType>(1 + (data[0] >> 1) % 3);
  c.content_checksum = (data[0] & 8) != 0;
  c.block_values = kBlocks[data[1] % 4];
  c.warmup_steps = 0;
  const uint32_t value_bytes = dtype_info(c.dtype).value_bytes;
  const uint64_t values = load_le16(data + 2) % 5000;
  const size_t length = std::min<size_t>(load_le16(data + 4), size - 6);
  const uint8_t* p = data + 6;
  const uint8_t* end = data + size;

  // A peer's coded slice, its frames' headers resealed so that mutations reach the fields.
  Bytes slice(reinterpret_cast<const std::byte*>(p),
              reinterpret_cast<const std::byte*>(p) + length);
  p += length;
  if ((data[0] & 0x30) != 0x30) {
    auto* s = reinterpret_cast<uint8_t*>(slice.data());
    for (const fuzz::Part& part : fuzz::split_payloads(s, slice.size())) {
      if (part.bytes >= wire::kHeaderBytes) fuzz::reseal_header(s + part.offset);
    }
  }
  decodes(c, slice, values);

  // A round trip of the rest: bit for bit, within the bound, and exact about the output's size.
  if (p == end) return;
  const uint8_t f = *p++;
  const uint64_t frame_values[] = {256, 1000, 4097, uint64_t{1} << 17};
  const uint64_t frame = f < 200 ? 1 + f : frame_values[f % 4];
  // At most 64 frames (each builds a table of its own) of at most 20000 values in all.
  const uint64_t n =
      std::min({static_cast<uint64_t>(end - p) / value_bytes, uint64_t{20000}, 64 * frame});
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(p), n * value_bytes);
  const uint64_t bound = collectives::coded_slice_bound(c, n, frame);
  Bytes coded = guarded(bound);
  const FrameStats stats = collectives::encode_slice(c, frame, in, {inside(coded), bound});
  check_guards(coded);
  if (stats.payload_bytes > bound || (n > 0) != (stats.payload_bytes > 0)) std::abort();
  const std::span<const std::byte> sent(inside(coded), stats.payload_bytes);
  Bytes decoded;
  if (!decodes(c, sent, n, &decoded)) std::abort();  // the sender's own slice
  if (!std::equal(decoded.begin(), decoded.end(), in.begin(), in.end())) std::abort();
  if (n == 0) return;
  // Its frames must fill the output exactly, and every byte of them is needed.
  if (decodes(c, sent, n - 1) || decodes(c, sent, n + 1)) std::abort();
  if (decodes(c, sent.first(sent.size() - 1), n)) std::abort();
}

void seal_record(std::span<std::byte> r) {
  auto* p = reinterpret_cast<uint8_t*>(r.data());
  store_le64(p + kRecordChecksumAt, 0);
  store_le64(p + kRecordChecksumAt, checksum64(p, r.size()));
}

void seal_verdict(std::span<std::byte> v) {
  auto* p = reinterpret_cast<uint8_t*>(v.data());
  store_le32(p + kVerdictChecksumAt, 0);
  store_le32(p + kVerdictChecksumAt, static_cast<uint32_t>(checksum64(p, v.size())));
}

// What a rank that read the exchange throws: its type and text ("" for none). Other exception
// types escape.
template <typename F>
std::string outcome(F&& body) {
  try {
    body();
  } catch (const CommError& e) {
    return std::string("CommError: ") + e.what();
  } catch (const ConfigError& e) {
    return std::string("ConfigError: ") + e.what();
  } catch (const FormatError& e) {
    return std::string("FormatError: ") + e.what();
  }
  return "";
}

// slice_of's slices of a part of `values` tile it: round 0 from its start, each round where the
// one before ends, the last to its end, none past it; never a wrap.
void check_slices(uint64_t values, uint32_t round, uint64_t slice_values) {
  if (slice_values == 0) return;  // not a slice size (check_agreement refuses it)
  const uint64_t rounds = collectives::rounds_of(values, slice_values);
  const collectives::Slice s = collectives::slice_of(values, round, slice_values);
  if (s.begin > values || s.values > values - s.begin) std::abort();
  if (round >= rounds) {
    if (s.values != 0) std::abort();
    return;
  }
  if (s.values == 0) std::abort();
  if (round == 0 && s.begin != 0) std::abort();
  if (round + 1 == rounds && s.begin + s.values != values) std::abort();
  if (round > 0) {
    const collectives::Slice before = collectives::slice_of(values, round - 1, slice_values);
    if (before.begin + before.values != s.begin) std::abort();
  }
}

// What every receiver relies on once check_agreement accepted `all`.
void check_accepted(const std::vector<CallRecord>& all) {
  const CallRecord& first = all.front();
  const uint32_t value_bytes = dtype_info(first.dtype).value_bytes;
  for (size_t from = 0; from < all.size(); ++from) {
    const CallRecord& r = all[from];
    if (r.rejected || r.kind != first.kind || r.dtype != first.dtype || r.op != first.op ||
        r.sequence != first.sequence || r.round != first.round ||
        r.slice_values != first.slice_values || r.block_values != first.block_values ||
        r.content_checksum != first.content_checksum || r.passes_through != first.passes_through) {
      std::abort();
    }
    for (size_t to = 0; to < all.size(); ++to) {
      const uint64_t sent = r.part_values[to];
      if (sent != all[to].expected_values[from]) std::abort();
      if (first.kind == CallKind::kReduceScatter &&
          (sent != first.part_values[0] || r.expected_values[to] != first.part_values[0])) {
        std::abort();
      }
      check_slices(sent, first.round, first.slice_values);
      const collectives::Slice s = collectives::slice_of(sent, first.round, first.slice_values);
      const unsigned __int128 raw = static_cast<unsigned __int128>(s.values) * value_bytes;
      const uint64_t bytes = r.part_bytes[to];
      if (bytes > raw) std::abort();
      if (from == to ? bytes != 0 : (bytes == 0) != (s.values == 0)) std::abort();
    }
  }
}

void fuzz_records(const uint8_t* data, size_t size) {
  if (size < 4) return;
  const int world = 2 + data[1] % 3;
  const uint8_t unsealed_records = (data[2] & 0x80) ? data[2] : 0;
  const uint8_t unsealed_verdicts = (data[3] & 0x80) ? data[3] : 0;
  const size_t record_bytes = collectives::call_record_bytes(world);
  const size_t verdict_bytes = collectives::verdict_bytes();
  const size_t w = static_cast<size_t>(world);
  Bytes records(w * record_bytes), verdicts(w * verdict_bytes);
  const size_t have = size - 4;
  std::memcpy(records.data(), data + 4, std::min(have, records.size()));
  if (have > records.size()) {
    std::memcpy(verdicts.data(), data + 4 + records.size(),
                std::min(have - records.size(), verdicts.size()));
  }
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    if (!(unsealed_records >> r & 1))
      seal_record({records.data() + i * record_bytes, record_bytes});
    if (!(unsealed_verdicts >> r & 1)) {
      seal_verdict({verdicts.data() + i * verdict_bytes, verdict_bytes});
    }
  }

  // Every rank reads the same bytes (the allgather's) the same way.
  std::string agreed_records, agreed_verdicts;
  for (int me = 0; me < world; ++me) {
    std::vector<CallRecord> all;
    const std::string records_outcome = outcome([&] {
      for (int r = 0; r < world; ++r) {
        all.push_back(collectives::read_call_record(
            {records.data() + static_cast<size_t>(r) * record_bytes, record_bytes}, world, r));
      }
      for (size_t r = 0; r < all.size(); ++r) {
        if (all[r].rejected) throw ConfigError(collectives::refusal_text(all, r, ""));
      }
      collectives::check_agreement(all);
    });
    if (records_outcome.empty()) check_accepted(all);
    if (!all.empty()) {
      check_slices(all[0].part_values[0], all[0].round, all[0].slice_values);
    }
    const std::string verdicts_outcome = outcome([&] {
      for (int r = 0; r < world; ++r) {
        const std::span<const std::byte> in(
            verdicts.data() + static_cast<size_t>(r) * verdict_bytes, verdict_bytes);
        const collectives::Verdict v = collectives::read_verdict(in, r);
        if (!(v.seconds >= 0 && v.seconds <= 1e9)) std::abort();
        if (v.message.size() > 240 || v.message.find('\0') != std::string::npos) {
          std::abort();
        }
        // What a rank sends again reads back as it was (the message cut to whole characters).
        Bytes again(verdict_bytes);
        collectives::write_verdict(v, again);
        const collectives::Verdict back = collectives::read_verdict(again, r);
        if (back.ok != v.ok || std::memcmp(&back.seconds, &v.seconds, sizeof v.seconds) != 0 ||
            v.message.compare(0, back.message.size(), back.message) != 0) {
          std::abort();
        }
      }
    });
    if (me == 0) {
      agreed_records = records_outcome;
      agreed_verdicts = verdicts_outcome;
    } else if (records_outcome != agreed_records || verdicts_outcome != agreed_verdicts) {
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) {
    fuzz_records(data, size);
  } else {
    fuzz_slices(data, size);
  }
  return 0;
}
