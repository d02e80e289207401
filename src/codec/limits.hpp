// The checks every coder and size function of the codec makes of its arguments before sizing
// anything from them (include/ciera/config.hpp, kMaxShardValues).
#pragma once

#include <cstdint>
#include <string>

#include "ciera/config.hpp"
#include "ciera/error.hpp"

namespace ciera::codec {

// ConfigError naming `who` for a shard of more than kMaxShardValues values.
inline void check_shard_values(uint64_t values, const char* who) {
  if (values > kMaxShardValues) {
    throw ConfigError(std::string(who) + ": " + std::to_string(values) +
                      " values, more than a shard may hold (2^48)");
  }
}

// `config` for a ShardEncoder/ShardDecoder (`who`) of `values` values: a stream of the shard
// codec's own kinds (exponent reuse, value-delta). A peer scheme's stream has coders of its own
// (make_peer_encoder, the engine's policies): given one, a ShardEncoder would send exponent-reuse
// frames under that name. The one exception is a one-shot coder of a stateless stream: its one
// key frame is the stateless peer coder's body.
inline const CodecConfig& coder_config(const CodecConfig& config, uint64_t values, bool one_shot,
                                       const char* who) {
  check_shard_values(values, who);
  const bool own = config.stream_kind == StreamKind::kExponentReuse ||
                   config.stream_kind == StreamKind::kValueDelta ||
                   (one_shot && config.stream_kind == StreamKind::kStateless);
  if (!own) {
    throw ConfigError(std::string(who) + ": a " +
                      std::string(stream_kind_name(config.stream_kind)) +
                      " stream is a peer scheme's, coded by its own coders (a ShardPolicy of the "
                      "engine), not by the shard codec");
  }
  return config;
}

}  // namespace ciera::codec
