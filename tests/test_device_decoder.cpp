// The GPU decoder's logic (codec/device_decode.hpp), run on the host by the emulation that calls
// the same step functions as the CUDA kernels, against the CPU decoder: on every frame of
// trajectories over dtype x block size x shard size x change pattern x coding mode, the same
// output bit for bit and the same exponent cache; on corrupted, truncated, misrouted and
// out-of-sequence payloads, the same verdict (both refuse, with the cache left as it was). The
// same for value-delta streams, whose cache is the previous values, with hand-built sections that
// break each rule of docs/format.md's "Value-delta frames" one at a time.
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/device_decode_emulation.hpp"
#include "codec/differences.hpp"
#include "codec/wire.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "cuda/value_delta_trajectory.hpp"
#include "format/content_checksum.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using codec::device::EmulatedDecoder;
using testing::DeltaStep;
using testing::DeltaTrajectory;
using testing::Pattern;
using testing::Trajectory;

std::span<const uint8_t> bytes_of(const std::vector<std::byte>& v, size_t n) {
  return {reinterpret_cast<const uint8_t*>(v.data()), n};
}

// Rewrites the header checksum so that a mutation of the header reaches the later checks.
void reseal(std::vector<std::byte>& payload) {
  if (payload.size() < 80) return;
  auto* p = reinterpret_cast<uint8_t*>(payload.data());
  store_le32(p + 72, static_cast<uint32_t>(checksum64(p, 72)));
}

struct Case {
  DType dtype;
  uint32_t block;
  size_t n;
  Pattern pattern;
  ExponentCoding coding;
  ChangeDetection detection;
};

std::string name_of(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " B " + std::to_string(c.block) + " n " +
         std::to_string(c.n) + " pattern " + std::to_string(static_cast<int>(c.pattern)) +
         " coding " + std::string(exponent_coding_name(c.coding)) + " " +
         std::string(change_detection_name(c.detection));
}

// Decodes a trajectory with both decoders; with `mutate`, tries corrupted copies of each payload
// first, which both must refuse alike (or accept alike, with equal output).
void run(const Case& c, bool mutate, uint64_t seed) {
  SCOPED_TRACE(name_of(c));
  CodecConfig config;
  config.dtype = c.dtype;
  config.block_values = c.block;
  config.coding = c.coding;
  config.detection = c.detection;
  config.warmup_steps = 2;
  const StreamIdentity id{7, 99};
  ShardEncoder encoder(config, c.n, id);
  ShardDecoder cpu(config, c.n, id);
  EmulatedDecoder emulated(config, c.n, id);
  Trajectory trajectory(c.dtype, c.n, c.pattern, seed);
  const size_t value_bytes = dtype_info(c.dtype).value_bytes;
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> cpu_out(c.n * value_bytes), dev_out(c.n * value_bytes);
  std::mt19937_64 rng(seed);
  bool in_sync = true;
  for (int step = 0; step < 8 && in_sync; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) trajectory.step();
    const FrameStats stats = encoder.encode(trajectory.span(), payload);
    const size_t size = stats.payload_bytes;
    if (mutate) {
      for (int trial = 0; trial < 12 && in_sync; ++trial) {
        std::vector<std::byte> bad(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(size));
        const int kind = static_cast<int>(rng() % 4);
        if (kind == 3 && !bad.empty()) {
          bad.resize(rng() % bad.size());  // truncated
        } else if (!bad.empty()) {
          for (int flips = 1 + static_cast<int>(rng() % 3); flips > 0; --flips) {
            bad[rng() % bad.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
          }
          if (kind != 0) reseal(bad);
        }
        const std::vector<uint8_t> cache_before(emulated.cache().begin(), emulated.cache().end());
        bool cpu_ok = true;
        try {
          cpu.decode(bad, cpu_out);
        } catch (const FormatError&) {
          cpu_ok = false;
        }
        const uint32_t status = emulated.decode(bytes_of(bad, bad.size()),
                                                {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
        ASSERT_EQ(status == codec::device::kOk, cpu_ok)
            << "trial " << trial << ": CPU " << (cpu_ok ? "accepted" : "refused") << ", device "
            << codec::device::describe_status(status, emulated.plan().detail[0], emulated.plan().detail[1]);
        if (cpu_ok) {
          ASSERT_EQ(dev_out, cpu_out);
          in_sync = false;  // both moved on past the encoder; stop this trajectory here
        } else {
          ASSERT_TRUE(std::equal(cache_before.begin(), cache_before.end(), emulated.cache().begin()))
              << "a refused frame changed the device cache";
        }
      }
      if (!in_sync) break;
    }
    cpu.decode(std::span(payload.data(), size), cpu_out);
    const uint32_t status = emulated.decode(bytes_of(payload, size),
                                            {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
    ASSERT_EQ(status, codec::device::kOk)
        << codec::device::describe_status(status, emulated.plan().detail[0], emulated.plan().detail[1])
        << " (" << exponent_section_name(stats.section) << " frame)";
    ASSERT_EQ(dev_out, trajectory.values());
    ASSERT_EQ(dev_out, cpu_out);
    ASSERT_TRUE(std::equal(cpu.cached_exponents().begin(), cpu.cached_exponents().end(),
                           emulated.cache().begin()));
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 4096u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{777}, size_t{40001}}) {
        for (const Pattern pattern : {Pattern::kSparse, Pattern::kRandom, Pattern::kSpecial}) {
          for (const ExponentCoding coding : {ExponentCoding::kAuto, ExponentCoding::kBlock, ExponentCoding::kFine}) {
            all.push_back({dtype, block, n, pattern, coding, ChangeDetection::kExact});
          }
          all.push_back({dtype, block, n, pattern, ExponentCoding::kBlock, ChangeDetection::kHash});
        }
      }
    }
  }
  return all;
}

TEST(DeviceDecoder, EmulatedStepsDecodeEveryFrameAsTheCpuDecoder) {
  uint64_t seed = 1;
  for (const Case& c : cases()) run(c, false, seed++);
}

TEST(DeviceDecoder, EmulatedStepsRefuseWhatTheCpuDecoderRefuses) {
  uint64_t seed = 1000;
  for (const Case& c : cases()) {
    if (c.n > 1000) continue;
    run(c, true, seed++);
  }
}

TEST(DeviceDecoder, LargeKeyFramesSpanSeveralRansSegments) {
  run({DType::kBF16, 512, 3 * 16384 + 123, Pattern::kSparse, ExponentCoding::kAuto, ChangeDetection::kExact},
      false, 5);
}

// The stream rules (docs/format.md, "Streams") on a fresh decoder and a stream's first three
// frames: nothing before the key frame, then frames only in order, a replay refused.
void expect_frames_in_order_only(EmulatedDecoder& d, const std::vector<std::vector<std::byte>>& frames,
                                 std::span<uint8_t> out) {
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kNoCache);
  EXPECT_EQ(d.decode(bytes_of(frames[0], frames[0].size()), out), codec::device::kOk);
  EXPECT_EQ(d.decode(bytes_of(frames[2], frames[2].size()), out), codec::device::kOutOfSequence);
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kOk);
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kOutOfSequence);  // replay
  EXPECT_EQ(d.decode(bytes_of(frames[2], frames[2].size()), out), codec::device::kOk);
}

// The stream rules (docs/format.md, "Streams") as the CPU decoder applies them.
TEST(DeviceDecoder, StreamPositionRulesMatchTheCpuDecoder) {
  CodecConfig config;
  config.warmup_steps = 1;
  const size_t n = 1000;
  ShardEncoder encoder(config, n, {3, 10});
  Trajectory trajectory(DType::kBF16, n, Pattern::kSparse, 4);
  std::vector<std::vector<std::byte>> frames;
  for (int step = 0; step < 4; ++step) {
    if (step > 0) trajectory.step();
    std::vector<std::byte> payload(encoder.max_payload_bytes());
    payload.resize(encoder.encode(trajectory.span(), payload).payload_bytes);
    frames.push_back(payload);
  }
  std::vector<uint8_t> out(2 * n);
  EmulatedDecoder other_stream(config, n, {4, 10});
  EXPECT_EQ(other_stream.decode(bytes_of(frames[0], frames[0].size()), out), codec::device::kMisrouted);
  EmulatedDecoder d(config, n, {3, 10});
  expect_frames_in_order_only(d, frames, out);
  // A resynchronisation: the next key frame starts a new epoch, accepted only once requested.
  encoder.request_key_frame();
  trajectory.step();
  std::vector<std::byte> key(encoder.max_payload_bytes());
  key.resize(encoder.encode(trajectory.span(), key).payload_bytes);
  EXPECT_EQ(d.decode(bytes_of(key, key.size()), out), codec::device::kUnrequestedEpoch);
  d.request_resync();
  EXPECT_EQ(d.decode(bytes_of(key, key.size()), out), codec::device::kOk);
  EXPECT_EQ(d.state().epoch, 11u);
}

// ---- value-delta streams (docs/format.md, "Value-delta frames") ---------------------------------

CodecConfig value_delta_config(DType dtype, bool checksum = true) {
  CodecConfig config;
  config.dtype = dtype;
  config.stream_kind = StreamKind::kValueDelta;
  config.content_checksum = checksum;
  return config;
}

std::string status_text(const EmulatedDecoder& d, uint32_t status) {
  return codec::device::describe_status(status, d.plan().detail[0], d.plan().detail[1]);
}

// Why the device refused corrupted value-delta frames (by status), over the runs.
std::map<uint32_t, int> g_delta_statuses;

// Decodes a value-delta trajectory with both decoders: every value back, the same output, the
// device's cache (the previous values) equal to the values. With `mutate`, corrupted copies of
// each payload first (bit flips, resealed or not, mostly in the section; truncations), which both
// must refuse alike (the device's cache unchanged) or accept alike with equal output.
void run_delta(DType dtype, size_t n, bool mutate, uint64_t seed, bool checksum = true) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " n " + std::to_string(n) + (checksum ? "" : " no checksum"));
  const CodecConfig config = value_delta_config(dtype, checksum);
  const StreamIdentity id{31, 7};
  ShardEncoder encoder(config, n, id);
  ShardDecoder cpu(config, n, id);
  EmulatedDecoder emulated(config, n, id);
  ASSERT_EQ(cpu.cache_bytes(), n * dtype_info(dtype).value_bytes);
  DeltaTrajectory trajectory(dtype, n, seed);
  const std::vector<DeltaStep> steps = testing::delta_schedule();
  const size_t bytes = n * dtype_info(dtype).value_bytes;
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> cpu_out(bytes), dev_out(bytes);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (size_t step = 0; step <= steps.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step) +
                 (step > 0 ? " (" + testing::delta_step_name(steps[step - 1]) + ")" : std::string()));
    if (step > 0) trajectory.step(steps[step - 1]);
    const FrameStats stats = encoder.encode(trajectory.span(), payload);
    const size_t size = stats.payload_bytes;
    if (mutate) {
      for (int trial = 0; trial < 12; ++trial) {
        std::vector<std::byte> bad(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(size));
        const int kind = static_cast<int>(rng() % 4);
        if (kind == 3) {
          bad.resize(rng() % bad.size());  // truncated
        } else {
          for (int flips = 1 + static_cast<int>(rng() % 3); flips > 0; --flips) {
            // Mostly past the header, where the section is.
            const size_t at = size > 80 && rng() % 5 != 0 ? 80 + rng() % (size - 80) : rng() % size;
            bad[at] ^= static_cast<std::byte>(1u << (rng() % 8));
          }
          if (kind != 0) reseal(bad);
        }
        const std::vector<uint8_t> values_before(emulated.values().begin(), emulated.values().end());
        bool cpu_ok = true;
        std::string cpu_why;
        try {
          cpu.decode(bad, cpu_out);
        } catch (const FormatError& e) {
          cpu_ok = false;
          cpu_why = e.what();
        }
        const uint32_t status = emulated.decode(bytes_of(bad, bad.size()),
                                                {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
        ASSERT_EQ(status == codec::device::kOk, cpu_ok)
            << "trial " << trial << ": CPU " << (cpu_ok ? "accepted" : "refused: " + cpu_why) << "; device "
            << status_text(emulated, status);
        if (cpu_ok) {
          // Accepted alike (a flip the checksum does not cover, with it off): the same output.
          // Both caches moved on past the encoder's: this trajectory ends here.
          ASSERT_EQ(dev_out, cpu_out);
          return;
        }
        ++refused;
        if (stats.kind == FrameKind::kValueDelta) ++g_delta_statuses[status];
        ASSERT_TRUE(std::equal(values_before.begin(), values_before.end(), emulated.values().begin()))
            << "a refused frame changed the device cache (" << status_text(emulated, status) << ")";
      }
    }
    cpu.decode(std::span(payload.data(), size), cpu_out);
    const uint32_t status = emulated.decode(bytes_of(payload, size),
                                            {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
    ASSERT_EQ(status, codec::device::kOk) << status_text(emulated, status) << " (" << frame_kind_name(stats.kind)
                                          << " frame, " << exponent_section_name(stats.section) << " section)";
    ASSERT_EQ(dev_out, trajectory.values());
    ASSERT_EQ(dev_out, cpu_out);
    ASSERT_TRUE(std::equal(emulated.values().begin(), emulated.values().end(), trajectory.bytes().begin()));
    ASSERT_TRUE(emulated.cache().empty());
  }
  if (mutate && n > 0) {
    EXPECT_GT(refused, 0);
  }
}

TEST(DeviceDecoder, ValueDeltaFramesDecodeAsOnTheCpu) {
  uint64_t seed = 2000;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{1000},
                           size_t{3000}, size_t{100003}}) {
      run_delta(dtype, n, false, seed++);
    }
    run_delta(dtype, 1000, false, seed++, /*checksum=*/false);
  }
}

TEST(DeviceDecoder, ValueDeltaFramesAreRefusedAsOnTheCpu) {
  uint64_t seed = 3000;
  for (int round = 0; round < 3; ++round) {
    for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      for (const size_t n : {size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{1000}, size_t{3000}}) {
        run_delta(dtype, n, true, seed++);
      }
      run_delta(dtype, 1000, true, seed++, /*checksum=*/false);
    }
  }
  // Corruption reached the difference section's own checks, not only the header's.
  using namespace codec::device;
  for (const uint32_t status : {kStreamMalformed, kDifferenceExtraBits, kContentChecksum}) {
    EXPECT_GT(g_delta_statuses[status], 0) << describe_status(status, 0, 0);
  }
  std::string seen;
  for (const auto& [status, count] : g_delta_statuses) {
    seen.append(" ").append(std::to_string(status)).append(":").append(std::to_string(count));
  }
  std::printf("corrupted value-delta frames refused, by device status:%s\n", seen.c_str());
}

// A difference section built by hand (docs/format.md, "Value-delta frames"), packed (or constant)
// streams, with the defects of the canonical-form rules on request.
struct SectionParts {
  std::vector<uint8_t> groups, escapes;
  std::vector<bool> extra;
  int64_t length_delta = 0;       // added to L
  std::vector<uint8_t> extra_tail;  // bytes after the extra bits (counted by length_delta or not)
  uint8_t padding_or = 0;         // OR-ed into the last extra byte
  std::vector<uint8_t> trailing;  // bytes after everything
};

unsigned width_of(uint64_t v) {
  unsigned w = 0;
  while (w < 64 && (v >> w) != 0) ++w;
  return w;
}

SectionParts parts_of(const std::vector<uint32_t>& z) {
  SectionParts p;
  p.groups.assign((z.size() + 2) / 3, 0);
  for (size_t i = 0; i < z.size(); ++i) {
    p.groups[i / 3] = static_cast<uint8_t>(p.groups[i / 3] | (std::min<uint32_t>(z[i], 3) << (2 * (i % 3))));
    if (z[i] < 3) continue;
    const uint32_t v = z[i] - 3;
    const unsigned bucket = width_of(v);
    p.escapes.push_back(static_cast<uint8_t>(bucket));
    for (unsigned k = 0; k + 1 < bucket; ++k) p.extra.push_back(((v - (uint64_t{1} << (bucket - 1))) >> k) & 1);
  }
  return p;
}

// A stream in its canonical form: constant for one distinct symbol, else packed.
void put_packed(std::vector<uint8_t>& out, const std::vector<uint8_t>& symbols) {
  if (!symbols.empty() &&
      std::all_of(symbols.begin(), symbols.end(), [&](uint8_t s) { return s == symbols[0]; })) {
    out.push_back(1);
    out.push_back(symbols[0]);
    out.insert(out.end(), 8, 0);
    return;
  }
  unsigned w = 1;
  for (uint8_t s : symbols) w = std::max(w, width_of(s));
  const uint64_t body = (symbols.size() * w + 7) / 8;
  out.push_back(0);
  out.push_back(static_cast<uint8_t>(w));
  for (unsigned k = 0; k < 8; ++k) out.push_back(static_cast<uint8_t>(body >> (8 * k)));
  const size_t at = out.size();
  out.resize(at + body, 0);
  for (size_t i = 0; i < symbols.size(); ++i) {
    for (unsigned k = 0; k < w; ++k) {
      if ((symbols[i] >> k) & 1) out[at + (i * w + k) / 8] |= static_cast<uint8_t>(1u << ((i * w + k) % 8));
    }
  }
}

std::vector<uint8_t> lay_out(const SectionParts& p) {
  std::vector<uint8_t> out;
  put_packed(out, p.groups);
  put_packed(out, p.escapes);
  const uint64_t length = (p.extra.size() + 7) / 8;
  const uint64_t claimed = length + static_cast<uint64_t>(p.length_delta);
  for (unsigned k = 0; k < 8; ++k) out.push_back(static_cast<uint8_t>(claimed >> (8 * k)));
  const size_t at = out.size();
  out.resize(at + length, 0);
  for (size_t k = 0; k < p.extra.size(); ++k) {
    if (p.extra[k]) out[at + k / 8] |= static_cast<uint8_t>(1u << (k % 8));
  }
  if (length > 0) out.back() |= p.padding_or;
  out.insert(out.end(), p.extra_tail.begin(), p.extra_tail.end());
  out.insert(out.end(), p.trailing.begin(), p.trailing.end());
  return out;
}

// One value-delta stream after its key frame, with frames built by hand: both decoders must
// reach the same verdict on each, the device with the status named.
struct Crafted {
  Crafted(DType d, size_t values)
      : dtype(d), n(values), w(8 * dtype_info(d).value_bytes), config(value_delta_config(d)),
        cpu(config, n, kId), emulated(config, n, kId), out(n * dtype_info(d).value_bytes) {
    ShardEncoder encoder(config, n, kId);
    DeltaTrajectory trajectory(d, n, 77 + n);
    base = trajectory.values();
    std::vector<std::byte> key(encoder.max_payload_bytes());
    key.resize(encoder.encode(base, key).payload_bytes);
    cpu.decode(key, out);
    EXPECT_EQ(emulated.decode(bytes_of(key, key.size()), as_bytes(out)), codec::device::kOk);
  }

  static std::span<uint8_t> as_bytes(std::vector<std::byte>& v) {
    return {reinterpret_cast<uint8_t*>(v.data()), v.size()};
  }

  // The values `z` makes of the base.
  std::vector<std::byte> values_of(const std::vector<uint32_t>& z) const {
    std::vector<std::byte> v = base;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t x = testing::get_value(dtype, base, i);
      uint32_t y;
      if (w == 16) {
        const uint16_t o = codec::to_ordered<uint16_t>(static_cast<uint16_t>(x));
        y = codec::from_ordered<uint16_t>(
            static_cast<uint16_t>(o + codec::unzigzag<uint16_t>(static_cast<uint16_t>(z[i]))));
      } else {
        y = codec::from_ordered<uint32_t>(codec::to_ordered<uint32_t>(x) + codec::unzigzag<uint32_t>(z[i]));
      }
      testing::put_value(dtype, v, i, y);
    }
    return v;
  }

  std::vector<std::byte> frame(const std::vector<uint8_t>& section, const std::vector<std::byte>& values,
                               ExponentSection kind = ExponentSection::kDifferences,
                               FrameKind frame_kind = FrameKind::kValueDelta) const {
    wire::Header h;
    h.dtype = dtype;
    h.kind = frame_kind;
    h.section = kind;
    h.flags = wire::kFlagContentChecksum;
    h.block_values = config.block_values;
    h.num_values = n;
    h.stream = kId.stream;
    h.epoch = kId.epoch;
    h.sequence = 1;
    h.exponent_bytes = section.size();
    if (frame_kind == FrameKind::kDelta) h.bitmap_bytes = wire::bitmap_bytes_for(n, config.block_values);
    format::ContentChecksum sum;
    sum.update(values.data(), values.size());
    h.content_checksum = sum.digest();
    std::vector<std::byte> payload(80 + h.bitmap_bytes + section.size());
    wire::write_header(h, reinterpret_cast<uint8_t*>(payload.data()));
    if (!section.empty()) std::memcpy(payload.data() + 80 + h.bitmap_bytes, section.data(), section.size());
    return payload;
  }

  // Both refuse `payload`; the device says `expected`; neither cache moved.
  void expect_refused(const std::vector<std::byte>& payload, uint32_t expected, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_THROW(cpu.decode(payload, out), FormatError);
    const std::vector<uint8_t> before(emulated.values().begin(), emulated.values().end());
    const uint32_t status = emulated.decode(bytes_of(payload, payload.size()), as_bytes(out));
    EXPECT_EQ(status, expected) << status_text(emulated, status);
    EXPECT_TRUE(std::equal(before.begin(), before.end(), emulated.values().begin()));
  }
  // Both accept it, with `values` out (and then hold them).
  void expect_accepted(const std::vector<std::byte>& payload, const std::vector<std::byte>& values) {
    cpu.decode(payload, out);
    EXPECT_EQ(out, values);
    const uint32_t status = emulated.decode(bytes_of(payload, payload.size()), as_bytes(out));
    ASSERT_EQ(status, codec::device::kOk) << status_text(emulated, status);
    EXPECT_EQ(out, values);
    EXPECT_TRUE(std::equal(emulated.values().begin(), emulated.values().end(),
                           reinterpret_cast<const uint8_t*>(values.data())));
  }

  static constexpr StreamIdentity kId{17, 5};
  DType dtype;
  size_t n;
  unsigned w;
  CodecConfig config;
  ShardDecoder cpu;
  EmulatedDecoder emulated;
  std::vector<std::byte> base, out;
};

TEST(DeviceDecoder, ValueDeltaCanonicalFormAndBoundsAsOnTheCpu) {
  using namespace codec::device;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{4}, size_t{5}, size_t{1000}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n " + std::to_string(n));
      Crafted c(dtype, n);
      const uint32_t max_z = c.w == 32 ? 0xFFFFFFFFu : (1u << c.w) - 1;
      std::vector<uint32_t> z(n, 0);
      z[0] = 1;
      z[n - 1] = 200;
      z[n / 2] = max_z;
      const auto values = c.values_of(z);
      const auto good = c.frame(lay_out(parts_of(z)), values);

      c.expect_refused(c.frame(lay_out(parts_of(std::vector<uint32_t>(n, 0))), c.base), kDifferenceNoChange,
                       "no value changed");
      c.expect_refused(c.frame({0}, c.base, ExponentSection::kUnchanged), kTrailingBytes, "non-empty unchanged");
      c.expect_refused(c.frame({}, c.base), kStreamMalformed, "empty differences");
      if (n % 3 != 0) {
        SectionParts p = parts_of(z);
        p.groups.back() |= static_cast<uint8_t>(1u << (2 * 2));
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceClassPastEnd, "class past N");
      }
      {
        std::vector<uint32_t> zz = z;
        zz[1] = 3;
        SectionParts p = parts_of(zz);
        const size_t index = zz[0] >= 3 ? 1 : 0;
        p.escapes[index] = static_cast<uint8_t>(c.w);
        p.extra.insert(p.extra.begin(), c.w - 1, true);
        c.expect_refused(c.frame(lay_out(p), c.values_of(zz)), kDifferenceEscapeTooLarge, "escape beyond the width");
        p = parts_of(zz);
        p.escapes[index] = static_cast<uint8_t>(c.w + 1);
        p.extra.insert(p.extra.begin(), c.w, false);
        c.expect_refused(c.frame(lay_out(p), c.values_of(zz)), kSymbolTooLarge, "bucket above the width");
      }
      {
        SectionParts p = parts_of(z);
        p.length_delta = 1;
        p.extra_tail = {0};
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceExtraBits, "L one too many");
        p = parts_of(z);
        p.length_delta = -1;
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceExtraBits, "L one too few");
        p = parts_of(z);
        p.length_delta = int64_t{1} << 62;
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceExtraBits, "huge L");
        p = parts_of(z);
        ASSERT_NE(p.extra.size() % 8, 0u);
        p.padding_or = 0x80;
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceExtraBits, "non-zero padding");
        p = parts_of(z);
        p.trailing = {0};
        c.expect_refused(c.frame(lay_out(p), values), kDifferenceExtraBits, "trailing byte");
        p = parts_of(z);
        p.escapes.push_back(1);
        c.expect_refused(c.frame(lay_out(p), values), kStreamMalformed, "an escape too many");
        p = parts_of(z);
        p.groups.push_back(1);
        c.expect_refused(c.frame(lay_out(p), values), kStreamMalformed, "a group too many");
      }
      {
        std::vector<uint32_t> zz = z;
        zz[0] = 2;
        c.expect_refused(c.frame(lay_out(parts_of(zz)), values), kContentChecksum, "checksum of other values");
      }
      // Frames of the other stream kind, and frame kinds paired with the wrong section.
      c.expect_refused(c.frame({}, c.base, ExponentSection::kUnchanged, FrameKind::kDelta), kWrongStreamKind,
                       "an exponent-delta frame");
      c.expect_refused(c.frame({}, c.base, ExponentSection::kBlock), kKindSectionMismatch, "value-delta with block");
      c.expect_refused(c.frame(lay_out(parts_of(z)), values, ExponentSection::kDifferences, FrameKind::kDelta),
                       kKindSectionMismatch, "exponent-delta with differences");
      // The stream is where it was: the genuine frame decodes, then an 'unchanged' one.
      c.expect_accepted(good, values);
      std::vector<std::byte> unchanged = c.frame({}, values, ExponentSection::kUnchanged);
      auto* h = reinterpret_cast<uint8_t*>(unchanged.data());
      store_le64(h + 32, 2);  // the next sequence
      reseal(unchanged);
      c.expect_accepted(unchanged, values);
    }
  }
}

// A value-delta frame to an exponent-reuse decoder, and any frame before a key frame: refused.
TEST(DeviceDecoder, ValueDeltaStreamRulesMatchTheCpuDecoder) {
  for (const DType dtype : {DType::kBF16, DType::kFP32}) {
    const size_t n = 500;
    const CodecConfig delta = value_delta_config(dtype);
    CodecConfig reuse = delta;
    reuse.stream_kind = StreamKind::kExponentReuse;
    ShardEncoder encoder(delta, n, {3, 10});
    DeltaTrajectory trajectory(dtype, n, 9);
    std::vector<std::vector<std::byte>> frames;
    for (int step = 0; step < 3; ++step) {
      if (step > 0) trajectory.step(DeltaStep::kSmall);
      std::vector<std::byte> payload(encoder.max_payload_bytes());
      payload.resize(encoder.encode(trajectory.span(), payload).payload_bytes);
      frames.push_back(payload);
    }
    std::vector<uint8_t> out(n * dtype_info(dtype).value_bytes);
    EmulatedDecoder exponents(reuse, n, {3, 10});
    EXPECT_EQ(exponents.decode(bytes_of(frames[0], frames[0].size()), out), codec::device::kOk);
    EXPECT_EQ(exponents.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kWrongStreamKind);
    EmulatedDecoder d(delta, n, {3, 10});
    expect_frames_in_order_only(d, frames, out);
    EXPECT_TRUE(std::equal(d.values().begin(), d.values().end(), trajectory.bytes().begin()));
    d.reset();
    EXPECT_EQ(d.decode(bytes_of(frames[2], frames[2].size()), out), codec::device::kNoCache);
  }
}

// ---- non-canonical encodings of a content (docs/format.md, "Canonical form") --------------------

// `payload` with its exponent section replaced by `section` (and, given, its bitmap by `bitmap`),
// the header's lengths and checksum rewritten: the content and its checksum stay the same.
std::vector<std::byte> with_section(const std::vector<std::byte>& payload,
                                    const std::vector<uint8_t>& section,
                                    const std::vector<uint8_t>& bitmap = {}) {
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  wire::Header h = wire::read_header(p, payload.size());
  std::vector<std::byte> out(payload.begin(),
                             payload.end() - static_cast<std::ptrdiff_t>(h.exponent_bytes));
  if (!bitmap.empty()) {
    EXPECT_EQ(bitmap.size(), h.bitmap_bytes);
    std::memcpy(out.data() + wire::kHeaderBytes, bitmap.data(), bitmap.size());
  }
  for (uint8_t byte : section) out.push_back(static_cast<std::byte>(byte));
  h.exponent_bytes = section.size();
  wire::write_header(h, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

std::vector<uint8_t> section_of(const std::vector<std::byte>& payload) {
  const wire::Header h =
      wire::read_header(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
  std::vector<uint8_t> section(h.exponent_bytes);
  std::memcpy(section.data(), payload.data() + (payload.size() - h.exponent_bytes), section.size());
  return section;
}

// A symbol stream's 10-byte framing with `body` after it.
std::vector<uint8_t> stream_of(uint8_t method, uint8_t arg, const std::vector<uint8_t>& body) {
  std::vector<uint8_t> out = {method, arg};
  for (unsigned k = 0; k < 8; ++k)
    out.push_back(static_cast<uint8_t>(uint64_t{body.size()} >> (8 * k)));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<uint8_t> packed_body(const std::vector<uint8_t>& symbols, unsigned w) {
  std::vector<uint8_t> body((symbols.size() * w + 7) / 8, 0);
  for (size_t i = 0; i < symbols.size(); ++i) {
    for (unsigned k = 0; k < w; ++k) {
      if ((symbols[i] >> k) & 1)
        body[(i * w + k) / 8] |= static_cast<uint8_t>(1u << ((i * w + k) % 8));
    }
  }
  return body;
}

// Both decoders refuse the encodings of a content that are not its canonical one, where the
// stream alone shows it: a packed stream of one distinct symbol, a rANS table of one symbol or
// with a frequency 0 at an end, a varint longer than it needs to be, a bitmap that marks a block
// whose exponents did not change. Each is otherwise a valid payload of the same content (the
// content checksum matches), and each canonical original is accepted.
TEST(DeviceDecoder, NonCanonicalEncodingsOfAContentAreRefusedAsOnTheCpu) {
  using namespace codec::device;
  const size_t n = 5000;
  CodecConfig config;
  config.dtype = DType::kBF16;
  config.block_values = 512;
  config.coding = ExponentCoding::kBlock;
  config.warmup_steps = 0;
  const StreamIdentity id{4, 2};
  std::vector<std::byte> out(2 * n);
  const std::span<uint8_t> dev{reinterpret_cast<uint8_t*>(out.data()), out.size()};
  // Both refuse `payload`: the CPU decoder saying `cpu_says`, the device with `expected`.
  auto refused = [&](const std::vector<std::byte>& payload, uint32_t expected,
                     const std::string& what, const std::string& cpu_says) {
    SCOPED_TRACE(what);
    ShardDecoder cpu(config, n, id);
    EmulatedDecoder emulated(config, n, id);
    try {
      cpu.decode(payload, out);
      ADD_FAILURE() << "the CPU decoder accepted it";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(cpu_says), std::string::npos) << e.what();
    }
    const uint32_t status = emulated.decode(bytes_of(payload, payload.size()), dev);
    EXPECT_EQ(status, expected) << describe_status(status, emulated.plan().detail[0],
                                                   emulated.plan().detail[1]);
  };
  auto key_frame = [&](const std::vector<std::byte>& values) {
    ShardEncoder encoder(config, n, id);
    std::vector<std::byte> payload(encoder.max_payload_bytes());
    payload.resize(encoder.encode(values, payload).payload_bytes);
    ShardDecoder cpu(config, n, id);
    EmulatedDecoder emulated(config, n, id);
    cpu.decode(payload, out);
    EXPECT_EQ(emulated.decode(bytes_of(payload, payload.size()), dev), kOk);
    return payload;
  };

  // Weights' exponents (normal, sigma 0.02): the full stream is rANS.
  std::vector<std::byte> weights(2 * n);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i < n; ++i)
    testing::put_value(DType::kBF16, weights, i, std::bit_cast<uint32_t>(normal(rng)) >> 16);
  const auto rans_frame = key_frame(weights);
  const std::vector<uint8_t> rans = section_of(rans_frame);
  ASSERT_EQ(rans[0], 2) << "expected a rANS exponent stream";
  const uint8_t first = rans[10], last = rans[11];
  ASSERT_LT(last, 255);
  size_t table_end = 12;
  size_t one_byte = 0;  // the first frequency written in one byte
  for (unsigned s = first; s <= last; ++s) {
    if (one_byte == 0 && rans[table_end] < 0x80 && rans[table_end] != 0) one_byte = table_end;
    while (rans[table_end] & 0x80) ++table_end;
    ++table_end;
  }
  ASSERT_NE(one_byte, 0u);
  auto rebuilt = [&](auto&& edit) {  // the rANS stream with its body edited, framing rewritten
    std::vector<uint8_t> body(rans.begin() + 10, rans.end());
    edit(body);
    return stream_of(2, 0, body);
  };
  refused(with_section(rans_frame, rebuilt([&](std::vector<uint8_t>& body) {
                         body[1] = static_cast<uint8_t>(last + 1);
                         body.insert(body.begin() + static_cast<std::ptrdiff_t>(table_end - 10), 0);
                       })),
          kStreamMalformed, "rANS table with frequency 0 at its last symbol",
          "a symbol at its ends has frequency 0");
  if (first > 0) {
    refused(with_section(rans_frame, rebuilt([&](std::vector<uint8_t>& body) {
                           body[0] = static_cast<uint8_t>(first - 1);
                           body.insert(body.begin() + 2, 0);
                         })),
            kStreamMalformed, "rANS table with frequency 0 at its first symbol",
            "a symbol at its ends has frequency 0");
  }
  refused(with_section(rans_frame, rebuilt([&](std::vector<uint8_t>& body) {
                         body[one_byte - 10] |= 0x80;
                         body.insert(body.begin() + static_cast<std::ptrdiff_t>(one_byte - 10 + 1),
                                     0);
                       })),
          kStreamMalformed, "a frequency in two bytes where one holds it",
          "varint is not in its shortest form");

  // One exponent throughout (1.0 .. 2.0): the canonical stream is constant.
  std::vector<std::byte> ones(2 * n);
  for (size_t i = 0; i < n; ++i) testing::put_value(DType::kBF16, ones, i, 0x3F80u | (i % 128));
  const auto constant_frame = key_frame(ones);
  ASSERT_EQ(section_of(constant_frame), stream_of(1, 127, {}));
  refused(
      with_section(constant_frame, stream_of(0, 7, packed_body(std::vector<uint8_t>(n, 127), 7))),
      kStreamMalformed, "packed stream of one distinct symbol",
      "packed stream of one distinct symbol");
  std::vector<uint8_t> one_symbol = {127, 127, 0x80, 0x20};  // 4096 as a varint
  for (unsigned k = 0; k < 16; ++k)
    one_symbol.insert(one_symbol.end(), {0x00, 0x80, 0x00, 0x00});  // 2^15
  refused(with_section(constant_frame, stream_of(2, 0, one_symbol)), kStreamMalformed,
          "rANS table of one symbol", "one symbol: a constant stream");

  // A block frame whose bitmap also marks block 1, unchanged, with its cached exponents sent.
  std::vector<std::byte> next = ones;
  testing::put_value(DType::kBF16, next, 3, 0x4000u);  // 2.0: block 0's exponents change
  ShardEncoder encoder(config, n, id);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  payload.resize(encoder.encode(ones, payload).payload_bytes);
  std::vector<std::byte> block_frame(encoder.max_payload_bytes());
  const FrameStats stats = encoder.encode(next, block_frame);
  block_frame.resize(stats.payload_bytes);
  ASSERT_EQ(stats.section, ExponentSection::kBlock);
  std::vector<uint8_t> exponents(1024, 127);
  exponents[3] = 128;
  const auto marked = with_section(block_frame, stream_of(0, 8, packed_body(exponents, 8)),
                                   std::vector<uint8_t>{0x03, 0x00});
  ShardDecoder cpu(config, n, id);
  EmulatedDecoder emulated(config, n, id);
  cpu.decode(payload, out);
  ASSERT_EQ(emulated.decode(bytes_of(payload, payload.size()), dev), kOk);
  try {
    cpu.decode(marked, out);
    ADD_FAILURE() << "the CPU decoder accepted a marked block whose exponents did not change";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("block 1 as changed"), std::string::npos) << e.what();
  }
  const uint32_t status = emulated.decode(bytes_of(marked, marked.size()), dev);
  EXPECT_EQ(status, kBlockUnchanged)
      << describe_status(status, emulated.plan().detail[0], emulated.plan().detail[1]);
  EXPECT_EQ(emulated.plan().detail[0], 1u);
  // The canonical frame still decodes on both, to `next`.
  cpu.decode(block_frame, out);
  EXPECT_EQ(out, next);
  ASSERT_EQ(emulated.decode(bytes_of(block_frame, block_frame.size()), dev), kOk);
  EXPECT_EQ(out, next);
}

}  // namespace
}  // namespace ciera
