// A fuzz input read as what one receiver gets from one sender: CIERA payloads back to back
// (docs/format.md), decoded in order by one ShardDecoder. Shared by fuzz_payload (the target)
// and its mutator, which decodes the same way to re-seal the content checksums it mutated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/wire.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "output_guard.hpp"

namespace ciera::fuzz {

// What a rejected payload must leave as it was: whether the decoder holds a cache, its stream
// position and the cached exponents.
struct DecoderState {
  bool has_cache = false;
  uint32_t stream = 0, epoch = 0;
  uint64_t sequence = 0;
  std::vector<uint8_t> cache;

  static DecoderState of(const ShardDecoder& d) {
    return {d.has_cache(),
            d.stream(),
            d.epoch(),
            d.last_sequence(),
            {d.cached_exponents().begin(), d.cached_exponents().end()}};
  }
  bool operator==(const DecoderState&) const = default;
};

// Header offsets (docs/format.md, "Header").
inline constexpr size_t kDTypeAt = 5;
inline constexpr size_t kFlagsAt = 8;
inline constexpr size_t kBlockValuesAt = 12;
inline constexpr size_t kNumValuesAt = 16;
inline constexpr size_t kEpochAt = 24;
inline constexpr size_t kStreamAt = 28;
inline constexpr size_t kBitmapBytesAt = 40;
inline constexpr size_t kSignMantissaBytesAt = 48;
inline constexpr size_t kExponentBytesAt = 56;
inline constexpr size_t kContentChecksumAt = 64;
inline constexpr size_t kHeaderChecksumAt = 72;

inline constexpr size_t kMaxStreamPayloads = 16;

struct Part {
  size_t offset;
  size_t bytes;
};

// Splits `input` where its headers say each payload ends (header + bitmap + padding +
// sign-mantissa + exponent section), unchecked: checking is the decoder's job. A payload too
// short for a header, or claiming more than is left, takes the rest of the input.
inline std::vector<Part> split_payloads(const uint8_t* input, size_t size) {
  std::vector<Part> parts;
  size_t at = 0;
  while (at < size) {
    const uint8_t* p = input + at;
    const size_t left = size - at;
    size_t bytes = left;
    if (left >= wire::kHeaderBytes && parts.size() + 1 < kMaxStreamPayloads) {
      const uint64_t bitmap = load_le64(p + kBitmapBytesAt);
      const uint64_t sign_mantissa = load_le64(p + kSignMantissaBytesAt);
      const uint64_t exponents = load_le64(p + kExponentBytesAt);
      // Each section is bounded by `left` before it is added, so the sum cannot overflow.
      if (bitmap <= left && sign_mantissa <= left && exponents <= left) {
        const uint64_t claimed =
            wire::sign_mantissa_offset(bitmap, sign_mantissa) + sign_mantissa + exponents;
        if (claimed <= left) bytes = static_cast<size_t>(claimed);
      }
    }
    parts.push_back({at, bytes});
    at += bytes;
  }
  return parts;
}

// Low 32 bits of XXH3-64 of header bytes 0..71 at offset 72 (docs/format.md, "Header"), so that
// a mutated header reaches the field checks behind the checksum.
inline void reseal_header(uint8_t* payload) {
  store_le32(payload + kHeaderChecksumAt,
             static_cast<uint32_t>(checksum64(payload, kHeaderChecksumAt)));
}

// The receiver a stream's first header asks for: its dtype, block size and value count (each
// clamped to what a decoder can be configured with), a checksum requirement exactly when that
// header carries one, and its stream id and epoch (docs/format.md, "Streams"). A value count
// larger than the whole input cannot belong to a valid payload (every value has at least one
// sign-mantissa byte), so the decoder then gets none and rejects the count.
struct Receiver {
  CodecConfig config;
  uint64_t num_values = 0;
  StreamIdentity identity;
};

inline Receiver receiver_for(const uint8_t* input, size_t size) {
  Receiver r;
  if (size < wire::kHeaderBytes) {
    r.config.content_checksum = false;
    return r;
  }
  if (is_valid_dtype_code(input[kDTypeAt])) r.config.dtype = static_cast<DType>(input[kDTypeAt]);
  r.config.block_values = std::clamp(load_le32(input + kBlockValuesAt),
                                     CodecConfig::kMinBlockValues, CodecConfig::kMaxBlockValues);
  r.config.content_checksum = (load_le16(input + kFlagsAt) & wire::kFlagContentChecksum) != 0;
  const uint64_t n = load_le64(input + kNumValuesAt);
  r.num_values = n <= size ? n : 0;
  r.identity = {.stream = load_le32(input + kStreamAt), .epoch = load_le32(input + kEpochAt)};
  return r;
}

// One ShardDecoder receiving a whole input, checking on every payload what reliability test 2
// asks: FormatError or a decode, never a write outside the output; and, as test 3 asks of
// truncations, a rejected payload leaves the decoder's state exactly as it was. After a
// rejection it requests a resynchronisation, as the engine does when a gather fails, so that
// the sender's key frame of its next epoch is accepted.
class StreamReceiver {
 public:
  StreamReceiver(const uint8_t* input, size_t size)
      : receiver_(receiver_for(input, size)),
        decoder_(receiver_.config, receiver_.num_values, receiver_.identity),
        shard_bytes_(receiver_.num_values * dtype_info(receiver_.config.dtype).value_bytes),
        output_(shard_bytes_ + 2 * kGuardBytes, kGuard) {}

  // Whether `payload` decoded. Aborts if the decoder broke a promise.
  bool receive(std::span<const std::byte> payload) {
    const DecoderState before = DecoderState::of(decoder_);
    bool decoded = true;
    try {
      decoder_.decode(payload, shard());
    } catch (const FormatError&) {
      decoded = false;
      if (DecoderState::of(decoder_) != before) {
        std::abort();  // a rejected payload changed the decoder's state
      }
      decoder_.request_resync();
    }
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (output_[i] != kGuard || output_[kGuardBytes + shard_bytes_ + i] != kGuard) {
        std::abort();  // written outside the output
      }
    }
    return decoded;
  }

  std::span<std::byte> shard() { return {output_.data() + kGuardBytes, shard_bytes_}; }
  const Receiver& receiver() const { return receiver_; }
  const ShardDecoder& decoder() const { return decoder_; }

 private:
  Receiver receiver_;
  ShardDecoder decoder_;
  size_t shard_bytes_;
  std::vector<std::byte> output_;
};

}  // namespace ciera::fuzz
