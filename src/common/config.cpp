#include "ciera/config.hpp"

#include <string>

#include "ciera/error.hpp"

namespace ciera {

std::string_view change_detection_name(ChangeDetection mode) {
  return mode == ChangeDetection::kHash ? "hash" : "exact";
}

ChangeDetection parse_change_detection(std::string_view name) {
  if (name == "exact") return ChangeDetection::kExact;
  if (name == "hash") return ChangeDetection::kHash;
  throw ConfigError("unknown change detection '" + std::string(name) +
                    "' (expected exact or hash)");
}

std::string_view exponent_coding_name(ExponentCoding mode) {
  switch (mode) {
    case ExponentCoding::kAuto: return "auto";
    case ExponentCoding::kBlock: return "block";
    case ExponentCoding::kFine: return "fine";
  }
  return "unknown";
}

ExponentCoding parse_exponent_coding(std::string_view name) {
  if (name == "auto") return ExponentCoding::kAuto;
  if (name == "block") return ExponentCoding::kBlock;
  if (name == "fine") return ExponentCoding::kFine;
  throw ConfigError("unknown exponent coding '" + std::string(name) +
                    "' (expected auto, block or fine)");
}

std::string_view shard_policy_name(ShardPolicy policy) {
  switch (policy) {
    case ShardPolicy::kRaw: return "raw";
    case ShardPolicy::kCiera: return "ciera";
    case ShardPolicy::kDelta: return "delta";
    case ShardPolicy::kZeroppInt8: return "zeropp-int8";
    case ShardPolicy::kSdp4bit: return "sdp4bit";
    case ShardPolicy::kStateless: return "stateless";
  }
  return "unknown";
}

bool is_shard_policy(ShardPolicy policy) { return static_cast<uint8_t>(policy) <= 5; }

bool lossy_policy(ShardPolicy policy) {
  return policy == ShardPolicy::kZeroppInt8 || policy == ShardPolicy::kSdp4bit;
}

StreamKind policy_stream_kind(ShardPolicy policy) {
  switch (policy) {
    case ShardPolicy::kCiera: return StreamKind::kExponentReuse;
    case ShardPolicy::kDelta: return StreamKind::kValueDelta;
    case ShardPolicy::kZeroppInt8: return StreamKind::kZeroppInt8;
    case ShardPolicy::kSdp4bit: return StreamKind::kSdp4bit;
    case ShardPolicy::kStateless: return StreamKind::kStateless;
    case ShardPolicy::kRaw: break;
  }
  throw ConfigError("policy " + std::string(shard_policy_name(policy)) + " has no codec stream");
}

ShardPolicy parse_shard_policy(std::string_view name) {
  if (name == "raw") return ShardPolicy::kRaw;
  if (name == "ciera") return ShardPolicy::kCiera;
  if (name == "delta") return ShardPolicy::kDelta;
  if (name == "zeropp-int8") return ShardPolicy::kZeroppInt8;
  if (name == "sdp4bit") return ShardPolicy::kSdp4bit;
  if (name == "stateless") return ShardPolicy::kStateless;
  throw ConfigError("unknown shard policy '" + std::string(name) +
                    "' (expected raw, ciera, delta, zeropp-int8, sdp4bit or stateless)");
}

std::string_view stream_kind_name(StreamKind kind) {
  switch (kind) {
    case StreamKind::kExponentReuse: return "exponent-reuse";
    case StreamKind::kValueDelta: return "value-delta";
    case StreamKind::kZeroppInt8: return "zeropp-int8";
    case StreamKind::kSdp4bit: return "sdp4bit";
    case StreamKind::kStateless: return "stateless";
  }
  return "unknown";
}

void CodecConfig::validate() const {
  if (static_cast<uint8_t>(dtype) < 1 || static_cast<uint8_t>(dtype) > 3) {
    throw ConfigError("config: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
  }
  if (static_cast<uint8_t>(stream_kind) > static_cast<uint8_t>(StreamKind::kStateless)) {
    throw ConfigError("config: unknown stream kind " + std::to_string(static_cast<int>(stream_kind)));
  }
  if (block_values < kMinBlockValues || block_values > kMaxBlockValues) {
    throw ConfigError("config: block_values " + std::to_string(block_values) +
                      " is outside [" + std::to_string(kMinBlockValues) + ", " +
                      std::to_string(kMaxBlockValues) + "]");
  }
  if (detection != ChangeDetection::kExact && detection != ChangeDetection::kHash) {
    throw ConfigError("config: unknown change detection mode");
  }
  if (coding != ExponentCoding::kAuto && coding != ExponentCoding::kBlock &&
      coding != ExponentCoding::kFine) {
    throw ConfigError("config: unknown exponent coding mode");
  }
  if (coding == ExponentCoding::kFine && detection == ChangeDetection::kHash) {
    // Fine coding names the values whose exponent changed; with hash detection the sender keeps
    // only block hashes, not the previous exponents, so it cannot know which values changed.
    throw ConfigError(
        "config: fine exponent coding needs exact change detection (hash detection keeps no "
        "previous exponents to compare values against)");
  }
  if (hash_bits < 1 || hash_bits > 128) {
    throw ConfigError("config: hash_bits " + std::to_string(hash_bits) +
                      " is outside [1, 128]");
  }
}

}  // namespace ciera
