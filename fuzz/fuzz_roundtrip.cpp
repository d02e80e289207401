// Round-trips arbitrary inputs: the fuzzer's bytes become a configuration and a short sequence
// of shards (each step flips some of the previous step's bytes). Every step must decode bit for
// bit, in every mode.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ciera/codec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  ciera::CodecConfig config;
  config.dtype = static_cast<ciera::DType>(1 + data[0] % 3);
  config.block_values = 64 + (data[1] % 8) * 37;
  config.detection = (data[2] & 1) ? ciera::ChangeDetection::kHash : ciera::ChangeDetection::kExact;
  config.coding = config.detection == ciera::ChangeDetection::kHash
                      ? ciera::ExponentCoding::kBlock
                      : static_cast<ciera::ExponentCoding>((data[2] >> 1) % 3);
  config.warmup_steps = (data[2] >> 3) % 3;
  const int steps = 1 + (data[3] % 4);
  data += 4;
  size -= 4;
  const size_t vb = ciera::dtype_info(config.dtype).value_bytes;
  const size_t n = size / vb;
  std::vector<std::byte> shard(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + n * vb);

  ciera::ShardEncoder encoder(config, n);
  ciera::ShardDecoder decoder(config, n);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> out(n * vb);
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {
      // Deterministic perturbation derived from the data: flip exponent bits of every k-th value.
      const size_t k = size == 0 ? 1 : 1 + (static_cast<size_t>(data[step % size]) % 13);
      for (size_t i = static_cast<size_t>(step) % k; i < n; i += k) shard[i * vb + vb - 1] ^= std::byte{0x01};
    }
    const ciera::FrameStats sent = encoder.encode(shard, payload);
    if (sent.payload_bytes > payload.size()) std::abort();
    decoder.decode({payload.data(), sent.payload_bytes}, out);
    if (n > 0 && std::memcmp(out.data(), shard.data(), shard.size()) != 0) std::abort();
  }
  return 0;
}
