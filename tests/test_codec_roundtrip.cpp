// Multi-step round trips over dtype x block size x shard size x change pattern x detection and
// coding mode (house rule 8, reliability test 1): every step bitwise equal, never past the bound.
#include <gtest/gtest.h>

#include <cstring>
#include <span>
#include <tuple>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using testing::Pattern;
using testing::Trajectory;

struct Mode {
  ChangeDetection detection;
  ExponentCoding coding;
  const char* name;
};
const Mode kModes[] = {
    {ChangeDetection::kExact, ExponentCoding::kAuto, "exact_auto"},
    {ChangeDetection::kExact, ExponentCoding::kBlock, "exact_block"},
    {ChangeDetection::kExact, ExponentCoding::kFine, "exact_fine"},
    {ChangeDetection::kHash, ExponentCoding::kAuto, "hash_auto"},
    {ChangeDetection::kHash, ExponentCoding::kBlock, "hash_block"},
};

enum class Size { kZero, kOne, kBlockMinus1, kBlock, kBlockPlus1, kOdd, kLarge };
// The large shard: a million values, or under a sanitizer 2^18 + 3, still 17 rANS segments of
// 16384 exponents and a partial block at every block size. The million's 225 cases were 97% of
// the sweep's time under AddressSanitizer, and the sweep about half of that stage's suites.
constexpr size_t kLargeValues = testing::kSanitized ? (size_t{1} << 18) + 3 : 1000000;
size_t size_for(Size s, uint32_t block) {
  switch (s) {
    case Size::kZero: return 0;
    case Size::kOne: return 1;
    case Size::kBlockMinus1: return block - 1;
    case Size::kBlock: return block;
    case Size::kBlockPlus1: return block + 1;
    case Size::kOdd: return 12345;
    case Size::kLarge: return kLargeValues;
  }
  return 0;
}

using Params = std::tuple<DType, uint32_t, Size, Pattern, int>;

class RoundTrip : public ::testing::TestWithParam<Params> {};

constexpr size_t kCanaryBytes = 64;
constexpr uint8_t kCanary = 0xC5;

TEST_P(RoundTrip, EveryStepIsBitwiseExact) {
  const auto [dtype, block, size, pattern, mode_index] = GetParam();
  const Mode mode = kModes[mode_index];
  const size_t n = size_for(size, block);
  CodecConfig config;
  config.dtype = dtype;
  config.block_values = block;
  config.detection = mode.detection;
  config.coding = mode.coding;
  config.warmup_steps = 2;
  const int steps = size == Size::kLarge ? 4 : 7;

  const StreamIdentity stream{.stream = 5, .epoch = 11};
  ShardEncoder encoder(config, n, stream);
  ShardDecoder decoder(config, n, stream);
  const size_t bound = max_payload_bytes(dtype, n, block);
  ASSERT_EQ(encoder.max_payload_bytes(), bound);
  std::vector<std::byte> payload(bound);
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  std::vector<std::byte> out(bytes + kCanaryBytes);

  Trajectory trajectory(dtype, n, pattern, 1000 + n + block);
  for (int step = 0; step < steps; ++step) {
    if (step > 0) trajectory.step();
    const FrameStats sent = encoder.encode(trajectory.span(), payload);
    ASSERT_LE(sent.payload_bytes, bound);
    EXPECT_EQ(sent.kind, step < 2 ? FrameKind::kKey : FrameKind::kDelta);
    std::memset(out.data(), 0xEE, bytes);
    std::memset(out.data() + bytes, kCanary, kCanaryBytes);
    const FrameStats got = decoder.decode({payload.data(), sent.payload_bytes},
                                          {out.data(), bytes});
    ASSERT_TRUE(std::equal(out.begin(), out.begin() + bytes, trajectory.values().begin()))
        << "step " << step << " section " << exponent_section_name(sent.section);
    for (size_t i = 0; i < kCanaryBytes; ++i) ASSERT_EQ(static_cast<uint8_t>(out[bytes + i]), kCanary);
    EXPECT_EQ(got.section, sent.section);
    EXPECT_EQ(got.changed_blocks, sent.changed_blocks);
    if (mode.coding == ExponentCoding::kBlock || mode.detection == ChangeDetection::kHash) {
      EXPECT_NE(sent.section, ExponentSection::kFine);
    }
    if (pattern == Pattern::kNone && step >= 2) {
      EXPECT_EQ(sent.section, ExponentSection::kUnchanged);
    }
    // The decoder's cache now holds exactly the shard's exponents.
    std::vector<uint8_t> want(n);
    for (size_t i = 0; i < n; ++i) {
      const DTypeInfo info = dtype_info(dtype);
      want[i] = static_cast<uint8_t>((testing::get_value(dtype, trajectory.values(), i) >>
                                      (info.sign_mantissa_bits - 1)) &
                                     ((1u << info.exponent_bits) - 1));
    }
    ASSERT_TRUE(std::equal(want.begin(), want.end(), decoder.cached_exponents().begin()));
  }
}

std::string param_name(const ::testing::TestParamInfo<Params>& info) {
  const auto [dtype, block, size, pattern, mode] = info.param;
  const char* sizes[] = {"n0", "n1", "nBm1", "nB", "nBp1", "nOdd", "nLarge"};
  return std::string(dtype_name(dtype)) + "_B" + std::to_string(block) + "_" +
         sizes[static_cast<int>(size)] + "_" + testing::pattern_name(pattern) + "_" +
         kModes[mode].name;
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, RoundTrip,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                       ::testing::Values(64u, 512u, 4096u),
                       ::testing::Values(Size::kZero, Size::kOne, Size::kBlockMinus1, Size::kBlock,
                                         Size::kBlockPlus1, Size::kOdd, Size::kLarge),
                       ::testing::Values(Pattern::kNone, Pattern::kAll, Pattern::kRandom,
                                         Pattern::kSparse, Pattern::kSpecial),
                       ::testing::Range(0, 5)),
    param_name);

TEST(Codec, OddBlockSizesRoundTrip) {
  for (uint32_t block : {65u, 100u, 777u, 3001u}) {
    for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      CodecConfig config;
      config.dtype = dtype;
      config.block_values = block;
      config.warmup_steps = 1;
      const size_t n = 3 * block + 13;
      ShardEncoder encoder(config, n);
      ShardDecoder decoder(config, n);
      std::vector<std::byte> payload(encoder.max_payload_bytes());
      std::vector<std::byte> out(n * dtype_info(dtype).value_bytes);
      Trajectory t(dtype, n, Pattern::kSparse, block);
      for (int step = 0; step < 5; ++step) {
        t.step();
        const auto sent = encoder.encode(t.span(), payload);
        decoder.decode({payload.data(), sent.payload_bytes}, out);
        ASSERT_EQ(out, t.values()) << "B=" << block << " " << dtype_name(dtype);
      }
    }
  }
}

// docs/format.md, "Padding": a sign-mantissa plane of at least 64 KiB starts at the first multiple
// of 64 after the header and bitmap, and the bytes between are written as zeros (over a buffer
// full of junk) and must be zeros; a smaller plane follows the bitmap directly.
TEST(Codec, LargeSignMantissaPlanesStartAlignedAfterZeroPadding) {
  int padded = 0;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 777u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{40000}, size_t{100000}}) {
        CodecConfig config;
        config.dtype = dtype;
        config.block_values = block;
        config.warmup_steps = 1;
        ShardEncoder encoder(config, n);
        ShardDecoder decoder(config, n);
        std::vector<std::byte> payload(encoder.max_payload_bytes());
        std::vector<std::byte> out(n * dtype_info(dtype).value_bytes);
        Trajectory t(dtype, n, Pattern::kSparse, 7);
        for (int step = 0; step < 3; ++step) {  // a key frame, then delta frames
          std::fill(payload.begin(), payload.end(), std::byte{0xAA});
          t.step();
          const FrameStats f = encoder.encode(t.span(), payload);
          const uint64_t plane = f.payload_bytes - f.sign_mantissa_bytes - f.exponent_bytes;
          const uint64_t padding_begin = 80 + f.bitmap_bytes;
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " B=" + std::to_string(block) +
                       " n=" + std::to_string(n) + " step " + std::to_string(step));
          if (f.sign_mantissa_bytes < 65536) {
            EXPECT_EQ(plane, padding_begin);
          } else {
            EXPECT_EQ(plane % 64, 0u);
            ASSERT_GE(plane, padding_begin);
            EXPECT_LT(plane - padding_begin, 64u);
          }
          const std::span<const std::byte> good(payload.data(), f.payload_bytes);
          for (uint64_t at = padding_begin; at < plane; ++at) {
            EXPECT_EQ(payload[at], std::byte{0});
            std::vector<std::byte> bad(good.begin(), good.end());
            bad[at] = std::byte{1};
            EXPECT_THROW(decoder.decode(bad, out), FormatError) << "padding byte " << at;
            ++padded;
          }
          decoder.decode(good, out);
          ASSERT_EQ(out, t.values());
        }
      }
    }
  }
  EXPECT_GT(padded, 0);
}

TEST(Codec, SparseChangesCostFarLessThanRaw) {
  CodecConfig config;
  config.warmup_steps = 1;
  const size_t n = 1 << 20;
  ShardEncoder encoder(config, n);
  ShardDecoder decoder(config, n);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> out(2 * n);
  Trajectory t(DType::kBF16, n, Pattern::kSparse, 5);
  encoder.encode(t.span(), payload);
  t.step();
  const auto sent = encoder.encode(t.span(), payload);
  decoder.reset();
  EXPECT_EQ(sent.section, ExponentSection::kFine);
  // 8 bits of sign-mantissa per value plus a small fraction of a bit for the changes.
  EXPECT_LT(static_cast<double>(sent.payload_bytes) * 8 / n, 8.3);
}

TEST(Codec, StatelessRoundTripAndInspect) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    CodecConfig config;
    config.dtype = dtype;
    const size_t n = 50000;
    Trajectory t(dtype, n, Pattern::kSpecial, 1);
    std::vector<std::byte> payload(max_payload_bytes(dtype, n, config.block_values));
    const size_t len = encode_stateless(config, t.span(), payload);
    const PayloadInfo info = inspect_payload({payload.data(), len});
    EXPECT_EQ(info.kind, FrameKind::kKey);
    EXPECT_EQ(info.dtype, dtype);
    EXPECT_EQ(info.num_values, n);
    EXPECT_EQ(info.payload_bytes, len);
    EXPECT_TRUE(info.has_content_checksum);
    std::vector<std::byte> out(t.values().size());
    decode_stateless(config, {payload.data(), len}, out);
    EXPECT_EQ(out, t.values());
    // An output of another size is the caller's mistake, not a malformed payload.
    std::vector<std::byte> short_out(out.size() - dtype_info(dtype).value_bytes);
    try {
      decode_stateless(config, {payload.data(), len}, short_out);
      ADD_FAILURE() << "decoded into an output one value short";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(
          std::string(e.what()).find("the output holds 49999 " + std::string(dtype_name(dtype)) +
                                     " values, but the payload holds 50000"),
          std::string::npos)
          << e.what();
    }
  }
}

// The API takes shards at any alignment (a slot of an interleaved buffer, a tensor's storage at
// an odd offset): the coders read and write them as bytes, never through a pointer to a wider
// type (UndefinedBehaviorSanitizer's alignment check sees that, in the sanitizer build).
TEST(Codec, ShardsAtOddAddressesRoundTripEveryKindAndDtype) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (StreamKind kind : {StreamKind::kExponentReuse, StreamKind::kValueDelta}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::string(stream_kind_name(kind)));
      CodecConfig config;
      config.dtype = dtype;
      config.stream_kind = kind;
      config.warmup_steps = 0;  // delta frames from the second on
      const size_t n = 20001;
      Trajectory t(dtype, n, Pattern::kSparse, 7);
      ShardEncoder encoder(config, n);
      ShardDecoder decoder(config, n);
      const size_t bytes = t.values().size();
      std::vector<std::byte> in(bytes + 1), out(bytes + 3),
          payload(encoder.max_payload_bytes() + 1);
      for (int step = 0; step < 4; ++step, t.step()) {
        std::memcpy(in.data() + 1, t.values().data(), bytes);
        const size_t len =
            encoder.encode({in.data() + 1, bytes}, {payload.data() + 1, payload.size() - 1})
                .payload_bytes;
        decoder.decode({payload.data() + 1, len}, {out.data() + 3, bytes});
        ASSERT_EQ(std::memcmp(out.data() + 3, t.values().data(), bytes), 0) << "step " << step;
      }
    }
  }
}

// A one-shot encoder's frame is the first frame of an ordinary encoder of the same stream, byte
// for byte, without the cache; a one-shot decoder takes that frame and nothing else.
TEST(Codec, OneShotCodersKeepNoStateAndCodeOneKeyFrame) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (StreamKind kind : {StreamKind::kExponentReuse, StreamKind::kValueDelta}) {
      for (ChangeDetection detection : {ChangeDetection::kExact, ChangeDetection::kHash}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::string(stream_kind_name(kind)) +
                     (detection == ChangeDetection::kHash ? " hash" : " exact"));
        CodecConfig config;
        config.dtype = dtype;
        config.stream_kind = kind;
        config.detection = detection;
        config.warmup_steps = 0;  // the ordinary encoder's second frame is a delta frame
        const size_t n = 70000;   // more than two rANS segments
        const StreamIdentity id{.stream = 3, .epoch = 9};
        Trajectory t(dtype, n, Pattern::kSpecial, 4);
        ShardEncoder ordinary(config, n, id);
        ShardEncoder once = ShardEncoder::one_shot(config, n, id);
        EXPECT_EQ(once.cache_bytes(), 0u);
        std::vector<std::byte> want(ordinary.max_payload_bytes()), got(once.max_payload_bytes());
        const size_t want_len = ordinary.encode(t.span(), want).payload_bytes;
        const size_t got_len = once.encode(t.span(), got).payload_bytes;
        ASSERT_EQ(got_len, want_len);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got_len), 0);
        EXPECT_EQ(once.cache_bytes(), 0u);
        EXPECT_THROW(once.encode(t.span(), got), std::logic_error);

        ShardDecoder decoder = ShardDecoder::one_shot(config, n, id);
        EXPECT_EQ(decoder.cache_bytes(), 0u);
        std::vector<std::byte> out(t.values().size());
        decoder.decode({got.data(), got_len}, out);
        EXPECT_EQ(out, t.values());
        EXPECT_EQ(decoder.cache_bytes(), 0u);
        EXPECT_FALSE(decoder.has_cache());
        EXPECT_THROW(decoder.decode({got.data(), got_len}, out), FormatError);  // the same again
        // The ordinary encoder's next frame (a delta frame, the next in sequence, which an
        // ordinary decoder would take) is refused: the one-shot decoder has no cache to read. So
        // is a fresh one-shot decoder.
        t.step();
        const size_t next_len = ordinary.encode(t.span(), want).payload_bytes;
        EXPECT_THROW(decoder.decode({want.data(), next_len}, out), FormatError);
        ShardDecoder fresh = ShardDecoder::one_shot(config, n, id);
        EXPECT_THROW(fresh.decode({want.data(), next_len}, out), FormatError);
        // (An ordinary decoder of the same stream takes both frames.)
        ShardDecoder control(config, n, id);
        control.decode({got.data(), got_len}, out);
        control.decode({want.data(), next_len}, out);
        EXPECT_EQ(out, t.values());
      }
    }
  }
}

TEST(Codec, ChecksumCanBeTurnedOff) {
  CodecConfig config;
  config.content_checksum = false;
  config.warmup_steps = 1;
  const size_t n = 10000;
  ShardEncoder encoder(config, n);
  ShardDecoder decoder(config, n);
  CodecConfig strict = config;
  strict.content_checksum = true;
  ShardDecoder strict_decoder(strict, n);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> out(2 * n);
  Trajectory t(DType::kBF16, n, Pattern::kSparse, 2);
  for (int step = 0; step < 4; ++step) {
    t.step();
    const auto sent = encoder.encode(t.span(), payload);
    EXPECT_FALSE(inspect_payload({payload.data(), sent.payload_bytes}).has_content_checksum);
    decoder.decode({payload.data(), sent.payload_bytes}, out);
    EXPECT_EQ(out, t.values());
    // A decoder that requires checksums refuses a payload without one.
    EXPECT_THROW(strict_decoder.decode({payload.data(), sent.payload_bytes}, out), FormatError);
  }
}

TEST(Codec, ResyncStartsANewEpochAndRecoversAColdDecoder) {
  CodecConfig config;
  config.warmup_steps = 1;
  const size_t n = 5000;
  const StreamIdentity stream{.stream = 0, .epoch = 7};
  ShardEncoder encoder(config, n, stream);
  ShardDecoder decoder(config, n, stream);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> out(2 * n);
  Trajectory t(DType::kBF16, n, Pattern::kSparse, 3);
  for (int step = 0; step < 3; ++step) {
    t.step();
    const auto sent = encoder.encode(t.span(), payload);
    decoder.decode({payload.data(), sent.payload_bytes}, out);
  }
  decoder.reset();  // the receiver restarted with a cold cache
  t.step();
  auto sent = encoder.encode(t.span(), payload);
  EXPECT_THROW(decoder.decode({payload.data(), sent.payload_bytes}, out), FormatError);
  encoder.request_key_frame();
  t.step();
  sent = encoder.encode(t.span(), payload);
  EXPECT_EQ(sent.kind, FrameKind::kKey);
  EXPECT_EQ(sent.epoch, 8u);
  decoder.decode({payload.data(), sent.payload_bytes}, out);
  EXPECT_EQ(out, t.values());
  t.step();
  sent = encoder.encode(t.span(), payload);
  EXPECT_EQ(sent.kind, FrameKind::kDelta);
  decoder.decode({payload.data(), sent.payload_bytes}, out);
  EXPECT_EQ(out, t.values());
}

TEST(Codec, CacheBytesAreReported) {
  CodecConfig exact;
  CodecConfig hash;
  hash.detection = ChangeDetection::kHash;
  const size_t n = 1 << 16;
  EXPECT_EQ(ShardEncoder(exact, n).cache_bytes(), n);
  EXPECT_EQ(ShardEncoder(hash, n).cache_bytes(), 16 * (n / 512));
  EXPECT_EQ(ShardDecoder(exact, n).cache_bytes(), n);
}

}  // namespace
}  // namespace ciera
