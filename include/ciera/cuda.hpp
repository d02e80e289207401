// The GPU side of the codec (ciera::cuda; built when CMake finds nvcc, option CIERA_CUDA).
//
// Status (issue 15, docs/gpu.md): the device ShardEncoder and ShardDecoder and the building
// blocks below compute exactly the bytes the CPU codec computes (docs/format.md) from the same
// functions (CIERA_HD), on caller-owned device buffers and the caller's stream, with no
// allocation and no host synchronisation inside a call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/codec.hpp"
#include "ciera/config.hpp"
#include "ciera/dtype.hpp"

struct CUstream_st;  // cudaStream_t, without the CUDA headers

namespace ciera::cuda {

using Stream = CUstream_st*;

// Whether a CUDA device can run this build's kernels; if not, `why` says why (no driver, no
// device, an architecture the build has no code for).
bool device_available(std::string* why = nullptr);

// Splits `n` values (little-endian, at `values`) into their exponents (`exponents`, n bytes) and
// the sign-mantissa plane of docs/format.md (`sign_mantissa`, SignMantissaLayout bytes).
void split(DType dtype, const void* values, uint64_t n, uint8_t* exponents,
           uint8_t* sign_mantissa, Stream stream);
// The inverse of split().
void merge(DType dtype, const uint8_t* exponents, const uint8_t* sign_mantissa, uint64_t n,
           void* values, Stream stream);

// Sets bit k of `bitmap` (ceil(ceil(n/B)/8) bytes, written whole) when some exponent of block k
// differs between `now` and `before` (exact change detection).
void changed_blocks(const uint8_t* now, const uint8_t* before, uint64_t n, uint32_t block_values,
                    uint8_t* bitmap, Stream stream);

// Chunks the content checksum of `bytes` bytes uses (docs/format.md, "Integrity").
uint64_t checksum_chunks(uint64_t bytes);
// The content checksum of `bytes` bytes at `data`, written to `*result` (device memory).
// `digests` holds checksum_chunks(bytes) u64s and `scratch` 8 * checksum_chunks(bytes) bytes.
void content_checksum(const void* data, uint64_t bytes, uint64_t* digests, uint8_t* scratch,
                      uint64_t* result, Stream stream);

// Decodes the rANS segments of one stream (docs/format.md, "Symbol stream", rANS): `segments`
// points at the first segment, `offsets` holds each segment's byte offset from it and one more
// entry, the end (so segment j is [offsets[j], offsets[j+1])); `slots` is the decoder table
// (4096 entries, entropy::rans_slot_entry). Writes the `symbols` symbols to `out` and, for each
// malformed segment, sets `*failed` (device memory) to 1.
void rans_decode(const uint32_t* slots, const uint8_t* segments, const uint64_t* offsets,
                 uint64_t symbols, uint8_t* out, uint32_t* failed, Stream stream);

// Sender side of one shard on the GPU: writes the payload the CPU ShardEncoder writes for the same
// configuration, identity and shard sequence, byte for byte, for either stream kind (exponent
// reuse, or value-delta: then it keeps the values last sent, value_bytes per value, and sends a
// key frame instead of a value-delta frame where the CPU encoder does). Memory is allocated once.
class ShardEncoder {
 public:
  ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity = {});
  ~ShardEncoder();
  ShardEncoder(ShardEncoder&&) noexcept;
  ShardEncoder& operator=(ShardEncoder&&) noexcept;

  // Enqueues the encoding of `shard` (num_values values of device memory) into `payload`
  // (max_payload_bytes() bytes of device memory) on `stream`; neither allocates nor waits. The
  // payload's length is written to `*payload_bytes` (device memory) when the stream gets there,
  // and payload_bytes() returns it on the host (waiting for it).
  void encode(const void* shard, void* payload, uint64_t* payload_bytes, Stream stream);
  // The length of the last payload encoded (waits for the device).
  uint64_t payload_bytes();
  // Makes the next frame a key frame of a new epoch (as on the CPU).
  void request_key_frame();

  uint64_t num_values() const;
  size_t max_payload_bytes() const;
  uint32_t epoch() const;
  uint64_t next_sequence() const;

 private:
  struct Impl;
  Impl& state() const;  // std::logic_error once moved from
  std::unique_ptr<Impl> impl_;
};

// Receiver side of one peer shard on the GPU; owns that shard's cache in device memory: its
// exponents, or for a value-delta stream its previous values (cache_bytes(): N, or N *
// value_bytes; written only from a verified output, so no second copy is kept). Accepts exactly
// what the CPU ShardDecoder accepts (the same payloads, the same stream rules) and reconstructs
// the same bytes. Memory is allocated once, at construction.
class ShardDecoder {
 public:
  ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected = {});
  ~ShardDecoder();
  ShardDecoder(ShardDecoder&&) noexcept;
  ShardDecoder& operator=(ShardDecoder&&) noexcept;

  // Enqueues the decoding of `payload` (`payload_bytes` bytes of device memory) into `shard`
  // (num_values values of device memory) on `stream`; neither allocates nor waits. Call check()
  // before using `shard`: the verdict is known once the stream reaches this point. A refused
  // frame leaves the cache and the stream position as they were (the contents of `shard` are
  // then unspecified). Decodes on one decoder must be checked in order; a decode() while
  // another is unchecked checks that one first.
  void decode(const void* payload, uint64_t payload_bytes, void* shard, Stream stream);
  // Waits for the last decode() and throws FormatError naming why it was refused, if it was.
  void check();

  // As ShardDecoder::request_resync() and reset() on the CPU, ordered on `stream`.
  void request_resync(Stream stream);
  void reset(Stream stream);
  // The epoch of the stream it decodes now (waits for its last work).
  uint32_t epoch() const;

  uint64_t num_values() const;
  size_t cache_bytes() const;
  // The cached exponents, copied to the host (waits for the device); for tests and diagnostics.
  // Empty for a value-delta stream.
  std::vector<uint8_t> cached_exponents() const;
  // A value-delta stream's cache, the previous values (N * value_bytes bytes), copied to the host
  // (waits for the device); empty for an exponent-reuse stream.
  std::vector<uint8_t> cached_values() const;

 private:
  struct Impl;
  Impl& state() const;  // std::logic_error once moved from
  std::unique_ptr<Impl> impl_;
};

// The codec backend of the compressed allgather engine (include/ciera/backend.hpp) on CUDA
// device `device`: payload memory is that device's (cudaMalloc), coded by the ShardEncoder and
// ShardDecoder above; start()'s stream is a cudaStream_t of that device. Each engine thread
// works on a non-blocking stream of its own. Throws ConfigError if the device does not exist
// or cannot run this build's kernels.
std::shared_ptr<const CodecBackend> codec_backend(int device = 0);

}  // namespace ciera::cuda
