// Decoder safety (reliability tests 3, 4, 6, 8, 9, 11): every malformed payload is a FormatError
// and leaves the decoder exactly as it was.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "ciera/selection.hpp"
#include "codec/wire.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using testing::Pattern;
using testing::Trajectory;

struct DecoderSnapshot {
  bool has_cache;
  uint32_t epoch;
  uint64_t sequence;
  std::vector<uint8_t> cache;
  explicit DecoderSnapshot(const ShardDecoder& d)
      : has_cache(d.has_cache()), epoch(d.epoch()), sequence(d.last_sequence()),
        cache(d.cached_exponents().begin(), d.cached_exponents().end()) {}
  bool operator==(const DecoderSnapshot&) const = default;
};

constexpr StreamIdentity kStream{.stream = 4, .epoch = 3};

// A sender/receiver pair advanced past warmup, with the next frame encoded but not yet decoded;
// with `resync`, that frame is the key frame of a resynchronisation the (warm) receiver asked for.
struct Fixture {
  Fixture(CodecConfig c, size_t values, Pattern pattern, int steps, bool resync = false)
      : config(c),
        n(values),
        encoder(c, values, kStream),
        decoder(c, values, kStream),
        trajectory(c.dtype, values, pattern, 77),
        payload(encoder.max_payload_bytes()),
        out(values * dtype_info(c.dtype).value_bytes) {
    for (int i = 0; i < steps; ++i) {
      trajectory.step();
      const auto s = encoder.encode(trajectory.span(), payload);
      decoder.decode({payload.data(), s.payload_bytes}, out);
    }
    if (resync) {
      encoder.request_key_frame();
      decoder.request_resync();
    }
    trajectory.step();
    stats = encoder.encode(trajectory.span(), payload);
    payload.resize(stats.payload_bytes);
  }

  // Decoding `bad` must throw FormatError and leave the decoder untouched.
  void expect_rejected(const std::vector<std::byte>& bad, const std::string& what) {
    const DecoderSnapshot before(decoder);
    EXPECT_THROW(decoder.decode(bad, out), FormatError) << what;
    EXPECT_TRUE(DecoderSnapshot(decoder) == before) << "decoder state changed: " << what;
  }

  void expect_good_decode() {
    decoder.decode(payload, out);
    EXPECT_EQ(out, trajectory.values());
  }

  CodecConfig config;
  size_t n;
  ShardEncoder encoder;
  ShardDecoder decoder;
  Trajectory trajectory;
  std::vector<std::byte> payload;
  std::vector<std::byte> out;
  FrameStats stats;
};

CodecConfig config_for(ExponentCoding coding, DType dtype = DType::kBF16) {
  CodecConfig c;
  c.dtype = dtype;
  c.coding = coding;
  c.warmup_steps = 1;
  c.block_values = 64;
  return c;
}

// The frame corrupted: a delta frame, a key frame to a cold receiver, or the key frame of a
// resynchronisation to a warm one (whose cache a refused frame must leave as it was).
enum class Frame { kDelta, kColdKey, kResyncKey };

std::string frame_name(Frame frame) {
  return frame == Frame::kDelta ? "Delta" : frame == Frame::kColdKey ? "ColdKey" : "ResyncKey";
}

Fixture corruption_fixture(ExponentCoding coding, DType dtype, Frame frame) {
  return Fixture(config_for(coding, dtype), 2000, Pattern::kSparse,
                 frame == Frame::kColdKey ? 0 : 3, frame == Frame::kResyncKey);
}

std::string corruption_name(
    const ::testing::TestParamInfo<std::tuple<ExponentCoding, DType, Frame>>& info) {
  const ExponentCoding coding = std::get<0>(info.param);
  return std::string(coding == ExponentCoding::kFine ? "Fine" : "Block") +
         std::string(dtype_name(std::get<1>(info.param))) + frame_name(std::get<2>(info.param));
}

class Corruption : public ::testing::TestWithParam<std::tuple<ExponentCoding, DType, Frame>> {};

TEST_P(Corruption, EveryTruncationIsRejected) {
  const auto [coding, dtype, frame] = GetParam();
  Fixture f = corruption_fixture(coding, dtype, frame);
  ASSERT_EQ(f.stats.kind, frame == Frame::kDelta ? FrameKind::kDelta : FrameKind::kKey);
  ASSERT_EQ(f.decoder.has_cache(), frame != Frame::kColdKey);
  for (size_t len = 0; len < f.payload.size(); ++len) {
    f.expect_rejected({f.payload.begin(), f.payload.begin() + len}, "truncated to " + std::to_string(len));
  }
  auto longer = f.payload;
  longer.push_back(std::byte{0});
  f.expect_rejected(longer, "one trailing byte");
  f.expect_good_decode();
}

TEST_P(Corruption, EverySingleBitFlipIsRejected) {
  const auto [coding, dtype, frame] = GetParam();
  Fixture f = corruption_fixture(coding, dtype, frame);
  if (frame == Frame::kDelta) {
    EXPECT_EQ(f.stats.section, coding == ExponentCoding::kBlock ? ExponentSection::kBlock
                                                                 : ExponentSection::kFine);
  }
  const size_t sm_begin = wire::sign_mantissa_offset(f.stats.bitmap_bytes, f.stats.sign_mantissa_bytes);
  const size_t exp_begin = sm_begin + f.stats.sign_mantissa_bytes;
  for (size_t byte = 0; byte < f.payload.size(); ++byte) {
    // Every bit of header, bitmap and exponent section; every 7th byte of the large plane.
    if (byte >= sm_begin && byte < exp_begin && byte % 7 != 0) continue;
    for (int bit = 0; bit < 8; ++bit) {
      auto bad = f.payload;
      bad[byte] ^= std::byte(1u << bit);
      f.expect_rejected(bad, "bit " + std::to_string(bit) + " of byte " + std::to_string(byte));
    }
  }
  f.expect_good_decode();
}

INSTANTIATE_TEST_SUITE_P(
    Frames, Corruption,
    ::testing::Combine(::testing::Values(ExponentCoding::kFine, ExponentCoding::kBlock),
                       ::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                       ::testing::Values(Frame::kDelta, Frame::kColdKey, Frame::kResyncKey)),
    corruption_name);

// A moved-from encoder or decoder says so (std::logic_error naming the class) instead of
// dereferencing null.
TEST(DecoderSafety, MovedFromCodecsSaySo) {
  const CodecConfig c = config_for(ExponentCoding::kFine, DType::kBF16);
  ShardEncoder encoder(c, 1000);
  ShardDecoder decoder(c, 1000);
  ShardEncoder encoder2(std::move(encoder));
  ShardDecoder decoder2(std::move(decoder));
  EXPECT_EQ(encoder2.num_values(), 1000u);
  EXPECT_EQ(decoder2.num_values(), 1000u);
  const auto says_moved_from = [](const std::function<void()>& use, const std::string& name) {
    try {
      use();
      ADD_FAILURE() << "a moved-from " << name << " answered";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(name + ": used after it was moved from"),
                std::string::npos)
          << e.what();
    }
  };
  // NOLINTBEGIN(bugprone-use-after-move): the behaviour under test
  says_moved_from([&] { encoder.request_key_frame(); }, "ShardEncoder");
  says_moved_from([&] { (void)decoder.has_cache(); }, "ShardDecoder");
  // NOLINTEND(bugprone-use-after-move)
}

// Shards of at least format::kStreamingBytes are assembled in L1 and streamed out past the caches;
// a corrupted frame must still leave the cache as it was (the fine changes already applied to it
// are reverted), and the next good frame must decode exactly.
TEST(DecoderSafety, LargeStreamedShardsRevertAndRecover) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u}) {
      CodecConfig c = config_for(ExponentCoding::kFine, dtype);
      c.block_values = block;
      const size_t n = 2'500'001;  // >= 4 MiB in every dtype; a partial last block
      Fixture f(c, n, Pattern::kSparse, 3);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " B=" + std::to_string(block));
      ASSERT_EQ(f.stats.section, ExponentSection::kFine);
      const size_t sm_begin = wire::sign_mantissa_offset(f.stats.bitmap_bytes, f.stats.sign_mantissa_bytes);
      for (const size_t at : {sm_begin, sm_begin + f.stats.sign_mantissa_bytes / 2,
                              sm_begin + f.stats.sign_mantissa_bytes - 1}) {
        auto bad = f.payload;
        bad[at] ^= std::byte{0x01};
        f.expect_rejected(bad, "flipped sign-mantissa byte " + std::to_string(at));
      }
      f.expect_good_decode();
    }
  }
}

TEST(DecoderSafety, SkippedRepeatedAndForeignFramesAreRejected) {
  Fixture f(config_for(ExponentCoding::kAuto), 3000, Pattern::kSparse, 3);
  const auto frame4 = f.payload;
  // Skipped step: encode one more and try it before frame 4.
  f.trajectory.step();
  std::vector<std::byte> frame5(f.encoder.max_payload_bytes());
  frame5.resize(f.encoder.encode(f.trajectory.span(), frame5).payload_bytes);
  f.expect_rejected(frame5, "skipped frame");
  f.decoder.decode(frame4, f.out);
  f.expect_rejected(frame4, "repeated frame");
  f.decoder.decode(frame5, f.out);
  EXPECT_EQ(f.out, f.trajectory.values());

  // A delta from another incarnation of the stream (another epoch) with the right sequence number.
  ShardEncoder other(f.config, f.n, {.stream = kStream.stream, .epoch = 99});
  std::vector<std::byte> p;
  for (int i = 0; i < 6; ++i) {
    p.resize(other.max_payload_bytes());
    p.resize(other.encode(f.trajectory.span(), p).payload_bytes);
  }
  ASSERT_EQ(inspect_payload(p).kind, FrameKind::kDelta);
  ASSERT_EQ(inspect_payload(p).sequence, f.decoder.last_sequence() + 1);
  f.expect_rejected(p, "foreign epoch");
}

// Reliability test 13: a payload belongs to one stream (sender and shard, restart epoch); a
// misrouted, replayed or stale frame is an error, key frames included, unless the receiver asked
// for a resynchronisation.
struct StreamFrames {
  // Frames 0..count-1 of `identity`'s stream, the first `warmup` of them key frames.
  StreamFrames(StreamIdentity identity, int count, int warmup = 1) {
    CodecConfig c = config_for(ExponentCoding::kAuto);
    c.warmup_steps = static_cast<uint32_t>(warmup);
    ShardEncoder encoder(c, kValues, identity);
    Trajectory t(c.dtype, kValues, Pattern::kSparse, 21);
    for (int i = 0; i < count; ++i) {
      t.step();
      frames.push_back(encode(encoder, t));
      values.push_back(t.values());
    }
  }
  static std::vector<std::byte> encode(ShardEncoder& encoder, const Trajectory& t) {
    std::vector<std::byte> p(encoder.max_payload_bytes());
    p.resize(encoder.encode(t.span(), p).payload_bytes);
    return p;
  }
  static constexpr size_t kValues = 3000;
  std::vector<std::vector<std::byte>> frames;
  std::vector<std::vector<std::byte>> values;
};

// Decoding must throw FormatError and leave `decoder` exactly as it was.
void expect_refused(ShardDecoder& decoder, const std::vector<std::byte>& frame,
                    const std::string& what, const std::string& reason) {
  const DecoderSnapshot before(decoder);
  std::vector<std::byte> out(StreamFrames::kValues * 2);
  try {
    decoder.decode(frame, out);
    ADD_FAILURE() << what << ": decoded";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << what << ": " << e.what();
  }
  EXPECT_TRUE(DecoderSnapshot(decoder) == before) << "decoder state changed: " << what;
}

void expect_decoded(ShardDecoder& decoder, const StreamFrames& s, size_t frame) {
  std::vector<std::byte> out(StreamFrames::kValues * 2);
  decoder.decode(s.frames[frame], out);
  EXPECT_EQ(out, s.values[frame]);
}

ShardDecoder decoder_for(StreamIdentity identity) {
  return ShardDecoder(config_for(ExponentCoding::kAuto), StreamFrames::kValues, identity);
}

TEST(StreamIdentity, AnotherStreamsPayloadIsMisrouted) {
  const StreamFrames mine({.stream = 7, .epoch = 40}, 3);
  const StreamFrames other_peer({.stream = 8, .epoch = 40}, 3);
  ShardDecoder decoder = decoder_for({.stream = 7, .epoch = 40});
  expect_refused(decoder, other_peer.frames[0], "another stream's key frame", "misrouted");
  expect_decoded(decoder, mine, 0);
  expect_refused(decoder, other_peer.frames[1], "another stream's delta frame", "misrouted");
  expect_decoded(decoder, mine, 1);
}

TEST(StreamIdentity, ReplayedAndSkippedKeyFramesAreRefused) {
  const StreamFrames s({.stream = 1, .epoch = 9}, 5, /*warmup=*/3);  // frames 0-2 are key frames
  ShardDecoder decoder = decoder_for({.stream = 1, .epoch = 9});
  expect_decoded(decoder, s, 0);
  expect_refused(decoder, s.frames[2], "a key frame that skips one", "out-of-sequence");
  expect_decoded(decoder, s, 1);
  expect_decoded(decoder, s, 2);
  expect_decoded(decoder, s, 3);
  for (size_t old = 0; old < 3; ++old) {
    expect_refused(decoder, s.frames[old], "replayed key frame " + std::to_string(old),
                   "stale or out-of-sequence");
  }
  expect_decoded(decoder, s, 4);
}

TEST(StreamIdentity, AFreshDecoderTakesOnlyItsOwnEpoch) {
  // A receiver set up for epoch 12 of a stream: the key frame of an earlier incarnation (a
  // restarted job replaying old traffic) is stale, a later one was never asked for.
  const StreamFrames earlier({.stream = 2, .epoch = 11}, 1);
  const StreamFrames later({.stream = 2, .epoch = 13}, 1);
  ShardDecoder decoder = decoder_for({.stream = 2, .epoch = 12});
  expect_refused(decoder, earlier.frames[0], "an earlier epoch's key frame", "stale");
  expect_refused(decoder, later.frames[0], "an unrequested later epoch", "no resynchronisation");
  // Joining a stream late is allowed: the first key frame of the epoch may have any sequence.
  const StreamFrames warm({.stream = 2, .epoch = 12}, 4, /*warmup=*/4);
  expect_decoded(decoder, warm, 2);
  expect_decoded(decoder, warm, 3);
}

TEST(StreamIdentity, ResynchronisationIsAcceptedOnlyWhenRequested) {
  CodecConfig c = config_for(ExponentCoding::kAuto);
  c.warmup_steps = 1;
  const StreamIdentity id{.stream = 3, .epoch = 0xFFFFFFFEu};  // the epoch wraps on the way
  ShardEncoder encoder(c, StreamFrames::kValues, id);
  ShardDecoder decoder = decoder_for(id);
  Trajectory t(c.dtype, StreamFrames::kValues, Pattern::kSparse, 5);
  std::vector<std::byte> out(StreamFrames::kValues * 2);
  std::vector<std::vector<std::byte>> sent;
  const auto send = [&] {
    t.step();
    sent.push_back(StreamFrames::encode(encoder, t));
    return sent.back();
  };
  for (int i = 0; i < 3; ++i) {
    decoder.decode(send(), out);
    EXPECT_EQ(out, t.values());
  }
  // The sender resynchronises twice (epochs 0xFFFFFFFF, then 0): the receiver did not ask.
  encoder.request_key_frame();
  encoder.request_key_frame();
  const std::vector<std::byte> resync = send();
  ASSERT_EQ(inspect_payload(resync).epoch, 0u);
  expect_refused(decoder, resync, "an unrequested resynchronisation", "no resynchronisation");
  decoder.request_resync();
  decoder.decode(resync, out);
  EXPECT_EQ(out, t.values());
  EXPECT_EQ(decoder.epoch(), 0u);
  // The old epoch's frames, key or delta, are stale now, even with another resync requested.
  decoder.request_resync();
  expect_refused(decoder, sent[0], "the old epoch's key frame", "stale");
  expect_refused(decoder, sent[2], "the old epoch's delta frame", "stale");
  decoder.decode(send(), out);  // the new epoch's first delta
  EXPECT_EQ(out, t.values());
}

TEST(StreamIdentity, AnUnrelatedIncarnationIsNoResynchronisation) {
  // A restarted sender draws a random epoch; a receiver of the old incarnation that asked for a
  // resync still refuses it unless it is within kMaxResyncEpochs ahead.
  const StreamFrames old_sender({.stream = 6, .epoch = 100}, 2);
  const StreamFrames restarted({.stream = 6, .epoch = 100 + kMaxResyncEpochs + 1}, 1);
  ShardDecoder decoder = decoder_for({.stream = 6, .epoch = 100});
  expect_decoded(decoder, old_sender, 0);
  decoder.request_resync();
  expect_refused(decoder, restarted.frames[0], "another incarnation", "not a resynchronisation");
  EXPECT_NE(new_stream_epoch(), new_stream_epoch());  // 2^-32 chance of a false alarm
}

TEST(StreamIdentity, AResetDecoderWaitsForAKeyFrameOfItsStream) {
  const StreamFrames s({.stream = 0, .epoch = 5}, 4);
  const StreamFrames resynced({.stream = 0, .epoch = 6}, 1);
  ShardDecoder decoder = decoder_for({.stream = 0, .epoch = 5});
  expect_decoded(decoder, s, 0);
  expect_decoded(decoder, s, 1);
  decoder.reset();  // a cold receiver: the next frame must be a key frame
  expect_refused(decoder, s.frames[2], "a delta frame after reset", "no exponent cache");
  expect_refused(decoder, s.frames[0], "a replayed key frame after reset", "stale");
  expect_decoded(decoder, resynced, 0);  // reset() asked for the resynchronisation
  EXPECT_EQ(decoder.stream(), 0u);
  EXPECT_EQ(inspect_payload(resynced.frames[0]).stream, 0u);
}

TEST(DecoderSafety, PayloadsForAnotherConfigurationAreRejected) {
  const size_t n = 1000;
  Trajectory t(DType::kBF16, n, Pattern::kSparse, 1);
  CodecConfig base;
  std::vector<std::byte> payload(max_payload_bytes(DType::kBF16, n, 512));
  payload.resize(encode_stateless(base, t.span(), payload));
  std::vector<std::byte> out(4 * n);
  CodecConfig fp16 = base;
  fp16.dtype = DType::kFP16;
  EXPECT_THROW(ShardDecoder(fp16, n).decode(payload, {out.data(), 2 * n}), FormatError);
  CodecConfig block256 = base;
  block256.block_values = 256;
  EXPECT_THROW(ShardDecoder(block256, n).decode(payload, {out.data(), 2 * n}), FormatError);
  EXPECT_THROW(ShardDecoder(base, n + 1).decode(payload, {out.data(), 2 * n + 2}), FormatError);
  try {
    ShardDecoder(fp16, n).decode(payload, {out.data(), 2 * n});
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("dtype"), std::string::npos) << e.what();
  }
}

TEST(DecoderSafety, HugeClaimedSizesAreRejectedBeforeUse) {
  wire::Header h;
  h.dtype = DType::kBF16;
  h.block_values = 512;
  h.num_values = uint64_t{1} << 62;
  h.sign_mantissa_bytes = uint64_t{1} << 62;
  h.exponent_bytes = ~uint64_t{0};
  std::vector<std::byte> bytes(wire::kHeaderBytes);
  wire::write_header(h, reinterpret_cast<uint8_t*>(bytes.data()));
  EXPECT_THROW(inspect_payload(bytes), FormatError);
  std::vector<std::byte> out(2000);
  EXPECT_THROW(ShardDecoder(CodecConfig{}, 1000).decode(bytes, out), FormatError);
}

TEST(DecoderSafety, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(9);
  ShardDecoder decoder(CodecConfig{}, 100);
  std::vector<std::byte> out(200);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::byte> garbage(rng() % 400);
    for (auto& b : garbage) b = std::byte(rng());
    EXPECT_THROW(decoder.decode(garbage, out), FormatError);
  }
  EXPECT_FALSE(decoder.has_cache());
}

// Reliability test 9: a deliberately weakened change detector lets stale exponents through;
// the content checksum must catch it, and a key frame must then restore exactness.
TEST(DecoderSafety, HashCollisionsAreCaughtByTheChecksumAndRepairedByAKeyFrame) {
  CodecConfig c;
  c.detection = ChangeDetection::kHash;
  c.hash_bits = 1;  // every other changed block collides
  c.warmup_steps = 1;
  c.block_values = 64;
  const size_t n = 4096;
  ShardEncoder encoder(c, n);
  ShardDecoder decoder(c, n);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> out(2 * n);
  Trajectory t(DType::kBF16, n, Pattern::kSparse, 4);
  int caught = 0;
  for (int step = 0; step < 20; ++step) {
    t.step();
    const auto sent = encoder.encode(t.span(), payload);
    const DecoderSnapshot before(decoder);
    try {
      decoder.decode({payload.data(), sent.payload_bytes}, out);
      ASSERT_EQ(out, t.values()) << "a decode that succeeds must be exact";
    } catch (const FormatError& e) {
      ++caught;
      EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
      EXPECT_TRUE(DecoderSnapshot(decoder) == before);
      encoder.request_key_frame();  // the receiver asks for a resynchronisation
      decoder.request_resync();
      t.step();
      const auto key = encoder.encode(t.span(), payload);
      ASSERT_EQ(key.kind, FrameKind::kKey);
      decoder.decode({payload.data(), key.payload_bytes}, out);
      ASSERT_EQ(out, t.values());
    }
  }
  EXPECT_GT(caught, 0);
}

TEST(DecoderSafety, MisuseOfBufferSizesIsReported) {
  CodecConfig c;
  ShardEncoder encoder(c, 100);
  std::vector<std::byte> values(200), small(10), out(199);
  EXPECT_THROW(encoder.encode(values, small), std::invalid_argument);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  EXPECT_THROW(encoder.encode({values.data(), 198}, payload), std::invalid_argument);
  ShardDecoder decoder(c, 100);
  EXPECT_THROW(decoder.decode(payload, out), std::invalid_argument);
}

// The block grid divides by block_values: it used to be built before the configuration was
// checked, so block_values 0 was a division by zero (SIGFPE) instead of the ConfigError.
TEST(CodecMisuse, BlockValuesZeroIsAConfigErrorEverywhere) {
  CodecConfig config;
  config.block_values = 0;
  EXPECT_THROW(ShardEncoder(config, 100), ConfigError);
  EXPECT_THROW(ShardDecoder(config, 100), ConfigError);
  EXPECT_THROW(ShardEncoder::one_shot(config, 100, {}), ConfigError);
  EXPECT_THROW(ShardDecoder::one_shot(config, 100, {}), ConfigError);
  EXPECT_THROW(expected_payload_bytes(config, DType::kBF16, 100, 0.1, 0.01), ConfigError);
  config.detection = ChangeDetection::kHash;
  EXPECT_THROW(codec_cache_bytes(config, 100, true), ConfigError);
  CodecConfig delta;
  delta.stream_kind = StreamKind::kValueDelta;
  EXPECT_THROW(codec_cache_bytes(delta, (uint64_t{1} << 63) + 8, true), ConfigError);  // wrapped
}

// From a user audit of the codec API. A peer scheme's stream kind given to the shard codec ran
// exponent reuse under that name (and reported its cache); the size bounds wrapped for huge
// counts (a bound below the real size); an encode into a buffer overlapping the shard sent a
// frame the receiver rejected only at its checksum, the encoder moving on.
TEST(CodecMisuse, PeerKindsHugeCountsAndOverlapsAreRefused) {
  for (const StreamKind peer :
       {StreamKind::kZeroppInt8, StreamKind::kSdp4bit, StreamKind::kStateless}) {
    CodecConfig config;
    config.stream_kind = peer;
    EXPECT_THROW(ShardEncoder(config, 100), ConfigError);
    EXPECT_THROW(ShardDecoder(config, 100), ConfigError);
    if (peer == StreamKind::kStateless) {
      EXPECT_NO_THROW(
          ShardEncoder::one_shot(config, 100, {}));  // one key frame: the stateless body
    } else {
      EXPECT_THROW(ShardEncoder::one_shot(config, 100, {}), ConfigError);
    }
    EXPECT_EQ(codec_cache_bytes(config, 100, true), peer == StreamKind::kSdp4bit ? 200u : 0u);
    EXPECT_EQ(codec_cache_bytes(config, 100, false), peer == StreamKind::kSdp4bit ? 200u : 0u);
  }
  EXPECT_THROW(max_payload_bytes(DType::kBF16, ~uint64_t{0}, 512), ConfigError);
  EXPECT_THROW(max_payload_bytes(DType::kFP32, uint64_t{1} << 62, 512), ConfigError);
  EXPECT_NO_THROW(max_payload_bytes(DType::kFP32, kMaxShardValues, 512));
  EXPECT_THROW(peers::int8_bound_bytes(DType::kFP32, ~uint64_t{0}, 8000), ConfigError);
  EXPECT_THROW(peers::diff4_bound_bytes(DType::kFP32, ~uint64_t{0}, 2048), ConfigError);
  EXPECT_THROW(ShardEncoder(CodecConfig{}, uint64_t{1} << 63), ConfigError);
  EXPECT_THROW(ShardDecoder(CodecConfig{}, kMaxShardValues + 1), ConfigError);

  const uint64_t n = 1000;
  ShardEncoder encoder(CodecConfig{}, n);
  std::vector<std::byte> buffer(encoder.max_payload_bytes() + 2 * n);
  EXPECT_THROW(encoder.encode({buffer.data(), 2 * n}, {buffer.data(), encoder.max_payload_bytes()}),
               std::invalid_argument);
  EXPECT_THROW(
      encoder.encode({buffer.data() + 8, 2 * n}, {buffer.data(), encoder.max_payload_bytes()}),
      std::invalid_argument);
  EXPECT_EQ(encoder.next_sequence(), 0u);  // nothing was sent
  std::vector<std::byte> shard(2 * n), payload(encoder.max_payload_bytes()), out(2 * n);
  ShardDecoder decoder(CodecConfig{}, n);
  const FrameStats sent = encoder.encode(shard, payload);
  decoder.decode({payload.data(), sent.payload_bytes}, out);
  EXPECT_EQ(out, shard);

  // A decode whose output overlaps its payload (from a user audit: without a content checksum
  // it returned wrong values and moved the stream on, so a retry from a clean buffer was
  // "out of sequence") is refused, and nothing changes.
  for (const bool checksum : {false, true}) {
    CodecConfig config;
    config.content_checksum = checksum;
    ShardEncoder sender(config, n);
    ShardDecoder receiver(config, n);
    const std::vector<uint8_t> values = testing::random_bytes(2 * n, 7);
    std::memcpy(shard.data(), values.data(), shard.size());
    std::vector<std::byte> both(sender.max_payload_bytes() + 2 * n);
    const FrameStats frame = sender.encode(shard, {both.data(), sender.max_payload_bytes()});
    const std::span<const std::byte> in{both.data(), frame.payload_bytes};
    EXPECT_THROW(receiver.decode(in, {both.data() + 16, 2 * n}), std::invalid_argument);
    EXPECT_THROW(decode_stateless(config, in, {both.data(), 2 * n}), std::invalid_argument);
    EXPECT_EQ(receiver.last_sequence(), 0u);
    EXPECT_FALSE(receiver.has_cache());
    std::vector<std::byte> clean(2 * n);
    receiver.decode(in, clean);  // the same frame, from a clean buffer: the stream had not moved
    EXPECT_EQ(clean, shard);
  }

  // A header whose value count passes the limit is malformed, at inspection and at decoding.
  wire::Header h;
  h.dtype = DType::kBF16;
  h.block_values = 512;
  h.num_values = kMaxShardValues + 1;
  std::vector<std::byte> bytes(wire::kHeaderBytes);
  wire::write_header(h, reinterpret_cast<uint8_t*>(bytes.data()));
  try {
    inspect_payload(bytes);
    ADD_FAILURE() << "a header of 2^48 + 1 values was taken";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("more than a shard may hold"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(expected_delta_payload_bytes(100, std::numeric_limits<double>::quiet_NaN()),
               ConfigError);
  EXPECT_THROW(expected_delta_payload_bytes(100, std::numeric_limits<double>::infinity()),
               ConfigError);
  EXPECT_EQ(expected_delta_payload_bytes(100, -1.0), double(wire::kHeaderBytes));  // not measured
}

// Rates are fractions: a rate past 1 or NaN gave a frame larger than raw, or NaN bytes, silently.
TEST(CodecMisuse, ExpectedPayloadBytesRefusesRatesOutsideZeroToOne) {
  const CodecConfig config;
  for (const double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THROW(expected_payload_bytes(config, DType::kBF16, 100, bad, 0.0), ConfigError) << bad;
    EXPECT_THROW(expected_payload_bytes(config, DType::kBF16, 100, 0.0, bad), ConfigError) << bad;
  }
  try {
    expected_payload_bytes(config, DType::kBF16, 100, 2.0, 0.0);
    FAIL() << "a block change rate of 2 was taken";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "expected_payload_bytes: block_change_rate must be in [0, 1], got 2.000000");
  }
  EXPECT_GT(expected_payload_bytes(config, DType::kBF16, 100, 1.0, 1.0), 0.0);
}

}  // namespace
}  // namespace ciera
