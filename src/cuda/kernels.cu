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

__device__ inline uint16_t load16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }
__device__ inline uint32_t load32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
__device__ inline void store16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}
__device__ inline void store32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}

// --- split and merge: one thread per value (FP16: per 8 values, 3 bytes of its 3-bit plane) ---

__global__ void split_bf16(const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* sm) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint16_t x = load16(values + 2 * i);
  exps[i] = format::bits::bf16_exponent(x);
  sm[i] = format::bits::bf16_sign_mantissa(x);
}

__global__ void merge_bf16(const uint8_t* exps, const uint8_t* sm, uint64_t n, uint8_t* values) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  store16(values + 2 * i, format::bits::bf16_merge(exps[i], sm[i]));
}

__global__ void split_fp16(const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* low8,
                           uint8_t* high3) {
  const uint64_t group = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint64_t first = 8 * group;
  if (first >= n) return;
  const unsigned count = n - first < 8 ? unsigned(n - first) : 8u;
  uint8_t h[8];
  for (unsigned k = 0; k < count; ++k) {
    const uint16_t x = load16(values + 2 * (first + k));
    exps[first + k] = format::bits::fp16_exponent(x);
    low8[first + k] = format::bits::fp16_low8(x);
    h[k] = format::bits::fp16_high3(x);
  }
  const uint32_t word = format::bits::fp16_pack_high3(h, count);
  const unsigned bytes = (3 * count + 7) / 8;
  for (unsigned b = 0; b < bytes; ++b) high3[3 * group + b] = uint8_t(word >> (8 * b));
}

__global__ void merge_fp16(const uint8_t* exps, const uint8_t* low8, const uint8_t* high3,
                           uint64_t n, uint8_t* values) {
  const uint64_t group = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint64_t first = 8 * group;
  if (first >= n) return;
  const unsigned count = n - first < 8 ? unsigned(n - first) : 8u;
  const unsigned bytes = (3 * count + 7) / 8;
  uint32_t word = 0;
  for (unsigned b = 0; b < bytes; ++b) word |= uint32_t{high3[3 * group + b]} << (8 * b);
  for (unsigned k = 0; k < count; ++k) {
    store16(values + 2 * (first + k),
            format::bits::fp16_merge(exps[first + k], low8[first + k],
                                     format::bits::fp16_unpack_high3(word, k)));
  }
}

__global__ void split_fp32(const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* high,
                           uint8_t* low16) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint32_t x = load32(values + 4 * i);
  exps[i] = format::bits::fp32_exponent(x);
  high[i] = format::bits::fp32_high(x);
  store16(low16 + 2 * i, format::bits::fp32_low16(x));
}

__global__ void merge_fp32(const uint8_t* exps, const uint8_t* high, const uint8_t* low16,
                           uint64_t n, uint8_t* values) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  store32(values + 4 * i, format::bits::fp32_merge(exps[i], high[i], load16(low16 + 2 * i)));
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
  const auto* v = static_cast<const uint8_t*>(values);
  switch (dtype) {
    case DType::kBF16:
      split_bf16<<<blocks_for(n), kThreads, 0, stream>>>(v, n, exponents, sign_mantissa);
      break;
    case DType::kFP16:
      split_fp16<<<blocks_for((n + 7) / 8), kThreads, 0, stream>>>(v, n, exponents, sign_mantissa,
                                                                   sign_mantissa + n);
      break;
    case DType::kFP32:
      split_fp32<<<blocks_for(n), kThreads, 0, stream>>>(v, n, exponents, sign_mantissa,
                                                         sign_mantissa + n);
      break;
  }
  check_launch("split");
}

void merge(DType dtype, const uint8_t* exponents, const uint8_t* sign_mantissa, uint64_t n,
           void* values, Stream stream) {
  if (n == 0) return;
  auto* v = static_cast<uint8_t*>(values);
  switch (dtype) {
    case DType::kBF16:
      merge_bf16<<<blocks_for(n), kThreads, 0, stream>>>(exponents, sign_mantissa, n, v);
      break;
    case DType::kFP16:
      merge_fp16<<<blocks_for((n + 7) / 8), kThreads, 0, stream>>>(exponents, sign_mantissa,
                                                                   sign_mantissa + n, n, v);
      break;
    case DType::kFP32:
      merge_fp32<<<blocks_for(n), kThreads, 0, stream>>>(exponents, sign_mantissa,
                                                         sign_mantissa + n, n, v);
      break;
  }
  check_launch("merge");
}

void changed_blocks(const uint8_t* now, const uint8_t* before, uint64_t n, uint32_t block_values,
                    uint8_t* bitmap, Stream stream) {
  const uint64_t blocks = (n + block_values - 1) / block_values;
  if (blocks == 0) return;
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
    chunk_digests<<<blocks_for(chunks), kThreads, 0, stream>>>(static_cast<const uint8_t*>(data),
                                                               bytes, chunks, digests, secret);
    check_launch("content_checksum");
  }
  combine_digests<<<1, 1, 0, stream>>>(digests, chunks, scratch, result, secret);
  check_launch("content_checksum");
}

void rans_decode(const uint32_t* slots, const uint8_t* segments, const uint64_t* offsets,
                 uint64_t symbols, uint8_t* out, uint32_t* failed, Stream stream) {
  const uint64_t count = entropy::rans_segment_count(symbols);
  if (count == 0) return;
  rans_segments<<<blocks_for(count), kThreads, 0, stream>>>(slots, segments, offsets, symbols,
                                                            count, out, failed);
  check_launch("rans_decode");
}

}  // namespace ciera::cuda
