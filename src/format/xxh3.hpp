// XXH3-64 with seed 0 as a plain function that the CUDA kernels and the CPU share (CIERA_HD), for
// the content checksum's chunks and digests (docs/format.md, "Integrity"). Written from the
// algorithm's description in xxHash 0.8 (every length path: 0, 1-3, 4-8, 9-16, 17-128, 129-240,
// and the striped long hash); the CPU codec itself keeps xxHash's SIMD code
// (format/content_checksum.hpp), and tests hold this one to libxxhash for every path. The
// 192-byte default secret is the caller's: xxHash's own XXH3_kSecret on the host, a copy of it
// in constant memory on the GPU, so no part of xxHash is copied into this repository.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"

namespace ciera::format::xxh3 {

inline constexpr size_t kSecretBytes = 192;
inline constexpr size_t kStripeBytes = 64;
inline constexpr size_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / 8;  // 16
inline constexpr size_t kBlockBytes = kStripeBytes * kStripesPerBlock;         // 1024

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

// xxHash's default secret (host memory; src/format/xxh3_secret.cpp).
const uint8_t* default_secret();

CIERA_HD inline uint64_t read64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
CIERA_HD inline uint32_t read32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
CIERA_HD inline uint64_t rotl64(uint64_t x, unsigned r) { return x << r | x >> (64 - r); }
CIERA_HD inline uint64_t swap64(uint64_t x) {
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r = r << 8 | ((x >> (8 * i)) & 0xFF);
  return r;
}
// Low and high halves of the 128-bit product, folded with xor.
CIERA_HD inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}
CIERA_HD inline uint64_t xxh64_avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}
CIERA_HD inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}
CIERA_HD inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  return h ^ (h >> 28);
}
CIERA_HD inline uint64_t mix16(const uint8_t* in, const uint8_t* secret) {
  return mul128_fold64(read64(in) ^ read64(secret), read64(in + 8) ^ read64(secret + 8));
}

// The eight accumulators of the long hash, and its steps (a GPU may run them across threads).
struct Accumulators {
  uint64_t acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                     kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
};
CIERA_HD inline void accumulate_stripe(uint64_t* acc, const uint8_t* in, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t value = read64(in + 8 * i);
    const uint64_t key = value ^ read64(secret + 8 * i);
    acc[i ^ 1] += value;
    acc[i] += (key & 0xFFFFFFFFu) * (key >> 32);
  }
}
CIERA_HD inline void scramble(uint64_t* acc, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(secret + kSecretBytes - kStripeBytes + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}
CIERA_HD inline uint64_t merge(const uint64_t* acc, const uint8_t* secret, uint64_t len) {
  uint64_t result = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    result += mul128_fold64(acc[2 * i] ^ read64(secret + 11 + 16 * i),
                            acc[2 * i + 1] ^ read64(secret + 11 + 16 * i + 8));
  }
  return avalanche(result);
}

// The striped accumulation of the long hash (len > 240), shared by the 64- and 128-bit hashes.
CIERA_HD inline Accumulators accumulate_long(const uint8_t* in, size_t len, const uint8_t* secret) {
  Accumulators a;
  const size_t blocks = (len - 1) / kBlockBytes;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      accumulate_stripe(a.acc, in + b * kBlockBytes + s * kStripeBytes, secret + 8 * s);
    }
    scramble(a.acc, secret);
  }
  const size_t stripes = ((len - 1) - kBlockBytes * blocks) / kStripeBytes;
  for (size_t s = 0; s < stripes; ++s) {
    accumulate_stripe(a.acc, in + blocks * kBlockBytes + s * kStripeBytes, secret + 8 * s);
  }
  accumulate_stripe(a.acc, in + len - kStripeBytes, secret + kSecretBytes - kStripeBytes - 7);
  return a;
}

CIERA_HD inline uint64_t hash_long(const uint8_t* in, size_t len, const uint8_t* secret) {
  return merge(accumulate_long(in, len, secret).acc, secret, len);
}

// XXH3_64bits(in, len) with the default secret `secret` (kSecretBytes bytes).
CIERA_HD inline uint64_t hash64(const uint8_t* in, size_t len, const uint8_t* secret) {
  if (len == 0) return xxh64_avalanche(read64(secret + 56) ^ read64(secret + 64));
  if (len <= 3) {
    const uint32_t combined = uint32_t{in[0]} << 16 | uint32_t{in[len >> 1]} << 24 |
                              uint32_t{in[len - 1]} | static_cast<uint32_t>(len) << 8;
    const uint64_t flip = read32(secret) ^ read32(secret + 4);
    return xxh64_avalanche(uint64_t{combined} ^ flip);
  }
  if (len <= 8) {
    const uint64_t flip = read64(secret + 8) ^ read64(secret + 16);
    const uint64_t value = read32(in + len - 4) + (uint64_t{read32(in)} << 32);
    return rrmxmx(value ^ flip, len);
  }
  if (len <= 16) {
    const uint64_t lo = read64(in) ^ (read64(secret + 24) ^ read64(secret + 32));
    const uint64_t hi = read64(in + len - 8) ^ (read64(secret + 40) ^ read64(secret + 48));
    return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  if (len <= 128) {
    uint64_t acc = len * kPrime64_1;
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += mix16(in + 48, secret + 96);
          acc += mix16(in + len - 64, secret + 112);
        }
        acc += mix16(in + 32, secret + 64);
        acc += mix16(in + len - 48, secret + 80);
      }
      acc += mix16(in + 16, secret + 32);
      acc += mix16(in + len - 32, secret + 48);
    }
    acc += mix16(in, secret);
    acc += mix16(in + len - 16, secret + 16);
    return avalanche(acc);
  }
  if (len <= 240) {
    uint64_t acc = len * kPrime64_1;
    for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, secret + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < len / 16; ++i) acc += mix16(in + 16 * i, secret + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, secret + 136 - 17);
    return avalanche(acc);
  }
  return hash_long(in, len, secret);
}

// XXH3_128bits(in, len) with the default secret: the block hashes of hash change detection
// (common/checksum.hpp's block_hash on the CPU). Low and high halves.
struct Hash128 {
  uint64_t low = 0;
  uint64_t high = 0;
};

CIERA_HD inline uint32_t swap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}
CIERA_HD inline Hash128 mul128(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return {a * b, __umul64hi(a, b)};
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return {static_cast<uint64_t>(p), static_cast<uint64_t>(p >> 64)};
#endif
}
CIERA_HD inline Hash128 mix32(Hash128 acc, const uint8_t* in1, const uint8_t* in2, const uint8_t* secret) {
  acc.low += mix16(in1, secret);
  acc.low ^= read64(in2) + read64(in2 + 8);
  acc.high += mix16(in2, secret + 16);
  acc.high ^= read64(in1) + read64(in1 + 8);
  return acc;
}
CIERA_HD inline Hash128 finish128(Hash128 acc, uint64_t len) {
  Hash128 h;
  h.low = avalanche(acc.low + acc.high);
  h.high = 0 - avalanche(acc.low * kPrime64_1 + acc.high * kPrime64_4 + len * kPrime64_2);
  return h;
}

CIERA_HD inline Hash128 hash128(const uint8_t* in, size_t len, const uint8_t* secret) {
  if (len == 0) {
    return {xxh64_avalanche(read64(secret + 64) ^ read64(secret + 72)),
            xxh64_avalanche(read64(secret + 80) ^ read64(secret + 88))};
  }
  if (len <= 3) {
    const uint32_t combined_low = uint32_t{in[0]} << 16 | uint32_t{in[len >> 1]} << 24 |
                                  uint32_t{in[len - 1]} | static_cast<uint32_t>(len) << 8;
    const uint32_t swapped = swap32(combined_low);
    const uint32_t combined_high = swapped << 13 | swapped >> 19;
    const uint64_t flip_low = read32(secret) ^ read32(secret + 4);
    const uint64_t flip_high = read32(secret + 8) ^ read32(secret + 12);
    return {xxh64_avalanche(uint64_t{combined_low} ^ flip_low),
            xxh64_avalanche(uint64_t{combined_high} ^ flip_high)};
  }
  if (len <= 8) {
    const uint64_t value = read32(in) + (uint64_t{read32(in + len - 4)} << 32);
    const uint64_t keyed = value ^ (read64(secret + 16) ^ read64(secret + 24));
    Hash128 m = mul128(keyed, kPrime64_1 + (uint64_t{len} << 2));
    m.high += m.low << 1;
    m.low ^= m.high >> 3;
    m.low ^= m.low >> 35;
    m.low *= kPrimeMx2;
    m.low ^= m.low >> 28;
    m.high = avalanche(m.high);
    return m;
  }
  if (len <= 16) {
    const uint64_t flip_low = read64(secret + 32) ^ read64(secret + 40);
    const uint64_t flip_high = read64(secret + 48) ^ read64(secret + 56);
    const uint64_t in_low = read64(in);
    uint64_t in_high = read64(in + len - 8);
    Hash128 m = mul128(in_low ^ in_high ^ flip_low, kPrime64_1);
    m.low += uint64_t{len - 1} << 54;
    in_high ^= flip_high;
    m.high += in_high + (in_high & 0xFFFFFFFFu) * (kPrime32_2 - 1);
    m.low ^= swap64(m.high);
    Hash128 h = mul128(m.low, kPrime64_2);
    h.high += m.high * kPrime64_2;
    return {avalanche(h.low), avalanche(h.high)};
  }
  if (len <= 128) {
    Hash128 acc{len * kPrime64_1, 0};
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc = mix32(acc, in + 48, in + len - 64, secret + 96);
        acc = mix32(acc, in + 32, in + len - 48, secret + 64);
      }
      acc = mix32(acc, in + 16, in + len - 32, secret + 32);
    }
    acc = mix32(acc, in, in + len - 16, secret);
    return finish128(acc, len);
  }
  if (len <= 240) {
    Hash128 acc{len * kPrime64_1, 0};
    for (size_t i = 0; i < 4; ++i) acc = mix32(acc, in + 32 * i, in + 32 * i + 16, secret + 32 * i);
    acc.low = avalanche(acc.low);
    acc.high = avalanche(acc.high);
    for (size_t i = 4; i < len / 32; ++i) {
      acc = mix32(acc, in + 32 * i, in + 32 * i + 16, secret + 3 + 32 * (i - 4));
    }
    acc = mix32(acc, in + len - 16, in + len - 32, secret + 136 - 17 - 16);
    return finish128(acc, len);
  }
  const Accumulators a = accumulate_long(in, len, secret);
  Hash128 h;
  h.low = merge(a.acc, secret, len);
  // merge() adds len * kPrime64_1 at secret + 11; the high half starts from ~(len * kPrime64_2)
  // at secret + kSecretBytes - 64 - 11.
  uint64_t result = ~(len * kPrime64_2);
  const uint8_t* key = secret + kSecretBytes - kStripeBytes - 11;
  for (int i = 0; i < 4; ++i) {
    result += mul128_fold64(a.acc[2 * i] ^ read64(key + 16 * i), a.acc[2 * i + 1] ^ read64(key + 16 * i + 8));
  }
  h.high = avalanche(result);
  return h;
}

// The content checksum (docs/format.md, "Integrity") of the chunk digests `digests` (one per
// 16 KiB chunk, in order): XXH3-64 of them as little-endian u64s. `scratch` holds 8 * count bytes.
CIERA_HD inline uint64_t combine_digests(const uint64_t* digests, size_t count, uint8_t* scratch,
                                         const uint8_t* secret) {
  for (size_t i = 0; i < count; ++i) {
    for (int b = 0; b < 8; ++b) scratch[8 * i + b] = static_cast<uint8_t>(digests[i] >> (8 * b));
  }
  return hash64(scratch, 8 * count, secret);
}

}  // namespace ciera::format::xxh3
