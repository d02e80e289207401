// Value-delta streams (docs/format.md, "Value-delta frames"): the order-preserving map and the
// zigzag, every difference kernel of every SIMD target against docs/format.md read literally,
// the difference section's writer and reader (revert included), round trips of
// ShardEncoder/ShardDecoder with stream_kind value-delta, corruption, hand-built non-canonical
// sections, and the stream-kind checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/differences.hpp"
#include "codec/kernels.hpp"
#include "codec/wire.hpp"
#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "format/content_checksum.hpp"
#include "test_util.hpp"

namespace ciera::codec {
namespace {

using ciera::testing::kernels_of_every_target;
using Bytes = std::vector<std::byte>;

// ---- docs/format.md read literally -------------------------------------------------------------

// ord(x) = x ^ all-ones if the sign bit is set, else x | sign bit.
uint32_t ref_ord(uint32_t x, unsigned w) {
  const uint32_t all = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
  const uint32_t sign = 1u << (w - 1);
  return (x & sign) ? (x ^ all) : (x | sign);
}
uint32_t ref_unord(uint32_t o, unsigned w) {
  const uint32_t all = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
  const uint32_t sign = 1u << (w - 1);
  return (o & sign) ? (o & ~sign) : (o ^ all);
}
// d = ord(new) - ord(old) mod 2^w read as a signed w-bit integer; z = 2d (d >= 0), -2d - 1 (d < 0).
uint32_t ref_z(uint32_t new_bits, uint32_t old_bits, unsigned w) {
  const uint64_t mod = uint64_t{1} << w;
  const uint64_t d = (uint64_t{ref_ord(new_bits, w)} + mod - ref_ord(old_bits, w)) % mod;
  const int64_t s = d >= mod / 2 ? static_cast<int64_t>(d) - static_cast<int64_t>(mod) : static_cast<int64_t>(d);
  return static_cast<uint32_t>(s >= 0 ? 2 * s : -2 * s - 1);
}
uint32_t ref_apply(uint32_t old_bits, uint32_t z, unsigned w) {
  const uint64_t mod = uint64_t{1} << w;
  const int64_t d = (z & 1) ? -static_cast<int64_t>((uint64_t{z} + 1) / 2) : static_cast<int64_t>(z / 2);
  const uint64_t o = (uint64_t{ref_ord(old_bits, w)} + static_cast<uint64_t>(d + static_cast<int64_t>(mod))) % mod;
  return ref_unord(static_cast<uint32_t>(o), w);
}

// A float's value from its bits (BF16: the top half of an FP32; FP16 decoded by hand).
double value_of(DType dtype, uint32_t bits) {
  if (dtype == DType::kFP32) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (dtype == DType::kBF16) {
    const uint32_t b = bits << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  const int sign = (bits >> 15) & 1, e = (bits >> 10) & 31, m = bits & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(1024 + m, e - 25);
  return sign ? -v : v;
}

unsigned width_of(DType dtype) { return 8 * dtype_info(dtype).value_bytes; }

// ---- the map and the zigzag --------------------------------------------------------------------

TEST(DifferenceMap, EverySixteenBitPatternIsABijectionThatKeepsOrder) {
  std::vector<bool> seen(65536), seen_z(65536);
  for (uint32_t x = 0; x < 65536; ++x) {
    const auto b = static_cast<uint16_t>(x);
    const uint16_t o = to_ordered<uint16_t>(b);
    ASSERT_EQ(o, ref_ord(x, 16)) << std::hex << x;
    ASSERT_EQ(from_ordered<uint16_t>(o), b) << std::hex << x;
    ASSERT_EQ(from_ordered<uint16_t>(b), ref_unord(x, 16)) << std::hex << x;
    ASSERT_FALSE(seen[o]) << "two patterns map to " << o;
    seen[o] = true;
    // Neighbours are neighbours: a positive pattern's successor is one above it, a negative
    // one's successor (larger magnitude) one below.
    if (x != 0x7FFF && x != 0xFFFF) {
      const uint16_t next = to_ordered<uint16_t>(static_cast<uint16_t>(x + 1));
      ASSERT_EQ(next, static_cast<uint16_t>((x & 0x8000) ? o - 1 : o + 1)) << std::hex << x;
    }
    // Zigzag: 0, -1, +1, -2, ... -> 0, 1, 2, 3, ...
    const auto d = static_cast<int16_t>(b);
    const uint16_t z = zigzag<uint16_t>(b);
    ASSERT_EQ(z, static_cast<uint16_t>(d >= 0 ? 2 * d : -2 * int32_t{d} - 1)) << d;
    ASSERT_EQ(unzigzag<uint16_t>(z), b);
    ASSERT_FALSE(seen_z[z]);
    seen_z[z] = true;
  }
  // -0.0 sits just below +0.0; the largest NaN patterns at the ends.
  EXPECT_EQ(to_ordered<uint16_t>(0x8000) + 1, to_ordered<uint16_t>(0x0000));
  EXPECT_EQ(to_ordered<uint16_t>(0xFFFF), 0);
  EXPECT_EQ(to_ordered<uint16_t>(0x7FFF), 0xFFFF);
  EXPECT_EQ(zigzag<uint16_t>(0), 0);
  EXPECT_EQ(zigzag<uint16_t>(0xFFFF), 1);
  EXPECT_EQ(zigzag<uint16_t>(1), 2);
  EXPECT_EQ(zigzag<uint16_t>(0xFFFE), 3);
  EXPECT_EQ(zigzag<uint16_t>(0x8000), 0xFFFF);
  EXPECT_EQ(zigzag<uint16_t>(0x7FFF), 0xFFFE);

  // Order: every non-NaN BF16 and FP16 pattern, sorted by its ordered integer, is sorted by value
  // (with -0.0 right before +0.0).
  for (const DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<uint16_t> by_order;
    for (uint32_t x = 0; x < 65536; ++x) {
      if (!std::isnan(value_of(dtype, x))) by_order.push_back(static_cast<uint16_t>(x));
    }
    std::sort(by_order.begin(), by_order.end(),
              [](uint16_t a, uint16_t b) { return to_ordered<uint16_t>(a) < to_ordered<uint16_t>(b); });
    for (size_t i = 1; i < by_order.size(); ++i) {
      const double a = value_of(dtype, by_order[i - 1]), b = value_of(dtype, by_order[i]);
      ASSERT_TRUE(a < b || (a == 0 && b == 0 && by_order[i - 1] == 0x8000 && by_order[i] == 0))
          << std::hex << by_order[i - 1] << " " << by_order[i];
    }
  }
}

TEST(DifferenceMap, ThirtyTwoBitPatternsAreABijectionThatKeepsOrder) {
  std::mt19937_64 rng(5);
  std::vector<uint32_t> patterns = {0, 1, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFF,
                                    0xFFFFFFFE, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00800000,
                                    0x807FFFFF, 0x3F800000, 0xBF800000};
  for (int i = 0; i < 2'000'000; ++i) patterns.push_back(static_cast<uint32_t>(rng()));
  for (const uint32_t x : patterns) {
    const uint32_t o = to_ordered<uint32_t>(x);
    ASSERT_EQ(o, ref_ord(x, 32)) << std::hex << x;
    ASSERT_EQ(from_ordered<uint32_t>(o), x);
    ASSERT_EQ(to_ordered<uint32_t>(from_ordered<uint32_t>(x)), x);
    if (x != 0x7FFFFFFF && x != 0xFFFFFFFF) {
      ASSERT_EQ(to_ordered<uint32_t>(x + 1), (x & 0x80000000u) ? o - 1 : o + 1) << std::hex << x;
    }
    const auto d = static_cast<int32_t>(x);
    const uint32_t z = zigzag<uint32_t>(x);
    ASSERT_EQ(z, static_cast<uint32_t>(d >= 0 ? 2 * int64_t{d} : -2 * int64_t{d} - 1)) << d;
    ASSERT_EQ(unzigzag<uint32_t>(z), x);
    ASSERT_EQ(zigzag<uint32_t>(unzigzag<uint32_t>(x)), x);
  }
  EXPECT_EQ(to_ordered<uint32_t>(0x80000000u) + 1, to_ordered<uint32_t>(0u));
  // Order against the float values of random non-NaN pairs.
  for (int i = 0; i < 1'000'000; ++i) {
    const auto a = static_cast<uint32_t>(rng()), b = static_cast<uint32_t>(rng());
    const double va = value_of(DType::kFP32, a), vb = value_of(DType::kFP32, b);
    if (std::isnan(va) || std::isnan(vb) || va == vb) continue;
    ASSERT_EQ(va < vb, to_ordered<uint32_t>(a) < to_ordered<uint32_t>(b)) << std::hex << a << " " << b;
  }
}

TEST(DifferenceMap, EscapeBucketsFollowTheFormat) {
  EXPECT_EQ(escape_bucket(0), 0u);
  EXPECT_EQ(escape_bucket(1), 1u);
  EXPECT_EQ(escape_bucket(2), 2u);
  EXPECT_EQ(escape_bucket(3), 2u);
  EXPECT_EQ(escape_bucket(0xFFFC), 16u);
  EXPECT_EQ(escape_bucket(0xFFFFFFFCu), 32u);
  for (unsigned b = 0; b <= 32; ++b) {
    EXPECT_EQ(escape_extra_bits(b), b < 2 ? 0u : b - 1);
    EXPECT_EQ(escape_base(b), b == 0 ? 0u : uint64_t{1} << (b - 1));
  }
}

// ---- the kernels against the format ------------------------------------------------------------

// 192 values are 64 groups, what the VBMI passes take at once.
const size_t kLengths[] = {0,  1,  2,   3,   4,   5,   31,  32,  33,       47,  48,
                           49, 64, 100, 191, 192, 193, 383, 384, 1000 + 7, 6145};

enum class ZMix { kNoEscapes, kFewEscapes, kManyEscapes, kAllEscapes, kZeros };
const ZMix kMixes[] = {ZMix::kNoEscapes, ZMix::kFewEscapes, ZMix::kManyEscapes, ZMix::kAllEscapes,
                       ZMix::kZeros};

// z values below 2^w: classes 0..2, or escapes of every bucket width.
uint32_t random_z(ZMix mix, unsigned w, std::mt19937_64& rng) {
  const uint64_t r = rng();
  bool escape = false;
  switch (mix) {
    case ZMix::kZeros: return 0;
    case ZMix::kNoEscapes: return static_cast<uint32_t>(r % 3);
    case ZMix::kFewEscapes: escape = r % 50 == 0; break;
    case ZMix::kManyEscapes: escape = r % 2 == 0; break;
    case ZMix::kAllEscapes: escape = true; break;
  }
  if (!escape) return static_cast<uint32_t>((r >> 8) % 3);
  const unsigned bits = static_cast<unsigned>((r >> 8) % (w + 1));  // width of the raw z
  const uint64_t max = w == 32 ? 0xFFFFFFFFull : (uint64_t{1} << w) - 1;
  uint64_t z = bits == 0 ? 3 : (rng() & ((uint64_t{1} << bits) - 1)) | (uint64_t{1} << (bits - 1));
  z = std::clamp<uint64_t>(z, 3, max);
  if ((r >> 16) % 16 == 0) z = max;        // the largest difference
  else if ((r >> 16) % 16 == 1) z = 3;     // the smallest escape
  return static_cast<uint32_t>(z);
}

template <typename U>
std::vector<U> random_values(size_t n, std::mt19937_64& rng) {
  std::vector<U> v(n);
  for (auto& x : v) x = static_cast<U>(rng());
  return v;
}

template <typename U>
struct KernelSet {
  uint64_t (*differences)(const uint8_t*, U*, size_t, U*);
  uint64_t (*group_symbols)(const U*, size_t, uint8_t*);
  void (*expand_groups)(const uint8_t*, size_t, U*);
  uint64_t (*apply_differences)(U*, const U*, size_t, uint8_t*);
  uint64_t (*collect_escapes)(const U*, size_t, U*);
  void (*place_escapes)(U*, size_t, const U*);
};
KernelSet<uint16_t> set16(const CodecKernels& k) {
  return {k.differences16, k.group_symbols16, k.expand_groups16, k.apply_differences16,
          k.collect_escapes16, k.place_escapes16};
}
KernelSet<uint32_t> set32(const CodecKernels& k) {
  return {k.differences32, k.group_symbols32, k.expand_groups32, k.apply_differences32,
          k.collect_escapes32, k.place_escapes32};
}

template <typename U>
void check_kernels(const CodecKernels& table, const KernelSet<U>& k, uint64_t seed) {
  constexpr unsigned w = 8 * sizeof(U);
  std::mt19937_64 rng(seed);
  for (const size_t n : kLengths) {
    for (const ZMix mix : kMixes) {
      SCOPED_TRACE(std::string(table.target) + " w=" + std::to_string(w) + " n=" +
                   std::to_string(n) + " mix=" + std::to_string(static_cast<int>(mix)));
      const size_t groups_n = (n + 2) / 3;
      // Reference z, with zeros up to the next multiple of 3.
      std::vector<U> z(3 * groups_n + 64, U{0});
      for (size_t i = 0; i < n; ++i) z[i] = static_cast<U>(random_z(mix, w, rng));
      // differences: base and values that give exactly these z.
      std::vector<U> base = random_values<U>(n, rng);
      std::vector<U> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = static_cast<U>(ref_apply(base[i], z[i], w));
      {
        std::vector<U> b = base;
        std::vector<U> got(n + 64, static_cast<U>(0xA5A5A5A5u));
        uint64_t want_changed = 0;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(ref_z(values[i], base[i], w), z[i]) << i;
          want_changed += z[i] != 0;
        }
        // The caller's values at an odd address: the shard may have any alignment.
        std::vector<uint8_t> odd(n * sizeof(U) + 1);
        if (n > 0) std::memcpy(odd.data() + 1, values.data(), n * sizeof(U));  // data() may be null
        EXPECT_EQ(k.differences(odd.data() + 1, b.data(), n, got.data()), want_changed);
        EXPECT_TRUE(std::equal(z.begin(), z.begin() + n, got.begin()));
        EXPECT_EQ(b, values);
        for (size_t i = n; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<U>(0xA5A5A5A5u)) << i;
      }
      // group_symbols
      std::vector<uint8_t> want_groups(groups_n);
      uint64_t want_escaped = 0;
      for (size_t g = 0; g < groups_n; ++g) {
        unsigned s = 0;
        for (unsigned j = 0; j < 3; ++j) s |= std::min<uint32_t>(z[3 * g + j], 3) << (2 * j);
        want_groups[g] = static_cast<uint8_t>(s);
      }
      for (size_t i = 0; i < n; ++i) want_escaped += z[i] >= 3;
      {
        std::vector<uint8_t> got(groups_n + 64, 0xEE);
        EXPECT_EQ(k.group_symbols(z.data(), n, got.data()), want_escaped);
        EXPECT_TRUE(std::equal(want_groups.begin(), want_groups.end(), got.begin()));
        for (size_t i = groups_n; i < got.size(); ++i) ASSERT_EQ(got[i], 0xEE) << i;
        EXPECT_EQ(table.count_escapes(want_groups.data(), groups_n), want_escaped);
      }
      // expand_groups: the classes; escaped values get 3.
      {
        std::vector<U> got(3 * groups_n + 64, static_cast<U>(0x5A5A5A5Au));
        k.expand_groups(want_groups.data(), groups_n, got.data());
        for (size_t i = 0; i < 3 * groups_n; ++i) ASSERT_EQ(got[i], std::min<U>(z[i], 3)) << i;
        for (size_t i = 3 * groups_n; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<U>(0x5A5A5A5Au));
      }
      // collect_escapes: the z >= 3 in order (room for n + 32).
      std::vector<U> want_escapes;
      for (size_t i = 0; i < n; ++i) {
        if (z[i] >= 3) want_escapes.push_back(z[i]);
      }
      {
        std::vector<U> got(n + 32);
        EXPECT_EQ(k.collect_escapes(z.data(), n, got.data()), want_escapes.size());
        EXPECT_TRUE(std::equal(want_escapes.begin(), want_escapes.end(), got.begin()));
      }
      // place_escapes: classes with 3 for each escape, patched in order (32 readable past).
      {
        std::vector<U> classes(n);
        for (size_t i = 0; i < n; ++i) classes[i] = std::min<U>(z[i], 3);
        std::vector<U> escapes = want_escapes;
        escapes.resize(escapes.size() + 32, static_cast<U>(0x7777));
        k.place_escapes(classes.data(), n, escapes.data());
        EXPECT_TRUE(std::equal(classes.begin(), classes.end(), z.begin()));
      }
      // apply_differences: out = base = the values.
      {
        std::vector<U> b = base;
        // The caller's output at an odd address, with a canary on each side.
        std::vector<uint8_t> out(n * sizeof(U) + 65, 0x3C);
        uint64_t want_changed = 0;
        for (size_t i = 0; i < n; ++i) want_changed += z[i] != 0;
        EXPECT_EQ(k.apply_differences(b.data(), z.data(), n, out.data() + 1), want_changed);
        if (n > 0) {
          EXPECT_EQ(std::memcmp(out.data() + 1, values.data(), n * sizeof(U)), 0);
        }
        EXPECT_EQ(b, values);
        EXPECT_EQ(out[0], 0x3C);
        for (size_t i = n * sizeof(U) + 1; i < out.size(); ++i) ASSERT_EQ(out[i], 0x3C) << i;
      }
    }
  }
}

TEST(DifferenceKernels, SixteenBitPassesFollowTheFormatOnEveryTarget) {
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) check_kernels(*k, set16(*k), 1);
}

TEST(DifferenceKernels, ThirtyTwoBitPassesFollowTheFormatOnEveryTarget) {
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) check_kernels(*k, set32(*k), 2);
}

TEST(DifferenceKernels, CountEscapesCountsClassThreeOfEverySymbol) {
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
    // Every symbol alone, then random runs.
    for (unsigned s = 0; s < 64; ++s) {
      const auto sym = static_cast<uint8_t>(s);
      const uint64_t want = ((s & 3) == 3) + (((s >> 2) & 3) == 3) + (((s >> 4) & 3) == 3);
      EXPECT_EQ(k->count_escapes(&sym, 1), want) << k->target << " " << s;
    }
    std::mt19937_64 rng(3);
    for (const size_t n : kLengths) {
      std::vector<uint8_t> g(n);
      uint64_t want = 0;
      for (auto& s : g) {
        s = static_cast<uint8_t>(rng() % 64);
        for (unsigned j = 0; j < 3; ++j) want += ((s >> (2 * j)) & 3) == 3;
      }
      EXPECT_EQ(k->count_escapes(g.data(), n), want) << k->target << " n=" << n;
    }
  }
}

// The extra bits of escape symbols: bucket - 1 for buckets 2..32, none for 0 and 1.
TEST(DifferenceKernels, EscapeExtraBitsTotalSumsEveryBucketsExtraBits) {
  std::mt19937_64 rng(5);
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
    for (unsigned b = 0; b <= kMaxEscapeBucket; ++b) {
      const auto bucket = static_cast<uint8_t>(b);
      EXPECT_EQ(k->escape_extra_bits_total(&bucket, 1), escape_extra_bits(b))
          << k->target << " " << b;
    }
    for (const size_t m : kLengths) {
      for (const unsigned top : {1u, 16u, 32u}) {
        std::vector<uint8_t> buckets(m);
        uint64_t want = 0;
        for (auto& b : buckets) {
          b = static_cast<uint8_t>(rng() % (top + 1));
          want += escape_extra_bits(b);
        }
        EXPECT_EQ(k->escape_extra_bits_total(buckets.data(), m), want)
            << k->target << " m=" << m << " top=" << top;
      }
    }
  }
}

// escape_symbols16: bucket b = bit width of v = z - 3; b >= 2 adds b - 1 bits of v - 2^(b-1),
// LSB first, appended to what the writer already holds.
TEST(DifferenceKernels, EscapeSymbolsFollowTheFormatOnEveryTarget) {
  std::mt19937_64 rng(4);
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
    for (const size_t m : kLengths) {
      for (const unsigned lead : {0u, 3u, 13u}) {
        std::vector<uint16_t> escaped(m);
        for (auto& z : escaped) z = static_cast<uint16_t>(random_z(ZMix::kAllEscapes, 16, rng));
        std::vector<uint8_t> want_symbols(m);
        std::vector<bool> want_bits;
        for (unsigned i = 0; i < lead; ++i) want_bits.push_back(i % 2 == 0);
        for (size_t e = 0; e < m; ++e) {
          const uint32_t v = escaped[e] - 3u;
          const unsigned b = static_cast<unsigned>(std::bit_width(v));
          want_symbols[e] = static_cast<uint8_t>(b);
          if (b >= 2) {
            const uint32_t extra = v - (1u << (b - 1));
            for (unsigned i = 0; i + 1 < b; ++i) want_bits.push_back((extra >> i) & 1);
          }
        }
        std::vector<uint8_t> bytes(want_bits.size() / 8 + 64, 0);
        SlackBitWriter writer(bytes.data());
        uint32_t lead_bits = 0;
        for (unsigned i = 0; i < lead; ++i) lead_bits |= (i % 2 == 0 ? 1u : 0u) << i;
        if (lead > 0) writer.put(lead_bits, lead);
        std::vector<uint8_t> symbols(m + 64, 0xEE);
        k->escape_symbols16(escaped.data(), m, symbols.data(), writer);
        ASSERT_EQ(writer.bits(), want_bits.size()) << k->target << " m=" << m;
        const uint64_t written = writer.finish();
        ASSERT_EQ(written, (want_bits.size() + 7) / 8);
        EXPECT_TRUE(std::equal(want_symbols.begin(), want_symbols.end(), symbols.begin()))
            << k->target << " m=" << m;
        for (size_t i = m; i < symbols.size(); ++i) ASSERT_EQ(symbols[i], 0xEE) << k->target << " " << i;
        for (size_t i = 0; i < want_bits.size(); ++i) {
          ASSERT_EQ(((bytes[i / 8] >> (i % 8)) & 1) != 0, want_bits[i]) << k->target << " m=" << m << " bit " << i;
        }
        if (want_bits.size() % 8 != 0) { EXPECT_EQ(bytes[want_bits.size() / 8] >> (want_bits.size() % 8), 0); }
      }
    }
  }
}

// escape_values16 inverts escape_symbols16 from any starting bit, on every target, and reports
// an escape whose z does not fit 16 bits (bucket 16 with large extra bits) wherever it is.
TEST(DifferenceKernels, EscapeValuesInvertEscapeSymbolsOnEveryTarget) {
  std::mt19937_64 rng(5);
  for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
    for (const size_t m : kLengths) {
      for (const unsigned lead : {0u, 5u, 13u}) {
        std::vector<uint16_t> escaped(m);
        for (auto& z : escaped) z = static_cast<uint16_t>(random_z(ZMix::kAllEscapes, 16, rng));
        std::vector<uint8_t> bytes(2 * m + 64, 0);
        SlackBitWriter writer(bytes.data());
        if (lead > 0) writer.put(0x1555u & ((1u << lead) - 1), lead);
        std::vector<uint8_t> symbols(m + 16, 0);
        k->escape_symbols16(escaped.data(), m, symbols.data(), writer);
        const uint64_t end = writer.bits();
        writer.finish();
        std::vector<uint16_t> z(m + 16, 0xEEEE);
        EXPECT_EQ(k->escape_values16(symbols.data(), m, bytes.data(), lead, z.data()), end)
            << k->target << " m=" << m;
        EXPECT_TRUE(std::equal(escaped.begin(), escaped.end(), z.begin())) << k->target << " m=" << m;
        for (size_t i = m; i < z.size(); ++i) ASSERT_EQ(z[i], 0xEEEE) << k->target << " " << i;
        if (m == 0) continue;
        // Bucket 16 says z - 3 >= 2^15; all-ones extra bits then make z = 3 + 2^16 - 1: too large.
        const size_t bad = rng() % m;
        std::vector<uint8_t> over(symbols);
        over[bad] = 16;
        std::vector<uint8_t> ones(bytes.size() + 8, 0xFF);
        EXPECT_EQ(k->escape_values16(over.data(), m, ones.data(), 0, z.data()), kEscapeOverflow)
            << k->target << " m=" << m << " bad=" << bad;
      }
    }
  }
}

// ---- hand-built sections (docs/format.md, "Symbol stream" and "Value-delta frames") -----------

void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// A canonical symbol stream by hand: constant for one distinct symbol, else packed at the bit
// width of the largest symbol (an empty stream: packed, width 1).
void put_stream(std::vector<uint8_t>& out, const std::vector<uint8_t>& symbols) {
  if (!symbols.empty() && std::all_of(symbols.begin(), symbols.end(), [&](uint8_t s) { return s == symbols[0]; })) {
    out.push_back(1);
    out.push_back(symbols[0]);
    put_u64(out, 0);
    return;
  }
  unsigned width = 1;
  for (uint8_t s : symbols) width = std::max(width, static_cast<unsigned>(std::bit_width(unsigned{s})));
  const uint64_t body = (symbols.size() * width + 7) / 8;
  out.push_back(0);
  out.push_back(static_cast<uint8_t>(width));
  put_u64(out, body);
  std::vector<uint8_t> bytes(body, 0);
  for (size_t i = 0; i < symbols.size(); ++i) {
    for (unsigned b = 0; b < width; ++b) {
      if ((symbols[i] >> b) & 1) bytes[(i * width + b) / 8] |= static_cast<uint8_t>(1u << ((i * width + b) % 8));
    }
  }
  out.insert(out.end(), bytes.begin(), bytes.end());
}

// The parts of a differences section, before it is laid out.
struct SectionParts {
  std::vector<uint8_t> groups;
  std::vector<uint8_t> escapes;
  std::vector<bool> extra;
  int64_t length_delta = 0;         // added to the correct L
  std::vector<uint8_t> extra_tail;  // bytes after the extra bits (counted in L if length_delta)
  uint8_t padding_or = 0;           // or-ed into the last extra byte
  std::vector<uint8_t> trailing;    // bytes after the section
};

// The parts of the differences z (docs/format.md read literally).
SectionParts parts_of(const std::vector<uint32_t>& z) {
  SectionParts p;
  for (size_t g = 0; g < (z.size() + 2) / 3; ++g) {
    unsigned s = 0;
    for (unsigned j = 0; j < 3 && 3 * g + j < z.size(); ++j) s |= std::min<uint32_t>(z[3 * g + j], 3) << (2 * j);
    p.groups.push_back(static_cast<uint8_t>(s));
  }
  for (const uint32_t zi : z) {
    if (zi < 3) continue;
    const uint32_t v = zi - 3;
    const unsigned b = static_cast<unsigned>(std::bit_width(v));
    p.escapes.push_back(static_cast<uint8_t>(b));
    for (unsigned i = 0; i + 1 < b; ++i) p.extra.push_back(((v - (1u << (b - 1))) >> i) & 1);
  }
  return p;
}

std::vector<uint8_t> lay_out(const SectionParts& p) {
  std::vector<uint8_t> out;
  put_stream(out, p.groups);
  put_stream(out, p.escapes);
  std::vector<uint8_t> extra((p.extra.size() + 7) / 8, 0);
  for (size_t i = 0; i < p.extra.size(); ++i) {
    if (p.extra[i]) extra[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
  }
  if (!extra.empty()) extra.back() |= p.padding_or;
  extra.insert(extra.end(), p.extra_tail.begin(), p.extra_tail.end());
  put_u64(out, static_cast<uint64_t>(static_cast<int64_t>((p.extra.size() + 7) / 8) + p.length_delta));
  out.insert(out.end(), extra.begin(), extra.end());
  out.insert(out.end(), p.trailing.begin(), p.trailing.end());
  return out;
}

// ---- DifferenceWriter / DifferenceReader -------------------------------------------------------

std::vector<uint8_t> random_shard(DType dtype, size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n * dtype_info(dtype).value_bytes);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = ciera::testing::weight_bits(dtype, rng);
    std::memcpy(v.data() + i * dtype_info(dtype).value_bytes, &bits, dtype_info(dtype).value_bytes);
  }
  return v;
}

uint32_t get_bits(DType dtype, const std::vector<uint8_t>& v, size_t i) {
  uint32_t bits = 0;
  std::memcpy(&bits, v.data() + i * dtype_info(dtype).value_bytes, dtype_info(dtype).value_bytes);
  return bits;
}
void set_bits(DType dtype, std::vector<uint8_t>& v, size_t i, uint32_t bits) {
  std::memcpy(v.data() + i * dtype_info(dtype).value_bytes, &bits, dtype_info(dtype).value_bytes);
}

// `values` moved on from `base` by z drawn from `mix`.
std::vector<uint8_t> moved(DType dtype, const std::vector<uint8_t>& base, ZMix mix, std::mt19937_64& rng) {
  std::vector<uint8_t> v = base;
  const size_t n = base.size() / dtype_info(dtype).value_bytes;
  for (size_t i = 0; i < n; ++i) {
    set_bits(dtype, v, i, ref_apply(get_bits(dtype, base, i), random_z(mix, width_of(dtype), rng), width_of(dtype)));
  }
  return v;
}

const size_t kSectionCounts[] = {1, 2, 3, 4, 5, 100, 6143, 6144, 6145, 3 * 6144 + 2, 40001};

TEST(DifferenceSection, WriterMatchesTheFormatAndTheReaderInvertsAndReverts) {
  std::mt19937_64 rng(11);
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const unsigned w = width_of(dtype);
    for (const size_t n : kSectionCounts) {
      for (const ZMix mix : {ZMix::kNoEscapes, ZMix::kFewEscapes, ZMix::kManyEscapes, ZMix::kAllEscapes}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + " mix=" +
                     std::to_string(static_cast<int>(mix)));
        const std::vector<uint8_t> old = random_shard(dtype, n, rng);
        const std::vector<uint8_t> now = moved(dtype, old, mix, rng);
        std::vector<uint32_t> z(n);
        uint64_t changed = 0;
        for (size_t i = 0; i < n; ++i) {
          z[i] = ref_z(get_bits(dtype, now, i), get_bits(dtype, old, i), w);
          changed += z[i] != 0;
        }
        if (changed == 0) continue;
        // Writer: base moves on, the checksum is of the values.
        std::vector<uint8_t> base = old;
        std::vector<uint8_t> section(4 * n * 4 + 1024);
        DifferenceWriter writer;
        FrameStats stats;
        format::ContentChecksum sum;
        const auto r = writer.write(dtype, now.data(), base.data(), n, section.data(), section.size(), &sum, stats);
        ASSERT_TRUE(r.fits);
        EXPECT_EQ(r.changed, changed);
        EXPECT_EQ(base, now);
        format::ContentChecksum want_sum;
        want_sum.update(now.data(), now.size());
        EXPECT_EQ(sum.digest(), want_sum.digest());
        section.resize(r.bytes);
        // The hand-built section of the same z decodes to the same values (the writer may code
        // a stream with rANS where the hand-built one is packed).
        const std::vector<uint8_t> literal = lay_out(parts_of(z));
        for (const std::vector<uint8_t>* s : {static_cast<const std::vector<uint8_t>*>(&section), &literal}) {
          std::vector<uint8_t> b = old;
          std::vector<uint8_t> out(now.size() + 16, 0xCD);
          DifferenceReader reader;
          format::ContentChecksum rsum;
          EXPECT_EQ(reader.read(dtype, s->data(), s->size(), b.data(), n, out.data(), &rsum), changed);
          EXPECT_TRUE(std::equal(now.begin(), now.end(), out.begin()));
          for (size_t i = now.size(); i < out.size(); ++i) ASSERT_EQ(out[i], 0xCD);
          EXPECT_EQ(b, now);
          EXPECT_EQ(rsum.digest(), want_sum.digest());
          // revert() after a successful read puts the base back exactly.
          reader.revert(dtype, b.data(), n);
          EXPECT_EQ(b, old);
        }
        // Where the writer coded neither stream with rANS, its section is the literal one.
        const uint64_t first_body = load_le64(section.data() + 2);
        ASSERT_LE(10 + first_body + 10, section.size());
        if (section[0] != 2 && section[10 + first_body] != 2) { EXPECT_EQ(section, literal); }
        // Too little room: nothing usable, but the base still moves on (the encoder then sends
        // a key frame of these values).
        std::vector<uint8_t> small_base = old;
        std::vector<uint8_t> small(8);
        FrameStats small_stats;
        const auto rs = writer.write(dtype, now.data(), small_base.data(), n, small.data(), 8, nullptr, small_stats);
        EXPECT_FALSE(rs.fits);
        EXPECT_EQ(small_base, now);
      }
    }
  }
}

TEST(DifferenceSection, UnchangedValuesWriteNothing) {
  std::mt19937_64 rng(12);
  for (const DType dtype : {DType::kBF16, DType::kFP32}) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{7000}}) {
      const std::vector<uint8_t> v = random_shard(dtype, n, rng);
      std::vector<uint8_t> base = v;
      std::vector<uint8_t> out(16);
      DifferenceWriter writer;
      FrameStats stats;
      const auto r = writer.write(dtype, v.data(), base.data(), n, out.data(), out.size(), nullptr, stats);
      EXPECT_TRUE(r.fits);
      EXPECT_EQ(r.bytes, 0u);
      EXPECT_EQ(r.changed, 0u);
    }
  }
}

// A section that fails anywhere, before or during the pass, leaves the base exactly as it was;
// one that parses leaves revert() able to put it back.
TEST(DifferenceSection, CorruptSectionsLeaveTheBaseOrRevertExactly) {
  std::mt19937_64 rng(13);
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{5}, size_t{200}, size_t{2 * 6144 + 7}}) {
      const std::vector<uint8_t> old = random_shard(dtype, n, rng);
      const std::vector<uint8_t> now = moved(dtype, old, ZMix::kFewEscapes, rng);
      std::vector<uint8_t> base = old;
      std::vector<uint8_t> section(8 * n + 1024);
      DifferenceWriter writer;
      FrameStats stats;
      const auto r = writer.write(dtype, now.data(), base.data(), n, section.data(), section.size(), nullptr, stats);
      ASSERT_TRUE(r.fits);
      section.resize(r.bytes);
      int rejected = 0, parsed = 0;
      DifferenceReader reader;  // reused across trials, as the decoder's is
      std::vector<uint8_t> out(now.size());
      for (int trial = 0; trial < 3000; ++trial) {
        std::vector<uint8_t> bad = section;
        switch (trial % 4) {
          case 0: bad[rng() % bad.size()] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
          case 1: bad[rng() % bad.size()] = static_cast<uint8_t>(rng()); break;
          case 2: bad.resize(rng() % bad.size()); break;
          case 3: for (int i = 0, e = 1 + static_cast<int>(rng() % 3); i < e; ++i) bad.push_back(static_cast<uint8_t>(rng())); break;
        }
        std::vector<uint8_t> b = old;
        try {
          reader.read(dtype, bad.data(), bad.size(), b.data(), n, out.data(), nullptr);
          ++parsed;
          reader.revert(dtype, b.data(), n);
          ASSERT_EQ(b, old) << "revert after a corrupt section that parsed, trial " << trial;
        } catch (const FormatError&) {
          ++rejected;
          ASSERT_EQ(b, old) << "a rejected section changed the base, trial " << trial;
        }
      }
      EXPECT_GT(rejected, 0);
      // The genuine section still reads with the same reader.
      std::vector<uint8_t> b = old;
      reader.read(dtype, section.data(), section.size(), b.data(), n, out.data(), nullptr);
      EXPECT_EQ(out, now);
    }
  }
}

// An escape beyond the dtype's width in a late chunk: earlier chunks are already applied when
// the pass meets it, and must be taken back.
TEST(DifferenceSection, AnEscapeBeyondTheWidthInALateChunkRevertsTheEarlierChunks) {
  std::mt19937_64 rng(14);
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const unsigned w = width_of(dtype);
    const size_t n = 3 * 6144 + 10;
    const std::vector<uint8_t> old = random_shard(dtype, n, rng);
    std::vector<uint32_t> z(n);
    for (auto& zi : z) zi = static_cast<uint32_t>(random_z(ZMix::kFewEscapes, w, rng));
    SectionParts p = parts_of(z);
    // Value n - 2 becomes the largest bucket with all extra bits set: z = 3 + 2^w - 1 > 2^w - 1.
    p = parts_of([&] {
      auto zz = z;
      zz[n - 2] = 3;  // an escape of bucket 0 for now
      return zz;
    }());
    // Patch that escape (the last escape but possibly one) into bucket w with all-ones extra.
    size_t index = 0;
    for (size_t i = 0; i < n - 2; ++i) index += z[i] >= 3;
    std::vector<bool> extra;
    size_t bit = 0;
    std::vector<uint8_t> escapes = p.escapes;
    for (size_t e = 0; e < escapes.size(); ++e) {
      const unsigned b = escapes[e];
      if (e == index) {
        escapes[e] = static_cast<uint8_t>(w);
        for (unsigned i = 0; i + 1 < w; ++i) extra.push_back(true);
      } else {
        for (unsigned i = 0; i + 1 < b; ++i) extra.push_back(p.extra[bit + i]);
      }
      if (b >= 2) bit += b - 1;
    }
    p.escapes = escapes;
    p.extra = extra;
    const std::vector<uint8_t> section = lay_out(p);
    std::vector<uint8_t> b = old;
    std::vector<uint8_t> out(old.size());
    DifferenceReader reader;
    try {
      reader.read(dtype, section.data(), section.size(), b.data(), n, out.data(), nullptr);
      ADD_FAILURE() << "an escape beyond " << w << " bits was accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("beyond"), std::string::npos) << e.what();
    }
    EXPECT_EQ(b, old) << dtype_name(dtype);
    // The largest legal escape, in the same place, is accepted.
    auto zz = z;
    zz[n - 2] = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
    const std::vector<uint8_t> good = lay_out(parts_of(zz));
    reader.read(dtype, good.data(), good.size(), b.data(), n, out.data(), nullptr);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(get_bits(dtype, b, i), ref_apply(get_bits(dtype, old, i), zz[i], w));
  }
}

// ---- ShardEncoder / ShardDecoder with stream_kind value-delta ----------------------------------

constexpr StreamIdentity kId{.stream = 9, .epoch = 41};

CodecConfig delta_config(DType dtype, bool checksum = true) {
  CodecConfig c;
  c.dtype = dtype;
  c.stream_kind = StreamKind::kValueDelta;
  c.block_values = 64;
  c.warmup_steps = 30;  // ignored by value-delta streams
  c.content_checksum = checksum;
  return c;
}

enum class Step { kNothing, kNudge, kSmall, kSignFlip, kSpecial, kExtreme, kWrap, kOneExtreme, kRandomAll };

std::string step_name(Step s) {
  switch (s) {
    case Step::kNothing: return "nothing";
    case Step::kNudge: return "nudge";
    case Step::kSmall: return "small";
    case Step::kSignFlip: return "sign-flip";
    case Step::kSpecial: return "special";
    case Step::kExtreme: return "extreme";
    case Step::kWrap: return "wrap";
    case Step::kOneExtreme: return "one-extreme";
    case Step::kRandomAll: return "random-all";
  }
  return "?";
}

// Moves `v` (n values of `dtype`) on by one step of kind `s`.
void apply_step(DType dtype, std::vector<uint8_t>& v, Step s, std::mt19937_64& rng) {
  const unsigned w = width_of(dtype);
  const size_t n = v.size() / dtype_info(dtype).value_bytes;
  const uint32_t all = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
  const uint32_t sign = 1u << (w - 1);
  const auto specials = ciera::testing::special_bits(dtype);
  const auto ord_add = [&](uint32_t x, int64_t d) {
    const uint64_t mod = uint64_t{1} << w;
    return ref_unord(static_cast<uint32_t>((ref_ord(x, w) + static_cast<uint64_t>(d % static_cast<int64_t>(mod)) + mod) % mod), w);
  };
  for (size_t i = 0; i < n; ++i) {
    uint32_t x = get_bits(dtype, v, i);
    const uint64_t r = rng();
    switch (s) {
      case Step::kNothing: break;
      case Step::kNudge: if (r % 100 < 3) x = ord_add(x, (r >> 8) & 1 ? 1 : -1); break;
      case Step::kSmall: if (r % 3 == 0) x = ord_add(x, static_cast<int64_t>((r >> 8) % 401) - 200); break;
      case Step::kSignFlip:
        if (r % 10 == 0) x = static_cast<uint32_t>((r >> 8) % 3);  // +0 and the smallest subnormals
        if (r % 5 == 1) x ^= sign;                                 // across zero
        break;
      case Step::kSpecial: if (r % 5 == 0) x = specials[(r >> 8) % specials.size()]; break;
      case Step::kExtreme: if (r % 20 == 0) x = x == 0 ? all : 0; break;
      case Step::kWrap: if (r % 20 == 0) x = x == all ? all >> 1 : all; break;  // ord 0 <-> 2^w - 1
      case Step::kOneExtreme: if (i == n / 2) x = x == 0 ? all : 0; break;
      case Step::kRandomAll: x = static_cast<uint32_t>(r) & all; break;
    }
    set_bits(dtype, v, i, x);
  }
}

// The step kinds of a 48-step run after the key frame: every kind, random jumps in the middle,
// small changes again after them.
std::vector<Step> schedule() {
  const Step cycle[] = {Step::kNothing, Step::kNudge,    Step::kNudge,   Step::kSmall,
                        Step::kNothing, Step::kSignFlip, Step::kSpecial, Step::kSpecial,
                        Step::kExtreme, Step::kExtreme,  Step::kWrap,    Step::kWrap,
                        Step::kOneExtreme, Step::kNudge, Step::kRandomAll, Step::kNudge,
                        Step::kNothing, Step::kSmall,    Step::kRandomAll, Step::kRandomAll,
                        Step::kNudge,   Step::kNothing,  Step::kNothing,  Step::kSmall};
  std::vector<Step> s;
  for (int round = 0; round < 2; ++round) s.insert(s.end(), std::begin(cycle), std::end(cycle));
  return s;
}

// A sender and a receiver of one value-delta stream; send() checks every frame.
struct DeltaPair {
  DeltaPair(const CodecConfig& c, size_t values, StreamIdentity id = kId)
      : config(c), n(values), encoder(c, values, id), decoder(c, values, id),
        payload(encoder.max_payload_bytes()), out(values * dtype_info(c.dtype).value_bytes) {}

  FrameStats encode(const std::vector<uint8_t>& v) {
    last = encoder.encode(std::as_bytes(std::span(v)), payload);
    EXPECT_LE(last.payload_bytes, encoder.max_payload_bytes());
    return last;
  }
  Bytes frame() const { return {payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(last.payload_bytes)}; }
  // Encodes and decodes `v`, which must come back bit for bit.
  FrameStats send(const std::vector<uint8_t>& v) {
    const FrameStats sent = encode(v);
    std::fill(out.begin(), out.end(), std::byte{0xEE});
    const FrameStats got = decoder.decode(frame(), out);
    EXPECT_EQ(got.kind, sent.kind);
    EXPECT_EQ(got.section, sent.section);
    EXPECT_EQ(got.sequence, sent.sequence);
    EXPECT_EQ(got.payload_bytes, sent.payload_bytes);
    EXPECT_TRUE(v.empty() || std::memcmp(out.data(), v.data(), v.size()) == 0) << "decode differs";
    if (sent.kind == FrameKind::kValueDelta) {
      EXPECT_TRUE(got.changed_values_known);
      EXPECT_EQ(got.changed_values, sent.changed_values);
    }
    return sent;
  }

  CodecConfig config;
  size_t n;
  ShardEncoder encoder;
  ShardDecoder decoder;
  Bytes payload;
  Bytes out;
  FrameStats last;
};

TEST(ValueDeltaStream, EveryPatternRoundTripsBitForBit) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5},
                           size_t{1000}, size_t{100003}}) {
      for (const bool checksum : {true, false}) {
        if (!checksum && n != 1000) continue;
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + (checksum ? "" : " no checksum"));
        std::mt19937_64 rng(n * 7 + static_cast<unsigned>(dtype));
        DeltaPair pair(delta_config(dtype, checksum), n);
        std::vector<uint8_t> v = random_shard(dtype, n, rng);
        const FrameStats first = pair.send(v);
        EXPECT_EQ(first.kind, FrameKind::kKey);
        int value_delta_frames = 0, keys = 0;
        const std::vector<Step> steps = schedule();
        for (size_t step = 0; step < steps.size(); ++step) {
          SCOPED_TRACE("step " + std::to_string(step) + " " + step_name(steps[step]));
          const std::vector<uint8_t> before = v;
          apply_step(dtype, v, steps[step], rng);
          const FrameStats s = pair.send(v);
          ASSERT_FALSE(::testing::Test::HasFailure());
          value_delta_frames += s.kind == FrameKind::kValueDelta;
          keys += s.kind == FrameKind::kKey;
          EXPECT_NE(s.kind, FrameKind::kDelta);
          if (v == before) {
            // Nothing changed: the 80-byte header alone.
            EXPECT_EQ(s.kind, FrameKind::kValueDelta);
            EXPECT_EQ(s.section, ExponentSection::kUnchanged);
            EXPECT_EQ(s.payload_bytes, wire::kHeaderBytes);
          } else if (s.kind == FrameKind::kValueDelta) {
            EXPECT_EQ(s.section, ExponentSection::kDifferences);
          }
          if (steps[step] == Step::kRandomAll && n >= 1000) {
            EXPECT_EQ(s.kind, FrameKind::kKey) << "every value random must fall back to a key frame";
          }
          if ((steps[step] == Step::kNudge || steps[step] == Step::kSmall ||
               steps[step] == Step::kOneExtreme) && n >= 1000) {
            EXPECT_EQ(s.kind, FrameKind::kValueDelta);
          }
          EXPECT_EQ(s.epoch, kId.epoch) << "a fallback key frame stays in its epoch";
        }
        EXPECT_GT(value_delta_frames, 10);
        if (n >= 1000) { EXPECT_GE(keys, 3); }
      }
    }
  }
}

// Wire size where it matters: 5% of values move by one unit in the last place.
TEST(ValueDeltaStream, SparseOneUlpStepsCostWellUnderABitPerValue) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const size_t n = 100000;
    std::mt19937_64 rng(21);
    DeltaPair pair(delta_config(dtype), n);
    std::vector<uint8_t> v = random_shard(dtype, n, rng);
    pair.send(v);
    double worst = 0;
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < n; ++i) {
        if (rng() % 20 == 0) set_bits(dtype, v, i, ref_apply(get_bits(dtype, v, i), 1 + rng() % 2, width_of(dtype)));
      }
      const FrameStats s = pair.send(v);
      ASSERT_EQ(s.kind, FrameKind::kValueDelta);
      worst = std::max(worst, 8.0 * static_cast<double>(s.payload_bytes) / n);
    }
    // Order-0 entropy of z here: 0.95 zeros and 0.025 each of 1 and 2, about 0.34 bits per value.
    RecordProperty(std::string(dtype_name(dtype)) + "_bits_per_value", std::to_string(worst));
    EXPECT_LT(worst, 0.40) << dtype_name(dtype) << ": " << worst << " bits per value";
    EXPECT_GT(worst, 0.30) << dtype_name(dtype) << ": below the entropy? " << worst;
  }
}

// A payload buffer larger than max_payload_bytes() must not let a value-delta frame grow past
// the key frame's size bound (docs/format.md, "Size bound": the encoder never exceeds it).
TEST(ValueDeltaStream, FramesNeverExceedTheSizeBoundWhateverTheBuffer) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{1}, size_t{5}, size_t{1000}, size_t{30000}}) {
      std::mt19937_64 rng(22);
      const CodecConfig c = delta_config(dtype);
      ShardEncoder encoder(c, n, kId);
      ShardDecoder decoder(c, n, kId);
      Bytes payload(4 * encoder.max_payload_bytes() + 4096);
      Bytes out(n * dtype_info(dtype).value_bytes);
      std::vector<uint8_t> v = random_shard(dtype, n, rng);
      for (int step = 0; step < 6; ++step) {
        if (step > 0) apply_step(dtype, v, step % 2 ? Step::kRandomAll : Step::kExtreme, rng);
        const FrameStats s = encoder.encode(std::as_bytes(std::span(v)), payload);
        EXPECT_LE(s.payload_bytes, encoder.max_payload_bytes())
            << dtype_name(dtype) << " n=" << n << " step " << step << " " << frame_kind_name(s.kind);
        if (step % 2 == 1 && n >= 1000) { EXPECT_EQ(s.kind, FrameKind::kKey); }
        decoder.decode({payload.data(), s.payload_bytes}, out);
        EXPECT_EQ(std::memcmp(out.data(), v.data(), v.size()), 0);
      }
    }
  }
}

// Adds a random step below 2^bits (mod 2^w) to each value with probability percent/100: near
// the dtype's width, differences that code to about as many bits as the values themselves.
void jump(DType dtype, std::vector<uint8_t>& v, unsigned bits, unsigned percent,
          std::mt19937_64& rng) {
  const unsigned w = width_of(dtype);
  const uint64_t mask = w == 32 ? 0xFFFFFFFFu : (1u << w) - 1;
  for (size_t i = 0; i < v.size() / dtype_info(dtype).value_bytes; ++i) {
    const uint64_t r = rng();
    if (r % 100 >= percent) continue;
    const uint64_t step = (r >> 8) & ((uint64_t{1} << bits) - 1);
    set_bits(dtype, v, i, static_cast<uint32_t>((get_bits(dtype, v, i) + step) & mask));
  }
}

// The values raw plus a key frame's framing (docs/format.md, "Size bound", read literally): the
// 80-byte header, the 10-byte header of its exponent stream, FP16's packed plane and exponents
// rounded up to whole bytes apart, and the padding before a plane of 64 KiB or more.
uint64_t raw_plus_framing(DType dtype, uint64_t n) {
  const uint64_t plane = dtype == DType::kBF16   ? n
                         : dtype == DType::kFP16 ? n + (3 * n + 7) / 8
                                                 : 3 * n;
  return n * dtype_info(dtype).value_bytes + 90 + (dtype == DType::kFP16 ? 1 : 0) +
         (plane >= 65536 ? 48 : 0);
}

// Whatever the steps, no frame of a value-delta stream costs more than the values raw plus a
// key frame's framing: incompressible differences (random bit patterns, random steps of nearly
// the dtype's width on some or all values) go as the key frame, which moves the receiver's
// previous values on, so that a one-unit step after it is a small value-delta frame again.
// Tiny shards are where value-delta frames reached max_payload_bytes(), which counts an
// exponent-delta frame's bitmap byte: one byte above.
TEST(ValueDeltaStream, IncompressibleStepsCostAtMostTheValuesRawPlusAKeyFramesFraming) {
  const unsigned percents[] = {100, 95, 80, 60, 50, 30};
  uint64_t seed = 40;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const unsigned w = width_of(dtype);
    for (const size_t n :
         {size_t{1}, size_t{2}, size_t{3}, size_t{5}, size_t{10}, size_t{17}, size_t{33},
          size_t{65}, size_t{100}, size_t{301}, size_t{1000}, size_t{30000}}) {
      for (const uint32_t block : {64u, 512u}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                     " B=" + std::to_string(block));
        std::mt19937_64 rng(seed++);
        CodecConfig c = delta_config(dtype);
        c.block_values = block;
        DeltaPair pair(c, n);
        std::vector<uint8_t> v = random_shard(dtype, n, rng);
        pair.send(v);
        const uint64_t most = raw_plus_framing(dtype, n);
        uint64_t worst = 0;
        int keys = 0;
        const int trials = n <= 100 ? 150 : 12;
        for (int t = 0; t < trials; ++t) {
          if (t % 10 == 0) {
            apply_step(dtype, v, Step::kRandomAll, rng);
          } else {
            jump(dtype, v, w - static_cast<unsigned>(rng() % 7), percents[rng() % 6], rng);
          }
          const FrameStats s = pair.send(v);  // bit for bit
          ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << t;
          worst = std::max(worst, s.payload_bytes);
          keys += s.kind == FrameKind::kKey;
          // Then one value moves by one unit in the last place: the receiver's previous values
          // are the sender's, so that is a value-delta frame of a few dozen bytes of framing
          // (below a few dozen values a key frame is smaller than those and goes instead).
          const size_t i = static_cast<size_t>(t) % n;
          set_bits(dtype, v, i, ref_apply(get_bits(dtype, v, i), 2, w));
          const FrameStats next = pair.send(v);
          ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << t << ", the step after";
          if (n >= 33) {
            EXPECT_EQ(next.kind, FrameKind::kValueDelta) << "trial " << t;
          }
          EXPECT_LE(next.payload_bytes, wire::kHeaderBytes + 28 + 100 + (n + 2) / 3 / 16)
              << "trial " << t;
        }
        EXPECT_LE(worst, most) << "the values raw are " << n * dtype_info(dtype).value_bytes
                               << " bytes";
        EXPECT_GT(keys, 0) << "no step fell back to a key frame";
      }
    }
  }
}

TEST(ValueDeltaStream, WarmupIsIgnored) {
  CodecConfig c = delta_config(DType::kBF16);
  c.warmup_steps = 1000;
  std::mt19937_64 rng(23);
  DeltaPair pair(c, 3000);
  std::vector<uint8_t> v = random_shard(DType::kBF16, 3000, rng);
  EXPECT_EQ(pair.send(v).kind, FrameKind::kKey);
  apply_step(DType::kBF16, v, Step::kNudge, rng);
  EXPECT_EQ(pair.send(v).kind, FrameKind::kValueDelta);
}

TEST(ValueDeltaStream, KeyFrameRequestsResynchronisationAndReset) {
  for (const DType dtype : {DType::kBF16, DType::kFP32}) {
    const size_t n = 20000;
    std::mt19937_64 rng(24);
    DeltaPair pair(delta_config(dtype), n);
    std::vector<uint8_t> v = random_shard(dtype, n, rng);
    pair.send(v);
    apply_step(dtype, v, Step::kNudge, rng);
    EXPECT_EQ(pair.send(v).kind, FrameKind::kValueDelta);
    // The sender's resynchronisation: a key frame of the next epoch, then differences again.
    pair.encoder.request_key_frame();
    pair.decoder.request_resync();
    apply_step(dtype, v, Step::kSmall, rng);
    const FrameStats key = pair.send(v);
    EXPECT_EQ(key.kind, FrameKind::kKey);
    EXPECT_EQ(key.epoch, kId.epoch + 1);
    EXPECT_EQ(pair.decoder.epoch(), kId.epoch + 1);
    apply_step(dtype, v, Step::kNudge, rng);
    EXPECT_EQ(pair.send(v).kind, FrameKind::kValueDelta);
    // A key frame request with nothing changed is still a key frame.
    pair.encoder.request_key_frame();
    pair.decoder.request_resync();
    EXPECT_EQ(pair.send(v).kind, FrameKind::kKey);
    EXPECT_EQ(pair.send(v).payload_bytes, wire::kHeaderBytes);

    // reset(): the previous values are forgotten; a value-delta frame is refused until a key frame.
    pair.decoder.reset();
    EXPECT_FALSE(pair.decoder.has_cache());
    apply_step(dtype, v, Step::kNudge, rng);
    pair.encode(v);
    ASSERT_EQ(pair.last.kind, FrameKind::kValueDelta);
    try {
      pair.decoder.decode(pair.frame(), pair.out);
      ADD_FAILURE() << "a reset decoder took a value-delta frame";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("previous values"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(pair.decoder.has_cache());
    pair.encoder.request_key_frame();
    apply_step(dtype, v, Step::kNudge, rng);
    EXPECT_EQ(pair.send(v).kind, FrameKind::kKey);
    apply_step(dtype, v, Step::kNudge, rng);
    EXPECT_EQ(pair.send(v).kind, FrameKind::kValueDelta);
  }
}

// A second sender with the same stream identity but another history: its value-delta frame
// applies to the wrong base, the content checksum catches it, and the decoder's previous values
// are untouched, so the right sender's next frame still decodes; a resynchronisation repairs a
// receiver that had followed the wrong sender.
TEST(ValueDeltaStream, AWrongBaseIsCaughtByTheChecksumAndLeavesTheCache) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{1000}, size_t{100003}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      std::mt19937_64 rng(25);
      const CodecConfig c = delta_config(dtype);
      DeltaPair right(c, n);
      ShardEncoder wrong(c, n, kId);
      Bytes wrong_payload(wrong.max_payload_bytes());
      std::vector<uint8_t> x = random_shard(dtype, n, rng);
      std::vector<uint8_t> y = x;
      apply_step(dtype, y, Step::kNudge, rng);  // histories differ by a few ulps
      right.send(x);
      wrong.encode(std::as_bytes(std::span(y)), wrong_payload);
      apply_step(dtype, x, Step::kNudge, rng);
      right.send(x);
      apply_step(dtype, y, Step::kSmall, rng);
      wrong.encode(std::as_bytes(std::span(y)), wrong_payload);
      apply_step(dtype, y, Step::kNudge, rng);
      const FrameStats w = wrong.encode(std::as_bytes(std::span(y)), wrong_payload);
      ASSERT_EQ(w.kind, FrameKind::kValueDelta);
      ASSERT_EQ(w.sequence, right.decoder.last_sequence() + 1);
      const uint64_t sequence = right.decoder.last_sequence();
      try {
        right.decoder.decode({wrong_payload.data(), w.payload_bytes}, right.out);
        ADD_FAILURE() << "a frame for another base was accepted";
      } catch (const FormatError& e) {
        EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
      }
      EXPECT_EQ(right.decoder.last_sequence(), sequence);
      EXPECT_EQ(right.decoder.epoch(), kId.epoch);
      EXPECT_TRUE(right.decoder.has_cache());
      // The right stream goes on, exactly, for a few frames.
      for (const Step s : {Step::kNudge, Step::kExtreme, Step::kNothing, Step::kSmall}) {
        apply_step(dtype, x, s, rng);
        right.send(x);
      }

      // A receiver that follows the wrong sender cannot take the right one's frames...
      ShardDecoder follower(c, n, kId);
      ShardEncoder wrong2(c, n, kId);
      Bytes out(x.size());
      std::vector<uint8_t> z = y;
      const FrameStats k2 = wrong2.encode(std::as_bytes(std::span(z)), wrong_payload);
      follower.decode({wrong_payload.data(), k2.payload_bytes}, out);
      apply_step(dtype, x, Step::kNudge, rng);
      ShardEncoder fresh(c, n, kId);  // the right history restarted: key frame then differences
      Bytes fp(fresh.max_payload_bytes());
      std::vector<uint8_t> base = x;
      fresh.encode(std::as_bytes(std::span(base)), fp);
      apply_step(dtype, x, Step::kNudge, rng);
      const FrameStats d = fresh.encode(std::as_bytes(std::span(x)), fp);
      ASSERT_EQ(d.kind, FrameKind::kValueDelta);
      EXPECT_THROW(follower.decode({fp.data(), d.payload_bytes}, out), FormatError);
      // ...until the sender resynchronises.
      fresh.request_key_frame();
      follower.request_resync();
      apply_step(dtype, x, Step::kNudge, rng);
      const FrameStats key = fresh.encode(std::as_bytes(std::span(x)), fp);
      ASSERT_EQ(key.kind, FrameKind::kKey);
      follower.decode({fp.data(), key.payload_bytes}, out);
      EXPECT_EQ(std::memcmp(out.data(), x.data(), x.size()), 0);
      apply_step(dtype, x, Step::kSmall, rng);
      const FrameStats next = fresh.encode(std::as_bytes(std::span(x)), fp);
      ASSERT_EQ(next.kind, FrameKind::kValueDelta);
      follower.decode({fp.data(), next.payload_bytes}, out);
      EXPECT_EQ(std::memcmp(out.data(), x.data(), x.size()), 0);
    }
  }
}

// ---- corruption -------------------------------------------------------------------------------

// `payload` (the genuine frame, or a damaged copy of it of any length) with the genuine frame's
// header edited and its header checksum recomputed, so that the body is what a decoder checks.
Bytes reseal(const Bytes& genuine, Bytes payload, const std::function<void(wire::Header&)>& edit) {
  wire::Header h = wire::read_header(reinterpret_cast<const uint8_t*>(genuine.data()), genuine.size());
  edit(h);
  wire::write_header(h, reinterpret_cast<uint8_t*>(payload.data()));
  return payload;
}
Bytes reseal(const Bytes& genuine, const std::function<void(wire::Header&)>& edit) {
  return reseal(genuine, genuine, edit);
}

// A recorded stream: its frames, which a fresh decoder replays to reach any point.
struct Recording {
  CodecConfig config;
  size_t n;
  std::vector<Bytes> frames;
  std::vector<std::vector<uint8_t>> shards;

  ShardDecoder decoder_before(size_t frame) const {
    ShardDecoder d(config, n, kId);
    Bytes out(n * dtype_info(config.dtype).value_bytes);
    for (size_t i = 0; i < frame; ++i) d.decode(frames[i], out);
    return d;
  }
};

Recording record(DType dtype, size_t n, const std::vector<Step>& steps, uint64_t seed) {
  Recording r{delta_config(dtype), n, {}, {}};
  std::mt19937_64 rng(seed);
  ShardEncoder encoder(r.config, n, kId);
  Bytes payload(encoder.max_payload_bytes());
  std::vector<uint8_t> v = random_shard(dtype, n, rng);
  for (size_t i = 0; i <= steps.size(); ++i) {
    if (i > 0) apply_step(dtype, v, steps[i - 1], rng);
    const FrameStats s = encoder.encode(std::as_bytes(std::span(v)), payload);
    r.frames.emplace_back(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(s.payload_bytes));
    r.shards.push_back(v);
  }
  return r;
}

// Decoding `bad` in place of frame `f` must fail (decoder state unchanged, and the genuine frame
// then decodes exactly: its previous values were untouched) or give exactly the genuine values.
void expect_safe(const Recording& r, size_t f, ShardDecoder& d, const Bytes& bad, const std::string& what) {
  const uint32_t epoch = d.epoch();
  const uint64_t sequence = d.last_sequence();
  const bool has_cache = d.has_cache();
  Bytes out(r.shards[f].size());
  bool accepted = false;
  try {
    d.decode(bad, out);
    accepted = true;
  } catch (const FormatError&) {
  }
  if (accepted) {
    // Only a payload equivalent to the genuine one may pass, and it must give the same values.
    ASSERT_EQ(std::memcmp(out.data(), r.shards[f].data(), out.size()), 0) << "wrong values accepted: " << what;
    d = r.decoder_before(f);
    return;
  }
  ASSERT_EQ(d.epoch(), epoch) << what;
  ASSERT_EQ(d.last_sequence(), sequence) << what;
  ASSERT_EQ(d.has_cache(), has_cache) << what;
  d.decode(r.frames[f], out);
  ASSERT_EQ(std::memcmp(out.data(), r.shards[f].data(), out.size()), 0) << "after " << what;
  d = r.decoder_before(f);
}

TEST(ValueDeltaCorruption, DamagedFramesAreRejectedAndTheCacheSurvives) {
  const std::vector<Step> steps = {Step::kNudge, Step::kSmall, Step::kExtreme, Step::kSpecial, Step::kNothing,
                                   Step::kWrap};
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{4}, size_t{700}, size_t{13000}}) {
      const Recording r = record(dtype, n, steps, 31 + n);
      std::mt19937_64 rng(32 + n);
      for (size_t f = 1; f < r.frames.size(); ++f) {
        const wire::Header h = wire::read_header(reinterpret_cast<const uint8_t*>(r.frames[f].data()), r.frames[f].size());
        if (h.kind != FrameKind::kValueDelta) continue;
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + " frame " + std::to_string(f) +
                     " " + std::string(exponent_section_name(h.section)) + " " + std::to_string(r.frames[f].size()) + " bytes");
        ShardDecoder d = r.decoder_before(f);
        const Bytes& good = r.frames[f];
        const size_t size = good.size();
        const int trials = n > 5000 ? 150 : 400;
        for (int t = 0; t < trials; ++t) {
          Bytes bad = good;
          std::string what;
          switch (t % 6) {
            case 0: {  // one bit anywhere (the header's checksum guards the first 80 bytes)
              const size_t at = rng() % size;
              bad[at] ^= std::byte(1u << (rng() % 8));
              what = "bit flip at " + std::to_string(at);
              break;
            }
            case 1: {  // one bit of the section, or a few
              if (size == wire::kHeaderBytes) continue;
              for (int k = 0, e = 1 + static_cast<int>(rng() % 3); k < e; ++k) {
                bad[wire::kHeaderBytes + rng() % (size - wire::kHeaderBytes)] ^= std::byte(1u << (rng() % 8));
              }
              what = "section bit flips";
              break;
            }
            case 2: {  // one byte of the section replaced
              if (size == wire::kHeaderBytes) continue;
              const size_t at = wire::kHeaderBytes + rng() % (size - wire::kHeaderBytes);
              bad[at] = std::byte(rng());
              what = "byte " + std::to_string(at) + " replaced";
              break;
            }
            case 3: {  // truncated, header resealed to the shorter section
              const size_t keep = wire::kHeaderBytes + rng() % (size - wire::kHeaderBytes + 1);
              if (keep == size) continue;
              bad.resize(keep);
              bad = reseal(good, bad, [&](wire::Header& hh) { hh.exponent_bytes = keep - wire::kHeaderBytes; });
              what = "truncated to " + std::to_string(keep);
              break;
            }
            case 4: {  // extended, resealed (or not)
              for (int k = 0, e = 1 + static_cast<int>(rng() % 9); k < e; ++k) bad.push_back(std::byte(rng()));
              if (rng() % 2) {
                const size_t len = bad.size() - wire::kHeaderBytes;
                bad = reseal(good, bad, [&](wire::Header& hh) { hh.exponent_bytes = len; });
              }
              what = "extended to " + std::to_string(bad.size());
              break;
            }
            case 5: {  // header fields resealed: section kind, checksum, sequence
              const unsigned which = static_cast<unsigned>(rng() % 4);
              bad = reseal(good, bad, [&](wire::Header& hh) {
                if (which == 0) hh.section = hh.section == ExponentSection::kUnchanged ? ExponentSection::kDifferences : ExponentSection::kUnchanged;
                if (which == 1) hh.content_checksum ^= uint64_t{1} << (rng() % 64);
                if (which == 2) hh.sequence += 1 + rng() % 3;
                if (which == 3) hh.kind = FrameKind::kDelta;
              });
              if (which == 3) continue;  // a pairing the header reader itself refuses: below
              what = "resealed header field " + std::to_string(which);
              break;
            }
          }
          expect_safe(r, f, d, bad, what);
          if (::testing::Test::HasFatalFailure()) return;
        }
        // Every truncation of a small frame, resealed.
        if (size < 400) {
          for (size_t keep = wire::kHeaderBytes; keep < size; ++keep) {
            Bytes bad(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep));
            bad = reseal(good, bad, [&](wire::Header& hh) { hh.exponent_bytes = keep - wire::kHeaderBytes; });
            expect_safe(r, f, d, bad, "resealed truncation to " + std::to_string(keep));
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// ---- hand-built non-canonical frames -----------------------------------------------------------

// A decoder holding `base` (the key frame of a value-delta stream) and frames built by hand.
struct Crafted {
  Crafted(DType dtype, size_t values)
      : config(delta_config(dtype)), n(values), w(width_of(dtype)), encoder(config, values, kId),
        decoder(config, values, kId), out(values * dtype_info(dtype).value_bytes) {
    std::mt19937_64 rng(41);
    base = random_shard(dtype, values, rng);
    Bytes payload(encoder.max_payload_bytes());
    const FrameStats s = encoder.encode(std::as_bytes(std::span(base)), payload);
    decoder.decode({payload.data(), s.payload_bytes}, out);
  }
  // The values `z` gives from the base, and their checksum.
  std::vector<uint8_t> values_of(const std::vector<uint32_t>& z) const {
    std::vector<uint8_t> v = base;
    for (size_t i = 0; i < n; ++i) set_bits(config.dtype, v, i, ref_apply(get_bits(config.dtype, base, i), z[i], w));
    return v;
  }
  Bytes frame(const std::vector<uint8_t>& section, const std::vector<uint8_t>& values,
              ExponentSection kind = ExponentSection::kDifferences) const {
    wire::Header h;
    h.dtype = config.dtype;
    h.kind = FrameKind::kValueDelta;
    h.section = kind;
    h.flags = wire::kFlagContentChecksum;
    h.block_values = config.block_values;
    h.num_values = n;
    h.stream = kId.stream;
    h.epoch = kId.epoch;
    h.sequence = decoder.last_sequence() + 1;
    h.exponent_bytes = section.size();
    format::ContentChecksum sum;
    sum.update(values.data(), values.size());
    h.content_checksum = sum.digest();
    Bytes p(wire::kHeaderBytes + section.size());
    wire::write_header(h, reinterpret_cast<uint8_t*>(p.data()));
    if (!section.empty()) std::memcpy(p.data() + wire::kHeaderBytes, section.data(), section.size());
    return p;
  }
  void expect_rejected(const Bytes& p, const std::string& message, const std::string& what) {
    const uint64_t sequence = decoder.last_sequence();
    try {
      decoder.decode(p, out);
      ADD_FAILURE() << what << " was accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_EQ(decoder.last_sequence(), sequence) << what;
  }
  // Decodes a genuine frame of `z`: the decoder's previous values were untouched.
  void expect_accepted(const std::vector<uint32_t>& z) {
    const std::vector<uint8_t> v = values_of(z);
    decoder.decode(frame(lay_out(parts_of(z)), v), out);
    EXPECT_EQ(std::memcmp(out.data(), v.data(), v.size()), 0);
    base = v;
  }

  CodecConfig config;
  size_t n;
  unsigned w;
  ShardEncoder encoder;
  ShardDecoder decoder;
  std::vector<uint8_t> base;
  Bytes out;
};

TEST(ValueDeltaCanonical, NonCanonicalSectionsAreRejected) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{4}, size_t{5}, size_t{1000}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      Crafted c(dtype, n);
      const uint32_t max_z = c.w == 32 ? 0xFFFFFFFFu : (1u << c.w) - 1;
      std::vector<uint32_t> z(n, 0);
      z[0] = 1;
      z[n - 1] = 200;  // an escape with extra bits
      z[n / 2] = max_z;
      // The literal layout decodes (the builder is right).
      c.expect_accepted(z);

      // No value changed, coded as 'differences' (canonical: 'unchanged').
      {
        const std::vector<uint32_t> none(n, 0);
        c.expect_rejected(c.frame(lay_out(parts_of(none)), c.base), "no value changed", "zero-change differences");
        // The 'unchanged' form of it is accepted, and an 'unchanged' with a body is not.
        c.expect_rejected(c.frame({0}, c.base, ExponentSection::kUnchanged), "not empty", "non-empty unchanged");
        c.decoder.decode(c.frame({}, c.base, ExponentSection::kUnchanged), c.out);
        EXPECT_EQ(std::memcmp(c.out.data(), c.base.data(), c.base.size()), 0);
        // An empty 'differences' section.
        c.expect_rejected(c.frame({}, c.base), "difference", "empty differences");
      }
      // A class past N in the last group.
      if (n % 3 != 0) {
        for (unsigned cls = 1; cls < 4; ++cls) {
          for (unsigned slot = static_cast<unsigned>(n % 3); slot < 3; ++slot) {
            SectionParts p = parts_of(z);
            p.groups.back() |= static_cast<uint8_t>(cls << (2 * slot));
            if (cls == 3) p.escapes.push_back(0);  // the escape it would need
            c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "past the end", "class past N");
          }
        }
      }
      // An escape beyond the width: the largest bucket with every extra bit set, and a bucket
      // above the width.
      {
        SectionParts p = parts_of(z);
        std::vector<uint32_t> zz = z;
        zz[1] = 3;  // bucket 0: no extra bits; patched below into bucket w, all ones
        p = parts_of(zz);
        size_t index = 0;  // zz[1] is the first escape unless zz[0] is one
        index = zz[0] >= 3 ? 1 : 0;
        p.escapes[index] = static_cast<uint8_t>(c.w);
        p.extra.insert(p.extra.begin(), c.w - 1, true);
        c.expect_rejected(c.frame(lay_out(p), c.values_of(zz)), "beyond", "escape beyond the width");
        p = parts_of(zz);
        p.escapes[index] = static_cast<uint8_t>(c.w + 1);
        p.extra.insert(p.extra.begin(), c.w, false);
        c.expect_rejected(c.frame(lay_out(p), c.values_of(zz)), "escapes stream", "bucket above the width");
      }
      // Wrong L (one more, with the byte present; one fewer), non-zero padding, trailing bytes.
      {
        SectionParts p = parts_of(z);
        p.length_delta = 1;
        p.extra_tail = {0};
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "extra bits", "L one too many");
        p = parts_of(z);
        p.length_delta = -1;
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "extra bits", "L one too few");
        p = parts_of(z);
        p.length_delta = int64_t{1} << 62;
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "extra bits", "huge L");
        p = parts_of(z);
        ASSERT_NE(p.extra.size() % 8, 0u) << "the test needs padding bits";
        p.padding_or = 0x80;
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "padding", "non-zero padding");
        p = parts_of(z);
        p.trailing = {0};
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "trailing", "trailing byte");
        // No extra bits at all and L = 1: still wrong.
        std::vector<uint32_t> small(n, 0);
        small[0] = 2;
        p = parts_of(small);
        p.length_delta = 1;
        p.extra_tail = {0};
        c.expect_rejected(c.frame(lay_out(p), c.values_of(small)), "extra bits", "L for no extra bits");
      }
      // Streams of the wrong length: a group too many, an escape too many or too few.
      {
        // (Non-zero symbols: a zero appended to a packed stream can be its padding, the same bytes.)
        SectionParts p = parts_of(z);
        p.groups.push_back(1);
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "", "a group too many");
        p = parts_of(z);
        p.escapes.push_back(1);
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "", "an escape too many");
        p = parts_of(z);
        p.escapes.pop_back();
        c.expect_rejected(c.frame(lay_out(p), c.values_of(z)), "", "an escape too few");
      }
      // A wrong checksum over a section that parses: the content checksum.
      {
        std::vector<uint32_t> zz = z;
        zz[0] = 2;
        c.expect_rejected(c.frame(lay_out(parts_of(zz)), c.values_of(z)), "checksum", "checksum of other values");
      }
      // After all of that, the previous values are untouched: a genuine frame decodes.
      std::vector<uint32_t> next(n, 0);
      next[n - 1] = 5;
      c.expect_accepted(next);
      c.expect_accepted(z);
    }
  }
}

// ---- stream kinds ------------------------------------------------------------------------------

TEST(ValueDeltaStreamKind, FramesOfTheOtherKindAreRejected) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const size_t n = 2000;
    std::mt19937_64 rng(51);
    CodecConfig delta = delta_config(dtype);
    CodecConfig reuse = delta;
    reuse.stream_kind = StreamKind::kExponentReuse;
    reuse.warmup_steps = 1;
    std::vector<uint8_t> v = random_shard(dtype, n, rng);

    // A value-delta frame at an exponent-reuse decoder (fresh, or holding the same key frame,
    // which both kinds share).
    DeltaPair d(delta, n);
    d.send(v);
    ShardDecoder reuse_decoder(reuse, n, kId);
    ShardDecoder fresh_reuse(reuse, n, kId);
    reuse_decoder.decode(d.frame(), d.out);  // the key frame
    EXPECT_EQ(std::memcmp(d.out.data(), v.data(), v.size()), 0);
    for (const Step s : {Step::kNudge, Step::kNothing}) {
      apply_step(dtype, v, s, rng);
      d.send(v);
      ASSERT_EQ(d.last.kind, FrameKind::kValueDelta);
      const PayloadInfo info = inspect_payload(d.frame());
      EXPECT_EQ(info.kind, FrameKind::kValueDelta);
      EXPECT_EQ(frame_kind_name(info.kind), "value-delta");
      EXPECT_EQ(info.section, s == Step::kNothing ? ExponentSection::kUnchanged : ExponentSection::kDifferences);
      EXPECT_EQ(info.payload_bytes, d.last.payload_bytes);
      EXPECT_EQ(info.sequence, d.last.sequence);
      for (ShardDecoder* dec : {&reuse_decoder, &fresh_reuse}) {
        const uint64_t seq = dec->last_sequence();
        try {
          dec->decode(d.frame(), d.out);
          ADD_FAILURE() << "an exponent-reuse decoder took a value-delta frame";
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find("value-delta frame"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("exponent-reuse stream"), std::string::npos) << e.what();
        }
        EXPECT_EQ(dec->last_sequence(), seq);
      }
    }
    EXPECT_EQ(exponent_section_name(ExponentSection::kDifferences), "differences");

    // An exponent-delta frame at a value-delta decoder.
    ShardEncoder reuse_encoder(reuse, n, kId);
    ShardDecoder delta_decoder(delta, n, kId);
    Bytes payload(reuse_encoder.max_payload_bytes());
    Bytes out(v.size());
    FrameStats s = reuse_encoder.encode(std::as_bytes(std::span(v)), payload);
    ASSERT_EQ(s.kind, FrameKind::kKey);
    delta_decoder.decode({payload.data(), s.payload_bytes}, out);  // key frames are shared
    for (int step = 0; step < 3; ++step) {
      apply_step(dtype, v, step == 1 ? Step::kNothing : Step::kSmall, rng);
      s = reuse_encoder.encode(std::as_bytes(std::span(v)), payload);
      ASSERT_EQ(s.kind, FrameKind::kDelta);
      try {
        delta_decoder.decode({payload.data(), s.payload_bytes}, out);
        ADD_FAILURE() << "a value-delta decoder took an exponent-delta frame";
      } catch (const FormatError& e) {
        EXPECT_NE(std::string(e.what()).find("exponent-delta frame"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("value-delta stream"), std::string::npos) << e.what();
      }
    }
    // Pairings the header itself refuses: a value-delta frame with a key or exponent section,
    // an exponent-delta frame with 'differences'.
    d.send(v);
    for (const auto& [kind, section] : {std::pair{FrameKind::kValueDelta, ExponentSection::kFull},
                                        std::pair{FrameKind::kValueDelta, ExponentSection::kFine},
                                        std::pair{FrameKind::kValueDelta, ExponentSection::kBlock},
                                        std::pair{FrameKind::kDelta, ExponentSection::kDifferences},
                                        std::pair{FrameKind::kKey, ExponentSection::kDifferences}}) {
      const Bytes bad = reseal(d.frame(), [&](wire::Header& h) {
        h.kind = kind;
        h.section = section;
      });
      EXPECT_THROW(inspect_payload(bad), FormatError);
      EXPECT_THROW(d.decoder.decode(bad, d.out), FormatError);
    }
    apply_step(dtype, v, Step::kNudge, rng);
    d.send(v);
  }
}

TEST(ValueDeltaStreamKind, CacheBytesAreTheValues) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{1000}, uint64_t{100003}}) {
      CodecConfig c = delta_config(dtype);
      const uint64_t want = n * dtype_info(dtype).value_bytes;
      EXPECT_EQ(codec_cache_bytes(c, n, true), want);
      EXPECT_EQ(codec_cache_bytes(c, n, false), want);
      c.detection = ChangeDetection::kHash;  // irrelevant to value-delta streams
      EXPECT_EQ(codec_cache_bytes(c, n, true), want);
      EXPECT_EQ(ShardEncoder(c, n, kId).cache_bytes(), want);
      EXPECT_EQ(ShardDecoder(c, n, kId).cache_bytes(), want);
      EXPECT_TRUE(ShardDecoder(c, n, kId).cached_exponents().empty());
    }
  }
  EXPECT_EQ(stream_kind_name(StreamKind::kValueDelta), "value-delta");
  EXPECT_EQ(stream_kind_name(StreamKind::kExponentReuse), "exponent-reuse");
  CodecConfig bad;
  bad.stream_kind = static_cast<StreamKind>(7);
  EXPECT_THROW(bad.validate(), ConfigError);
}

}  // namespace
}  // namespace ciera::codec
