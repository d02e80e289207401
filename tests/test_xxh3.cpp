// The XXH3-64 the GPU kernels share with the CPU (format/xxh3.hpp) equals libxxhash's on every
// length path, and the two-level content checksum built from it equals the codec's.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/checksum.hpp"
#include "format/content_checksum.hpp"
#include "format/xxh3.hpp"
#include "test_util.hpp"

namespace ciera::format {
namespace {

using ciera::testing::random_bytes;

TEST(Xxh3, EqualsLibxxhashOnEveryLengthPath) {
  const auto data = random_bytes(70000, 1);
  const uint8_t* secret = xxh3::default_secret();
  for (size_t n = 0; n <= 2100; ++n) {
    ASSERT_EQ(xxh3::hash64(data.data(), n, secret), checksum64(data.data(), n)) << "length " << n;
  }
  for (const size_t n : {size_t{4095}, size_t{4096}, size_t{4097}, size_t{16383}, size_t{16384},
                         size_t{16385}, size_t{65536}, data.size()}) {
    EXPECT_EQ(xxh3::hash64(data.data(), n, secret), checksum64(data.data(), n)) << "length " << n;
  }
  // Offsets that are not 8-byte aligned.
  for (size_t at = 1; at < 8; ++at) {
    EXPECT_EQ(xxh3::hash64(data.data() + at, 5000, secret), checksum64(data.data() + at, 5000));
  }
}

TEST(Xxh3, Hash128EqualsLibxxhashOnEveryLengthPath) {
  const auto data = random_bytes(9000, 2);
  const uint8_t* secret = xxh3::default_secret();
  for (size_t n = 0; n <= 4200; n += n < 300 ? 1 : 7) {
    const xxh3::Hash128 h = xxh3::hash128(data.data(), n, secret);
    const XXH128_hash_t expected = XXH3_128bits(data.data(), n);
    ASSERT_EQ(h.low, expected.low64) << "length " << n;
    ASSERT_EQ(h.high, expected.high64) << "length " << n;
  }
  const XXH128_hash_t whole = XXH3_128bits(data.data(), data.size());
  EXPECT_EQ(xxh3::hash128(data.data(), data.size(), secret).high, whole.high64);
}

TEST(Xxh3, ChunkDigestsCombineToTheContentChecksum) {
  const uint8_t* secret = xxh3::default_secret();
  for (const size_t n : {size_t{0}, size_t{1}, size_t{16384}, size_t{16385}, size_t{100000}}) {
    const auto data = random_bytes(n, n + 7);
    std::vector<uint64_t> digests;
    for (size_t at = 0; at < n; at += kChecksumChunkBytes) {
      digests.push_back(xxh3::hash64(data.data() + at, std::min<size_t>(kChecksumChunkBytes, n - at), secret));
    }
    std::vector<uint8_t> scratch(8 * digests.size() + 1);
    const uint64_t combined = xxh3::combine_digests(digests.data(), digests.size(), scratch.data(), secret);
    EXPECT_EQ(combined, content_checksum64(data.data(), n)) << n;
    ContentChecksum streaming;
    streaming.update(data.data(), n);
    EXPECT_EQ(combined, streaming.digest()) << n;
  }
}

}  // namespace
}  // namespace ciera::format
