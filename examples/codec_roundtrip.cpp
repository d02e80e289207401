// The shard codec on its own (README, "Using the library"): one sender's BF16 shard over 40
// training-like steps, encoded and decoded, each step checked bit for bit. Prints the wire bits
// per value of the last key frame and of the last step; exits 1 if any step was not exact or the
// codec failed.
#include <ciera/ciera.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

// The BF16 bits of `value`, rounded to nearest even as torch rounds.
uint16_t bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Returns 0 if every step was exact, 1 if one was not; throws ciera::Error (FormatError for a
// payload the decoder refuses) if the codec fails.
int roundtrip() {
  constexpr uint64_t shard_values = 1 << 16;
  constexpr int steps = 40;
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> weights(shard_values);
  for (float& w : weights) w = 0.02f * normal(random);

  ciera::CodecConfig config;  // BF16, B = 512, 30 warmup steps (key frames), exact detection
  const ciera::StreamIdentity stream{.stream = 7, .epoch = ciera::new_stream_epoch()};
  ciera::ShardEncoder encoder(config, shard_values, stream);
  ciera::ShardDecoder decoder(config, shard_values, stream);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<uint16_t> shard(shard_values), out(shard_values);

  double key_bits = 0, last_bits = 0;
  for (int step = 0; step < steps; ++step) {
    for (uint64_t i = 0; i < shard_values; ++i) {
      weights[i] -= 1e-4f * normal(random);  // an optimizer step: small, noisy updates
      shard[i] = bf16_bits(weights[i]);
    }
    const ciera::FrameStats sent = encoder.encode(std::as_bytes(std::span(shard)), payload);
    decoder.decode({payload.data(), sent.payload_bytes}, std::as_writable_bytes(std::span(out)));
    if (std::memcmp(out.data(), shard.data(), shard.size() * sizeof(uint16_t)) != 0) {
      std::fprintf(stderr, "step %d: the decoded shard differs from the one sent\n", step);
      return 1;
    }
    const double bits = 8.0 * static_cast<double>(sent.payload_bytes) / shard_values;
    (sent.kind == ciera::FrameKind::kKey ? key_bits : last_bits) = bits;
  }
  std::printf(
      "%d steps of %llu BF16 values, every one bitwise exact: %.2f bits/value in the last "
      "key frame, %.2f in the last step (raw: 16)\n",
      steps, static_cast<unsigned long long>(shard_values), key_bits, last_bits);
  return 0;
}

}  // namespace

int main() {
  try {
    return roundtrip();
  } catch (const ciera::Error& e) {
    std::fprintf(stderr, "codec_roundtrip: %s\n", e.what());
    return 1;
  }
}
