// `ciera bench codec`: the shard codec on a realistic training trajectory, verified every step,
// against memcpy, the paper's block mode, stateless exponent coding, zstd and the lossy peer
// schemes (ZeRO++'s int8 weights, SDP4Bit's 4-bit weight differences), all in one run.
// Parse (every option checked before any work) -> measure (a BenchResult) -> render (table or
// JSON). Two hidden options serve the Python entry point, which adds a zipnn row measured on the
// same shards (python/ciera/bench_peers.py): --save-shards writes the steady-state shards the
// stateless rows were measured on, --render-json renders a report (with that row) as the table.
#include <zstd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "ciera/ciera.hpp"
#include "ciera/peers.hpp"
#include "commands.hpp"
#include "common/floats.hpp"
#include "common/huge_pages.hpp"
#include "report.hpp"
#include "trajectory.hpp"
#if defined(CIERA_WITH_CUDA)
#include "bench_codec_cuda.hpp"
#endif

namespace ciera::tools {
namespace {

// The command line as CLI11 binds it: raw values, not yet checked.
struct Options {
  std::string dtype = "bf16";
  uint64_t values = 16ull << 20;
  uint32_t block = 512;
  uint32_t steps = 100;
  uint32_t warmup = 30;
  bool warmup_given = false;
  std::string mode = "auto";
  std::string detect = "exact";
  double learning_rate = 1e-4;
  uint64_t seed = 1;
  uint32_t sample_every = 10;
  bool no_checksum = false;
  bool no_compare = false;
  bool json = false;
  bool quiet = false;
  std::string device = "cpu";
  std::string save_shards;  // hidden: where to write the shards the stateless rows saw
  std::string render_json;  // hidden: a report to render as the table, instead of measuring
};

// What to run, checked: a valid codec configuration and a steady state to measure.
struct Request {
  Options options;  // as given, for the report
  std::string command;
  CodecConfig config;
  uint64_t values = 0;
  uint32_t value_bytes = 0;
  uint64_t raw_bytes = 0;
  bool compare_block = false;  // the paper's block mode beside an auto/fine primary
};

Request parse(const Options& o, const std::string& command) {
  Request r;
  r.options = o;
  r.command = command;
  r.config.dtype = parse_dtype(o.dtype);
  require_block_option(o.block);
  r.config.block_values = o.block;
  r.config.warmup_steps = o.warmup;
  // --mode delta: a value-delta stream (receivers keep the previous values) against exponent
  // reuse's auto mode beside it; otherwise the exponent coding of an exponent-reuse stream.
  const bool delta = o.mode == "delta";
  if (delta) r.config.stream_kind = StreamKind::kValueDelta;
  if (!delta && o.mode != "auto" && o.mode != "block" && o.mode != "fine")
    throw ConfigError("--mode " + o.mode + ": expected auto, block, fine or delta");
  r.config.coding = parse_exponent_coding(delta ? "auto" : o.mode);
  r.config.detection = parse_change_detection(o.detect);
  r.config.content_checksum = !o.no_checksum;
  r.config.validate();
  if (o.values < 1) throw ConfigError("--values must be at least 1");
  require_steps_after_warmup(o.steps, o.warmup, o.warmup_given);
  // Step 0 is every codec's key frame, and its exponents have no step before them: counted as a
  // steady step, it read as a third of the exponents changing.
  if (o.warmup < 1)
    throw ConfigError(
        "--warmup must be at least 1 (step 0 is the key frame; the steady figures start after it)");
  if (o.sample_every < 1) throw ConfigError("--sample-every must be at least 1");
  if (!(std::isfinite(o.learning_rate) && o.learning_rate > 0))
    throw ConfigError("--lr must be a finite number > 0");
  if (!o.save_shards.empty()) {
    if (o.no_compare || o.device != "cpu")
      throw ConfigError(
          "--save-shards writes the shards of the CPU comparison rows: not with --no-compare or --device");
    if (!std::ofstream(o.save_shards, std::ios::binary | std::ios::trunc))
      throw ConfigError("--save-shards " + o.save_shards + ": cannot write");
  }
  r.values = o.values;
  r.value_bytes = dtype_info(r.config.dtype).value_bytes;
  if (r.values > std::numeric_limits<uint64_t>::max() / 8 / r.value_bytes)
    throw ConfigError("--values " + std::to_string(r.values) + " is too large");
  r.raw_bytes = r.values * r.value_bytes;
  r.compare_block = !o.no_compare && r.config.coding != ExponentCoding::kBlock;
  return r;
}

// ---- Measuring -------------------------------------------------------------------------------

// Timings and sizes of one codec variant over the steady-state steps.
struct Variant {
  Variant(std::string n, std::string what) : name(std::move(n)), note(std::move(what)) {}
  std::string name;
  std::string note;
  std::vector<double> encode_s, decode_s;
  double wire_bytes = 0;
  uint64_t frames = 0;
  bool verified = true;
  double entropy_coded_bytes = 0, entropy_bound_bytes = 0;
  // Lossy peer schemes: the largest |reconstruction - input| over every measured finite value,
  // and the largest |reconstruction - input| / |input| over those that are not zero.
  bool lossy = false;
  double max_abs_error = 0, max_rel_error = 0;

  void add(double enc, double dec, uint64_t bytes, bool ok) {
    encode_s.push_back(enc);
    decode_s.push_back(dec);
    wire_bytes += static_cast<double>(bytes);
    ++frames;
    verified = verified && ok;
  }
  void add_entropy(const FrameStats& sent) {
    entropy_coded_bytes += static_cast<double>(sent.entropy_coded_bytes);
    entropy_bound_bytes += sent.entropy_bound_bytes;
  }
  double bits_per_value(uint64_t n) const { return frames ? 8 * wire_bytes / frames / n : 0; }
  double entropy_coded_vs_bound() const {
    return entropy_bound_bytes > 0 ? entropy_coded_bytes / entropy_bound_bytes : 0.0;
  }
};

// Everything the run measured; the renderers derive rates and ratios from it.
struct BenchResult {
  Variant primary, block, stateless, zstd1, zstd3, zeropp, sdp4bit, keyframe;
  std::vector<double> memcpy_s;
  // Steady state: exponents that changed (ground truth), the encoder's block and symbol counts.
  double changed_values = 0, changed_blocks = 0, blocks_total = 0, coded_symbols = 0,
         coded_entropy_bits = 0;
  // Value-delta mode, 16-bit dtypes: sum over steady steps of n * H0 of the values' zigzagged
  // step-to-step differences (docs/format.md, "Value-delta frames"), and of the values whose bit
  // pattern changed.
  double difference_entropy_bits = 0, changed_patterns = 0;
  uint64_t fine_frames = 0, steady_frames = 0;
  size_t encoder_cache_bytes = 0, decoder_cache_bytes = 0;

  explicit BenchResult(const Request& r)
      : primary("ciera-" + r.options.mode,
                r.options.mode == "delta"
                    ? "value-delta frames (receivers keep the previous values)"
                    : "exponent reuse, " + r.options.detect + " detection"),
        block(r.options.mode == "delta" ? "ciera-auto" : "ciera-block",
              r.options.mode == "delta" ? "exponent reuse (receivers keep the exponents)"
                                        : "paper's block mode (Algorithm 1)"),
        stateless(
            "stateless",
            "all exponents rANS-coded every step from their own counts (stateless, as ZipCCL; "
            "not ZipCCL's fixed code)"),
        zstd1("zstd-1", "zstd level 1 on the raw shard"),
        zstd3("zstd-3", "zstd level 3 on the raw shard"),
        zeropp("zeropp-int8",
               "ZeRO++ qwZ: int8, FP32 scale per " + std::to_string(peers::kZeroppGroupValues) +
                   " values; LOSSY: verified = the receiver's dequantisation equals the sender's "
                   "bit for bit"),
        sdp4bit("sdp4bit",
                "SDP4Bit qWD: 4-bit differences to the receivers' copy, groups of " +
                    std::to_string(peers::kSdp4bitGroupValues) +
                    ", stochastic rounding; LOSSY: verified = the receiver's copy equals the "
                    "sender's bit for bit"),
        keyframe("warmup key frames", "") {
    zeropp.lossy = sdp4bit.lossy = true;
  }
};

// Every buffer the measured calls write (payloads, decoded shards, the memcpy reference's copy)
// comes from the same allocator as the library's own (cache-line or huge-page aligned, as the
// engine's), so that no variant, memcpy included, gets a better placed destination than another.
using Buffer = std::vector<std::byte, HugePageAllocator<std::byte>>;

// A stateful CIERA encoder/decoder pair.
struct CieraPair {
  CieraPair(const CodecConfig& c, uint64_t n)
      : encoder(c, n), decoder(c, n), payload(encoder.max_payload_bytes()),
        out(n * dtype_info(c.dtype).value_bytes) {}
  ShardEncoder encoder;
  ShardDecoder decoder;
  Buffer payload;
  Buffer out;
};

struct StepResult {
  FrameStats sent;
  double encode_s, decode_s;
  bool ok;
};

StepResult run_pair(CieraPair& pair, std::span<const std::byte> values) {
  Stopwatch enc;
  const FrameStats sent = pair.encoder.encode(values, pair.payload);
  const double encode_s = enc.seconds();
  Stopwatch dec;
  pair.decoder.decode({pair.payload.data(), sent.payload_bytes}, pair.out);
  const double decode_s = dec.seconds();
  const bool ok = std::memcmp(pair.out.data(), values.data(), values.size()) == 0;
  return {sent, encode_s, decode_s, ok};
}

// Exponent fields of all values, computed independently of the codec (the bench's ground truth).
void exponents_of(DType dtype, std::span<const std::byte> values, std::vector<uint8_t>& out) {
  const DTypeInfo info = dtype_info(dtype);
  const unsigned shift = info.sign_mantissa_bits - 1;
  const uint32_t mask = (1u << info.exponent_bits) - 1;
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t x = 0;
    std::memcpy(&x, values.data() + i * info.value_bytes, info.value_bytes);
    out[i] = static_cast<uint8_t>((x >> shift) & mask);
  }
}

// A value of `dtype` (little-endian bits at `bits`) as a double, exactly.
double value_as_double(DType dtype, const std::byte* bits) {
  if (dtype == DType::kFP32) {
    float x;
    std::memcpy(&x, bits, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, bits, 2);
  return dtype == DType::kBF16 ? bf16_to_float(h) : fp16_to_float(h);
}

// Folds the error of a lossy row's reconstruction of `input` into its maxima. Non-finite inputs
// travel raw (ciera/peers.hpp) and are not counted; a finite input reconstructed as a non-finite
// value is an infinite error.
void add_errors(DType dtype, std::span<const std::byte> input,
                std::span<const std::byte> reconstructed, Variant& v) {
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  for (size_t offset = 0; offset < input.size(); offset += value_bytes) {
    const double x = value_as_double(dtype, input.data() + offset);
    if (!std::isfinite(x)) continue;
    const double y = value_as_double(dtype, reconstructed.data() + offset);
    const double error =
        std::isfinite(y) ? std::fabs(y - x) : std::numeric_limits<double>::infinity();
    v.max_abs_error = std::max(v.max_abs_error, error);
    if (x != 0) v.max_rel_error = std::max(v.max_rel_error, error / std::fabs(x));
  }
}

// The codecs under test with their buffers, all allocated before the first step.
class CodecBench {
 public:
  explicit CodecBench(const Request& r)
      : request_(r), config_(r.config), primary_(config_, r.values),
        copy_(r.raw_bytes),
        stateless_payload_(max_payload_bytes(config_.dtype, r.values, config_.block_values)),
        stateless_out_(r.raw_bytes), zstd_buf_(ZSTD_compressBound(r.raw_bytes)),
        zstd_out_(r.raw_bytes),
        int8_payload_(peers::int8_bound_bytes(config_.dtype, r.values, peers::kZeroppGroupValues)),
        int8_sender_(r.raw_bytes), int8_receiver_(r.raw_bytes),
        diff4_payload_(peers::diff4_bound_bytes(config_.dtype, r.values, peers::kSdp4bitGroupValues)),
        sender_base_(r.raw_bytes), receiver_base_(r.raw_bytes), previous_exps_(r.values),
        current_exps_(r.values) {
    if (!r.options.save_shards.empty()) {
      shards_file_.open(r.options.save_shards, std::ios::binary | std::ios::trunc);
      // A self-describing header line, then each saved shard's raw bytes.
      const nlohmann::json header = {{"format", "ciera-bench-shards"}, {"version", 1},
                                     {"dtype", r.options.dtype}, {"values", r.values},
                                     {"value_bytes", r.value_bytes}};
      shards_file_ << json_text(header) << "\n";
      check_shards_file();
    }
    if (r.compare_block) {
      CodecConfig block_config = config_;
      if (config_.stream_kind == StreamKind::kValueDelta) {
        block_config.stream_kind = StreamKind::kExponentReuse;
      } else {
        block_config.coding = ExponentCoding::kBlock;
      }
      block_pair_.emplace(block_config, r.values);
    }
  }

  // One optimizer step's values through every codec; `steady` after the warmup.
  void measure(uint32_t step, std::span<const std::byte> values, BenchResult& result) {
    exponents_of(config_.dtype, values, current_exps_);
    const bool steady = step >= request_.options.warmup;

    // copy_ still holds the previous step's values.
    if (steady && config_.stream_kind == StreamKind::kValueDelta && request_.value_bytes == 2) {
      difference_entropy(values, result);
    }
    Stopwatch copy_clock;
    std::memcpy(copy_.data(), values.data(), request_.raw_bytes);
    const double copy_s = copy_clock.seconds();

    measure_primary(values, steady, copy_s, result);
    if (block_pair_) {
      const StepResult b = run_pair(*block_pair_, values);
      if (steady) {
        result.block.add(b.encode_s, b.decode_s, b.sent.payload_bytes, b.ok);
        result.block.add_entropy(b.sent);
      } else if (!b.ok) {
        result.block.verified = false;
      }
    }
    // Stateless coders need no history, so they are measured on a sample of steady steps.
    const Options& o = request_.options;
    if (steady && !o.no_compare && (step - o.warmup) % o.sample_every == 0) {
      if (!stateless_warm_) {
        // A coder's first call pays for its buffers' first touch (page faults): one untimed
        // round, whose results are dropped, so that one sample (a short run) is not that cost.
        BenchResult dropped(request_);
        measure_stateless(values, dropped);
        measure_zeropp(values, dropped);
        stateless_warm_ = true;
      }
      measure_stateless(values, result);
      measure_zeropp(values, result);
      save_shard(values);
    }
    // SDP4Bit sends the full weights first: both copies start as the values of the step before
    // the first measured one, and every steady step then sends a 4-bit difference.
    if (!o.no_compare) {
      if (!sdp4bit_started_ && step + 1 >= o.warmup) {
        std::memcpy(sender_base_.data(), values.data(), request_.raw_bytes);
        std::memcpy(receiver_base_.data(), values.data(), request_.raw_bytes);
        sdp4bit_started_ = true;
      } else if (sdp4bit_started_ && steady) {
        measure_sdp4bit(step, values, result);
      }
    }
    std::swap(previous_exps_, current_exps_);
  }

  void finish(BenchResult& result) const {
    result.encoder_cache_bytes = primary_.encoder.cache_bytes();
    result.decoder_cache_bytes = primary_.decoder.cache_bytes();
  }

 private:
  void measure_primary(std::span<const std::byte> values, bool steady, double copy_s,
                       BenchResult& result) {
    const StepResult r = run_pair(primary_, values);
    if (!r.ok) result.primary.verified = false;
    if (!steady) {
      result.keyframe.add(r.encode_s, r.decode_s, r.sent.payload_bytes, r.ok);
      result.keyframe.add_entropy(r.sent);
      return;
    }
    result.memcpy_s.push_back(copy_s);
    result.primary.add(r.encode_s, r.decode_s, r.sent.payload_bytes, r.ok);
    result.primary.add_entropy(r.sent);
    uint64_t changed = 0;
    for (uint64_t i = 0; i < request_.values; ++i) changed += previous_exps_[i] != current_exps_[i];
    result.changed_values += static_cast<double>(changed);
    result.changed_blocks += static_cast<double>(r.sent.changed_blocks);
    result.blocks_total += static_cast<double>(r.sent.blocks);
    result.coded_symbols += static_cast<double>(r.sent.coded_symbols);
    result.coded_entropy_bits += r.sent.coded_symbols_entropy_bits;
    result.fine_frames += r.sent.section == ExponentSection::kFine;
    ++result.steady_frames;
  }

  // Order-0 entropy of the zigzagged differences of the ordered bit patterns, computed here
  // independently of the codec (the bound its bits per value are compared with).
  void difference_entropy(std::span<const std::byte> values, BenchResult& result) const {
    std::vector<uint64_t> hist(1u << 16);
    const uint64_t n = request_.values;
    uint64_t changed = 0;
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t now, before;
      std::memcpy(&now, values.data() + 2 * i, 2);
      std::memcpy(&before, copy_.data() + 2 * i, 2);
      auto ordered = [](uint16_t x) -> uint16_t { return (x & 0x8000) ? uint16_t(~x) : uint16_t(x | 0x8000); };
      const auto d = static_cast<int16_t>(static_cast<uint16_t>(ordered(now) - ordered(before)));
      const auto z = static_cast<uint16_t>(d >= 0 ? 2 * d : -2 * int32_t{d} - 1);
      ++hist[z];
      changed += now != before;
    }
    double bits = 0;
    for (uint64_t c : hist) {
      if (c != 0) bits -= static_cast<double>(c) * std::log2(static_cast<double>(c) / static_cast<double>(n));
    }
    result.difference_entropy_bits += bits;
    result.changed_patterns += static_cast<double>(changed);
  }

  void measure_stateless(std::span<const std::byte> values, BenchResult& result) {
    const uint64_t raw_bytes = request_.raw_bytes;
    Stopwatch enc;
    const size_t len = encode_stateless(config_, values, stateless_payload_);
    const double enc_s = enc.seconds();
    Stopwatch dec;
    decode_stateless(config_, {stateless_payload_.data(), len}, stateless_out_);
    const double dec_s = dec.seconds();
    result.stateless.add(enc_s, dec_s, len,
                         std::memcmp(stateless_out_.data(), values.data(), raw_bytes) == 0);
    for (auto [level, variant] : {std::pair{1, &result.zstd1}, std::pair{3, &result.zstd3}}) {
      Stopwatch zc;
      const size_t zlen =
          ZSTD_compress(zstd_buf_.data(), zstd_buf_.size(), values.data(), raw_bytes, level);
      const double zc_s = zc.seconds();
      if (ZSTD_isError(zlen)) throw Error(std::string("zstd: ") + ZSTD_getErrorName(zlen));
      Stopwatch zd;
      const size_t dlen = ZSTD_decompress(zstd_out_.data(), zstd_out_.size(), zstd_buf_.data(), zlen);
      const double zd_s = zd.seconds();
      variant->add(zc_s, zd_s, zlen,
                   !ZSTD_isError(dlen) && dlen == raw_bytes &&
                       std::memcmp(zstd_out_.data(), values.data(), raw_bytes) == 0);
    }
  }

  // ZeRO++: every rank dequantises the gathered int8 payloads, its own included; the sender's
  // reconstruction (untimed) must equal the receiver's bit for bit.
  void measure_zeropp(std::span<const std::byte> values, BenchResult& result) {
    const DType dtype = config_.dtype;
    Stopwatch enc;
    const size_t len = peers::quantize_int8(dtype, values, peers::kZeroppGroupValues, int8_payload_);
    const double enc_s = enc.seconds();
    const std::span<const std::byte> payload{int8_payload_.data(), len};
    Stopwatch dec;
    peers::dequantize_int8(dtype, payload, peers::kZeroppGroupValues, int8_receiver_);
    const double dec_s = dec.seconds();
    peers::dequantize_int8(dtype, payload, peers::kZeroppGroupValues, int8_sender_);
    const bool alike =
        std::memcmp(int8_sender_.data(), int8_receiver_.data(), request_.raw_bytes) == 0;
    result.zeropp.add(enc_s, dec_s, len,
                      alike && peers::int8_within_bound(dtype, values, int8_receiver_,
                                                        peers::kZeroppGroupValues));
    add_errors(dtype, values, int8_receiver_, result.zeropp);
  }

  // SDP4Bit: the sender quantises values - its copy and moves its copy on; the receiver applies
  // the payload to its own copy. The two copies must stay bitwise equal. Its stochastic rounding
  // draws afresh every step (a seed per step, from the trajectory's).
  void measure_sdp4bit(uint32_t step, std::span<const std::byte> values, BenchResult& result) {
    const DType dtype = config_.dtype;
    const uint64_t seed = (request_.options.seed << 32) ^ step;
    Stopwatch enc;
    const size_t len = peers::quantize_diff4(dtype, values, sender_base_, peers::kSdp4bitGroupValues,
                                             seed, diff4_payload_);
    const double enc_s = enc.seconds();
    Stopwatch dec;
    peers::apply_diff4(dtype, {diff4_payload_.data(), len}, peers::kSdp4bitGroupValues, receiver_base_);
    const double dec_s = dec.seconds();
    result.sdp4bit.add(enc_s, dec_s, len,
                       std::memcmp(sender_base_.data(), receiver_base_.data(), request_.raw_bytes) == 0);
    add_errors(dtype, values, receiver_base_, result.sdp4bit);
  }

  void save_shard(std::span<const std::byte> values) {
    if (!shards_file_.is_open()) return;
    shards_file_.write(reinterpret_cast<const char*>(values.data()),
                       static_cast<std::streamsize>(values.size()));
    check_shards_file();
  }

  void check_shards_file() {
    if (!shards_file_) throw Error("--save-shards " + request_.options.save_shards + ": cannot write");
  }

  const Request& request_;
  const CodecConfig config_;
  CieraPair primary_;
  std::optional<CieraPair> block_pair_;
  Buffer copy_, stateless_payload_, stateless_out_, zstd_buf_, zstd_out_;
  Buffer int8_payload_, int8_sender_, int8_receiver_;
  Buffer diff4_payload_, sender_base_, receiver_base_;
  bool sdp4bit_started_ = false;
  bool stateless_warm_ = false;  // the stateless and zeropp coders have run once, untimed
  std::vector<uint8_t> previous_exps_, current_exps_;
  std::ofstream shards_file_;
};

BenchResult measure(const Request& r) {
  const Options& o = r.options;
  TrajectoryOptions topt;
  topt.num_values = r.values;
  topt.dtype = r.config.dtype;
  topt.learning_rate = o.learning_rate;
  topt.seed = o.seed;
  AdamTrajectory trajectory(topt);
  CodecBench bench(r);
  BenchResult result(r);

  Progress progress("bench codec", o.steps, !o.quiet);
  for (uint32_t step = 0; step < o.steps; ++step) {
    if (step > 0) trajectory.step();
    bench.measure(step, trajectory.values(), result);
    progress.update(step + 1, step >= o.warmup
                                  ? fixed(result.primary.bits_per_value(r.values), 3) + " bits/value"
                                  : "warmup");
  }
  progress.finish();
  bench.finish(result);
  return result;
}

// ---- Rendering -------------------------------------------------------------------------------

// The rows of the comparison table, primary first.
std::vector<const Variant*> table_rows(const Request& r, const BenchResult& result) {
  std::vector<const Variant*> rows = {&result.primary};
  if (r.compare_block) rows.push_back(&result.block);
  if (!r.options.no_compare) {
    rows.push_back(&result.stateless);
    rows.push_back(&result.zstd1);
    rows.push_back(&result.zstd3);
    rows.push_back(&result.zeropp);
    // SDP4Bit's first send is the full weights; with no steady step after it there is no row.
    if (result.sdp4bit.frames > 0) rows.push_back(&result.sdp4bit);
  }
  return rows;
}

bool all_verified(const Request& r, const BenchResult& result) {
  bool verified = result.keyframe.verified;
  for (const Variant* v : table_rows(r, result)) verified = verified && v->verified;
  return verified;
}

nlohmann::json bench_json(const Request& r, const BenchResult& result) {
  const Options& o = r.options;
  const uint64_t n = r.values;
  const double raw_bytes = static_cast<double>(r.raw_bytes);
  const double memcpy_GBps = raw_bytes / median(result.memcpy_s) / 1e9;
  auto gbps = [&](const std::vector<double>& s) { return s.empty() ? 0.0 : raw_bytes / median(s) / 1e9; };
  const Variant& primary = result.primary;
  nlohmann::json j;
  j["command"] = r.command;
  j["machine"] = machine_description();
  j["config"] = {{"dtype", o.dtype},   {"values", n},          {"block", o.block},
                 {"steps", o.steps},   {"warmup", o.warmup},   {"mode", o.mode},
                 {"detect", o.detect}, {"learning_rate", o.learning_rate},
                 {"checksum", !o.no_checksum}, {"seed", o.seed}, {"threads", 1}};
  j["memcpy_GBps"] = memcpy_GBps;
  j["encode_GBps"] = gbps(primary.encode_s);
  j["decode_GBps"] = gbps(primary.decode_s);
  j["encode_vs_memcpy"] = gbps(primary.encode_s) / memcpy_GBps;
  j["decode_vs_memcpy"] = gbps(primary.decode_s) / memcpy_GBps;
  j["bits_per_value"] = primary.bits_per_value(n);
  j["ratio_vs_raw"] = 8.0 * r.value_bytes / primary.bits_per_value(n);
  j["exponent_change_rate"] = result.changed_values / (static_cast<double>(n) * result.steady_frames);
  // Value-delta frames have no blocks of exponents: the rate means nothing there (null).
  j["block_change_rate"] = o.mode == "delta" ? nlohmann::json(nullptr)
                           : result.blocks_total > 0
                               ? nlohmann::json(result.changed_blocks / result.blocks_total)
                               : nlohmann::json(0.0);
  j["exponent_entropy_bits"] =
      result.coded_symbols > 0 ? result.coded_entropy_bits / result.coded_symbols : 0.0;
  j["entropy_coded_vs_bound"] = primary.entropy_coded_vs_bound();
  j["fine_frame_fraction"] = result.steady_frames ? static_cast<double>(result.fine_frames) / result.steady_frames : 0.0;
  j["warmup_key_frame_bits_per_value"] = result.keyframe.bits_per_value(n);
  j["warmup_key_frame_entropy_coded_vs_bound"] = result.keyframe.entropy_coded_vs_bound();
  if (result.difference_entropy_bits > 0) {
    const double per_value = result.difference_entropy_bits / (static_cast<double>(n) * result.steady_frames);
    j["difference_entropy_bits_per_value"] = per_value;
    j["bits_vs_difference_entropy"] = primary.bits_per_value(n) / per_value;
    j["value_change_rate"] = result.changed_patterns / (static_cast<double>(n) * result.steady_frames);
  }
  j["encoder_cache_bytes"] = result.encoder_cache_bytes;
  j["decoder_cache_bytes"] = result.decoder_cache_bytes;
  j["verified"] = all_verified(r, result);
  nlohmann::json comparisons = nlohmann::json::array();
  for (const Variant* v : table_rows(r, result)) {
    nlohmann::json c = {{"name", v->name},
                        {"note", v->note},
                        {"bits_per_value", v->bits_per_value(n)},
                        {"ratio_vs_raw", 8.0 * r.value_bytes / v->bits_per_value(n)},
                        {"encode_GBps", gbps(v->encode_s)},
                        {"decode_GBps", gbps(v->decode_s)},
                        {"samples", v->frames},
                        {"verified", v->verified}};
    if (v->entropy_bound_bytes > 0) c["entropy_coded_vs_bound"] = v->entropy_coded_vs_bound();
    c["lossy"] = v->lossy;
    if (v->lossy) {
      c["max_abs_error"] = v->max_abs_error;
      c["max_rel_error"] = v->max_rel_error;
    }
    comparisons.push_back(c);
  }
  j["comparisons"] = comparisons;
  return j;
}

std::string scientific(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", value);
  return text;
}

// A lossy row's error (`field`, max_abs_error or max_rel_error: a relative error of 1 is a value
// flushed to zero); "-" for a lossless row, "inf" where the JSON holds none (not finite).
std::string error_text(const nlohmann::json& row, bool lossy, const char* field) {
  if (!lossy) return "-";
  const auto found = row.find(field);
  return found != row.end() && found->is_number() ? scientific(found->get<double>()) : "inf";
}

// The table is rendered from the JSON object alone, so the two never disagree, and so that a
// report with rows added after the run (the Python entry point's zipnn row) renders the same way.
void print_report(const nlohmann::json& j, std::ostream& out) {
  const nlohmann::json& config = j.at("config");
  const uint64_t n = config.at("values").get<uint64_t>();
  const std::string dtype = config.at("dtype").get<std::string>();
  const uint64_t raw_bytes = n * dtype_info(parse_dtype(dtype)).value_bytes;
  const uint32_t warmup = config.at("warmup").get<uint32_t>();
  const double memcpy_GBps = j.at("memcpy_GBps").get<double>();
  out << "ciera bench codec: " << n << " " << dtype << " values, B=" << config.at("block").get<uint32_t>()
      << ", " << config.at("steps").get<uint32_t>() << " steps (" << warmup << " warmup), Adam lr "
      << config.at("learning_rate").get<double>() << ", single thread\n"
      << "machine: " << j.at("machine").get<std::string>() << "\n\n";
  Table t({"codec", "bits/value", "ratio", "encode GB/s", "decode GB/s", "enc/memcpy", "dec/memcpy",
           "max abs error", "max rel error", "verified"});
  bool lossy_rows = false;
  for (const nlohmann::json& c : j.at("comparisons")) {
    const double encode = c.at("encode_GBps").get<double>(), decode = c.at("decode_GBps").get<double>();
    const bool lossy = c.value("lossy", false);
    lossy_rows = lossy_rows || lossy;
    t.add({c.at("name").get<std::string>(), fixed(c.at("bits_per_value").get<double>(), 3),
           fixed(c.at("ratio_vs_raw").get<double>(), 3) + "x", fixed(encode, 2), fixed(decode, 2),
           fixed(encode / memcpy_GBps, 2), fixed(decode / memcpy_GBps, 2),
           error_text(c, lossy, "max_abs_error"), error_text(c, lossy, "max_rel_error"),
           c.at("verified").get<bool>() ? "yes" : "NO"});
  }
  const double efficiency = j.at("entropy_coded_vs_bound").get<double>();
  out << t.render() << "\n";
  out << "memcpy of the same " << raw_bytes << " bytes: " << fixed(memcpy_GBps, 2) << " GB/s\n"
      << "exponent change rate (steady state): "
      << fixed(100 * j.at("exponent_change_rate").get<double>(), 3) << "% of values per step\n"
      << (j.at("block_change_rate").is_null()
              ? std::string()
              : "block change rate (B=" + std::to_string(config.at("block").get<uint32_t>()) +
                    "): " + fixed(100 * j.at("block_change_rate").get<double>(), 1) +
                    "% of blocks per step\n")
      << "coded symbols: order-0 entropy " << fixed(j.at("exponent_entropy_bits").get<double>(), 3)
      << " bits; "
      << (efficiency > 0
              ? "rANS output " + fixed(100 * (efficiency - 1), 2) + "% above the entropy bound"
              : std::string("no stream was worth rANS-coding (packed or constant)"))
      << "\n"
      << (j.contains("difference_entropy_bits_per_value")
              ? "value differences: " + fixed(100 * j.at("value_change_rate").get<double>(), 2) +
                    "% of values change per step; order-0 entropy " +
                    fixed(j.at("difference_entropy_bits_per_value").get<double>(), 3) +
                    " bits/value; the frames take " +
                    fixed(j.at("bits_vs_difference_entropy").get<double>(), 3) + "x that\n"
              : std::string())
      << (config.at("mode").get<std::string>() == "delta"
              ? "first " + std::to_string(warmup) +
                    " steps (one key frame, then value-delta frames): "
              : std::string("warmup key frames: "))
      << fixed(j.at("warmup_key_frame_bits_per_value").get<double>(), 3) << " bits/value\n"
      << "verified bit-exact every step: " << (j.at("verified").get<bool>() ? "yes" : "NO")
      << (lossy_rows ? "; lossy rows: every receiver's reconstruction equals the sender's bit for "
                       "bit (max abs error = max |reconstruction - input|, max rel error = max "
                       "|reconstruction - input| / |input|, 1 where a value became 0)"
                     : "")
      << "\n";
}

int run(const Request& r) {
  const BenchResult result = measure(r);
  const nlohmann::json j = bench_json(r, result);
  if (r.options.json) {
    std::cout << json_text(j, 2) << std::endl;
  } else {
    print_report(j, std::cout);
  }
  return j["verified"].get<bool>() ? kExitDone : kExitNotExact;
}

// --render-json FILE: the table of a report written by --json (rows may have been added to it).
int render_saved(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    throw UsageError("--render-json " + path + ": a directory, not a report");
  std::ifstream file(path, std::ios::binary);
  if (!file) throw UsageError("--render-json " + path + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(file);
    print_report(j, std::cout);
    return j.at("verified").get<bool>() ? kExitDone : kExitNotExact;
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("--render-json " + path + ": not a `ciera bench codec --json` report (" +
                     e.what() + ")");
  }
}

}  // namespace

void register_bench_codec(CLI::App& bench, const std::string& command) {
  auto opts = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand("codec", "Shard codec on a realistic Adam trajectory, verified every step");
  cmd->footer(
      "Comparison rows: the paper's block mode, stateless exponent coding, zstd -1/-3 (lossless), "
      "zeropp-int8 and sdp4bit (lossy: their max error columns; verified = every receiver's "
      "reconstruction equals the sender's bit for bit, and zeropp-int8's each value within one "
      "quantisation step of its input). Run as the Python package's `ciera`, a "
      "zipnn row too, measured on the same shards (needs pip install 'ciera[peers]').\n\n" +
      std::string(kExitStatusHelp));
  cmd->add_option("--dtype", opts->dtype, "bf16 | fp16 | fp32")->capture_default_str();
  cmd->add_option("--values", opts->values, "values in the shard")->capture_default_str();
  cmd->add_option("--block", opts->block, "values per block (64..4096)")->capture_default_str();
  cmd->add_option("--steps", opts->steps, "optimizer steps, warmup included")->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "key-frame warmup steps")
      ->capture_default_str()
      ->each([opts](const std::string&) { opts->warmup_given = true; });
  cmd->add_option("--mode", opts->mode, "exponent coding: auto | block | fine; or delta (value-delta frames)")->capture_default_str();
  cmd->add_option("--detect", opts->detect, "change detection: exact | hash")->capture_default_str();
  cmd->add_option("--lr", opts->learning_rate, "Adam learning rate")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "trajectory seed")->capture_default_str();
  cmd->add_option("--sample-every", opts->sample_every,
                  "measure stateless/zstd/zeropp-int8 (and zipnn) every k steady steps")
      ->capture_default_str();
  cmd->add_flag("--no-checksum", opts->no_checksum, "omit the content checksum");
  cmd->add_flag("--no-compare", opts->no_compare,
                "skip the comparison rows (block, stateless, zstd, zeropp-int8, sdp4bit, zipnn)");
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->add_flag("--quiet", opts->quiet, "no progress output");
  cmd->add_option("--device", opts->device, "cpu | cuda (the GPU codec beside cudaMemcpy and nvCOMP)")
      ->capture_default_str();
  // For the Python entry point (python/ciera/bench_peers.py), hence hidden (group ""): the shards
  // the stateless rows were measured on, and the table of a report it added a row to.
  cmd->add_option("--save-shards", opts->save_shards, "write the sampled steady-state shards to FILE")
      ->group("");
  cmd->add_option("--render-json", opts->render_json, "render the table of a --json report FILE")
      ->group("");
  cmd->callback([opts, command]() {
    if (!opts->render_json.empty()) throw CommandExit(render_saved(opts->render_json));
    const Request request = parse_step([&] { return parse(*opts, command); });
    if (opts->device == "cuda") {
#if defined(CIERA_WITH_CUDA)
      DeviceBenchOptions device;
      device.config = request.config;
      device.values = request.values;
      device.steps = opts->steps;
      device.learning_rate = opts->learning_rate;
      device.seed = opts->seed;
      device.sample_every = opts->sample_every;
      device.json = opts->json;
      device.quiet = opts->quiet;
      throw CommandExit(run_bench_codec_cuda(device));
#else
      throw UsageError(
          "--device cuda: this build of ciera has no CUDA codec (build where nvcc is on "
          "the PATH, CIERA_CUDA=AUTO or ON)");
#endif
    }
    require(opts->device == "cpu", "--device must be cpu or cuda, not '" + opts->device + "'");
    throw CommandExit(run(request));
  });
}

}  // namespace ciera::tools
