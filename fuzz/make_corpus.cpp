// Writes the seed corpus of every fuzz target, fuzz/corpus/<target>/, from the library itself:
// a change of the wire format or of the engine protocol is one command away from a matching
// corpus (scripts/fuzz-corpus.sh, or `cmake --build build/fuzz --target fuzz_corpus`).
//
//   make_corpus <corpus dir>
//
// Replaces each target's folder. Deterministic: the same library writes the same bytes.
//
//   fuzz_payload    payload streams (payload_stream.hpp): key frames, warmup and resynchronising
//                   key frames, delta frames with unchanged, block and fine exponent sections
//                   (escapes included), for BF16, FP16 and FP32, block sizes 64..4096, 0, 1 and
//                   block-straddling value counts, with and without content checksum, exact
//                   and hash change detection, NaN/Inf/subnormal/-0 values, a padded
//                   sign-mantissa plane, a damaged frame and the sender's resynchronising key
//                   frame, and stateless payloads;
//   fuzz_envelope   rounds of rank 1's control record and envelope (envelope_receiver.hpp): raw
//                   and compressed envelopes of three buckets, a cold restart, a peer ahead, a
//                   damaged payload and its key-frame retry;
//   fuzz_control    one round's control and verdict exchange results (fuzz_control.cpp);
//   fuzz_decode     one seed per configuration and frame its first two bytes select;
//   fuzz_roundtrip  a configuration and realistic shards of every dtype (one of 33000 values:
//                   three rANS segments);
//   fuzz_delta      scripts of value-delta stream steps (fuzz_delta.cpp): every dtype, with and
//                   without content checksum, 5, 40, 1013 and 6152 values (the last crosses a
//                   chunk of the difference pass); nudges, small steps, special values, extreme
//                   jumps, random values (key-frame fallback), sign flips, damaged frames,
//                   resealed sections, resynchronisations and a reset;
//   fuzz_peers      the peer schemes (fuzz_peers.cpp): every scheme and dtype, 0, 1, 7, 2049 and
//                   6001 values of realistic weights, edits, damaged and truncated frames, and a
//                   quantised body of each quantiser;
//   fuzz_collectives  coded slices of every dtype (frames of 1, 100 and 1000 values, with and
//                   without content checksum; checked to decode) with values for the round trip,
//                   and call records and verdicts of 2 to 4 ranks: reduce-scatter and alltoallv
//                   rounds (first, middle, last; coded and raw slices) that check_agreement
//                   accepts, a sequence mismatch, a refusal and a failed verdict.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/engine.hpp"
#include "collectives/call_record.hpp"
#include "collectives/slice_coding.hpp"
#include "engine/memory_ops.hpp"
#include "engine_fixture.hpp"
#include "envelope_receiver.hpp"
#include "payload_stream.hpp"

namespace {

using namespace ciera;
namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void append(Bytes& to, const void* data, size_t bytes) {
  const auto* p = static_cast<const std::byte*>(data);
  to.insert(to.end(), p, p + bytes);
}

// splitmix64: a fixed sequence per seed, on every platform.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }

 private:
  uint64_t state_;
};

// A shard of trained-weight-like values, edited through its bit fields (docs/format.md,
// "Exponent and sign-mantissa split"): exponents cluster a few steps below the bias, as those
// of weights of magnitude about 1e-2 do; signs and mantissas are random.
class Shard {
 public:
  Shard(DType dtype, uint64_t values, uint64_t seed) : random_(seed) {
    const DTypeInfo info = dtype_info(dtype);
    value_bytes_ = info.value_bytes;
    exponent_bits_ = info.exponent_bits;
    mantissa_bits_ = info.sign_mantissa_bits - 1;
    bytes_.resize(values * value_bytes_);
    for (uint64_t i = 0; i < values; ++i) {
      set(i, random_.below(2), typical_exponent(), random_.next() & mantissa_mask());
    }
  }

  const Bytes& bytes() const { return bytes_; }
  uint64_t values() const { return bytes_.size() / value_bytes_; }

  // Every exponent equal: the encoder codes a constant stream.
  void flatten_exponents() {
    for (uint64_t i = 0; i < values(); ++i) set_exponent(i, bias() - 4);
  }
  // `changes` values move their exponent by one; every `escape_every`-th (if any) by more.
  void change_sparse(uint64_t changes, uint64_t escape_every = 0) {
    for (uint64_t c = 0; c < changes && values() > 0; ++c) {
      const uint64_t i = random_.below(values());
      const uint32_t e = exponent(i);
      const bool escape = escape_every != 0 && c % escape_every == 0;
      const uint32_t step = escape ? 5 : 1;
      set_exponent(
          i, e > step + 1 && random_.below(2) ? e - step : std::min(e + step, max_exponent() - 1));
    }
  }
  // Every exponent of `blocks` random blocks of `block_values` drawn anew.
  void change_dense(uint64_t blocks, uint32_t block_values) {
    const uint64_t count = (values() + block_values - 1) / block_values;
    for (uint64_t b = 0; b < blocks && count > 0; ++b) {
      const uint64_t first = random_.below(count) * block_values;
      for (uint64_t i = first; i < std::min(values(), first + block_values); ++i) {
        set_exponent(i, typical_exponent());
      }
    }
  }
  // NaN, +-Inf, subnormals and -0 at a few places.
  void add_specials() {
    const uint32_t all_ones = max_exponent();
    for (uint64_t i = 0; i < values(); i += 37) {
      switch ((i / 37) % 5) {
        case 0:
          set(i, 0, all_ones, 1 | (random_.next() & mantissa_mask()));
          break;  // NaN
        case 1:
          set(i, random_.below(2), all_ones, 0);
          break;  // Inf
        case 2:
          set(i, random_.below(2), 0, 1 + random_.below(mantissa_mask()));
          break;
        case 3:
          set(i, 1, 0, 0);
          break;  // -0
        default:
          set(i, 0, 1, 0);
          break;  // smallest normal
      }
    }
  }

 private:
  uint32_t bias() const { return (1u << (exponent_bits_ - 1)) - 1; }
  uint32_t max_exponent() const { return (1u << exponent_bits_) - 1; }
  uint64_t mantissa_mask() const { return (uint64_t{1} << mantissa_bits_) - 1; }
  uint32_t typical_exponent() {
    uint32_t below = 5;
    while (below < bias() - 1 && random_.below(2)) ++below;  // geometric tail of small values
    return bias() - below + static_cast<uint32_t>(random_.below(2));
  }
  uint64_t load(uint64_t i) const {
    uint64_t v = 0;
    for (uint32_t b = 0; b < value_bytes_; ++b) {
      v |= static_cast<uint64_t>(bytes_[i * value_bytes_ + b]) << (8 * b);
    }
    return v;
  }
  void store(uint64_t i, uint64_t v) {
    for (uint32_t b = 0; b < value_bytes_; ++b) {
      bytes_[i * value_bytes_ + b] = static_cast<std::byte>(v >> (8 * b));
    }
  }
  uint32_t exponent(uint64_t i) const {
    return static_cast<uint32_t>(load(i) >> mantissa_bits_) & max_exponent();
  }
  void set(uint64_t i, uint64_t sign, uint32_t exponent, uint64_t mantissa) {
    store(i, (sign << (exponent_bits_ + mantissa_bits_)) | (uint64_t{exponent} << mantissa_bits_) |
                 (mantissa & mantissa_mask()));
  }
  void set_exponent(uint64_t i, uint32_t e) {
    const uint64_t v = load(i);
    const uint64_t field = uint64_t{max_exponent()} << mantissa_bits_;
    store(i, (v & ~field) | (uint64_t{e} << mantissa_bits_));
  }

  Random random_;
  uint32_t value_bytes_ = 0, exponent_bits_ = 0, mantissa_bits_ = 0;
  Bytes bytes_;
};

// ---- fuzz_payload ---------------------------------------------------------------------------

// kCorrupt: a frame damaged in transit (its last byte flipped), which the receiver rejects;
// kResync: the sender's answer, a key frame that starts a new epoch.
enum class Step { kSame, kSparse, kEscapes, kDense, kSpecials, kCorrupt, kResync };

struct Stream {
  Bytes bytes;                // the payloads back to back
  std::vector<bool> corrupt;  // per payload
};

// One sender's payloads: its first frame (always a key frame), then one per step.
Stream payload_stream(const CodecConfig& config, uint64_t values, const std::vector<Step>& steps,
                      uint64_t seed, bool flat = false) {
  Shard shard(config.dtype, values, seed);
  if (flat) shard.flatten_exponents();
  // Each stream its own id and epoch; fuzz_payload's receiver takes them from the first header.
  const StreamIdentity identity{.stream = static_cast<uint32_t>(seed * 7919),
                                .epoch = static_cast<uint32_t>(seed * 104729 + 1)};
  ShardEncoder encoder(config, values, identity);
  Stream stream;
  Bytes payload(encoder.max_payload_bytes());
  auto send = [&](bool corrupt) {
    const uint64_t bytes = encoder.encode(shard.bytes(), payload).payload_bytes;
    if (corrupt) payload[bytes - 1] ^= std::byte{0x5A};
    append(stream.bytes, payload.data(), bytes);
    stream.corrupt.push_back(corrupt);
  };
  send(false);
  for (Step step : steps) {
    switch (step) {
      case Step::kSame:
        break;
      case Step::kSparse:
        shard.change_sparse(1 + values / 100);
        break;
      case Step::kEscapes:
        shard.change_sparse(1 + values / 50, 3);
        break;
      case Step::kDense:
        shard.change_dense(2, config.block_values);
        break;
      case Step::kSpecials:
        shard.add_specials();
        break;
      case Step::kCorrupt:
        shard.change_sparse(1 + values / 100);
        break;
      case Step::kResync:
        encoder.request_key_frame();
        break;
    }
    send(step == Step::kCorrupt);
  }
  return stream;
}

CodecConfig codec(DType dtype, uint32_t block_values,
                  ExponentCoding coding = ExponentCoding::kAuto) {
  CodecConfig c;
  c.dtype = dtype;
  c.block_values = block_values;
  c.warmup_steps = 0;
  c.coding = coding;
  return c;
}

// Writes a payload stream after checking that fuzz_payload's receiver decodes every payload of
// it but the corrupt ones, so that a corpus written by a library whose format moved on cannot
// silently seed nothing but rejections. Notes the (dtype, exponent section) of every payload
// decoded in `seen`.
void write_stream(const fs::path& path, const Stream& stream,
                  std::set<std::pair<DType, ExponentSection>>& seen) {
  const auto* data = reinterpret_cast<const uint8_t*>(stream.bytes.data());
  fuzz::StreamReceiver receiver(data, stream.bytes.size());
  const std::vector<fuzz::Part> parts = fuzz::split_payloads(data, stream.bytes.size());
  if (parts.size() != stream.corrupt.size()) {
    throw std::runtime_error(path.filename().string() + ": fuzz_payload splits it into " +
                             std::to_string(parts.size()) + " payloads, not " +
                             std::to_string(stream.corrupt.size()));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::span<const std::byte> payload(stream.bytes.data() + parts[i].offset, parts[i].bytes);
    if (receiver.receive(payload) == stream.corrupt[i]) {
      throw std::runtime_error(path.filename().string() + ": fuzz_payload " +
                               (stream.corrupt[i] ? "accepts" : "rejects") + " payload " +
                               std::to_string(i));
    }
    if (!stream.corrupt[i]) {
      const PayloadInfo info = inspect_payload(payload);
      seen.insert({info.dtype, info.section});
    }
  }
  write_file(path, stream.bytes);
}

void payload_corpus(const fs::path& dir) {
  std::set<std::pair<DType, ExponentSection>> seen;
  using enum Step;
  uint64_t seed = 1;
  auto stream = [&](const std::string& name, const CodecConfig& config, uint64_t values,
                    const std::vector<Step>& steps, bool flat = false) {
    write_stream(dir / (name + ".bin"), payload_stream(config, values, steps, seed++, flat), seen);
  };
  const std::pair<DType, const char*> dtypes[] = {
      {DType::kBF16, "bf16"}, {DType::kFP16, "fp16"}, {DType::kFP32, "fp32"}};
  for (const auto& [dtype, name] : dtypes) {
    const std::string d = name;
    stream(d + "-b64-n1000-auto", codec(dtype, 64), 1000, {kSame, kSparse, kDense, kEscapes});
    stream(d + "-b512-n700-fine", codec(dtype, 512, ExponentCoding::kFine), 700,
           {kSparse, kEscapes, kSame});
    stream(d + "-b4096-n5000-block", codec(dtype, 4096, ExponentCoding::kBlock), 5000,
           {kDense, kSparse});
    stream(d + "-b100-n1", codec(dtype, 100), 1, {kSame, kSparse});
    stream(d + "-b100-n0", codec(dtype, 100), 0, {kSame});

    CodecConfig stateless = codec(dtype, 512);
    Shard shard(dtype, 1000, seed++);
    Bytes payload(max_payload_bytes(dtype, 1000, 512));
    payload.resize(encode_stateless(stateless, shard.bytes(), payload));
    write_stream(dir / (d + "-b512-n1000-stateless.bin"), {payload, {false}}, seen);
  }
  CodecConfig unchecked = codec(DType::kBF16, 256);
  unchecked.content_checksum = false;
  stream("bf16-b256-n3000-no-checksum", unchecked, 3000, {kSparse, kDense, kSame});
  CodecConfig hashed = codec(DType::kFP16, 128, ExponentCoding::kBlock);
  hashed.detection = ChangeDetection::kHash;
  stream("fp16-b128-n777-hash", hashed, 777, {kDense, kSame, kSparse});
  CodecConfig warm = codec(DType::kBF16, 64);
  warm.warmup_steps = 2;
  stream("bf16-b64-n400-warmup", warm, 400, {kSparse, kSparse, kSparse});
  stream("fp32-b128-n500-resync", codec(DType::kFP32, 128), 500,
         {kSparse, kCorrupt, kResync, kSparse});
  stream("bf16-b512-n200-constant", codec(DType::kBF16, 512), 200, {kSame, kSparse}, true);
  stream("fp16-b64-n640-specials", codec(DType::kFP16, 64), 640, {kSpecials, kSparse});
  stream("fp32-b4096-n4097-block", codec(DType::kFP32, 4096, ExponentCoding::kBlock), 4097,
         {kDense});
  // A sign-mantissa plane of 64 KiB starts after zero padding (docs/format.md, "Padding").
  stream("bf16-b512-n65536-padded", codec(DType::kBF16, 512), 65536, {kSparse});
  if (seen.size() != 3 * 4)
    throw std::runtime_error("fuzz_payload: a dtype lacks an exponent section");
}

// ---- fuzz_envelope --------------------------------------------------------------------------

// Rank 1 of fuzz_envelope's two-rank engine: its codecs and shards per bucket, and the rounds it
// sends, each its control record and then its envelope.
class Sender {
 public:
  // kCorrupt: a compressed round with one payload damaged in transit (its last byte flipped);
  // kRetry: the key-frame round that follows a failed one, at the same step.
  enum class Round { kCompressed, kRaw, kCold, kCorrupt, kRetry };
  enum class Change { kSame, kSparse, kDense };

  Sender() : layouts_(fuzz::envelope_buckets()) {
    uint64_t seed = 100;
    for (size_t b = 0; b < layouts_.size(); ++b) {
      const BucketLayout& layout = layouts_[b];
      State& s = states_.emplace_back();
      for (size_t k = 0; k < layout.params(); ++k) {
        s.encoders.push_back(fuzz::make_encoder(layouts_, b, k, fuzz::kSender));
        s.shards.emplace_back(layout.dtype, layout.shard_values[fuzz::kSender][k], seed++);
      }
    }
  }

  // Starts at `step` instead of the bucket's next step (a peer ahead of the receiver).
  void jump(uint32_t bucket, uint64_t step) { states_[bucket].step = step; }

  void round(Bytes& out, uint32_t bucket, Round kind, Change change = Change::kSame) {
    const BucketLayout& layout = layouts_[bucket];
    State& s = states_[bucket];
    for (Shard& shard : s.shards) {
      if (change == Change::kSparse) shard.change_sparse(1 + shard.values() / 100);
      if (change == Change::kDense)
        shard.change_dense(1, fuzz::engine_codec(layout.dtype).block_values);
    }
    const bool raw = kind == Round::kRaw;
    if (kind == Round::kCold || kind == Round::kRetry) {
      for (auto& e : s.encoders) {
        if (e) e->request_key_frame();
      }
    }
    std::vector<uint64_t> capacity(layout.params()), payload_bytes(layout.params());
    for (size_t k = 0; k < layout.params(); ++k) {
      capacity[k] = std::max<uint64_t>(s.shards[k].bytes().size(),
                                       s.encoders[k] ? s.encoders[k]->max_payload_bytes() : 0);
    }
    SendLayout send_layout;
    lay_out_send_buffer(capacity, send_layout);
    PayloadBuffer send(host_memory_ops());
    send.reserve(send_layout.buffer_bytes);
    for (size_t k = 0; k < layout.params(); ++k) {
      std::byte* slot = send.data() + send_layout.slot_offset[k];
      const Bytes& shard = s.shards[k].bytes();
      if (raw || !s.encoders[k]) {
        if (!shard.empty()) std::memcpy(slot, shard.data(), shard.size());
        payload_bytes[k] = shard.size();
      } else {
        payload_bytes[k] = s.encoders[k]->encode(shard, {slot, capacity[k]}).payload_bytes;
      }
    }
    EnvelopeHeader header;
    header.bucket = bucket;
    header.params = static_cast<uint32_t>(layout.params());
    header.step = s.step;
    header.all_raw = raw;
    std::vector<uint8_t> header_scratch(envelope_header_bytes(layout.params()));
    const uint64_t bytes = pack_envelope(send.data(), send_layout, payload_bytes, header,
                                         host_memory_ops(), header_scratch);
    std::byte* envelope = send.data() + send_layout.envelope_offset;
    if (kind == Round::kCorrupt) {
      uint64_t end = envelope_header_bytes(layout.params());
      for (size_t k = 0; k < layout.params(); ++k) {
        end += payload_bytes[k];
        if (s.encoders[k] && payload_bytes[k] > 0) {
          envelope[end - 1] ^= std::byte{0x5A};
          break;
        }
      }
    }
    const uint32_t flags = (raw ? uint32_t{kRaw} : 0u) |
                           (kind == Round::kCold ? uint32_t{kCold} : 0u) |
                           (kind == Round::kRetry ? uint32_t{kKeyRound} : 0u);
    const ControlRecord record = fuzz::control_record(bucket, layout, s.step, flags, bytes);
    append(out, &record, sizeof record);
    append(out, envelope, bytes);
    if (kind != Round::kCorrupt) ++s.step;
  }

 private:
  struct State {
    std::vector<std::unique_ptr<ShardEncoder>> encoders;
    std::vector<Shard> shards;
    uint64_t step = 0;
  };
  std::vector<BucketLayout> layouts_;
  std::vector<State> states_;
};

// Writes rounds after checking that fuzz_envelope's receiver gathers every one of them exactly,
// but those `failing` (one flag per round) names, which it must reject.
void write_rounds(const fs::path& path, const Bytes& rounds, const std::vector<bool>& failing) {
  const std::vector<std::string> outcomes =
      fuzz::receive_rounds(reinterpret_cast<const uint8_t*>(rounds.data()), rounds.size());
  if (outcomes.size() != failing.size()) {
    throw std::runtime_error(path.filename().string() + ": " + std::to_string(outcomes.size()) +
                             " rounds received of " + std::to_string(failing.size()));
  }
  for (size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i].empty() == failing[i]) {
      throw std::runtime_error(path.filename().string() + ", round " + std::to_string(i) + ": " +
                               (failing[i] ? "accepted" : outcomes[i]));
    }
  }
  write_file(path, rounds);
}

void envelope_corpus(const fs::path& dir) {
  using R = Sender::Round;
  using C = Sender::Change;
  const char* names[] = {"bf16", "fp32", "fp16"};
  for (uint32_t bucket = 0; bucket < 3; ++bucket) {
    Sender sender;
    Bytes rounds;
    sender.round(rounds, bucket, R::kCompressed);
    sender.round(rounds, bucket, R::kCompressed, C::kSame);
    sender.round(rounds, bucket, R::kCompressed, C::kSparse);
    sender.round(rounds, bucket, R::kCompressed, C::kDense);
    sender.round(rounds, bucket, R::kRaw, C::kSparse);
    sender.round(rounds, bucket, R::kCompressed, C::kSparse);
    write_rounds(dir / (std::string(names[bucket]) + "-rounds.bin"), rounds, std::vector(6, false));
  }
  {
    Sender sender;
    Bytes rounds;
    for (uint32_t bucket = 0; bucket < 3; ++bucket) sender.round(rounds, bucket, R::kCompressed);
    sender.round(rounds, 0, R::kCompressed, C::kSparse);
    sender.round(rounds, 1, R::kCompressed, C::kDense);
    sender.round(rounds, 2, R::kCompressed, C::kSame);
    write_rounds(dir / "mixed-buckets.bin", rounds, std::vector(6, false));
  }
  {
    Sender sender;
    Bytes rounds;
    sender.round(rounds, 0, R::kCompressed);
    sender.round(rounds, 0, R::kCompressed, C::kSparse);
    sender.round(rounds, 0, R::kCold, C::kSparse);
    sender.round(rounds, 0, R::kCompressed, C::kSparse);
    write_rounds(dir / "bf16-cold-restart.bin", rounds, std::vector(4, false));
  }
  for (uint32_t bucket = 0; bucket < 3; ++bucket) {
    Sender sender;
    Bytes rounds;
    sender.round(rounds, bucket, R::kCompressed);
    sender.round(rounds, bucket, R::kCorrupt, C::kSparse);
    sender.round(rounds, bucket, R::kRetry);
    sender.round(rounds, bucket, R::kCompressed, C::kSparse);
    write_rounds(dir / (std::string(names[bucket]) + "-corrupt-retry.bin"), rounds,
                 {false, true, false, false});
  }
  {
    Sender sender;
    Bytes rounds;
    sender.jump(1, 3);
    sender.round(rounds, 1, R::kCompressed);
    sender.round(rounds, 1, R::kCompressed, C::kSparse);
    write_rounds(dir / "fp32-peer-ahead.bin", rounds, std::vector(2, false));
  }
  {
    Sender sender;
    Bytes rounds;
    sender.round(rounds, 0, R::kRaw);
    sender.round(rounds, 0, R::kRaw, C::kSparse);
    write_rounds(dir / "bf16-raw.bin", rounds, std::vector(2, false));
  }
}

// ---- fuzz_control ---------------------------------------------------------------------------

struct Gather {
  Gather(uint32_t b, uint64_t s, uint32_t f = 0, std::string e = "")
      : bucket(b), step(s), flags(f), error(std::move(e)) {}
  uint32_t bucket;
  uint64_t step;
  uint32_t flags;
  std::string error;
};

// Every rank's RoundControl, then every rank's RoundVerdicts, for `world` ranks that all have
// `gathers` ready (rank r has `extra[r]` more); `edit` adjusts rank r's records.
Bytes control_round(int world, const std::vector<Gather>& gathers, std::vector<uint32_t> extra,
                    const std::vector<Verdict>& failed = {},
                    const std::function<void(int, ControlRecord&)>& edit = {}) {
  const std::vector<BucketLayout> buckets = fuzz::control_buckets(world);
  extra.resize(world, 0);
  Bytes out;
  for (int r = 0; r < world; ++r) {
    RoundControl control{};
    control.magic = kControlMagic;
    control.count =
        static_cast<uint32_t>(std::min<size_t>(gathers.size() + extra[r], kMaxRoundGathers));
    for (size_t i = 0; i < control.count; ++i) {
      const Gather& g = gathers[std::min(i, gathers.size() - 1)];
      const BucketLayout& layout = buckets[g.bucket];
      ControlRecord& c = control.records[i];
      c = fuzz::control_record(g.bucket, layout, g.step, g.flags,
                               (g.flags & kRaw) ? raw_envelope_bytes(layout, r)
                                                : fuzz::max_envelope_bytes(layout)[r] / 2);
      c.previous_us = 1000 + 10 * static_cast<uint32_t>(r);
      c.previous_compressed = 1;
      if (!g.error.empty()) write_text(c.error_text, kErrorTextBytes, g.error);
      if (edit) edit(r, c);
    }
    append(out, &control, sizeof control);
  }
  for (int r = 0; r < world; ++r) {
    RoundVerdicts verdicts{};
    if (static_cast<size_t>(r) < failed.size()) verdicts.verdicts[0] = failed[r];
    append(out, &verdicts, sizeof verdicts);
  }
  return out;
}

void control_corpus(const fs::path& dir) {
  write_file(dir / "world2-one-gather.bin", control_round(2, {{0, 5}}, {}));
  write_file(dir / "world3-two-gathers-uneven.bin", control_round(3, {{0, 9}, {1, 9}}, {0, 1, 2}));
  write_file(dir / "world4-cold-and-steps.bin",
             control_round(4, {{0, 12}}, {}, {}, [](int r, ControlRecord& c) {
               if (r == 2) c.flags |= kCold;
               if (r == 3) c.step = 11;
             }));
  write_file(dir / "world2-local-error.bin",
             control_round(2, {{1, 3, kLocalError, "input of 12 bytes, expected 128"}}, {}));
  write_file(dir / "world8-raw.bin", control_round(8, {{0, 40, kRaw}, {1, 40, kRaw}}, {}));
  Verdict failed{};
  record_failure(failed, 1, 2, "content checksum mismatch");
  Verdict envelope{};
  record_failure(envelope, 0, -1, "rank 0's envelope has trailing bytes");
  write_file(dir / "world3-failed-verdicts.bin",
             control_round(3, {{0, 7}}, {}, {Verdict{}, envelope, failed}));
}

// ---- fuzz_decode and fuzz_roundtrip -----------------------------------------------------------

void decode_corpus(const fs::path& dir) {
  // fuzz_decode's first byte picks one of its 12 configurations, the second its frame (0: the
  // rest of the input is the payload; 1: key; 2, 3: the deltas after it).
  for (uint8_t config = 0; config < 12; ++config) {
    for (uint8_t frame = 1; frame < 4; ++frame) {
      const Bytes seed = {std::byte{config}, std::byte{frame}};
      write_file(dir / ("config" + std::to_string(config) + "-frame" + std::to_string(frame)),
                 seed);
    }
  }
}

void roundtrip_corpus(const fs::path& dir) {
  // fuzz_roundtrip's header: dtype, block size, detection/coding/warmup, steps.
  const std::pair<DType, const char*> dtypes[] = {
      {DType::kBF16, "bf16"}, {DType::kFP16, "fp16"}, {DType::kFP32, "fp32"}};
  uint64_t seed = 1000;
  for (const auto& [dtype, name] : dtypes) {
    for (uint64_t values : {0, 1, 333}) {
      for (uint8_t mode : {0x00, 0x04, 0x01}) {  // exact/auto, exact/fine, hash/block
        Bytes input = {std::byte{static_cast<uint8_t>(static_cast<uint8_t>(dtype) - 1)},
                       std::byte{1}, std::byte{mode}, std::byte{3}};
        const Shard shard(dtype, values, seed++);
        append(input, shard.bytes().data(), shard.bytes().size());
        write_file(dir / (std::string(name) + "-n" + std::to_string(values) + "-mode" +
                          std::to_string(mode) + ".bin"),
                   input);
      }
    }
  }
  // A key frame whose exponents fill a pair of rANS segments (16384 symbols each) and start a
  // third (scripts/fuzz.sh lets fuzz_roundtrip's inputs be this long).
  Bytes input = {std::byte{0}, std::byte{1}, std::byte{0}, std::byte{3}};
  const Shard large(DType::kBF16, 33000, seed);
  append(input, large.bytes().data(), large.bytes().size());
  write_file(dir / "bf16-n33000-mode0.bin", input);
}

// ---- fuzz_delta ---------------------------------------------------------------------------------

void delta_corpus(const fs::path& dir) {
  // fuzz_delta's op byte: move | delivery << 3 | variant << 5 (fuzz_delta.cpp).
  constexpr uint8_t kNothing = 0, kNudge = 1, kSmall = 2, kFromInput = 3, kSpecial = 4, kExtreme = 5,
                    kRandomAll = 6, kSigns = 7;
  constexpr uint8_t kDamaged = 1 << 3, kResealed = 2 << 3, kResync = 3 << 3, kVariant = 1 << 5;
  // Each move but kNothing reads its spacing first (1 + byte % 16); kSmall then a span,
  // kFromInput a count and (index u16, value) pairs.
  const std::vector<uint8_t> steady = {
      kNudge, 15, kNudge, 15, kNothing, 0, kSmall, 2, 40, kSigns, 9, kSpecial, 6,
      kExtreme, 12, kFromInput, 0, 2, 3, 0, 0x80, 0x3F, 0x00, 0x00, 9, 0, 0xFF, 0xFF, 0xFF, 0xFF,
      kRandomAll, 0, kNudge, 15, kSmall, 0, 3, kNothing, 0, kNudge, 3};
  const std::vector<uint8_t> damaged = {
      kNudge, 15,
      kNudge | kDamaged, 15, 1, 90, 0, 0x55, 81, 0, 0x01,               // two bytes overwritten
      kSmall | kDamaged | kVariant, 4, 30, 0, 85, 0, 0xAA, 100, 0,     // one byte, then truncated
      kNudge | kResealed, 7, 0, 0, 0,                                   // the frame's own section
      kSmall | kResealed, 3, 20, 0xFF, 2, 12, 0, 0x10, 3, 0, 0x01, 1,   // shorter, two bytes xor-ed
      kNudge | kResealed, 15, 3, 1, 40, 0, 0x80, 0,                     // longer, one byte xor-ed
      kExtreme | kResealed | kVariant, 10, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1,
      kNothing | kResealed, 0, 0, 0, 1,                                  // an empty 'differences'
      kNudge | kResync, 15,
      kSmall | kResync | kVariant, 5, 9,                                // a reset receiver
      kNudge, 15, kRandomAll | kDamaged, 0, 1, 200, 0, 0x33};
  const std::pair<uint8_t, const char*> counts[] = {{0 << 3, "5"}, {1 << 3, "40"}, {2 << 3, "1013"},
                                                    {3 << 3, "6152"}};
  const uint8_t count_byte[] = {5, 40, 250, 16};
  const char* dtype_names[] = {"bf16", "fp16", "fp32"};
  for (uint8_t dtype = 0; dtype < 3; ++dtype) {
    for (const bool checksum : {true, false}) {
      for (size_t c = 0; c < std::size(counts); ++c) {
        for (const auto& [script, name] : {std::pair{&steady, "steady"}, std::pair{&damaged, "damaged"}}) {
          Bytes input = {std::byte{static_cast<uint8_t>(dtype | (checksum ? 0 : 4) | counts[c].first)},
                         std::byte{count_byte[c]}};
          append(input, script->data(), script->size());
          write_file(dir / (std::string(dtype_names[dtype]) + "-n" + counts[c].second +
                            (checksum ? "" : "-nochecksum") + "-" + name + ".bin"),
                     input);
        }
      }
    }
  }
}

// ---- fuzz_peers ---------------------------------------------------------------------------------

void peers_corpus(const fs::path& dir) {
  const char* kinds[] = {"zeropp-int8", "sdp4bit", "stateless"};
  const char* dtype_names[] = {"bf16", "fp16", "fp32"};
  const uint32_t value_bytes[] = {2, 2, 4};
  for (uint8_t kind = 0; kind < 3; ++kind) {
    for (uint8_t dtype = 0; dtype < 3; ++dtype) {
      for (const uint16_t n : {0, 1, 7, 2049, 6001}) {
        Bytes input = {std::byte{kind}, std::byte{dtype}, std::byte{static_cast<uint8_t>(n)},
                       std::byte{static_cast<uint8_t>(n >> 8)}, std::byte{15}};
        // Weights near 0.02 in magnitude, both signs: the bytes of a small float (BF16 0x3CA3).
        for (uint32_t i = 0; i < n; ++i) {
          const uint8_t sign = (i * 2654435761u >> 16) & 0x80;
          const uint8_t high[] = {0x3C, 0x25, 0x3C, 0xA3};
          for (uint32_t b = 0; b < value_bytes[dtype]; ++b) {
            const uint8_t byte = b + 1 == value_bytes[dtype] ? (high[dtype == 1 ? 1 : 0] | sign)
                                                             : static_cast<uint8_t>(i * 37 + b);
            input.push_back(std::byte{byte});
          }
        }
        // Four frames: edits, then a flag byte (odd: a damaged copy first, at the offset in the
        // next two bytes; 2: also truncated; 4: in the header; 8: after a resync request; 16: not
        // resealed).
        // clang-format off
        const uint8_t frames[] = {3, 0x3D, 9, 0x3C, 17, 0x01, 200, 0x80, 0,
                                  5, 0x11, 6, 0x22, 7, 0x33, 8, 0x44, 0x05, 32, 0,     // sequence
                                  9, 0x3C, 10, 0x3C, 11, 0xBC, 12, 0x3C, 0x03, 9, 0,   // body, cut
                                  1, 0, 2, 0, 3, 0, 4, 0, 0x0D, 16, 0};                // epoch
        // clang-format on
        append(input, frames, sizeof frames);
        // A body: a scale of 1.0f and some levels, as both quantisers lay a group out.
        const uint8_t body[] = {0x00, 0x00, 0x80, 0x3F, 0x9F, 0x81, 0x7F, 0x00, 0x18, 0x88};
        append(input, body, sizeof body);
        write_file(dir / (std::string(kinds[kind]) + "-" + dtype_names[dtype] + "-n" + std::to_string(n) + ".bin"),
                   input);
      }
    }
  }
}

// ---- fuzz_collectives
// -----------------------------------------------------------------------------

// fuzz_collectives.cpp's slice inputs: a peer's coded slice of a realistic shard in frames of
// `frame_values` (checked to decode to that shard here), then values for the round trip.
Bytes slice_input(DType dtype, uint8_t block, bool checksum, uint64_t values, uint64_t frame_values,
                  uint8_t round_trip_frame, uint64_t seed) {
  const uint32_t blocks[] = {64, 100, 512, 4096};
  CodecConfig c = codec(dtype, blocks[block]);
  c.content_checksum = checksum;
  const Shard shard(dtype, values, seed);
  Bytes coded(collectives::coded_slice_bound(c, values, frame_values));
  coded.resize(collectives::encode_slice(c, frame_values, shard.bytes(), coded).payload_bytes);
  Bytes decoded(shard.bytes().size());
  collectives::decode_slice(c, coded, decoded);
  if (decoded != shard.bytes()) throw std::runtime_error("fuzz_collectives: a slice decoded wrong");
  if (values > 0xFFFF || coded.size() > 0xFFFF)
    throw std::runtime_error("fuzz_collectives: too long");
  const auto code =
      static_cast<uint8_t>((static_cast<uint8_t>(dtype) - 1) << 1 | (checksum ? 8 : 0));
  Bytes input = {std::byte{code},
                 std::byte{block},
                 std::byte{static_cast<uint8_t>(values)},
                 std::byte{static_cast<uint8_t>(values >> 8)},
                 std::byte{static_cast<uint8_t>(coded.size())},
                 std::byte{static_cast<uint8_t>(coded.size() >> 8)}};
  append(input, coded.data(), coded.size());
  input.push_back(std::byte{round_trip_frame});
  const Shard more(dtype, values / 2 + 3, seed + 1);
  append(input, more.bytes().data(), more.bytes().size());
  return input;
}

// fuzz_collectives.cpp's record inputs: W ranks' call records of one round of a call and their
// verdicts, sealed as sent; `accepted` says whether every rank must accept the records.
Bytes records_input(const std::vector<collectives::CallRecord>& records,
                    const std::vector<collectives::Verdict>& verdicts, bool accepted) {
  const int world = static_cast<int>(records.size());
  bool ok = true;
  try {
    for (const collectives::CallRecord& r : records) {
      if (r.rejected) throw ConfigError("refused");
    }
    collectives::check_agreement(records);
  } catch (const Error&) {
    ok = false;
  }
  if (ok != accepted) throw std::runtime_error("fuzz_collectives: a record seed is not as meant");
  Bytes input = {std::byte{1}, std::byte{static_cast<uint8_t>(world - 2)}, std::byte{0},
                 std::byte{0}};
  Bytes record(collectives::call_record_bytes(world));
  for (const collectives::CallRecord& r : records) {
    collectives::write_call_record(r, record);
    collectives::read_call_record(record, world, 0);
    append(input, record.data(), record.size());
  }
  Bytes verdict(collectives::verdict_bytes());
  for (const collectives::Verdict& v : verdicts) {
    collectives::write_verdict(v, verdict);
    collectives::read_verdict(verdict, 0);
    append(input, verdict.data(), verdict.size());
  }
  return input;
}

void collectives_corpus(const fs::path& dir) {
  using collectives::CallKind;
  const std::pair<DType, const char*> dtypes[] = {
      {DType::kBF16, "bf16"}, {DType::kFP16, "fp16"}, {DType::kFP32, "fp32"}};
  uint64_t seed = 3000;
  for (const auto& [dtype, name] : dtypes) {
    const std::string d = name;
    write_file(dir / (d + "-slice-n300-frames100.bin"),
               slice_input(dtype, 0, true, 300, 100, 40, seed++));
    write_file(dir / (d + "-slice-n700-one-frame-nochecksum.bin"),
               slice_input(dtype, 2, false, 700, 1000, 200, seed++));
    write_file(dir / (d + "-slice-n5-frames1.bin"), slice_input(dtype, 1, true, 5, 1, 0, seed++));
  }
  write_file(dir / "bf16-slice-n0.bin", slice_input(DType::kBF16, 3, true, 0, 7, 7, seed++));

  // Round `round` of a reduce-scatter of `n` values per part in slices of `slice` values among
  // `world` ranks, or of an alltoallv where rank r sends rank p (1 + r + 2p) * n values; each
  // slice sent as `coded` of its raw bytes (in per mille; 1000: raw).
  auto call = [](CallKind kind, int world, uint64_t n, uint32_t round, uint64_t slice,
                 uint64_t coded) {
    std::vector<collectives::CallRecord> records(static_cast<size_t>(world));
    auto values = [&](int from, int to) {
      return kind == CallKind::kReduceScatter ? n : (1 + from + 2 * to) * n;
    };
    for (int r = 0; r < world; ++r) {
      collectives::CallRecord& c = records[static_cast<size_t>(r)];
      c.kind = kind;
      c.dtype = DType::kBF16;
      c.op = kind == CallKind::kReduceScatter ? ReduceOp::kAvg : ReduceOp::kSum;
      c.sequence = 17;
      c.round = round;
      c.slice_values = slice;
      c.block_values = 512;
      c.content_checksum = true;
      for (int p = 0; p < world; ++p) {
        c.part_values.push_back(values(r, p));
        c.expected_values.push_back(values(p, r));
        const uint64_t raw = collectives::slice_of(values(r, p), round, slice).values * 2;
        c.part_bytes.push_back(r == p ? 0 : std::max<uint64_t>(raw * coded / 1000, raw ? 1 : 0));
      }
    }
    return records;
  };
  using collectives::Verdict;
  const std::vector<Verdict> fine(4, Verdict{true, 0.25, ""});
  auto verdicts = [&](int world) {
    return std::vector<Verdict>(fine.begin(), fine.begin() + world);
  };
  const CallKind rs = CallKind::kReduceScatter, a2a = CallKind::kAlltoallv;
  write_file(dir / "world2-reduce-scatter-round0.bin",
             records_input(call(rs, 2, 1000, 0, 256, 700), verdicts(2), true));
  write_file(dir / "world3-reduce-scatter-middle-round.bin",
             records_input(call(rs, 3, 5000, 3, 1024, 650), verdicts(3), true));
  write_file(dir / "world4-reduce-scatter-raw-last-round.bin",
             records_input(call(rs, 4, 3000, 4, 1024, 1000), verdicts(4), true));
  write_file(dir / "world3-alltoallv-round1.bin",
             records_input(call(a2a, 3, 700, 1, 512, 800), verdicts(3), true));
  write_file(dir / "world4-alltoallv-past-short-parts.bin",
             records_input(call(a2a, 4, 100, 2, 256, 900), verdicts(4), true));
  {
    auto records = call(rs, 3, 1000, 0, 256, 700);
    records[2].sequence = 18;
    write_file(dir / "world3-sequence-mismatch.bin", records_input(records, verdicts(3), false));
  }
  {
    auto records = call(a2a, 2, 100, 0, 64, 700);
    records[1].rejected = true;
    write_file(dir / "world2-refused.bin", records_input(records, verdicts(2), false));
  }
  {  // pass_through_reduce_scatter's records: parts of 0 values, BF16, round 0
    auto records = call(rs, 3, 0, 0, 256, 1000);
    for (auto& r : records) r.passes_through = true;
    write_file(dir / "world3-passed-through.bin", records_input(records, verdicts(3), true));
    records[1] = call(rs, 3, 0, 0, 256, 1000)[1];  // rank 1 runs the call
    write_file(dir / "world3-pass-through-mixed.bin", records_input(records, verdicts(3), false));
  }
  {
    std::vector<Verdict> failed = verdicts(3);
    failed[1] = {false, 1.5, "rank 1 could not decode the part from rank 0 (round 2): a frame"};
    write_file(dir / "world3-failed-verdict.bin",
               records_input(call(rs, 3, 5000, 2, 1024, 700), failed, true));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_corpus <corpus dir>\n";
    return 2;
  }
  const fs::path root = argv[1];
  const std::pair<const char*, void (*)(const fs::path&)> targets[] = {
      {"fuzz_payload", payload_corpus},  // fuzz_device_decode's corpus too (scripts/fuzz.sh)
      {"fuzz_envelope", envelope_corpus},
      {"fuzz_control", control_corpus},
      {"fuzz_decode", decode_corpus},
      {"fuzz_roundtrip", roundtrip_corpus},
      {"fuzz_delta", delta_corpus},
      {"fuzz_peers", peers_corpus},
      {"fuzz_collectives", collectives_corpus}};
  try {
    for (const auto& [name, make] : targets) {
      const fs::path dir = root / name;
      fs::remove_all(dir);
      fs::create_directories(dir);
      make(dir);
      uint64_t files = 0, bytes = 0;
      for (const auto& entry : fs::directory_iterator(dir)) {
        ++files;
        bytes += entry.file_size();
      }
      std::cout << name << ": " << files << " files, " << bytes << " bytes\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "make_corpus: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
