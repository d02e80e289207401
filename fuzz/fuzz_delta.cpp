// Value-delta streams (docs/format.md, "Value-delta frames") under the fuzzer: the input is a
// configuration and a script of steps. Each step moves the shard on (nothing, ulp nudges, small
// steps, values from the input, special values, extreme jumps, every value random, sign flips),
// encodes it and delivers the frame: as sent, damaged (bytes overwritten, truncated), with its
// difference section replaced by input bytes under a resealed header, or after a
// resynchronisation or a reset of the receiver. Every frame as sent must decode bit for bit and
// stay within max_payload_bytes(); a damaged one must be refused (FormatError) or, with the
// content checksum on, give exactly the values sent; after a refusal the decoder's previous
// values must be untouched, so the genuine frame then decodes exactly. Nothing may be written
// outside the output.
//
//   byte 0: dtype (mod 3), bit 2 content checksum off, bits 3..4 the range of the value count
//   byte 1: the value count within its range (0..7, 0..63, 13..1033, 6136..6159)
//   then steps: an op byte and its operands. Bits 0..2 the move (0 nothing, 1 nudges, 2 small
//   steps, 3 values from the input, 4 special values, 5 extreme jumps, 6 all random, 7 sign
//   flips); bits 3..4 the delivery (0 as sent, 1 damaged in place, 2 another section under a
//   resealed header, 3 after a resynchronisation); bit 5 a variant of the delivery (truncated;
//   a section from the input; a reset of the receiver)
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/wire.hpp"
#include "output_guard.hpp"

namespace {

using ciera::DType;
using Bytes = std::vector<std::byte>;

class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), left_(size) {}
  bool empty() const { return left_ == 0; }
  size_t left() const { return left_; }
  uint8_t u8() {
    if (left_ == 0) return 0;
    --left_;
    return *p_++;
  }
  uint32_t u16() { return u8() | (uint32_t{u8()} << 8); }
  uint32_t u32() { return u16() | (u16() << 16); }

 private:
  const uint8_t* p_;
  size_t left_;
};

// splitmix64
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// The order-preserving map (docs/format.md, "Value-delta frames"), for the moves.
uint32_t ord(uint32_t x, unsigned w, uint32_t all) {
  const uint32_t sign = 1u << (w - 1);
  return (x & sign) ? (x ^ all) : (x | sign);
}
uint32_t unord(uint32_t o, unsigned w, uint32_t all) {
  const uint32_t sign = 1u << (w - 1);
  return (o & sign) ? (o & ~sign) : (o ^ all);
}

struct Shard {
  DType dtype;
  size_t n;
  unsigned w;
  uint32_t all;
  Bytes bytes;

  uint32_t get(size_t i) const {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + i * (w / 8), w / 8);
    return v;
  }
  void set(size_t i, uint32_t v) { std::memcpy(bytes.data() + i * (w / 8), &v, w / 8); }
  void add(size_t i, int64_t d) {
    set(i, unord(static_cast<uint32_t>((ord(get(i), w, all) + static_cast<uint64_t>(d)) & all), w, all));
  }
};

const uint32_t kSpecials16[] = {0x7FC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000,
                                0x8000, 0x7F7F, 0x7C00, 0xFC00, 0x7E00, 0x83FF, 0x7FFF};
const uint32_t kSpecials32[] = {0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u,
                                0x00000001u, 0x807FFFFFu, 0x00000000u, 0x80000000u, 0x7F7FFFFFu,
                                0x7FFFFFFFu, 0x00800000u};

void move(Shard& s, unsigned kind, Input& in, Random& rng) {
  if (s.n == 0) return;
  const size_t every = 1 + in.u8() % 16;
  const size_t first = rng.next() % every;
  switch (kind) {
    case 0: break;                                                           // nothing
    case 1: for (size_t i = first; i < s.n; i += every) s.add(i, rng.next() & 1 ? 1 : -1); break;  // ulp nudges
    case 2: {                                                                // small steps
      const int64_t span = 1 + in.u8();
      for (size_t i = first; i < s.n; i += every) s.add(i, static_cast<int64_t>(rng.next() % (2 * span + 1)) - span);
      break;
    }
    case 3: {                                                                // values from the input
      for (unsigned c = 0, count = in.u8() % 16; c < count; ++c) {
        const size_t i = in.u16() % s.n;
        s.set(i, (s.w == 32 ? in.u32() : in.u16()) & s.all);
      }
      break;
    }
    case 4: {                                                                // special values
      for (size_t i = first; i < s.n; i += every) {
        s.set(i, s.w == 32 ? kSpecials32[rng.next() % std::size(kSpecials32)]
                           : kSpecials16[rng.next() % std::size(kSpecials16)]);
      }
      break;
    }
    case 5: {                                                                // extreme jumps
      for (size_t i = first; i < s.n; i += every) {
        const uint32_t x = s.get(i);
        s.set(i, rng.next() & 1 ? (x == 0 ? s.all : 0) : (x == s.all ? s.all >> 1 : s.all));
      }
      break;
    }
    case 6: for (size_t i = 0; i < s.n; ++i) s.set(i, static_cast<uint32_t>(rng.next()) & s.all); break;  // all random
    case 7: for (size_t i = first; i < s.n; i += every) s.set(i, s.get(i) ^ (1u << (s.w - 1))); break;  // signs
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Input in(data, size);
  const uint8_t b0 = in.u8(), b1 = in.u8();
  ciera::CodecConfig config;
  config.dtype = static_cast<DType>(1 + b0 % 3);
  config.stream_kind = ciera::StreamKind::kValueDelta;
  config.content_checksum = (b0 & 4) == 0;
  config.block_values = 64;
  const unsigned range = (b0 >> 3) & 3;
  // The last range straddles the 6144-value chunks of the difference pass (codec/differences.cpp).
  const size_t n = range == 0 ? b1 % 8 : range == 1 ? b1 % 64 : range == 2 ? 13 + 4 * size_t{b1} : 6136 + b1 % 24;
  const ciera::StreamIdentity id{.stream = 3, .epoch = 17};
  ciera::ShardEncoder encoder(config, n, id);
  ciera::ShardDecoder decoder(config, n, id);

  Shard shard{config.dtype, n, 8u * ciera::dtype_info(config.dtype).value_bytes, 0, {}};
  shard.all = shard.w == 32 ? 0xFFFFFFFFu : (1u << shard.w) - 1;
  shard.bytes.resize(n * (shard.w / 8));
  Random rng{uint64_t{b0} << 8 | b1};
  for (size_t i = 0; i < n; ++i) shard.set(i, static_cast<uint32_t>(rng.next()) & shard.all);

  const size_t bytes = shard.bytes.size();
  const size_t bound = encoder.max_payload_bytes();
  Bytes payload(2 * bound + 64);  // larger than needed: a frame must still stay within the bound
  Bytes out(bytes + ciera::fuzz::kGuardBytes, ciera::fuzz::kGuard);
  const std::span<std::byte> shard_out(out.data(), bytes);
  const auto exact = [&] { return bytes == 0 || std::memcmp(out.data(), shard.bytes.data(), bytes) == 0; };
  const auto guard_intact = [&] {
    for (size_t i = bytes; i < out.size(); ++i) {
      if (out[i] != ciera::fuzz::kGuard) return false;
    }
    return true;
  };

  const int steps = n > 2000 ? 10 : 32;  // large shards: fewer steps, for speed
  for (int step = 0; step < steps; ++step) {
    const uint8_t op = step == 0 ? 0 : in.u8();
    if (step > 0 && in.empty() && op == 0) break;
    move(shard, op & 7, in, rng);
    const unsigned delivery = (op >> 3) & 3;
    const bool variant = (op >> 5) & 1;
    if (delivery == 3) {
      // Resynchronisation: asked for by the receiver, or after a reset of it.
      encoder.request_key_frame();
      if (variant) decoder.reset(); else decoder.request_resync();
    }
    const ciera::FrameStats sent = encoder.encode(shard.bytes, payload);
    if (sent.payload_bytes > bound) std::abort();
    if (step == 0 && sent.kind != ciera::FrameKind::kKey) std::abort();
    if (sent.kind == ciera::FrameKind::kDelta) std::abort();
    const Bytes frame(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(sent.payload_bytes));

    bool deliver_genuine = true;
    if (delivery == 1 || delivery == 2) {
      Bytes bad = frame;
      if (delivery == 1) {
        // (offset, value) pairs overwrite bytes; the variant truncates too.
        for (unsigned k = 0, count = 1 + in.u8() % 8; k < count; ++k) {
          const size_t at = in.u16() % bad.size();
          bad[at] = static_cast<std::byte>(in.u8());
        }
        if (variant) bad.resize(in.u16() % (bad.size() + 1));
      } else {
        // The frame's header, resealed around another difference section: the frame's own
        // (empty for a key or 'unchanged' frame) lengthened or shortened and with bytes
        // xor-ed, or (the variant) bytes from the input.
        ciera::wire::Header h = ciera::wire::read_header(reinterpret_cast<const uint8_t*>(frame.data()), frame.size());
        Bytes section;
        if (!variant) {
          if (sent.kind == ciera::FrameKind::kValueDelta) section.assign(frame.begin() + ciera::wire::kHeaderBytes, frame.end());
          const int length = static_cast<int>(section.size()) + static_cast<int8_t>(in.u8());
          section.resize(static_cast<size_t>(std::clamp(length, 0, 1 << 16)));
          for (unsigned k = 0, count = in.u8() % 8; k < count && !section.empty(); ++k) {
            const size_t at = in.u16() % section.size();
            section[at] ^= static_cast<std::byte>(in.u8());
          }
        } else {
          section.resize(std::min<size_t>(in.u16() % 2048, in.left()));
          for (auto& b : section) b = static_cast<std::byte>(in.u8());
        }
        h.kind = ciera::FrameKind::kValueDelta;
        h.section = section.empty() ? ciera::ExponentSection::kUnchanged : ciera::ExponentSection::kDifferences;
        if (in.u8() & 1) h.section = ciera::ExponentSection::kDifferences;  // empty 'differences' too
        h.bitmap_bytes = 0;
        h.sign_mantissa_bytes = 0;
        h.exponent_bytes = section.size();
        bad.assign(ciera::wire::kHeaderBytes, std::byte{0});
        ciera::wire::write_header(h, reinterpret_cast<uint8_t*>(bad.data()));
        bad.insert(bad.end(), section.begin(), section.end());
      }
      const uint32_t epoch = decoder.epoch();
      const uint64_t sequence = decoder.last_sequence();
      const bool has_cache = decoder.has_cache();
      bool accepted = false;
      try {
        decoder.decode(bad, shard_out);
        accepted = true;
      } catch (const ciera::FormatError&) {
      }
      if (!guard_intact()) std::abort();
      if (accepted) {
        // With the checksum on, only the values sent may come out; without it the receiver may
        // now hold other values: the sender resynchronises it.
        if (config.content_checksum && !exact()) std::abort();
        if (!config.content_checksum) {
          encoder.request_key_frame();
          decoder.request_resync();
        }
        deliver_genuine = false;
      } else if (decoder.epoch() != epoch || decoder.last_sequence() != sequence ||
                 decoder.has_cache() != has_cache) {
        std::abort();  // a refused frame moved the decoder
      }
    }
    if (!deliver_genuine) continue;
    try {
      const ciera::FrameStats got = decoder.decode(frame, shard_out);
      if (got.kind != sent.kind || got.section != sent.section) std::abort();
    } catch (const ciera::FormatError&) {
      std::abort();  // a frame as sent, to a decoder in step, must decode
    }
    if (!exact() || !guard_intact()) std::abort();
  }
  return 0;
}
