// The peer schemes (docs/format.md, "Peer-scheme frames") under the fuzzer, in two parts.
//
// Bodies: the rest of the input is handed as a quantised body to dequantize_int8 and apply_diff4
// (which have no checksum to hide behind): each must accept it or throw FormatError, never write
// outside its output, and apply_diff4 must leave its base untouched when it refuses.
//
// Streams: an encoder and a decoder of one scheme exchange frames of values taken from the input,
// some damaged in the header or the body and resealed (the checksum recomputed, so that the
// header's field and stream-position checks and the body's own checks are reached). A genuine
// frame must decode to what the sender reconstructs (the values themselves, for stateless). A
// damaged one must be refused, leaving the receiver at its epoch and the genuine frame still
// decodable, or decode to what its body says by the scheme's own functions (for stateless, whose
// body carries a content checksum, the values), leaving the receiver at the frame's epoch; never
// writing outside the output.
//
//   byte 0: scheme (mod 3: zeropp-int8, sdp4bit, stateless); byte 1: dtype (mod 3);
//   bytes 2-3: value count (mod 6200); byte 4: group size for the bodies (1 + byte);
//   then the shard's values, frames (edits: an offset byte, a value byte; a flag byte, and for a
//   damaged copy two offset bytes: fuzz_stream), and the body.
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
constexpr size_t kChecksumAt = 48;   // the bytes before it are the header's fields

Bytes guarded(size_t n) { return Bytes(n + 2 * fuzz::kGuardBytes, fuzz::kGuard); }
std::byte* inside(Bytes& b) { return b.data() + fuzz::kGuardBytes; }
void check_guards(const Bytes& b) {
  for (size_t i = 0; i < fuzz::kGuardBytes; ++i) {
    if (b[i] != fuzz::kGuard || b[b.size() - 1 - i] != fuzz::kGuard) std::abort();
  }
}

// Recomputes the frame's checksum, and its body-size field if `size` (else it stays as damaged).
void reseal(Bytes& frame, bool size) {
  auto* p = reinterpret_cast<uint8_t*>(frame.data());
  const uint64_t body = frame.size() - kHeaderBytes;
  if (size) store_le64(p + 40, body);
  store_le64(p + kChecksumAt,
             XXH3_64bits_withSeed(frame.data() + kHeaderBytes, body, checksum64(p, kChecksumAt)));
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

// What a receiver that accepted `frame` must output: its body applied as its header's frame code
// says, by the scheme's own functions (the body's values when nothing can check them); `held` is
// the sdp4bit receiver's copy. Aborts if the body is one that function refuses.
Bytes accepted_output(StreamKind kind, DType dtype, const Bytes& frame, const Bytes& values,
                      const Bytes& held) {
  const std::span<const std::byte> body(frame.data() + kHeaderBytes, frame.size() - kHeaderBytes);
  const uint8_t code = static_cast<uint8_t>(frame[6]);
  Bytes expected = kind == StreamKind::kSdp4bit ? held : Bytes(values.size());
  try {
    if (kind == StreamKind::kStateless) {
      expected = values;  // the body's content checksum holds the values themselves
    } else if (kind == StreamKind::kZeroppInt8) {
      peers::dequantize_int8(dtype, body, peers::kZeroppGroupValues, expected);
    } else if (code == 1) {  // values
      if (body.size() != expected.size()) std::abort();
      std::copy(body.begin(), body.end(), expected.begin());
    } else if (code == 2) {  // coded; 3 (repeat) keeps the copy
      peers::apply_diff4(dtype, body, peers::kSdp4bitGroupValues, expected);
    }
  } catch (const FormatError&) {
    std::abort();  // the decoder accepted a body its scheme refuses
  }
  return expected;
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
  Bytes held(bytes);  // sdp4bit: the receiver's copy, what it output last
  for (int frame_index = 0; frame_index < 4; ++frame_index) {
    // A few edits to the values, then the frame.
    for (int e = 0; e < 4 && p + 1 < end && bytes; ++e, p += 2) values[(p[0] * 131u) % bytes] = static_cast<std::byte>(p[1]);
    Bytes frame(encoder->max_payload_bytes());
    frame.resize(encoder->encode(values.data(), bytes, frame.data()));
    if (frame.size() > encoder->max_payload_bytes()) std::abort();
    // A flag byte: 1, a damaged copy first, one bit (1 << flag >> 5) flipped at the offset in the
    // next two bytes; 4, in the header (the body-size field kept as damaged unless 2), else in the
    // body (2: also truncated); 8, the receiver asks for a resynchronisation first; 16, not
    // resealed (else the checksum is recomputed, so that the checks behind it are reached).
    const uint8_t flag = p < end ? *p++ : 0;
    if ((flag & 1) && ((flag & 4) || frame.size() > kHeaderBytes)) {
      const size_t at = p + 1 < end ? (p[0] | size_t{p[1]} << 8) : 0;
      p += std::min<std::ptrdiff_t>(2, end - p);
      const bool header = (flag & 4) != 0;
      Bytes damaged = frame;
      damaged[header ? at % kChecksumAt : kHeaderBytes + at % (frame.size() - kHeaderBytes)] ^=
          static_cast<std::byte>(1u << (flag >> 5));
      if (!header && (flag & 2)) damaged.resize(damaged.size() - 1);
      if (!(flag & 16)) reseal(damaged, !header || (flag & 2));
      if (flag & 8) decoder->request_resync();
      const uint32_t epoch = decoder->epoch();
      bool accepted = true;
      try {
        decoder->decode(damaged.data(), damaged.size(), inside(out), bytes);
      } catch (const FormatError&) {
        accepted = false;
      }
      check_guards(out);
      if (!accepted) {
        // Refused: the receiver is where it was (the genuine frame below must still decode).
        if (decoder->epoch() != epoch) std::abort();
      } else {
        // Accepted (the change landed where the header's checks allow, or where any value is
        // valid): the output is what the damaged frame says, and the receiver is at its epoch.
        if (decoder->epoch() != load_le32(reinterpret_cast<const uint8_t*>(damaged.data()) + 16))
          std::abort();
        if (bytes &&
            std::memcmp(inside(out), accepted_output(kind, dtype, damaged, values, held).data(),
                        bytes) != 0) {
          std::abort();
        }
        return;  // the stream moved on; start over
      }
    }
    decoder->decode(frame.data(), frame.size(), inside(out), bytes);
    check_guards(out);
    if (bytes == 0) continue;
    if (kind == StreamKind::kStateless) {
      if (std::memcmp(inside(out), values.data(), bytes) != 0) std::abort();
    } else {
      encoder->reconstruct(frame.data(), frame.size(), mine.data(), bytes);
      if (std::memcmp(inside(out), mine.data(), bytes) != 0) std::abort();
    }
    std::memcpy(held.data(), inside(out), bytes);
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
