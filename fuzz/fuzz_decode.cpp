// Feeds arbitrary bytes to ShardDecoder (reliability test 2). Structure-aware: the first input
// byte picks a decoder configuration and a valid frame of that configuration (key, fine delta,
// block delta or none); the rest overwrites bytes of that frame and may truncate it, so the
// fuzzer reaches the deep validation paths as well as the header checks. The decoder must throw
// FormatError or decode; it must never crash, hang, or write outside its output buffer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"

namespace {

constexpr size_t kValues = 700;
constexpr size_t kCanary = 32;

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
  data += 2;
  size -= 2;

  std::vector<std::byte> payload;
  if (which == 0) {
    payload.assign(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  } else {
    payload = which == 1 ? s.key : which == 2 ? s.fine : s.block;
    // (offset_lo, offset_hi, value) triples overwrite bytes; a trailing byte truncates.
    size_t i = 0;
    for (; i + 3 <= size; i += 3) {
      const size_t offset = (data[i] | (size_t{data[i + 1]} << 8)) % (payload.size() + 1);
      if (offset < payload.size()) payload[offset] = static_cast<std::byte>(data[i + 2]);
    }
    if (i < size) payload.resize(data[i] % (payload.size() + 1));
  }

  ciera::ShardDecoder decoder(s.config, kValues);
  const size_t bytes = kValues * ciera::dtype_info(s.config.dtype).value_bytes;
  std::vector<std::byte> out(bytes + kCanary, std::byte{0xA5});
  try {
    if (which >= 2) decoder.decode(s.key, {out.data(), bytes});
    if (which == 3) decoder.decode(s.fine, {out.data(), bytes});
  } catch (const ciera::FormatError&) {
    std::abort();  // the unmodified prefix of the stream must decode
  }
  const auto before = std::vector<uint8_t>(decoder.cached_exponents().begin(), decoder.cached_exponents().end());
  try {
    decoder.decode(payload, {out.data(), bytes});
  } catch (const ciera::FormatError&) {
    // A rejected payload must leave the cache exactly as it was.
    if (!std::equal(before.begin(), before.end(), decoder.cached_exponents().begin())) std::abort();
  }
  for (size_t i = 0; i < kCanary; ++i) {
    if (out[bytes + i] != std::byte{0xA5}) std::abort();
  }
  return 0;
}
