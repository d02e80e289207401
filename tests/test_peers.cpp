// The peer schemes (include/ciera/peers.hpp): the two lossy quantisers against literal references
// (group edges, zero groups, ±Inf/NaN), their framed stream coders (damage, misrouting, replays),
// and the engine running them as shard policies: every rank gathers the same values, the lossless
// one bit for bit, the lossy ones within their quantisation error.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "engine_backend_suite.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using peers::apply_diff4;
using peers::dequantize_int8;
using peers::quantize_diff4;
using peers::quantize_int8;

std::vector<std::byte> bf16(std::initializer_list<uint16_t> bits) {
  std::vector<std::byte> out(bits.size() * 2);
  size_t i = 0;
  for (uint16_t b : bits) std::memcpy(out.data() + 2 * i++, &b, 2);
  return out;
}

std::vector<std::byte> fp32(std::initializer_list<float> values) {
  std::vector<std::byte> out(values.size() * 4);
  size_t i = 0;
  for (float v : values) std::memcpy(out.data() + 4 * i++, &v, 4);
  return out;
}

uint16_t bf16_at(const std::vector<std::byte>& v, size_t i) {
  uint16_t b;
  std::memcpy(&b, v.data() + 2 * i, 2);
  return b;
}

float fp32_at(const std::vector<std::byte>& v, size_t i) {
  float f;
  std::memcpy(&f, v.data() + 4 * i, 4);
  return f;
}

float scale_at(const std::vector<std::byte>& payload, size_t at) {
  float f;
  std::memcpy(&f, payload.data() + at, 4);
  return f;
}

std::vector<std::byte> int8_round_trip(DType dtype, const std::vector<std::byte>& values, uint32_t group,
                                       std::vector<std::byte>* payload_out = nullptr) {
  const size_t n = values.size() / dtype_info(dtype).value_bytes;
  std::vector<std::byte> payload(peers::int8_bound_bytes(dtype, n, group));
  payload.resize(quantize_int8(dtype, values, group, payload));
  std::vector<std::byte> out(values.size());
  dequantize_int8(dtype, payload, group, out);
  if (payload_out) *payload_out = payload;
  return out;
}

// ---- ZeRO++ int8 ---------------------------------------------------------------------------------

// 1.0, -0.5, 0.25, 0 in one group: scale 1/127; levels 127, -64 (-63.5 ties to even), 32 (31.75), 0;
// back in BF16 1.0, -0.50390625, 0.251953125, +0.
TEST(ZeroppInt8, OneGroupMatchesTheHandComputedLevelsAndValues) {
  std::vector<std::byte> payload;
  const auto out = int8_round_trip(DType::kBF16, bf16({0x3F80, 0xBF00, 0x3E80, 0x0000}), 4, &payload);
  ASSERT_EQ(payload.size(), 4u + 4u);
  EXPECT_EQ(scale_at(payload, 0), 1.0f / 127.0f);
  EXPECT_EQ(static_cast<int8_t>(payload[4]), 127);
  EXPECT_EQ(static_cast<int8_t>(payload[5]), -64);
  EXPECT_EQ(static_cast<int8_t>(payload[6]), 32);
  EXPECT_EQ(static_cast<int8_t>(payload[7]), 0);
  EXPECT_EQ(bf16_at(out, 0), 0x3F80);
  EXPECT_EQ(bf16_at(out, 1), 0xBF01);
  EXPECT_EQ(bf16_at(out, 2), 0x3E81);
  EXPECT_EQ(bf16_at(out, 3), 0x0000);
}

// Each group has its own scale: a group of small values next to a large one keeps its precision,
// and the last group may be short (5 values in groups of 4).
TEST(ZeroppInt8, EveryGroupHasItsOwnScaleAndTheLastMayBeShort) {
  std::vector<std::byte> payload;
  const auto in = fp32({0.01f, -0.02f, 0.03f, 0.04f, 100.0f});
  const auto out = int8_round_trip(DType::kFP32, in, 4, &payload);
  ASSERT_EQ(payload.size(), (4u + 4u) + (4u + 1u));
  EXPECT_EQ(scale_at(payload, 0), 0.04f / 127.0f);
  EXPECT_EQ(scale_at(payload, 8), 100.0f / 127.0f);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(fp32_at(out, i), fp32_at(in, i), 0.04 / 127 / 2 * 1.001) << i;
  EXPECT_EQ(fp32_at(out, 4), 127.0f * (100.0f / 127.0f));
}

// An all-zero group has scale 0 and decodes to +0 (-0.0 included: the scheme is lossy).
TEST(ZeroppInt8, ZeroGroupsDecodeToPositiveZero) {
  std::vector<std::byte> payload;
  const auto out = int8_round_trip(DType::kBF16, bf16({0x0000, 0x8000, 0x0000}), 2, &payload);
  EXPECT_EQ(scale_at(payload, 0), 0.0f);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(bf16_at(out, i), 0x0000) << i;
}

// A group holding ±Inf or NaN travels raw, bit for bit (NaN payloads too), flagged by a NaN
// scale; the other groups are quantised as usual.
TEST(ZeroppInt8, GroupsWithInfOrNanTravelRawBitForBit) {
  std::vector<std::byte> payload;
  const auto in = bf16({0x3F80, 0x7F80, 0xFFC1, 0x3F00, 0x4000, 0xC000});
  const auto out = int8_round_trip(DType::kBF16, in, 3, &payload);
  ASSERT_EQ(payload.size(), (4u + 6u) + (4u + 3u));
  EXPECT_TRUE(std::isnan(scale_at(payload, 0)));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(bf16_at(out, i), bf16_at(in, i)) << i;
  // 0.5, 2, -2 with scale 2/127: levels 32 (31.75), 127, -127 -> 0.50394 (0x3F01), 2, -2.
  EXPECT_EQ(bf16_at(out, 3), 0x3F01);
  EXPECT_EQ(bf16_at(out, 4), 0x4000);
  EXPECT_EQ(bf16_at(out, 5), 0xC000);
}

// Subnormal magnitudes: 127 / max would overflow FP32, so the group travels raw (found by
// fuzz/fuzz_peers, where it was a float-to-int conversion of infinity).
TEST(ZeroppInt8, GroupsTooSmallToScaleTravelRaw) {
  std::vector<std::byte> payload;
  const auto in = bf16({0x0001, 0x8003, 0x0000});
  const auto out = int8_round_trip(DType::kBF16, in, 3, &payload);
  EXPECT_TRUE(std::isnan(scale_at(payload, 0)));
  EXPECT_EQ(out, in);
  auto base = bf16({0x0000, 0x0000, 0x0000});
  std::vector<std::byte> diff(peers::diff4_bound_bytes(DType::kBF16, 3, 3));
  diff.resize(quantize_diff4(DType::kBF16, in, base, 3, 0, diff));
  EXPECT_TRUE(std::isnan(scale_at(diff, 0)));
  EXPECT_EQ(base, in);
}

TEST(ZeroppInt8, ErrorIsAtMostHalfAStepPlusTheDtypeRoundingAcrossDtypes) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    testing::Trajectory data(dtype, 20011, testing::Pattern::kNone, 3);
    const auto& in = data.values();
    const auto out = int8_round_trip(dtype, in, peers::kZeroppGroupValues);
    const size_t n = 20011;
    for (size_t first = 0; first < n; first += peers::kZeroppGroupValues) {
      const size_t count = std::min<size_t>(peers::kZeroppGroupValues, n - first);
      double max_abs = 0;
      for (size_t i = 0; i < count; ++i) max_abs = std::max(max_abs, std::fabs(testing::to_double(dtype, in, first + i)));
      const double step = max_abs / 127;
      for (size_t i = 0; i < count; ++i) {
        const double x = testing::to_double(dtype, in, first + i), y = testing::to_double(dtype, out, first + i);
        // Half a quantisation step, then the dtype's own rounding (a relative 2^-8 for BF16).
        ASSERT_LE(std::fabs(x - y), step / 2 * 1.0001 + std::fabs(y) * 0x1p-8) << dtype_name(dtype) << " " << first + i;
      }
    }
  }
}

// The bench's check of the lossy scheme: every reconstruction passes, in every dtype; a value off
// by more than one quantisation step fails, and so does a raw group off by one bit.
TEST(ZeroppInt8, WithinBoundAcceptsTheQuantiserAndCatchesWrongValues) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    testing::Trajectory data(dtype, 20011, testing::Pattern::kNone, 3);
    const auto& in = data.values();
    const auto out = int8_round_trip(dtype, in, peers::kZeroppGroupValues);
    EXPECT_TRUE(peers::int8_within_bound(dtype, in, out, peers::kZeroppGroupValues))
        << dtype_name(dtype);
  }
  // 1, 0.5 scaled by 1/127: 0.5 -> 64/127 = 0.5039. 0.52 is 2.5 steps away, 0.5039 half of one.
  const auto in = fp32({1.0f, 0.5f});
  EXPECT_TRUE(peers::int8_within_bound(DType::kFP32, in, fp32({1.0f, 64.0f / 127.0f}), 2));
  EXPECT_FALSE(peers::int8_within_bound(DType::kFP32, in, fp32({1.0f, 0.52f}), 2));
  EXPECT_FALSE(peers::int8_within_bound(DType::kFP32, in, fp32({1.0f, -0.5f}), 2));
  // A group with an infinity travels raw: a NaN or a changed bit there is wrong.
  const auto raw = bf16({0x3F80, 0x7F80});
  EXPECT_TRUE(peers::int8_within_bound(DType::kBF16, raw, raw, 2));
  EXPECT_FALSE(peers::int8_within_bound(DType::kBF16, raw, bf16({0x3F81, 0x7F80}), 2));
  EXPECT_FALSE(peers::int8_within_bound(DType::kBF16, raw, bf16({0x3F80, 0x7FC0}), 2));
  EXPECT_THROW(peers::int8_within_bound(DType::kBF16, raw, bf16({0x3F80}), 2), ConfigError);
}

TEST(ZeroppInt8, MalformedPayloadsAreFormatErrors) {
  std::vector<std::byte> payload;
  const auto in = bf16({0x3F80, 0xBF00, 0x3E80, 0x0000, 0x3F80});
  int8_round_trip(DType::kBF16, in, 4, &payload);
  std::vector<std::byte> out(in.size());
  auto truncated = payload;
  truncated.pop_back();
  EXPECT_THROW(dequantize_int8(DType::kBF16, truncated, 4, out), FormatError);
  auto longer = payload;
  longer.push_back(std::byte{0});
  EXPECT_THROW(dequantize_int8(DType::kBF16, longer, 4, out), FormatError);
  auto level = payload;
  level[5] = std::byte{0x80};  // -128
  EXPECT_THROW(dequantize_int8(DType::kBF16, level, 4, out), FormatError);
  auto negative = payload;
  const float minus = -1.0f;
  std::memcpy(negative.data(), &minus, 4);
  EXPECT_THROW(dequantize_int8(DType::kBF16, negative, 4, out), FormatError);
  EXPECT_THROW(quantize_int8(DType::kBF16, std::span(in).first(3), 4, payload), ConfigError);  // half a value
  EXPECT_THROW(quantize_int8(DType::kBF16, in, 0, payload), ConfigError);
}

// ---- SDP4Bit 4-bit differences ---------------------------------------------------------------------

// Differences 7, -7, 3, 0 against a zero base: scale 1, levels exact whatever the random draw
// (floor(level + u) with u in [0, 1)); nibbles 15, 1 -> 0x1F and 11, 8 -> 0x8B.
TEST(Sdp4bitDiff, OneGroupMatchesTheHandComputedNibbles) {
  auto base = fp32({0, 0, 0, 0});
  const auto in = fp32({7, -7, 3, 0});
  std::vector<std::byte> payload(peers::diff4_bound_bytes(DType::kFP32, 4, 4));
  payload.resize(quantize_diff4(DType::kFP32, in, base, 4, 12345, payload));
  ASSERT_EQ(payload.size(), 4u + 2u);
  EXPECT_EQ(scale_at(payload, 0), 1.0f);
  EXPECT_EQ(payload[4], std::byte{0x1F});
  EXPECT_EQ(payload[5], std::byte{0x8B});
  EXPECT_EQ(base, in);
  auto receiver = fp32({0, 0, 0, 0});
  apply_diff4(DType::kFP32, payload, 4, receiver);
  EXPECT_EQ(receiver, in);
}

// An odd group keeps its last byte's high nibble clear; unchanged values stay bit for bit.
TEST(Sdp4bitDiff, UnchangedValuesStayAndShortGroupsPadWithZeroBits) {
  auto base = bf16({0x3F80, 0x4000, 0xC040, 0x3F00, 0x3E00});
  auto receiver = base;
  auto in = base;
  in[4] = std::byte{0x00};  // value 2, 0xC040 -> 0xC000: -3 -> -2
  std::vector<std::byte> payload(peers::diff4_bound_bytes(DType::kBF16, 5, 2));
  payload.resize(quantize_diff4(DType::kBF16, in, base, 2, 7, payload));
  ASSERT_EQ(payload.size(), 3u * 4u + 1u + 1u + 1u);
  EXPECT_EQ(scale_at(payload, 0), 0.0f);
  EXPECT_EQ(payload[4], std::byte{0x88});
  EXPECT_EQ(scale_at(payload, 5), 1.0f / 7.0f);
  EXPECT_EQ(payload[9], std::byte{0x8F});      // levels 7 and 0
  EXPECT_EQ(payload[14] >> 4, std::byte{0});  // the last, single-value group's high nibble
  apply_diff4(DType::kBF16, payload, 2, receiver);
  EXPECT_EQ(receiver, base);
  EXPECT_EQ(bf16_at(base, 0), 0x3F80);
  EXPECT_EQ(bf16_at(base, 1), 0x4000);
  EXPECT_EQ(bf16_at(base, 4), 0x3E00);
  EXPECT_EQ(bf16_at(base, 2), 0xC000);  // difference 1 = 7 levels of 1/7: exact here
}

// Stochastic rounding is unbiased: a difference of 0.3 steps rounds up about 30% of the time.
TEST(Sdp4bitDiff, StochasticRoundingIsUnbiased) {
  const size_t n = 8192;
  std::vector<std::byte> base(n * 4), in(n * 4);
  for (size_t i = 0; i < n; ++i) {
    const float b = 0, v = (i == 0) ? 7.0f : 0.3f;  // value 0 fixes the scale at 1
    std::memcpy(base.data() + 4 * i, &b, 4);
    std::memcpy(in.data() + 4 * i, &v, 4);
  }
  std::vector<std::byte> payload(peers::diff4_bound_bytes(DType::kFP32, n, n));
  quantize_diff4(DType::kFP32, in, base, static_cast<uint32_t>(n), 99, payload);
  size_t ups = 0;
  for (size_t i = 1; i < n; ++i) ups += fp32_at(base, i) == 1.0f;
  EXPECT_NEAR(static_cast<double>(ups) / (n - 1), 0.3, 0.03);
}

// Error feedback: the difference is taken against the reconstruction, so repeated frames of the
// same target converge to it, and sender and receiver copies stay bitwise equal.
TEST(Sdp4bitDiff, ErrorDoesNotAccumulateAndBothCopiesStayEqual) {
  testing::Trajectory data(DType::kBF16, 10000, testing::Pattern::kSparse, 5);
  std::vector<std::byte> sender(data.values().size()), receiver(sender.size());
  std::vector<std::byte> payload(peers::diff4_bound_bytes(DType::kBF16, 10000, peers::kSdp4bitGroupValues));
  double first_error = 0, last_error = 0;
  for (int step = 0; step < 12; ++step) {
    const size_t len = quantize_diff4(DType::kBF16, data.values(), sender, peers::kSdp4bitGroupValues, step, payload);
    apply_diff4(DType::kBF16, std::span(payload).first(len), peers::kSdp4bitGroupValues, receiver);
    ASSERT_EQ(sender, receiver) << step;
    double error = 0;
    for (size_t i = 0; i < 10000; ++i) {
      const double d = testing::to_double(DType::kBF16, data.values(), i) - testing::to_double(DType::kBF16, sender, i);
      if (std::isfinite(d)) error = std::max(error, std::fabs(d));
    }
    (step == 0 ? first_error : last_error) = error;
  }
  EXPECT_GT(first_error, 0);
  EXPECT_LT(last_error, first_error / 100);
}

TEST(Sdp4bitDiff, NonFiniteValuesTravelRawAndMalformedPayloadsChangeNothing) {
  auto base = bf16({0x3F80, 0x3F80, 0x3F80, 0x3F80});
  const auto in = bf16({0x7F80, 0x3F81, 0xFFC3, 0x4000});
  auto receiver = base;
  std::vector<std::byte> payload(peers::diff4_bound_bytes(DType::kBF16, 4, 2));
  payload.resize(quantize_diff4(DType::kBF16, in, base, 2, 1, payload));
  EXPECT_TRUE(std::isnan(scale_at(payload, 0)));
  EXPECT_TRUE(std::isnan(scale_at(payload, 8)));
  EXPECT_EQ(base, in);
  auto bad = payload;
  bad.back() = std::byte{0xFF};
  const auto before = receiver;
  auto zero_nibble = payload;
  // Replace the second group by a finite one whose nibble 0 is invalid.
  zero_nibble.resize(8 + 4 + 1);
  const float one = 1.0f;
  std::memcpy(zero_nibble.data() + 8, &one, 4);
  zero_nibble[12] = std::byte{0x80};
  EXPECT_THROW(apply_diff4(DType::kBF16, zero_nibble, 2, receiver), FormatError);
  EXPECT_EQ(receiver, before);
  auto truncated = payload;
  truncated.pop_back();
  EXPECT_THROW(apply_diff4(DType::kBF16, truncated, 2, receiver), FormatError);
  EXPECT_EQ(receiver, before);
  apply_diff4(DType::kBF16, payload, 2, receiver);
  EXPECT_EQ(receiver, in);
}

// ---- Framed stream coders ---------------------------------------------------------------------------

CodecConfig peer_config(StreamKind kind) {
  CodecConfig c;
  c.stream_kind = kind;
  return c;
}

struct Frame {
  std::vector<std::byte> bytes;
};

Frame encode(PayloadEncoder& e, const std::vector<std::byte>& values) {
  Frame f{std::vector<std::byte>(e.max_payload_bytes())};
  f.bytes.resize(e.encode(values.data(), values.size(), f.bytes.data()));
  return f;
}

class PeerStreams : public ::testing::TestWithParam<StreamKind> {};

TEST_P(PeerStreams, ReceiversGetWhatTheSenderReconstructsAndRejectDamagedMisroutedOrReplayedFrames) {
  const StreamKind kind = GetParam();
  const auto backend = host_codec_backend();
  ASSERT_TRUE(backend->codes(kind));
  const uint64_t n = 5000;
  testing::Trajectory data(DType::kBF16, n, testing::Pattern::kSparse, 11);
  auto encoder = backend->make_encoder(peer_config(kind), n, {.stream = 3, .epoch = 9});
  auto decoder = backend->make_decoder(peer_config(kind), n, {.stream = 3, .epoch = 9});
  auto stranger = backend->make_decoder(peer_config(kind), n, {.stream = 4, .epoch = 9});
  EXPECT_EQ(encoder->lossy(), kind != StreamKind::kStateless);
  EXPECT_EQ(decoder->cache_bytes(), kind == StreamKind::kSdp4bit ? n * 2 : 0);
  std::vector<std::byte> out(n * 2), mine(n * 2);
  Frame previous;
  for (int step = 0; step < 6; ++step) {
    if (step > 0 && step != 3) data.step();  // step 3 repeats step 2's input
    const Frame f = encode(*encoder, data.values());
    if (kind == StreamKind::kSdp4bit && step == 3) {
      EXPECT_EQ(f.bytes.size(), 56u) << "a repeat frame";
    }
    // Damage anywhere is caught by the checksum, and the decoder is left as it was.
    for (size_t at : {size_t{0}, size_t{30}, f.bytes.size() / 2, f.bytes.size() - 1}) {
      auto damaged = f.bytes;
      damaged[at] ^= std::byte{0x10};
      EXPECT_THROW(decoder->decode(damaged.data(), damaged.size(), out.data(), out.size()), FormatError) << at;
    }
    EXPECT_THROW(stranger->decode(f.bytes.data(), f.bytes.size(), out.data(), out.size()), FormatError);
    decoder->decode(f.bytes.data(), f.bytes.size(), out.data(), out.size());
    if (kind == StreamKind::kStateless) {
      EXPECT_EQ(out, data.values()) << step;
    } else {
      encoder->reconstruct(f.bytes.data(), f.bytes.size(), mine.data(), mine.size());
      EXPECT_EQ(out, mine) << step;
    }
    if (step > 0) {
      EXPECT_THROW(decoder->decode(previous.bytes.data(), previous.bytes.size(), out.data(), out.size()), FormatError)
          << "a replayed frame";
    }
    previous = f;
  }
  // A resynchronisation: the sender starts a new epoch, which the receiver accepts once asked to.
  encoder->request_key_frame();
  const Frame key = encode(*encoder, data.values());
  EXPECT_THROW(decoder->decode(key.bytes.data(), key.bytes.size(), out.data(), out.size()), FormatError);
  decoder->request_resync();
  decoder->decode(key.bytes.data(), key.bytes.size(), out.data(), out.size());
  if (kind != StreamKind::kZeroppInt8) {
    EXPECT_EQ(out, data.values()) << "sdp4bit re-sends the values";
  }
}

// A frame whose checksum was recomputed after the damage (a sender's bug, not the wire's): the
// header's field and position checks refuse it, and the receiver then takes the genuine frame.
void reseal(std::vector<std::byte>& frame) {
  auto* p = reinterpret_cast<uint8_t*>(frame.data());
  store_le64(p + 48, XXH3_64bits_withSeed(frame.data() + 56, frame.size() - 56, checksum64(p, 48)));
}

TEST_P(PeerStreams, ResealedHeaderFieldsAndPositionsAreRefusedAndChangeNothing) {
  const StreamKind kind = GetParam();
  const auto backend = host_codec_backend();
  const uint64_t n = 3000;
  testing::Trajectory data(DType::kBF16, n, testing::Pattern::kSparse, 5);
  auto encoder = backend->make_encoder(peer_config(kind), n, {.stream = 3, .epoch = 9});
  auto decoder = backend->make_decoder(peer_config(kind), n, {.stream = 3, .epoch = 9});
  std::vector<std::byte> out(n * 2);
  const Frame first = encode(*encoder, data.values());
  decoder->decode(first.bytes.data(), first.bytes.size(), out.data(), out.size());
  data.step();
  const Frame f = encode(*encoder, data.values());
  // magic, version, scheme, frame code, dtype, group size, stream, reserved, value count,
  // sequence (a gap), epoch (a later one, unrequested), body size.
  for (const int at : {0, 4, 5, 6, 7, 8, 12, 20, 24, 32, 16, 40}) {
    auto damaged = f.bytes;
    damaged[static_cast<size_t>(at)] ^= std::byte{0x01};
    reseal(damaged);
    EXPECT_THROW(decoder->decode(damaged.data(), damaged.size(), out.data(), out.size()),
                 FormatError)
        << at;
    EXPECT_EQ(decoder->epoch(), 9u) << at;
  }
  decoder->decode(f.bytes.data(), f.bytes.size(), out.data(), out.size());
  if (kind == StreamKind::kStateless) {
    EXPECT_EQ(out, data.values());
  }
}

// A stateless body is a CIERA key frame with its own value count: one that differs from the
// frame header's is the frame's fault (FormatError), not the caller's (std::invalid_argument).
TEST(PeerStreamsStateless, ABodyOfAnotherValueCountIsAFormatError) {
  const auto backend = host_codec_backend();
  const uint64_t n = 1000;
  testing::Trajectory data(DType::kBF16, n + 1, testing::Pattern::kSparse, 7);
  auto other =
      backend->make_encoder(peer_config(StreamKind::kStateless), n + 1, {.stream = 3, .epoch = 9});
  auto decoder =
      backend->make_decoder(peer_config(StreamKind::kStateless), n, {.stream = 3, .epoch = 9});
  Frame f = encode(*other, data.values());
  store_le64(reinterpret_cast<uint8_t*>(f.bytes.data()) + 24, n);
  reseal(f.bytes);
  std::vector<std::byte> out(n * 2);
  EXPECT_THROW(decoder->decode(f.bytes.data(), f.bytes.size(), out.data(), out.size()),
               FormatError);
  const std::vector<std::byte> values(data.values().begin(), data.values().begin() + 2 * n);
  auto encoder =
      backend->make_encoder(peer_config(StreamKind::kStateless), n, {.stream = 3, .epoch = 9});
  const Frame genuine = encode(*encoder, values);
  decoder->decode(genuine.bytes.data(), genuine.bytes.size(), out.data(), out.size());
  EXPECT_EQ(out, values);
}

// A zeropp-int8 body found malformed in its second group (a level of -128, resealed) is refused
// after the first group was written: the shard's contents are then unspecified, as
// ShardDecoder::decode's (the engine fails the gather), but the stream position is kept.
TEST(PeerStreamsZeroppInt8, ABodyRefusedPartWayKeepsThePosition) {
  const auto backend = host_codec_backend();
  const uint64_t n = peers::kZeroppGroupValues + 100;
  testing::Trajectory data(DType::kBF16, n, testing::Pattern::kSparse, 9);
  auto encoder =
      backend->make_encoder(peer_config(StreamKind::kZeroppInt8), n, {.stream = 3, .epoch = 9});
  auto decoder =
      backend->make_decoder(peer_config(StreamKind::kZeroppInt8), n, {.stream = 3, .epoch = 9});
  std::vector<std::byte> out(n * 2), mine(n * 2);
  const Frame f = encode(*encoder, data.values());
  ASSERT_EQ(f.bytes.size(), 56 + (4 + peers::kZeroppGroupValues) + (4 + 100))
      << "no group travels raw";
  auto damaged = f.bytes;
  damaged[56 + 4 + peers::kZeroppGroupValues + 4 + 50] = std::byte{0x80};
  reseal(damaged);
  EXPECT_THROW(decoder->decode(damaged.data(), damaged.size(), out.data(), out.size()),
               FormatError);
  decoder->decode(f.bytes.data(), f.bytes.size(), out.data(), out.size());
  encoder->reconstruct(f.bytes.data(), f.bytes.size(), mine.data(), mine.size());
  EXPECT_EQ(out, mine);
}

INSTANTIATE_TEST_SUITE_P(Kinds, PeerStreams,
                         ::testing::Values(StreamKind::kZeroppInt8, StreamKind::kSdp4bit, StreamKind::kStateless),
                         [](const auto& test) {
                           std::string name(stream_kind_name(test.param));
                           std::erase(name, '-');
                           return name;
                         });

// ---- The engine -------------------------------------------------------------------------------------

// Every rank gathers the same bits; stateless, ciera and raw parameters exactly the input, the
// lossy ones within their quantisation error (every rank's own slot included); the sdp4bit cache
// is the receivers' copies and the sender's.
TEST(EnginePeerSchemes, EveryRankGathersTheSameValuesLosslessOnesExactly) {
  const int world = 3;
  // The lossy parameters after others, so that their payloads move when the envelope is packed
  // (the sender reconstructs its own slot from the packed payload).
  const std::vector<ShardPolicy> policies = {ShardPolicy::kStateless, ShardPolicy::kSdp4bit, ShardPolicy::kCiera,
                                             ShardPolicy::kZeroppInt8, ShardPolicy::kRaw, ShardPolicy::kZeroppInt8};
  auto layout = BucketLayout::fsdp_split("mixed", DType::kBF16, {5000, 6145, 3000, 24001, 999, 301}, world);
  layout.policy = policies;
  EngineConfig config;
  config.warmup_steps = 2;
  constexpr int kSteps = 12;
  std::mutex mutex;
  std::map<int, std::vector<std::vector<std::byte>>> outputs;  // [step][rank]
  testing::expect_no_errors(testing::run_backend_ranks(world, [](int) { return host_codec_backend(); },
                                                       [&](int rank, Transport& t, auto backend) {
    testing::Trajectory data(DType::kBF16, layout.total_bytes() / 2, testing::Pattern::kSparse, 21);
    CompressedAllgather engine(t, config, {layout}, backend);
    std::vector<std::byte> out(layout.total_bytes());
    for (int step = 0; step < kSteps; ++step) {
      data.step();
      const auto mine = data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank));
      const GatherStats stats = engine.run(0, mine, out);
      EXPECT_LT(stats.wire_bytes, stats.raw_bytes) << step;
      {
        std::lock_guard lock(mutex);
        outputs[step].resize(world);
        outputs[step][rank] = out;
      }
      // Per parameter and rank: exact, or within the quantisation error.
      for (int r = 0; r < world; ++r) {
        uint64_t at = layout.rank_offset(r) / 2;
        for (size_t k = 0; k < policies.size(); ++k) {
          const uint64_t count = layout.shard_values[r][k];
          for (uint64_t i = at; i < at + count; ++i) {
            const double x = testing::to_double(DType::kBF16, data.values(), i);
            const double y = testing::to_double(DType::kBF16, out, i);
            if (!lossy_policy(policies[k])) {
              ASSERT_EQ(testing::get_value(DType::kBF16, out, i), testing::get_value(DType::kBF16, data.values(), i))
                  << shard_policy_name(policies[k]) << " rank " << r << " step " << step;
            } else if (std::isfinite(x)) {
              ASSERT_LE(std::fabs(x - y), std::max(0.05 * std::fabs(x), 0.02))
                  << shard_policy_name(policies[k]) << " rank " << r << " step " << step;
            }
          }
          at += count;
        }
      }
    }
    // sdp4bit's copies: this rank's shard (sender) and every peer's (receivers), two bytes a value.
    uint64_t expected = 0;
    for (int r = 0; r < world; ++r) expected += layout.shard_values[r][1] * 2;
    ASSERT_GT(engine.cache_bytes(), expected);
    const size_t ciera_cache = engine.cache_bytes() - expected;
    EXPECT_GT(ciera_cache, 0u);  // the exponent caches of the ciera parameter
    EXPECT_LT(ciera_cache, 3000u * 2);
  }));
  for (const auto& [step, ranks] : outputs) {
    for (int r = 1; r < world; ++r) EXPECT_EQ(ranks[r], ranks[0]) << "step " << step << " rank " << r;
  }
}

// A backend that codes only exponent reuse and value delta (as the CUDA one) refuses the peer
// schemes on every rank, naming the parameter.
TEST(EnginePeerSchemes, ABackendThatCannotCodeThemFailsEveryRank) {
  class BaseKindsOnly final : public CodecBackend {
   public:
    std::string_view name() const override { return "cuda:7"; }
    const MemoryOps& memory() const override { return host_memory_ops(); }
    bool host_memory() const override { return true; }
    std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& c, uint64_t n, StreamIdentity id) const override {
      return host_codec_backend()->make_encoder(c, n, id);
    }
    std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& c, uint64_t n, StreamIdentity id) const override {
      return host_codec_backend()->make_decoder(c, n, id);
    }
  };
  auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, 2);
  layout.policy[1] = ShardPolicy::kSdp4bit;
  const auto errors = testing::run_backend_ranks(
      2, [](int) -> std::shared_ptr<const CodecBackend> { return std::make_shared<BaseKindsOnly>(); },
      [&](int, Transport& t, auto backend) { CompressedAllgather engine(t, EngineConfig{}, {layout}, backend); });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("parameter 1: sdp4bit policy is not supported on the cuda:7 codec backend"), std::string::npos) << e;
  }
}

TEST(PeerPolicies, NamesRoundTripAndOnlyTheQuantisersAreLossy) {
  for (ShardPolicy p : {ShardPolicy::kRaw, ShardPolicy::kCiera, ShardPolicy::kDelta, ShardPolicy::kZeroppInt8,
                        ShardPolicy::kSdp4bit, ShardPolicy::kStateless}) {
    EXPECT_EQ(parse_shard_policy(shard_policy_name(p)), p);
    EXPECT_EQ(lossy_policy(p), p == ShardPolicy::kZeroppInt8 || p == ShardPolicy::kSdp4bit);
  }
  EXPECT_FALSE(is_shard_policy(static_cast<ShardPolicy>(6)));
  EXPECT_THROW(parse_shard_policy("zeropp"), ConfigError);
}

}  // namespace
}  // namespace ciera
