// The engine setup the engine fuzzers receive for and make_corpus sends from: rank 0 receiving
// from rank 1 (fuzz_envelope), or from up to kMaxWorld ranks (fuzz_control), with fixed bucket
// layouts and the engine's codec settings. Codecs are made as the engine's make_codecs makes
// them (src/engine/engine.cpp), so that what the generator sends is what the engine would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/engine.hpp"
#include "engine/control.hpp"
#include "engine/envelope.hpp"
#include "engine/protocol.hpp"

namespace ciera::fuzz {

inline constexpr int kReceiver = 0;  // the rank the fuzzers play
inline constexpr int kSender = 1;    // fuzz_envelope's peer
inline constexpr int kMaxWorld = 8;
// Every rank's stream epoch (the engine's ranks each draw one at random and exchange them at
// setup; fixed here, so that the corpus is reproducible).
inline constexpr uint32_t kStreamEpoch = 0x5EED;

// The engine's codec settings for a bucket of `dtype`: EngineConfig's codec with small blocks
// (more blocks per small shard) and WarmupMode::kRaw, under which the engine's encoders have no
// warmup of their own.
inline CodecConfig engine_codec(DType dtype) {
  CodecConfig codec;
  codec.dtype = dtype;
  codec.block_values = 128;
  codec.warmup_steps = 0;
  return codec;
}

// fuzz_envelope's buckets between two ranks: every dtype, shards of 0 and 1 values, a partial
// last block, ranks holding different amounts, and raw-policy parameters among CIERA ones.
inline std::vector<BucketLayout> envelope_buckets() {
  constexpr ShardPolicy kC = ShardPolicy::kCiera, kR = ShardPolicy::kRaw;
  std::vector<BucketLayout> buckets(3);
  buckets[0].name = "bf16";
  buckets[0].dtype = DType::kBF16;
  buckets[0].shard_values = {{300, 1, 0, 16, 600}, {700, 1, 0, 16, 1000}};
  buckets[0].policy = {kC, kC, kC, kR, kC};
  buckets[1].name = "fp32";
  buckets[1].dtype = DType::kFP32;
  buckets[1].shard_values = {{64, 200}, {130, 3}};
  buckets[1].policy = {kC, kR};
  buckets[2].name = "fp16";
  buckets[2].dtype = DType::kFP16;
  buckets[2].shard_values = {{257}, {257}};
  buckets[2].policy = {kC};
  return buckets;
}

// fuzz_control's buckets for `world` ranks, sharded as FSDP does.
inline std::vector<BucketLayout> control_buckets(int world) {
  return {BucketLayout::fsdp_split("a", DType::kBF16, {1000, 7, 300}, world),
          BucketLayout::fsdp_split("b", DType::kFP32, {64}, world, ShardPolicy::kRaw)};
}

// The largest envelope each rank may announce (the engine's size_buffers).
inline std::vector<uint64_t> max_envelope_bytes(const BucketLayout& layout) {
  std::vector<uint64_t> bytes(static_cast<size_t>(layout.ranks()));
  for (int r = 0; r < layout.ranks(); ++r) {
    bytes[r] = envelope_bound(layout, r, engine_codec(layout.dtype).block_values);
  }
  return bytes;
}

// The stream rank `sender` sends parameter `param` of bucket `bucket` on, numbered as the
// engine's stream_of numbers it (docs/format.md, "Streams").
inline StreamIdentity stream_of(const std::vector<BucketLayout>& buckets, size_t bucket,
                                size_t param, int sender) {
  uint64_t params_before = 0;
  for (size_t b = 0; b < bucket; ++b) params_before += buckets[b].params();
  const uint64_t world = static_cast<uint64_t>(buckets[bucket].ranks());
  return {.stream = static_cast<uint32_t>((params_before + param) * world + sender),
          .epoch = kStreamEpoch};
}

// A rank's codecs for parameter `param` of `bucket`, as make_codecs makes them; null for a
// raw-policy parameter.
inline std::unique_ptr<ShardEncoder> make_encoder(const std::vector<BucketLayout>& buckets,
                                                  size_t bucket, size_t param, int rank) {
  const BucketLayout& layout = buckets[bucket];
  if (layout.policy[param] != ShardPolicy::kCiera) return nullptr;
  return std::make_unique<ShardEncoder>(engine_codec(layout.dtype),
                                        layout.shard_values[rank][param],
                                        stream_of(buckets, bucket, param, rank));
}
inline std::unique_ptr<PayloadDecoder> make_decoder(const std::vector<BucketLayout>& buckets,
                                                    size_t bucket, size_t param, int sender) {
  const BucketLayout& layout = buckets[bucket];
  if (layout.policy[param] != ShardPolicy::kCiera) return nullptr;
  return host_codec_backend()->make_decoder(engine_codec(layout.dtype),
                                            layout.shard_values[sender][param],
                                            stream_of(buckets, bucket, param, sender));
}

// A control record as the engine's make_record writes it.
inline ControlRecord control_record(uint32_t bucket, const BucketLayout& layout, uint64_t step,
                                    uint32_t flags, uint64_t envelope_bytes) {
  ControlRecord r{};
  r.magic = kControlMagic;
  r.version = kEngineProtocolVersion;
  r.bucket = bucket;
  r.flags = flags;
  r.step = step;
  r.envelope_bytes = envelope_bytes;
  r.policy_digest = policy_digest(layout);
  return r;
}

}  // namespace ciera::fuzz
