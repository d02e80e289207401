// Where a compressed allgather's payload bytes live and what codes them: a codec backend. The
// host backend (host_codec_backend()) keeps them in host memory and codes them with ShardEncoder
// and ShardDecoder; the CUDA backend (ciera::cuda::codec_backend, include/ciera/cuda.hpp) keeps
// them in a GPU's memory and codes them there. Both write and accept the same payloads
// (docs/format.md), so ranks on different backends gather together.
//
// The engine (include/ciera/engine.hpp) runs the same protocol on every backend; it reaches
// payload memory only through the backend's MemoryOps and its coders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "ciera/codec.hpp"
#include "ciera/config.hpp"
#include "ciera/memory.hpp"

namespace ciera {

// Sender side of one shard, on payload memory. One thread at a time.
class PayloadEncoder {
 public:
  virtual ~PayloadEncoder() = default;
  // Encodes `shard` (shard_bytes of payload memory: the coder's num_values values) into
  // `payload` (max_payload_bytes() of payload memory). Complete when it returns; returns the
  // payload's length. Key frames as ShardEncoder::encode.
  virtual uint64_t encode(const std::byte* shard, uint64_t shard_bytes, std::byte* payload) = 0;
  // As ShardEncoder::request_key_frame.
  virtual void request_key_frame() = 0;
  virtual uint32_t epoch() const = 0;
  virtual size_t max_payload_bytes() const = 0;
  // Bytes of persistent sender state.
  virtual size_t cache_bytes() const = 0;
  // Lossy streams (ShardPolicy::kZeroppInt8, kSdp4bit) only: whether the receivers reconstruct
  // something other than the input, and what. reconstruct() writes into `shard` (shard_bytes of
  // payload memory) what every receiver decodes from `payload`, the frame encode() just returned,
  // so that the sender gathers the same values as its peers.
  virtual bool lossy() const { return false; }
  virtual void reconstruct(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
                           uint64_t shard_bytes) const;
};

// Receiver side of one peer shard, on payload memory; owns its exponent cache. One thread at a
// time.
class PayloadDecoder {
 public:
  virtual ~PayloadDecoder() = default;
  // Reconstructs the shard bit for bit from `payload` into `shard` (shard_bytes of payload
  // memory). Complete when it returns. Throws FormatError as ShardDecoder::decode, leaving the
  // cache and stream position unchanged.
  virtual void decode(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
                      uint64_t shard_bytes) = 0;
  // As ShardDecoder::request_resync.
  virtual void request_resync() = 0;
  // The epoch of the stream it decodes now (the next replacement decoder starts past it).
  virtual uint32_t epoch() const = 0;
  // Bytes of the exponent cache.
  virtual size_t cache_bytes() const = 0;
};

// Something a gather waits for before it reads its input (a point in the caller's CUDA stream).
class InputFence {
 public:
  virtual ~InputFence() = default;
  // Blocks until the input is ready. Thread-safe; may be called any number of times.
  virtual void wait() = 0;
};

class CodecBackend {
 public:
  virtual ~CodecBackend() = default;
  // "host", "cuda:0", ...: for messages.
  virtual std::string_view name() const = 0;
  // The memory payloads live in. Lives as long as the backend.
  virtual const MemoryOps& memory() const = 0;
  // Whether that memory is host memory that a transport may read and write directly. When it
  // is not, the engine hands its transport payload memory only (it stages its own small host
  // records through payload memory), so that a device transport never sees a host pointer.
  virtual bool host_memory() const = 0;

  // Whether its coders take streams of `kind` (CodecConfig::stream_kind). The engine refuses a
  // policy whose streams its backend cannot code, on every rank. This default, kept by the CUDA
  // backend: exponent reuse and value delta. The host backend codes the peer schemes' too.
  virtual bool codes(StreamKind kind) const;

  // Coders of `num_values` values of `config.dtype`, as ShardEncoder / ShardDecoder.
  virtual std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& config,
                                                       uint64_t num_values,
                                                       StreamIdentity identity) const = 0;
  virtual std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& config,
                                                       uint64_t num_values,
                                                       StreamIdentity expected) const = 0;

  // A fence for work the caller enqueued before start() on `stream` (for the CUDA backend a
  // cudaStream_t, as an integer, 0 being CUDA's default stream: an event is recorded on it now);
  // null when there is nothing to wait for. This default, for backends without streams (the
  // host's): null for 0, std::invalid_argument for anything else.
  virtual std::unique_ptr<InputFence> fence(uintptr_t stream) const;
};

// Host memory (host_memory_ops()) and the CPU coders. Shared; lives as long as the program.
std::shared_ptr<const CodecBackend> host_codec_backend();

}  // namespace ciera
