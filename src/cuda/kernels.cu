// The GPU codec's device building blocks (include/ciera/cuda.hpp). Each kernel computes its
// bytes with the same CIERA_HD functions the host tests hold to the CPU codec, so GPU and CPU
// agree bit for bit by construction; tests/cuda/ checks it on a device.
#include <cuda_runtime.h>

#include <string>

#include "ciera/cuda.hpp"
#include "ciera/error.hpp"
#include "entropy/rans_segment.hpp"
#include "format/content_checksum.hpp"
#include "format/value_bits.hpp"
#include "format/xxh3.hpp"

namespace ciera::cuda {
namespace {

constexpr unsigned kThreads = 256;

unsigned blocks_for(uint64_t items) {
  const uint64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : blocks);
}

// Before each launch: an earlier call on this thread may have left a non-sticky status
// (cudaErrorNotReady from an event query), which check_launch would report as this launch's.
void clear_stale_error() { (void)cudaGetLastError(); }

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(std::string("CUDA ") + what + " launch failed: " + cudaGetErrorString(e));
  }
}

// The 192-byte XXH3 secret travels by value as a kernel argument: no constant symbol to set up.
struct Secret {
  uint8_t bytes[format::xxh3::kSecretBytes];
};

Secret host_secret() {
  Secret s;
  const uint8_t* from = format::xxh3::default_secret();
  for (size_t i = 0; i < sizeof s.bytes; ++i) s.bytes[i] = from[i];
  return s;
}

// --- split and merge: one thread per group (format/value_bits.hpp: a value, or 8 FP16 values) ---

__global__ void split_groups(uint8_t dtype, const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* sm) {
  const uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  format::bits::split_group(dtype, values, n, g, exps, sm);
}

__global__ void merge_groups(uint8_t dtype, const uint8_t* exps, const uint8_t* sm, uint64_t n, uint8_t* values) {
  const uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  format::bits::merge_group(dtype, [exps](uint64_t i) { return exps[i]; }, sm, n, g, values);
}

// --- exact change detection: one thread per block, a warp's ballot makes four bitmap bytes ---

__global__ void changed_blocks_kernel(const uint8_t* now, const uint8_t* before, uint64_t n,
                                      uint32_t block_values, uint64_t blocks, uint8_t* bitmap) {
  const uint64_t block = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  bool changed = false;
  if (block < blocks) {
    const uint64_t first = block * block_values;
    const uint64_t end = first + block_values < n ? first + block_values : n;
    for (uint64_t i = first; i < end && !changed; ++i) changed = now[i] != before[i];
  }
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, changed);
  const unsigned lane = threadIdx.x % 32;
  if (lane % 8 == 0 && block < blocks) bitmap[block / 8] = uint8_t(mask >> lane);
}

// --- content checksum: one thread per 16 KiB chunk, then one combining the digests ---

__global__ void chunk_digests(const uint8_t* data, uint64_t bytes, uint64_t chunks,
                              uint64_t* digests, Secret secret) {
  const uint64_t c = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const uint64_t first = c * format::kChecksumChunkBytes;
  const uint64_t length = bytes - first < format::kChecksumChunkBytes ? bytes - first
                                                                       : format::kChecksumChunkBytes;
  digests[c] = format::xxh3::hash64(data + first, length, secret.bytes);
}

__global__ void combine_digests(const uint64_t* digests, uint64_t chunks, uint8_t* scratch,
                                uint64_t* result, Secret secret) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  *result = format::xxh3::combine_digests(digests, chunks, scratch, secret.bytes);
}

// --- rANS: one thread per segment ---

__global__ void rans_segments(const uint32_t* slots, const uint8_t* segments,
                              const uint64_t* offsets, uint64_t symbols, uint64_t count,
                              uint8_t* out, uint32_t* failed) {
  const uint64_t j = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (j >= count) return;
  const uint64_t first = j * entropy::kRansSegmentSymbols;
  const uint64_t length = symbols - first < entropy::kRansSegmentSymbols
                              ? symbols - first
                              : entropy::kRansSegmentSymbols;
  const uint64_t begin = offsets[j];
  const uint64_t end = offsets[j + 1];
  if (end < begin ||
      !entropy::rans_decode_segment(slots, segments + begin, end - begin, length, out + first)) {
    atomicExch(failed, 1u);
  }
}

}  // namespace

void split(DType dtype, const void* values, uint64_t n, uint8_t* exponents,
           uint8_t* sign_mantissa, Stream stream) {
  if (n == 0) return;
  const auto code = static_cast<uint8_t>(dtype);
  clear_stale_error();
  split_groups<<<blocks_for(format::bits::group_count(code, n)), kThreads, 0, stream>>>(
      code, static_cast<const uint8_t*>(values), n, exponents, sign_mantissa);
  check_launch("split");
}

void merge(DType dtype, const uint8_t* exponents, const uint8_t* sign_mantissa, uint64_t n,
           void* values, Stream stream) {
  if (n == 0) return;
  const auto code = static_cast<uint8_t>(dtype);
  clear_stale_error();
  merge_groups<<<blocks_for(format::bits::group_count(code, n)), kThreads, 0, stream>>>(
      code, exponents, sign_mantissa, n, static_cast<uint8_t*>(values));
  check_launch("merge");
}

void changed_blocks(const uint8_t* now, const uint8_t* before, uint64_t n, uint32_t block_values,
                    uint8_t* bitmap, Stream stream) {
  const uint64_t blocks = (n + block_values - 1) / block_values;
  if (blocks == 0) return;
  clear_stale_error();
  changed_blocks_kernel<<<blocks_for(blocks), kThreads, 0, stream>>>(now, before, n, block_values,
                                                                     blocks, bitmap);
  check_launch("changed_blocks");
}

uint64_t checksum_chunks(uint64_t bytes) {
  return (bytes + format::kChecksumChunkBytes - 1) / format::kChecksumChunkBytes;
}

void content_checksum(const void* data, uint64_t bytes, uint64_t* digests, uint8_t* scratch,
                      uint64_t* result, Stream stream) {
  static const Secret secret = host_secret();
  const uint64_t chunks = checksum_chunks(bytes);
  if (chunks > 0) {
    clear_stale_error();
    chunk_digests<<<blocks_for(chunks), kThreads, 0, stream>>>(static_cast<const uint8_t*>(data),
                                                               bytes, chunks, digests, secret);
    check_launch("content_checksum");
  }
  clear_stale_error();
  combine_digests<<<1, 1, 0, stream>>>(digests, chunks, scratch, result, secret);
  check_launch("content_checksum");
}

void rans_decode(const uint32_t* slots, const uint8_t* segments, const uint64_t* offsets,
                 uint64_t symbols, uint8_t* out, uint32_t* failed, Stream stream) {
  const uint64_t count = entropy::rans_segment_count(symbols);
  if (count == 0) return;
  clear_stale_error();
  rans_segments<<<blocks_for(count), kThreads, 0, stream>>>(slots, segments, offsets, symbols,
                                                            count, out, failed);
  check_launch("rans_decode");
}

}  // namespace ciera::cuda
