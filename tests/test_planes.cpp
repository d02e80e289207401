// Plane kernels: every compiled SIMD target against the literal reference of docs/format.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <random>
#include <vector>

#include "ciera/dtype.hpp"
#include "common/checksum.hpp"
#include "format/content_checksum.hpp"
#include "format/planes.hpp"
#include "test_util.hpp"

namespace ciera::format {
namespace {

using ciera::testing::kernels_of_every_target;

const DType kDTypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};

using ciera::testing::random_bytes;

TEST(Planes, EveryBf16AndFp16BitPatternRoundTrips) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<uint8_t> values(65536 * 2);
    for (uint32_t i = 0; i < 65536; ++i) {
      values[2 * i] = static_cast<uint8_t>(i);
      values[2 * i + 1] = static_cast<uint8_t>(i >> 8);
    }
    const SignMantissaLayout layout(dtype, 65536);
    for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
      std::vector<uint8_t> exps(65536), sm(layout.total_bytes()), back(values.size());
      for (uint64_t first = 0; first < 65536; first += kMaxChunkValues) {
        split_values(layout, *k, values.data() + 2 * first, first, kMaxChunkValues,
                     exps.data() + first, sm.data());
      }
      for (uint64_t first = 0; first < 65536; first += kMaxChunkValues) {
        merge_values(layout, *k, exps.data() + first, sm.data(), first, kMaxChunkValues,
                     back.data() + 2 * first);
      }
      EXPECT_EQ(back, values) << dtype_name(dtype) << " on " << k->target;
    }
  }
}

// Splitting in arbitrary pieces at arbitrary offsets equals the reference on the whole shard.
TEST(Planes, KernelsMatchReferenceAtAnyOffset) {
  const size_t sizes[] = {0, 1, 7, 8, 9, 31, 33, 64, 65, 1000, 4099, 40001};
  for (DType dtype : kDTypes) {
    const uint32_t vb = dtype_info(dtype).value_bytes;
    for (size_t n : sizes) {
      const auto values = random_bytes(n * vb, n * 31 + vb);
      const SignMantissaLayout layout(dtype, n);
      std::vector<uint8_t> ref_exps(n), ref_sm(layout.total_bytes());
      reference::split(dtype, values.data(), n, ref_exps.data(), ref_sm.data());
      std::vector<uint8_t> ref_back(values.size());
      reference::merge(dtype, ref_exps.data(), ref_sm.data(), n, ref_back.data());
      ASSERT_EQ(ref_back, values) << "reference round trip, " << dtype_name(dtype) << " n=" << n;

      for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
        for (size_t piece : {size_t{1}, size_t{5}, size_t{8}, size_t{333}, kMaxChunkValues}) {
          std::vector<uint8_t> exps(n, 0xAA), sm(layout.total_bytes(), 0);
          for (size_t first = 0; first < n; first += piece) {
            const size_t count = std::min(piece, n - first);
            split_values(layout, *k, values.data() + first * vb, first, count, exps.data() + first,
                         sm.data());
          }
          ASSERT_EQ(exps, ref_exps) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          ASSERT_EQ(sm, ref_sm) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          std::vector<uint8_t> back(values.size(), 0x55);
          for (size_t first = 0; first < n; first += piece) {
            const size_t count = std::min(piece, n - first);
            merge_values(layout, *k, exps.data() + first, sm.data(), first, count,
                         back.data() + first * vb);
          }
          ASSERT_EQ(back, values) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          std::vector<uint8_t> only_exps(n);
          extract_exponents(dtype, *k, values.data(), n, only_exps.data());
          ASSERT_EQ(only_exps, ref_exps) << k->target;
        }
      }
    }
  }
}

TEST(Planes, SetExponentReplacesOnlyTheExponent) {
  for (DType dtype : kDTypes) {
    const DTypeInfo info = dtype_info(dtype);
    const auto values = random_bytes(64 * info.value_bytes, 7);
    for (size_t i = 0; i < 64; ++i) {
      std::vector<uint8_t> v(values.begin() + i * info.value_bytes,
                             values.begin() + (i + 1) * info.value_bytes);
      const uint8_t e = static_cast<uint8_t>((i * 37) & ((1u << info.exponent_bits) - 1));
      set_exponent(dtype, v.data(), e);
      EXPECT_EQ(exponent_of(dtype, v.data()), e);
      set_exponent(dtype, v.data(), exponent_of(dtype, values.data() + i * info.value_bytes));
      EXPECT_TRUE(std::equal(v.begin(), v.end(), values.begin() + i * info.value_bytes));
    }
  }
}

TEST(Planes, FindChangesMatchesScalarScanOnEveryTarget) {
  std::mt19937_64 rng(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{64}, size_t{100}, size_t{4096}}) {
    for (unsigned density : {0u, 1u, 50u, 100u}) {
      std::vector<uint8_t> before(n), now(n);
      for (size_t i = 0; i < n; ++i) {
        before[i] = static_cast<uint8_t>(rng());
        now[i] = (rng() % 100) < density ? static_cast<uint8_t>(before[i] + 1 + rng() % 255) : before[i];
      }
      std::vector<uint16_t> want_pos;
      std::vector<uint8_t> want_step;
      for (size_t i = 0; i < n; ++i) {
        if (now[i] != before[i]) {
          want_pos.push_back(static_cast<uint16_t>(i));
          want_step.push_back(static_cast<uint8_t>(now[i] - before[i]));
        }
      }
      for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
        std::vector<uint16_t> pos(n + 1);
        std::vector<uint8_t> step(n + 1);
        const size_t m = k->find_changes(now.data(), before.data(), n, pos.data(), step.data());
        pos.resize(m);
        step.resize(m);
        EXPECT_EQ(pos, want_pos) << k->target << " n=" << n;
        EXPECT_EQ(step, want_step) << k->target << " n=" << n;
      }
    }
  }
}

TEST(Planes, FusedBf16SplitDetectMatchesSplitThenFind) {
  std::mt19937_64 rng(8);
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{64}, size_t{65},
                   size_t{127}, size_t{128}, size_t{512}, size_t{4096}}) {
    for (unsigned density : {0u, 2u, 50u, 100u}) {
      std::vector<uint8_t> values(2 * n), cache(n);
      for (auto& b : values) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> exps(n), sm(n);
      reference::split(DType::kBF16, values.data(), n, exps.data(), sm.data());
      for (size_t i = 0; i < n; ++i) {
        // Changes of -1 and +1 (the common steps) and escaped ones.
        const uint64_t kind = rng() % 4;
        const auto delta = static_cast<uint8_t>(kind == 0 ? 1 : kind == 1 ? 0xFF : 1 + rng() % 255);
        cache[i] = (rng() % 100) < density ? static_cast<uint8_t>(exps[i] - delta) : exps[i];
      }
      // Tagged positions: i | class << 13 (class 0: step +1, 1: step -1, 2: escaped).
      std::vector<uint16_t> want_pos;
      std::vector<uint8_t> want_escapes;
      for (size_t i = 0; i < n; ++i) {
        if (exps[i] != cache[i]) {
          const auto step = static_cast<uint8_t>(exps[i] - cache[i]);
          const unsigned step_class = step == 1 ? 0 : step == 0xFF ? 1 : 2;
          want_pos.push_back(static_cast<uint16_t>(i | step_class << 13));
          if (step_class == 2) want_escapes.push_back(step);
        }
      }
      // Streamed (non-temporal) or not, into a 64-byte aligned plane or one byte past it (where
      // the kernels must fall back to ordinary stores).
      const auto check = [&](const PlaneKernels& k, bool stream, size_t misalign) {
        SCOPED_TRACE(std::string(k.target) + " n " + std::to_string(n) + " stream " +
                     std::to_string(stream) + " misalign " + std::to_string(misalign));
        std::vector<uint8_t> storage(n + 128, 0xAA), got_cache = cache;
        const size_t at = (-reinterpret_cast<uintptr_t>(storage.data()) & 63) + misalign;
        uint8_t* got_sm = storage.data() + at;
        std::vector<uint16_t> pos(n + kChangeSlack);
        std::vector<uint8_t> escapes(3 + n + kChangeSlack, 0xEE);
        size_t escape_count = 3;  // appends after what is there
        const size_t m = k.split_detect_bf16(values.data(), n, got_sm, got_cache.data(), pos.data(),
                                             escapes.data(), &escape_count, stream);
        stream_fence();
        pos.resize(m);
        EXPECT_EQ(std::vector<uint8_t>(got_sm, got_sm + n), sm);
        for (size_t i = 0; i < storage.size(); ++i) {
          if (i < at || i >= at + n) {
            ASSERT_EQ(storage[i], 0xAA) << "wrote byte " << i;
          }
        }
        EXPECT_EQ(got_cache, exps) << "cache must hold the new exponents";
        EXPECT_EQ(pos, want_pos);
        ASSERT_EQ(escape_count, 3 + want_escapes.size());
        EXPECT_EQ(std::vector<uint8_t>(escapes.begin(), escapes.begin() + 3), std::vector<uint8_t>(3, 0xEE));
        EXPECT_EQ(std::vector<uint8_t>(escapes.begin() + 3, escapes.begin() + 3 + want_escapes.size()),
                  want_escapes);
      };
      for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
        for (const bool stream : {false, true}) {
          check(*k, stream, 0);
          check(*k, stream, 1);
        }
      }
    }
  }
}

TEST(Planes, StreamCopyCopiesExactlyAtEveryAlignment) {
  const auto src = random_bytes(4096 + 128, 11);
  for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
    for (size_t offset = 0; offset < 64; offset += 7) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4096}}) {
        std::vector<uint8_t> dst(n + 128, 0xA5);
        k->stream_copy(dst.data() + offset, src.data() + 3, n);
        stream_fence();
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= offset && i < offset + n;
          ASSERT_EQ(dst[i], inside ? src[3 + i - offset] : 0xA5)
              << k->target << " offset " << offset << " n " << n << " byte " << i;
        }
      }
    }
  }
}

// Each target's streaming content checksum equals the definition computed with the shared
// library (content_checksum64: XXH3-64 of the XXH3-64 digests of 16 KiB chunks), whatever the
// sizes of the updates (xxHash buffers partial stripes between them; updates straddle chunks)
// and the input length (XXH3 has separate paths up to 16, 128, 240 bytes and beyond; lengths
// around a chunk boundary).
// The definition written out independently of content_checksum64.
uint64_t checksum64_of_digests(const uint8_t* data, size_t n) {
  std::vector<uint8_t> digests;
  for (size_t at = 0; at < n; at += kChecksumChunkBytes) {
    const uint64_t d = checksum64(data + at, std::min<size_t>(kChecksumChunkBytes, n - at));
    for (int i = 0; i < 8; ++i) digests.push_back(static_cast<uint8_t>(d >> (8 * i)));
  }
  return checksum64(digests.data(), digests.size());
}

TEST(Planes, ContentChecksumEqualsLibraryXxh3OnEveryTarget) {
  const auto data = random_bytes(70000, 12);
  EXPECT_EQ(checksum64_of_digests(data.data(), 0), checksum64(nullptr, 0));
  std::mt19937_64 rng(13);
  for (const PlaneKernels* k : kernels_of_every_target(kernels_for)) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
                           size_t{240}, size_t{241}, size_t{1024}, size_t{4099}, size_t{16383},
                           size_t{16384}, size_t{16385}, size_t{32768 + 17}, data.size()}) {
      const uint64_t expected = content_checksum64(data.data(), n);
      EXPECT_EQ(expected, checksum64_of_digests(data.data(), n)) << "n " << n;
      ContentChecksum whole(*k);
      whole.update(data.data(), n);
      EXPECT_EQ(whole.digest(), expected) << k->target << " n " << n;
      ContentChecksum pieces(*k);
      for (size_t at = 0; at < n;) {
        const size_t piece = std::min<size_t>(n - at, rng() % 3000);
        pieces.update(data.data() + at, piece);
        at += piece;
      }
      EXPECT_EQ(pieces.digest(), expected) << k->target << " n " << n << " in pieces";
    }
  }
}


}  // namespace
}  // namespace ciera::format
