// The peer schemes (docs/format.md, "Peer-scheme frames") under the fuzzer, in two parts.
//
// Bodies: the rest of the input is handed as a quantised body to dequantize_int8 and apply_diff4
// (which have no checksum to hide behind): each must accept it or throw FormatError, never write
// outside its output, and apply_diff4 must leave its base untouched when it refuses.
//
// Streams: an encoder and a decoder of one scheme exchange frames of values taken from the input,
// some damaged and resealed (the checksum recomputed, so that the body's own checks are reached).
// A genuine frame must decode to what the sender reconstructs (the values themselves, for
// stateless); a damaged one must be refused or decode without writing outside the output; after
// a refusal the genuine frame must still decode.
//
//   byte 0: scheme (mod 3: zeropp-int8, sdp4bit, stateless); byte 1: dtype (mod 3);
//   bytes 2-3: value count (mod 6200); byte 4: group size for the bodies (1 + byte);
//   then the shard's values, frames of edits (an offset byte, a value byte), and the body.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "output_guard.hpp"

namespace {

using namespace ciera;
using Bytes = std::vector<std::byte>;

constexpr size_t kHeaderBytes = 56;  // docs/format.md, "Peer-scheme frames"

Bytes guarded(size_t n) { return Bytes(n + 2 * fuzz::kGuardBytes, fuzz::kGuard); }
std::byte* inside(Bytes& b) { return b.data() + fuzz::kGuardBytes; }
void check_guards(const Bytes& b) {
  for (size_t i = 0; i < fuzz::kGuardBytes; ++i) {
    if (b[i] != fuzz::kGuard || b[b.size() - 1 - i] != fuzz::kGuard) std::abort();
  }
}

void reseal(Bytes& frame) {
  auto* p = reinterpret_cast<uint8_t*>(frame.data());
  const uint64_t body = frame.size() - kHeaderBytes;
  store_le64(p + 40, body);
  store_le64(p + 48, XXH3_64bits_withSeed(frame.data() + kHeaderBytes, body, checksum64(p, 48)));
}

void fuzz_bodies(DType dtype, size_t n, uint32_t group, const uint8_t* body, size_t size) {
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(body), size);
  Bytes out = guarded(bytes);
  try {
    peers::dequantize_int8(dtype, in, group, {inside(out), bytes});
  } catch (const FormatError&) {
  }
  check_guards(out);
  Bytes base = guarded(bytes);
  for (size_t i = 0; i < bytes; ++i) inside(base)[i] = static_cast<std::byte>(i * 7);
  const Bytes before = base;
  try {
    peers::apply_diff4(dtype, in, group, {inside(base), bytes});
  } catch (const FormatError&) {
    if (base != before) std::abort();  // a refused body changes nothing
  }
  check_guards(base);
}

void fuzz_stream(StreamKind kind, DType dtype, size_t n, const uint8_t*& p, const uint8_t* end) {
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  CodecConfig config;
  config.dtype = dtype;
  config.stream_kind = kind;
  const auto backend = host_codec_backend();
  auto encoder = backend->make_encoder(config, n, {.stream = 5, .epoch = 2});
  auto decoder = backend->make_decoder(config, n, {.stream = 5, .epoch = 2});
  Bytes values(bytes);
  for (size_t i = 0; i < bytes && p < end; ++i) values[i] = static_cast<std::byte>(*p++);
  Bytes out = guarded(bytes), mine(bytes);
  for (int frame_index = 0; frame_index < 4; ++frame_index) {
    // A few edits to the values, then the frame.
    for (int e = 0; e < 4 && p + 1 < end && bytes; ++e, p += 2) values[(p[0] * 131u) % bytes] = static_cast<std::byte>(p[1]);
    Bytes frame(encoder->max_payload_bytes());
    frame.resize(encoder->encode(values.data(), bytes, frame.data()));
    if (frame.size() > encoder->max_payload_bytes()) std::abort();
    if (p < end && (*p & 1) && frame.size() > kHeaderBytes) {  // a damaged copy first, resealed
      Bytes damaged = frame;
      damaged[kHeaderBytes + p[0] % (frame.size() - kHeaderBytes)] ^= static_cast<std::byte>(1 + (p[0] >> 1));
      if (*p & 2) damaged.resize(damaged.size() - 1);
      reseal(damaged);
      try {
        decoder->decode(damaged.data(), damaged.size(), inside(out), bytes);
        // Accepted (the change landed where any value is valid): the stream moved on; start over.
        check_guards(out);
        return;
      } catch (const FormatError&) {
      }
      check_guards(out);
    }
    if (p < end) ++p;
    decoder->decode(frame.data(), frame.size(), inside(out), bytes);
    check_guards(out);
    if (bytes == 0) continue;
    if (kind == StreamKind::kStateless) {
      if (std::memcmp(inside(out), values.data(), bytes) != 0) std::abort();
    } else {
      encoder->reconstruct(frame.data(), frame.size(), mine.data(), bytes);
      if (std::memcmp(inside(out), mine.data(), bytes) != 0) std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const StreamKind kinds[] = {StreamKind::kZeroppInt8, StreamKind::kSdp4bit, StreamKind::kStateless};
  const StreamKind kind = kinds[data[0] % 3];
  const DType dtype = static_cast<DType>(1 + data[1] % 3);
  const size_t n = (data[2] | size_t{data[3]} << 8) % 6200;
  const uint32_t group = 1u + data[4];
  const uint8_t* p = data + 5;
  const uint8_t* end = data + size;
  fuzz_stream(kind, dtype, n, p, end);
  fuzz_bodies(dtype, std::min<size_t>(n, 600), group, p, static_cast<size_t>(end - p));
  return 0;
}
