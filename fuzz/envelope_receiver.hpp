// Rank 0 of the engine in engine_fixture.hpp receiving what rank 1 sends, round after round:
// rank 1's control record (128 bytes, docs/format.md, "Engine protocol", step 1), then the
// envelope it announced (step 2), decoded into the output by the receiver's ShardDecoders, which
// it keeps from round to round as the engine keeps them. A round that fails is retried once in
// the next, with key frames, as the engine's run_round does. The checks run through the engine's
// own functions: check_records and agreed_step on the records, EnvelopeReader and ShardDecoder on
// the envelope, in the order the engine's decode_envelope calls them. fuzz_envelope feeds it
// arbitrary bytes; make_corpus checks that every round it writes is received exactly.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ciera/error.hpp"
#include "engine/memory_ops.hpp"
#include "engine_fixture.hpp"
#include "output_guard.hpp"

namespace ciera::fuzz {

struct Bucket {
  BucketLayout layout;
  uint32_t value_bytes = 0;
  std::vector<uint64_t> max_envelope_bytes;
  std::vector<std::unique_ptr<PayloadDecoder>> decoders;  // [param], for the sender's shards
  uint64_t step = 0;
  bool retrying = false;  // the last round failed: this one is its key-frame retry
};

// The engine's resynchronise(): a key-frame round follows, from the streams' next epochs.
inline void expect_key_frames(Bucket& s) {
  for (auto& decoder : s.decoders) {
    if (decoder) decoder->request_resync();
  }
}

// What CompressedAllgather::Impl::decode_envelope does for a peer's envelope: the engine's own
// decode_envelope (src/engine/envelope.hpp), a failure recorded in `verdict`.
inline void decode_envelope(Bucket& s, uint64_t step, uint32_t bucket, const std::byte* envelope,
                            uint64_t envelope_bytes, std::byte* out, Verdict& verdict) {
  EnvelopeHeader expected;
  expected.bucket = bucket;
  expected.params = static_cast<uint32_t>(s.layout.params());
  expected.step = step;
  ciera::decode_envelope(envelope, envelope_bytes, expected, s.layout, kSender, s.decoders,
                         out + s.layout.rank_offset(kSender),
                         host_memory_ops(), [&verdict](int param, const std::string& reason) {
                           record_failure(verdict, kSender, param, reason);
                         });
}

inline std::vector<Bucket> receiver_buckets() {
  const std::vector<BucketLayout> layouts = envelope_buckets();
  std::vector<Bucket> buckets(layouts.size());
  for (size_t b = 0; b < layouts.size(); ++b) {
    Bucket& s = buckets[b];
    s.layout = layouts[b];
    s.value_bytes = dtype_info(s.layout.dtype).value_bytes;
    s.max_envelope_bytes = max_envelope_bytes(s.layout);
    for (size_t k = 0; k < s.layout.params(); ++k) {
      s.decoders.push_back(make_decoder(layouts, b, k, kSender));
    }
  }
  return buckets;
}

// Every byte of the output but the sender's part must still be a guard byte.
inline void check_output(const std::vector<std::byte>& out, const BucketLayout& layout) {
  const uint64_t from = kGuardBytes + layout.rank_offset(kSender);
  const uint64_t to = from + layout.rank_bytes(kSender);
  for (uint64_t i = 0; i < out.size(); ++i) {
    if ((i < from || i >= to) && out[i] != kGuard) std::abort();
  }
}

// Receives every round of `input`. Returns, per round, "" if it was gathered exactly, else why
// not (the failure every rank would report, or the control exchange's error). Aborts on a write
// outside rank 1's part of the output. The envelope lives in its own allocation, exactly as long
// as announced, so that AddressSanitizer catches any read past it.
inline std::vector<std::string> receive_rounds(const uint8_t* data, size_t size) {
  std::vector<std::string> outcomes;
  std::vector<Bucket> buckets = receiver_buckets();
  size_t at = 0;
  while (size - at >= sizeof(ControlRecord)) {
    ControlRecord peer;
    std::memcpy(&peer, data + at, sizeof peer);
    at += sizeof peer;
    // This rank gathers the bucket the peer names if there is one (else the peer is out of
    // order): the order of gathers is the callers', not the protocol's.
    const uint32_t bucket = peer.bucket < buckets.size() ? peer.bucket : 0;
    Bucket& s = buckets[bucket];
    const ControlRecord records[] = {
        control_record(bucket, s.layout, s.step, 0, raw_envelope_bytes(s.layout, kReceiver)), peer};
    try {
      // No error of its own: a local error is read from its record, as the peers read it.
      check_records(records, bucket, s.layout, kReceiver, s.max_envelope_bytes, "");
    } catch (const CommError& e) {
      outcomes.push_back(e.what());
      break;  // every later gather fails too
    } catch (const ConfigError& e) {
      outcomes.push_back(e.what());
      continue;  // this gather fails alone, before its payload exchange
    }
    const uint64_t step = agreed_step(records);
    // A cold peer or one at another step makes a key-frame round (scheduler.cpp's
    // needs_resync), whose envelope this round's is taken to be.
    if (peer.step != s.step || (peer.flags & kCold)) expect_key_frames(s);
    s.step = step;
    // The transport delivers exactly the announced bytes (bounded by check_records); an input
    // that ends early leaves the rest zero.
    const uint64_t envelope_bytes = peer.envelope_bytes;
    std::vector<std::byte> envelope(envelope_bytes);
    const size_t present = std::min<uint64_t>(envelope_bytes, size - at);
    if (present > 0) std::memcpy(envelope.data(), data + at, present);
    at += present;
    std::vector<std::byte> out(s.layout.total_bytes() + 2 * kGuardBytes, kGuard);
    RoundVerdicts verdicts[2] = {};
    Verdict& mine = verdicts[kReceiver].verdicts[0];
    decode_envelope(s, step, bucket, envelope.data(), envelope_bytes, out.data() + kGuardBytes,
                    mine);
    check_output(out, s.layout);
    outcomes.push_back(failure_text(verdicts, 0, s.layout.name));
    if (outcomes.back().empty() != !mine.failed) std::abort();
    if (mine.failed) {
      // The engine's run_round: every rank re-sends the gather as key frames once (the next
      // round of the input); a second failure is a CommError, and every later gather fails.
      if (s.retrying) break;
      s.retrying = true;
      expect_key_frames(s);
      continue;
    }
    s.retrying = false;
    s.step = step + 1;
  }
  return outcomes;
}

}  // namespace ciera::fuzz
