// XXH3 hashing from Debian's libxxhash: one-shot XXH3-64 and the block hashes of hash change
// detection (XXH3-128), paper §3.1. The streaming content checksum of the codec runs xxHash's
// code compiled per SIMD target instead (format/content_checksum.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/hash_bits.hpp"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#if defined(__x86_64__) && !defined(CIERA_XXHASH_NO_DISPATCH)
// Debian's libxxhash carries runtime-dispatched AVX2/AVX-512 variants; this header routes the
// XXH3 entry points to them (about twice the SSE2 speed for the content checksum).
#include <xxh_x86dispatch.h>
#endif

namespace ciera {

inline uint64_t checksum64(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

// The payload's content checksum (docs/format.md, "Integrity") in one call, straight from the
// definition: XXH3-64 of every 16 KiB chunk, then XXH3-64 of those digests (little-endian u64s).
// The codec computes it in streaming passes (format/content_checksum.hpp); this is the reference
// that tests and fuzzers hold them to.
inline uint64_t content_checksum64(const void* data, size_t bytes) {
  constexpr size_t kChunk = 16384;  // format::kChecksumChunkBytes
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t at = 0; at < bytes; at += kChunk) {
    const uint64_t digest = XXH3_64bits(p + at, bytes - at < kChunk ? bytes - at : kChunk);
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(digest >> (8 * i));
    XXH3_64bits_update(&state, le, sizeof le);
  }
  return XXH3_64bits_digest(&state);
}

struct BlockHash {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const BlockHash&) const = default;
};

// XXH3-128 of a block's exponent bytes, keeping `bits` (1..128) of it. Fewer than 128 bits exist
// only to force collisions in the reliability tests.
inline BlockHash block_hash(const uint8_t* exps, size_t n, unsigned bits) {
  const XXH128_hash_t h = XXH3_128bits(exps, n);
  BlockHash out{h.low64, h.high64};
  keep_hash_bits(out.low, out.high, bits);
  return out;
}

}  // namespace ciera
