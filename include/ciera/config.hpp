// The one place where codec parameters and their defaults live (house rule 2).
#pragma once

#include <cstdint>
#include <string_view>

#include "ciera/dtype.hpp"

namespace ciera {

// The most coding threads an engine or a collectives object starts beside its caller's
// (EngineConfig / CollectivesConfig::worker_threads): more is a ConfigError, not thousands of
// threads that the cores could never run at once.
inline constexpr unsigned kMaxWorkerThreads = 256;

// The most values one shard may hold: 2^48, beyond any machine's memory, and below which every
// size the codec computes fits 64 bits. The coders and size functions refuse more (ConfigError);
// a payload whose header claims more is malformed (FormatError).
inline constexpr uint64_t kMaxShardValues = uint64_t{1} << 48;

// How the sender finds blocks whose exponents changed since the last send (paper §3.1).
enum class ChangeDetection : uint8_t {
  // Compare with the sender's copy of the exponents it last sent: no false "unchanged" is
  // possible. Costs one byte of sender memory per value.
  kExact = 0,
  // A 128-bit XXH3 hash per block, as in the paper's Algorithm 1: 16 bytes of sender memory per
  // block. A collision would be caught by the content checksum (docs/format.md).
  kHash = 1,
};

// How the exponents of changed blocks are coded in a delta frame.
enum class ExponentCoding : uint8_t {
  kAuto = 0,   // per shard and step, whichever of block/fine is smaller (fine needs kExact)
  kBlock = 1,  // the paper's mode: all exponents of each changed block, entropy-coded
  kFine = 2,   // positions of changed values inside changed blocks plus their exponent steps
};

std::string_view change_detection_name(ChangeDetection mode);
ChangeDetection parse_change_detection(std::string_view name);  // "exact" | "hash"
std::string_view exponent_coding_name(ExponentCoding mode);
ExponentCoding parse_exponent_coding(std::string_view name);  // "auto" | "block" | "fine"

// How one parameter's shards travel: the engine's per-parameter switch, and what the selector
// (paper §3.2) chooses. kDelta goes beyond the paper: the receivers keep the previous values of
// the shard (two bytes per BF16 value instead of one) and take value-delta frames.
//
// The last three are the alternatives CIERA is compared with (include/ciera/peers.hpp), run by
// the same engine over the same transport so that only the scheme differs. The selector never
// chooses them. Two are LOSSY: every rank, the sender included, gathers what the receivers
// reconstruct, not the input.
//  - kZeroppInt8: ZeRO++'s quantised weights (qwZ), block-wise symmetric int8. Lossy.
//  - kSdp4bit: SDP4Bit's weight-difference quantisation, 4-bit, against the receivers' copy. Lossy.
//  - kStateless: every exponent entropy-coded in every frame, no cache (ZipCCL's idea). Lossless.
enum class ShardPolicy : uint8_t {
  kRaw = 0,
  kCiera = 1,
  kDelta = 2,
  kZeroppInt8 = 3,
  kSdp4bit = 4,
  kStateless = 5,
};

// "raw" | "ciera" | "delta" | "zeropp-int8" | "sdp4bit" | "stateless"
std::string_view shard_policy_name(ShardPolicy policy);
ShardPolicy parse_shard_policy(std::string_view name);
bool is_shard_policy(ShardPolicy policy);  // one of the values above
// Whether the gathered values may differ from the input (kZeroppInt8, kSdp4bit).
bool lossy_policy(ShardPolicy policy);

// What the receiver of a stream keeps between frames, and so which frames the stream carries
// (docs/format.md, "Value-delta frames").
enum class StreamKind : uint8_t {
  // The paper's exponent reuse: the receiver keeps each value's exponent (a byte per value); key
  // frames and exponent-delta frames.
  kExponentReuse = 0,
  // The receiver keeps the previous values (value_bytes per value); key frames and value-delta
  // frames, which carry the exact step-to-step difference of every value.
  kValueDelta = 1,
  // The peer schemes' streams (ShardPolicy::kZeroppInt8, kSdp4bit, kStateless; wire format in
  // docs/format.md, "Peer-scheme frames"). kSdp4bit's receiver keeps its reconstruction
  // (value_bytes per value); the other two keep nothing.
  kZeroppInt8 = 2,
  kSdp4bit = 3,
  kStateless = 4,
};

// "exponent-reuse" | "value-delta" | "zeropp-int8" | "sdp4bit" | "stateless"
std::string_view stream_kind_name(StreamKind kind);
// The stream kind a coded policy's parameters travel in (kRaw has none: ConfigError).
StreamKind policy_stream_kind(ShardPolicy policy);

struct CodecConfig {
  static constexpr uint32_t kMinBlockValues = 64;
  static constexpr uint32_t kMaxBlockValues = 4096;

  DType dtype = DType::kBF16;
  StreamKind stream_kind = StreamKind::kExponentReuse;
  // Values per block (paper §3.1 and §4.1, where B = 512 was chosen). Any value in
  // [kMinBlockValues, kMaxBlockValues]; a shard's last block may be partial.
  uint32_t block_values = 512;
  // The first `warmup_steps` frames of an encoder are key frames (all exponents): exponents
  // change often while Adam's moments warm up (paper §2.2, O2). Value-delta streams ignore it:
  // a value-delta frame is the smaller one from the second frame on, warm or not.
  uint32_t warmup_steps = 30;
  ChangeDetection detection = ChangeDetection::kExact;
  ExponentCoding coding = ExponentCoding::kAuto;
  // XXH3-64 of the reconstructed shard in every payload. A decoder with `content_checksum` on
  // rejects payloads that carry none; one with it off still verifies a checksum that is present.
  // Off on both sides, nothing checks the values: damage in transit or a wrong base decodes to
  // wrong values without an error (docs/format.md, "Integrity").
  bool content_checksum = true;
  // Test hook for the reliability suite: keep only this many bits of each block hash (1..128) to
  // force collisions in kHash mode. Leave at 128.
  uint32_t hash_bits = 128;

  // Throws ConfigError naming the offending field.
  void validate() const;
  // *this once validate() passed: for member initializers, before anything derived from the
  // fields (a block grid divides by block_values) is built.
  const CodecConfig& validated() const {
    validate();
    return *this;
  }
};

}  // namespace ciera
