// The envelope: the unit one rank sends for one gather of one bucket in the payload exchange
// (docs/format.md, "Engine protocol", step 2). A fixed header, one length per parameter, then
// the parameters' payloads back to back, each raw bytes or a CIERA payload (whose key and delta
// frames are the codec's business, not the envelope's).
//
// Envelope bytes live in payload memory (include/ciera/memory.hpp), which may be a GPU's: the
// header is built in host memory and copied in, and a received header is copied out before it is
// read, both through MemoryOps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/codec.hpp"
#include "ciera/engine.hpp"
#include "engine/memory_ops.hpp"

namespace ciera {

constexpr uint32_t kEnvelopeMagic = 0x42454943;  // "CIEB"
constexpr uint64_t kEnvelopeFixedBytes = 24;     // before the per-parameter lengths
constexpr uint8_t kEnvelopeAllRaw = 1;           // flags bit 0: every payload is raw bytes

inline uint64_t envelope_header_bytes(size_t params) { return kEnvelopeFixedBytes + 8 * params; }

// Whether a parameter of this policy travels as codec frames (ciera: exponent reuse; delta:
// value-delta frames; the peer schemes' frames) rather than raw bytes, outside raw warmup.
inline bool coded_policy(ShardPolicy policy) { return policy != ShardPolicy::kRaw && is_shard_policy(policy); }

// Which gather an envelope belongs to; a receiver checks it against the gather it is decoding.
struct EnvelopeHeader {
  uint32_t bucket = 0;
  uint32_t params = 0;
  uint64_t step = 0;
  bool all_raw = false;
};

// The largest envelope `rank` can send for `layout`: each parameter as raw bytes or its largest
// CIERA payload (max_payload_bytes), whichever is larger.
uint64_t envelope_bound(const BucketLayout& layout, int rank, uint32_t block_values);
// The largest payload one shard of `values` values of this policy can take coded (0 for raw).
uint64_t coded_payload_bound(ShardPolicy policy, DType dtype, uint64_t values, uint32_t block_values);
// The exact size of `rank`'s all-raw envelope.
uint64_t raw_envelope_bytes(const BucketLayout& layout, int rank);

// Where this rank's envelope and one encoding slot per parameter sit in its send buffer. Each
// slot starts on a cache line, so that the encoder can stream a large payload's sign-mantissa
// plane past the caches (docs/format.md, "Padding"); the envelope starts where its first slot is
// exactly where pack_envelope puts the first payload, so that one never moves.
struct SendLayout {
  uint64_t envelope_offset = 0;       // bytes into the send buffer
  std::vector<uint64_t> slot_offset;  // [param], bytes into the send buffer
  uint64_t buffer_bytes = 0;          // send buffer size these offsets need
};
// Lays out slots of `slot_capacity_bytes[k]` each (raw shard or largest payload, whichever is
// larger). Reuses `layout`'s storage.
void lay_out_send_buffer(std::span<const uint64_t> slot_capacity_bytes, SendLayout& layout);

// Slides the encoded payloads (payload_bytes[k] at their slots) together behind the header and
// writes the header, in `send` (payload memory); the header is built in `scratch` (host memory,
// at least envelope_header_bytes(params) bytes). Returns the envelope's length in bytes.
uint64_t pack_envelope(std::byte* send, const SendLayout& layout,
                       std::span<const uint64_t> payload_bytes, const EnvelopeHeader& header,
                       const MemoryOps& memory, std::span<uint8_t> scratch);

// Walks a received envelope (payload memory, `bytes` long) payload by payload, checking every
// length against the envelope's end before it is used.
class EnvelopeReader {
 public:
  EnvelopeReader(const std::byte* envelope, uint64_t bytes, const MemoryOps& memory)
      : envelope_(envelope), bytes_(bytes), memory_(memory) {}

  // Whether the header is well formed and belongs to the `expected` gather (all_raw ignored);
  // call first. Copies the header out of payload memory.
  bool open(const EnvelopeHeader& expected);
  // Flags bit 0.
  bool all_raw() const;
  // The next parameter's payload; false if its length runs past the envelope's end.
  bool next(std::span<const std::byte>& payload);
  // Whether every byte has been consumed (no trailing bytes).
  bool at_end() const { return offset_ == bytes_; }

 private:
  const std::byte* envelope_;
  uint64_t bytes_;
  const MemoryOps& memory_;
  std::vector<uint8_t> header_;  // the header, in host memory (open())
  size_t params_ = 0;  // set by open()
  size_t next_param_ = 0;
  uint64_t offset_ = 0;  // of the next payload; set by open()
};

// Decodes `peer`'s envelope (`envelope_bytes` at `envelope`, payload memory) for the gather
// `expected` of `layout` into `dest`, the peer's part of the output: parameter k through
// decoders[k], or as raw bytes where that is null, the envelope is all raw, or raw_params[k] is
// set (`raw_params` is empty or has one entry per parameter: the ciera parameters of a
// raw-warmup gather whose delta parameters travel coded). A problem is reported through
// `fail(param, reason)` (param -1: the envelope as a whole), never thrown, so that every rank
// can agree on it in the verdict exchange; decoding stops at a malformed envelope but goes on
// past a parameter that fails to decode.
using EnvelopeFailure = std::function<void(int param, const std::string& reason)>;
void decode_envelope(const std::byte* envelope, uint64_t envelope_bytes,
                     const EnvelopeHeader& expected, const BucketLayout& layout, int peer,
                     std::span<const std::unique_ptr<PayloadDecoder>> decoders,
                     std::span<const uint8_t> raw_params, std::byte* dest, const MemoryOps& memory,
                     const EnvelopeFailure& fail);
// The same with no parameter raw by warmup.
inline void decode_envelope(const std::byte* envelope, uint64_t envelope_bytes,
                            const EnvelopeHeader& expected, const BucketLayout& layout, int peer,
                            std::span<const std::unique_ptr<PayloadDecoder>> decoders,
                            std::byte* dest, const MemoryOps& memory, const EnvelopeFailure& fail) {
  decode_envelope(envelope, envelope_bytes, expected, layout, peer, decoders, {}, dest, memory, fail);
}

}  // namespace ciera
