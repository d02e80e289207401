// Feeds arbitrary bytes to ShardDecoder (reliability test 2). Structure-aware: the first input
// byte picks a decoder configuration, the second a valid frame of that configuration (key, fine
// delta, block delta or none); the rest overwrites bytes of that frame and may truncate it, and
// the header checksum is resealed (unless the second byte's bit 2 says not), so the fuzzer
// reaches the deep validation paths as well as the header's field checks. The decoder must throw
// FormatError or decode; it must never crash, hang, or write outside its output buffer; a
// rejected payload leaves its cache, stream, epoch and sequence exactly as they were
// (payload_stream.hpp's StreamReceiver), and the unmodified frame decodes to its shard. A payload
// rejected for its content checksum is resealed with the checksum of what was reconstructed and
// received again (as fuzz_payload does).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "payload_stream.hpp"

namespace {

constexpr size_t kValues = 700;

struct Stream {
  ciera::CodecConfig config;
  std::vector<std::byte> key, fine, block;  // key frame, then two deltas following it
};

std::vector<std::byte> shard_at(ciera::DType dtype, int step) {
  const size_t vb = ciera::dtype_info(dtype).value_bytes;
  std::vector<std::byte> v(kValues * vb);
  uint32_t x = 12345;
  for (size_t i = 0; i < v.size(); ++i) {
    x = x * 1103515245 + 12345;
    v[i] = static_cast<std::byte>(x >> 16);
  }
  // Move some exponents between steps so deltas are non-trivial.
  for (size_t i = static_cast<size_t>(step); i < kValues; i += 7) v[i * vb + vb - 1] ^= std::byte{0x01};
  return v;
}

std::vector<Stream> make_streams() {
  std::vector<Stream> streams;
  for (ciera::DType dtype : {ciera::DType::kBF16, ciera::DType::kFP16, ciera::DType::kFP32}) {
    for (uint32_t block : {64u, 100u}) {
      for (ciera::ExponentCoding second : {ciera::ExponentCoding::kFine, ciera::ExponentCoding::kBlock}) {
        Stream s;
        s.config.dtype = dtype;
        s.config.block_values = block;
        s.config.warmup_steps = 1;
        s.config.coding = second;
        ciera::ShardEncoder encoder(s.config, kValues);
        auto frame = [&](int step) {
          std::vector<std::byte> p(encoder.max_payload_bytes());
          p.resize(encoder.encode(shard_at(dtype, step), p).payload_bytes);
          return p;
        };
        s.key = frame(0);
        s.fine = frame(1);
        s.block = frame(2);
        streams.push_back(std::move(s));
      }
    }
  }
  return streams;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<Stream> streams = make_streams();
  if (size < 2) return 0;
  const Stream& s = streams[data[0] % streams.size()];
  const unsigned which = data[1] % 4;  // 0: raw bytes, 1: key, 2: first delta, 3: second delta
  const unsigned flags = data[1];      // 4: leave the header checksum as mutated
  data += 2;
  size -= 2;

  std::vector<std::byte> payload, genuine;
  if (which == 0) {
    payload.assign(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  } else {
    payload = which == 1 ? s.key : which == 2 ? s.fine : s.block;
    genuine = payload;
    // (offset_lo, offset_hi, value) triples overwrite bytes; a trailing byte truncates.
    size_t i = 0;
    for (; i + 3 <= size; i += 3) {
      const size_t offset = (data[i] | (size_t{data[i + 1]} << 8)) % (payload.size() + 1);
      if (offset < payload.size()) payload[offset] = static_cast<std::byte>(data[i + 2]);
    }
    if (i < size) payload.resize(data[i] % (payload.size() + 1));
  }

  // Unless the flag says otherwise, the header checksum is resealed (payload_stream.hpp), so that
  // a mutated header reaches the field checks behind it.
  if (!(flags & 4) && payload.size() >= ciera::wire::kHeaderBytes) {
    ciera::fuzz::reseal_header(reinterpret_cast<uint8_t*>(payload.data()));
  }

  ciera::ShardDecoder decoder(s.config, kValues);
  const size_t bytes = kValues * ciera::dtype_info(s.config.dtype).value_bytes;
  std::vector<std::byte> out(bytes + 2 * ciera::fuzz::kGuardBytes, ciera::fuzz::kGuard);
  const std::span<std::byte> shard(out.data() + ciera::fuzz::kGuardBytes, bytes);
  try {
    if (which >= 2) decoder.decode(s.key, shard);
    if (which == 3) decoder.decode(s.fine, shard);
  } catch (const ciera::FormatError&) {
    std::abort();  // the unmodified prefix of the stream must decode
  }
  auto receive = [&](std::span<const std::byte> p) {
    const auto before = ciera::fuzz::DecoderState::of(decoder);
    bool decoded = true;
    try {
      decoder.decode(p, shard);
    } catch (const ciera::FormatError&) {
      decoded = false;
      // A rejected payload leaves everything about the receiver as it was (StreamReceiver).
      if (ciera::fuzz::DecoderState::of(decoder) != before) std::abort();
    }
    for (size_t i = 0; i < ciera::fuzz::kGuardBytes; ++i) {
      if (out[i] != ciera::fuzz::kGuard ||
          out[ciera::fuzz::kGuardBytes + bytes + i] != ciera::fuzz::kGuard) {
        std::abort();  // written outside the output
      }
    }
    return decoded;
  };
  if (receive(payload)) {
    // The genuine frame (a mutation that changed nothing, or one the reseal undid) decodes to its
    // shard.
    if (which != 0 && payload == genuine &&
        std::memcmp(shard.data(), shard_at(s.config.dtype, static_cast<int>(which) - 1).data(),
                    bytes) != 0) {
      std::abort();
    }
    return 0;
  }
  if (which != 0 && payload == genuine) std::abort();  // the genuine frame must decode
  // As fuzz_payload: a payload refused only for its content checksum, resealed with the checksum
  // of what was reconstructed, is received again by the unchanged decoder.
  const auto* h = reinterpret_cast<const uint8_t*>(payload.data());
  if (payload.size() < ciera::wire::kHeaderBytes ||
      !(ciera::load_le16(h + ciera::fuzz::kFlagsAt) & ciera::wire::kFlagContentChecksum)) {
    return 0;
  }
  const uint64_t reconstructed = ciera::content_checksum64(shard.data(), shard.size());
  if (ciera::load_le64(h + ciera::fuzz::kContentChecksumAt) == reconstructed) return 0;
  auto* q = reinterpret_cast<uint8_t*>(payload.data());
  ciera::store_le64(q + ciera::fuzz::kContentChecksumAt, reconstructed);
  ciera::fuzz::reseal_header(q);
  receive(payload);
  return 0;
}
