// The peer schemes' framed stream coders (docs/format.md, "Peer-scheme frames"), as the host
// codec backend hands them to the engine for ShardPolicy::kZeroppInt8, kSdp4bit and kStateless.
#pragma once

#include <memory>

#include "ciera/backend.hpp"

namespace ciera {

// `config.stream_kind` is kZeroppInt8, kSdp4bit or kStateless (ConfigError otherwise).
std::unique_ptr<PayloadEncoder> make_peer_encoder(const CodecConfig& config, uint64_t values,
                                                  StreamIdentity identity);
std::unique_ptr<PayloadDecoder> make_peer_decoder(const CodecConfig& config, uint64_t values,
                                                  StreamIdentity expected);

bool is_peer_stream(StreamKind kind);

}  // namespace ciera
