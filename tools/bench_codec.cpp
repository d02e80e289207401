// `ciera bench codec`: the shard codec on a realistic training trajectory, verified every step,
// against memcpy, the paper's block mode, stateless exponent coding and zstd, all in one run.
#include <zstd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ciera/ciera.hpp"
#include "commands.hpp"
#include "common/huge_pages.hpp"
#include "report.hpp"
#include "trajectory.hpp"

namespace ciera::tools {
namespace {

struct Options {
  std::string dtype = "bf16";
  uint64_t values = 16ull << 20;
  uint32_t block = 512;
  uint32_t steps = 100;
  uint32_t warmup = 30;
  std::string mode = "auto";
  std::string detect = "exact";
  double learning_rate = 1e-4;
  uint64_t seed = 1;
  uint32_t sample_every = 10;
  bool no_checksum = false;
  bool no_compare = false;
  bool json = false;
  bool quiet = false;
};

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

  void add(double enc, double dec, uint64_t bytes, bool ok) {
    encode_s.push_back(enc);
    decode_s.push_back(dec);
    wire_bytes += static_cast<double>(bytes);
    ++frames;
    verified = verified && ok;
  }
  double bits_per_value(uint64_t n) const { return frames ? 8 * wire_bytes / frames / n : 0; }
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

int run(const Options& o, const std::string& command) {
  CodecConfig config;
  config.dtype = parse_dtype(o.dtype);
  config.block_values = o.block;
  config.warmup_steps = o.warmup;
  config.coding = parse_exponent_coding(o.mode);
  config.detection = parse_change_detection(o.detect);
  config.content_checksum = !o.no_checksum;
  config.validate();
  if (o.steps <= o.warmup) throw ConfigError("--steps must exceed --warmup to measure a steady state");
  const uint64_t n = o.values;
  const uint32_t value_bytes = dtype_info(config.dtype).value_bytes;
  const uint64_t raw_bytes = n * value_bytes;

  TrajectoryOptions topt;
  topt.num_values = n;
  topt.dtype = config.dtype;
  topt.learning_rate = o.learning_rate;
  topt.seed = o.seed;
  AdamTrajectory trajectory(topt);

  CieraPair primary(config, n);
  std::optional<CieraPair> block_pair;
  if (!o.no_compare && config.coding != ExponentCoding::kBlock) {
    CodecConfig block_config = config;
    block_config.coding = ExponentCoding::kBlock;
    block_pair.emplace(block_config, n);
  }
  Variant primary_v{"ciera-" + o.mode, "exponent reuse, " + o.detect + " detection"};
  Variant block_v{"ciera-block", "paper's block mode (Algorithm 1)"};
  Variant stateless_v{"stateless", "all exponents rANS-coded every step (ZipCCL-style)"};
  Variant zstd1_v{"zstd-1", "zstd level 1 on the raw shard"};
  Variant zstd3_v{"zstd-3", "zstd level 3 on the raw shard"};
  Variant keyframe_v{"warmup key frames", ""};

  std::vector<double> memcpy_s;
  Buffer copy(raw_bytes);
  Buffer stateless_payload(max_payload_bytes(config.dtype, n, config.block_values));
  Buffer stateless_out(raw_bytes);
  Buffer zstd_buf(ZSTD_compressBound(raw_bytes));
  Buffer zstd_out(raw_bytes);
  std::vector<uint8_t> previous_exps(n), current_exps(n);
  double changed_values = 0, changed_blocks = 0, blocks_total = 0, coded_symbols = 0,
         coded_entropy_bits = 0;
  uint64_t fine_frames = 0, steady_frames = 0;

  Progress progress("bench codec", o.steps, !o.quiet);
  for (uint32_t step = 0; step < o.steps; ++step) {
    if (step > 0) trajectory.step();
    const auto values = trajectory.values();
    exponents_of(config.dtype, values, current_exps);
    const bool steady = step >= o.warmup;

    Stopwatch copy_clock;
    std::memcpy(copy.data(), values.data(), raw_bytes);
    const double copy_s = copy_clock.seconds();

    const StepResult r = run_pair(primary, values);
    if (!r.ok) primary_v.verified = false;
    if (steady) {
      memcpy_s.push_back(copy_s);
      primary_v.add(r.encode_s, r.decode_s, r.sent.payload_bytes, r.ok);
      primary_v.entropy_coded_bytes += static_cast<double>(r.sent.entropy_coded_bytes);
      primary_v.entropy_bound_bytes += r.sent.entropy_bound_bytes;
      uint64_t changed = 0;
      for (uint64_t i = 0; i < n; ++i) changed += previous_exps[i] != current_exps[i];
      changed_values += static_cast<double>(changed);
      changed_blocks += static_cast<double>(r.sent.changed_blocks);
      blocks_total += static_cast<double>(r.sent.blocks);
      coded_symbols += static_cast<double>(r.sent.coded_symbols);
      coded_entropy_bits += r.sent.coded_symbols_entropy_bits;
      fine_frames += r.sent.section == ExponentSection::kFine;
      ++steady_frames;
    } else {
      keyframe_v.add(r.encode_s, r.decode_s, r.sent.payload_bytes, r.ok);
      keyframe_v.entropy_coded_bytes += static_cast<double>(r.sent.entropy_coded_bytes);
      keyframe_v.entropy_bound_bytes += r.sent.entropy_bound_bytes;
    }
    if (block_pair) {
      const StepResult b = run_pair(*block_pair, values);
      if (steady) {
        block_v.add(b.encode_s, b.decode_s, b.sent.payload_bytes, b.ok);
        block_v.entropy_coded_bytes += static_cast<double>(b.sent.entropy_coded_bytes);
        block_v.entropy_bound_bytes += b.sent.entropy_bound_bytes;
      } else if (!b.ok) {
        block_v.verified = false;
      }
    }
    // Stateless coders need no history, so they are measured on a sample of steady steps.
    if (steady && !o.no_compare && (step - o.warmup) % o.sample_every == 0) {
      Stopwatch enc;
      const size_t len = encode_stateless(config, values, stateless_payload);
      const double enc_s = enc.seconds();
      Stopwatch dec;
      decode_stateless(config, {stateless_payload.data(), len}, stateless_out);
      const double dec_s = dec.seconds();
      stateless_v.add(enc_s, dec_s, len, std::memcmp(stateless_out.data(), values.data(), raw_bytes) == 0);
      for (auto [level, variant] : {std::pair{1, &zstd1_v}, std::pair{3, &zstd3_v}}) {
        Stopwatch zc;
        const size_t zlen = ZSTD_compress(zstd_buf.data(), zstd_buf.size(), values.data(), raw_bytes, level);
        const double zc_s = zc.seconds();
        if (ZSTD_isError(zlen)) throw Error(std::string("zstd: ") + ZSTD_getErrorName(zlen));
        Stopwatch zd;
        const size_t dlen = ZSTD_decompress(zstd_out.data(), zstd_out.size(), zstd_buf.data(), zlen);
        const double zd_s = zd.seconds();
        variant->add(zc_s, zd_s, zlen,
                     !ZSTD_isError(dlen) && dlen == raw_bytes &&
                         std::memcmp(zstd_out.data(), values.data(), raw_bytes) == 0);
      }
    }
    std::swap(previous_exps, current_exps);
    progress.update(step + 1, steady ? fixed(primary_v.bits_per_value(n), 3) + " bits/value" : "warmup");
  }
  progress.finish();

  const double memcpy_GBps = raw_bytes / median(memcpy_s) / 1e9;
  auto gbps = [&](const std::vector<double>& s) { return s.empty() ? 0.0 : raw_bytes / median(s) / 1e9; };
  std::vector<const Variant*> rows = {&primary_v};
  if (block_pair) rows.push_back(&block_v);
  if (!o.no_compare) {
    rows.push_back(&stateless_v);
    rows.push_back(&zstd1_v);
    rows.push_back(&zstd3_v);
  }
  bool verified = true;
  for (const Variant* v : rows) verified = verified && v->verified;
  verified = verified && keyframe_v.verified;
  const double efficiency = primary_v.entropy_bound_bytes > 0
                                ? primary_v.entropy_coded_bytes / primary_v.entropy_bound_bytes
                                : 0.0;

  nlohmann::json j;
  j["command"] = command;
  j["machine"] = machine_description();
  j["config"] = {{"dtype", o.dtype},   {"values", n},          {"block", o.block},
                 {"steps", o.steps},   {"warmup", o.warmup},   {"mode", o.mode},
                 {"detect", o.detect}, {"learning_rate", o.learning_rate},
                 {"checksum", !o.no_checksum}, {"seed", o.seed}, {"threads", 1}};
  j["memcpy_GBps"] = memcpy_GBps;
  j["encode_GBps"] = gbps(primary_v.encode_s);
  j["decode_GBps"] = gbps(primary_v.decode_s);
  j["encode_vs_memcpy"] = gbps(primary_v.encode_s) / memcpy_GBps;
  j["decode_vs_memcpy"] = gbps(primary_v.decode_s) / memcpy_GBps;
  j["bits_per_value"] = primary_v.bits_per_value(n);
  j["ratio_vs_raw"] = 8.0 * value_bytes / primary_v.bits_per_value(n);
  j["exponent_change_rate"] = changed_values / (static_cast<double>(n) * steady_frames);
  j["block_change_rate"] = blocks_total > 0 ? changed_blocks / blocks_total : 0.0;
  j["exponent_entropy_bits"] = coded_symbols > 0 ? coded_entropy_bits / coded_symbols : 0.0;
  j["entropy_coded_vs_bound"] = efficiency;
  j["fine_frame_fraction"] = steady_frames ? static_cast<double>(fine_frames) / steady_frames : 0.0;
  j["warmup_key_frame_bits_per_value"] = keyframe_v.bits_per_value(n);
  j["warmup_key_frame_entropy_coded_vs_bound"] =
      keyframe_v.entropy_bound_bytes > 0 ? keyframe_v.entropy_coded_bytes / keyframe_v.entropy_bound_bytes : 0.0;
  j["encoder_cache_bytes"] = primary.encoder.cache_bytes();
  j["decoder_cache_bytes"] = primary.decoder.cache_bytes();
  j["verified"] = verified;
  nlohmann::json comparisons = nlohmann::json::array();
  for (const Variant* v : rows) {
    nlohmann::json c = {{"name", v->name},
                        {"note", v->note},
                        {"bits_per_value", v->bits_per_value(n)},
                        {"ratio_vs_raw", 8.0 * value_bytes / v->bits_per_value(n)},
                        {"encode_GBps", gbps(v->encode_s)},
                        {"decode_GBps", gbps(v->decode_s)},
                        {"samples", v->frames},
                        {"verified", v->verified}};
    if (v->entropy_bound_bytes > 0) c["entropy_coded_vs_bound"] = v->entropy_coded_bytes / v->entropy_bound_bytes;
    comparisons.push_back(c);
  }
  j["comparisons"] = comparisons;

  if (o.json) {
    std::cout << j.dump(2) << std::endl;
  } else {
    std::cout << "ciera bench codec: " << n << " " << o.dtype << " values, B=" << o.block << ", "
              << o.steps << " steps (" << o.warmup << " warmup), Adam lr " << o.learning_rate
              << ", single thread\n"
              << "machine: " << machine_description() << "\n\n";
    Table t({"codec", "bits/value", "ratio", "encode GB/s", "decode GB/s", "enc/memcpy",
             "dec/memcpy", "verified"});
    for (const Variant* v : rows) {
      t.add({v->name, fixed(v->bits_per_value(n), 3), fixed(8.0 * value_bytes / v->bits_per_value(n), 3) + "x",
             fixed(gbps(v->encode_s), 2), fixed(gbps(v->decode_s), 2),
             fixed(gbps(v->encode_s) / memcpy_GBps, 2), fixed(gbps(v->decode_s) / memcpy_GBps, 2),
             v->verified ? "yes" : "NO"});
    }
    std::cout << t.render() << "\n";
    std::cout << "memcpy of the same " << raw_bytes << " bytes: " << fixed(memcpy_GBps, 2) << " GB/s\n"
              << "exponent change rate (steady state): " << fixed(100 * j["exponent_change_rate"].get<double>(), 3) << "% of values per step\n"
              << "block change rate (B=" << o.block << "): " << fixed(100 * j["block_change_rate"].get<double>(), 1) << "% of blocks per step\n"
              << "coded symbols: order-0 entropy " << fixed(j["exponent_entropy_bits"].get<double>(), 3)
              << " bits; "
              << (efficiency > 0 ? "rANS output " + fixed(100 * (efficiency - 1), 2) + "% above the entropy bound"
                                 : std::string("no stream was worth rANS-coding (packed or constant)"))
              << "\n"
              << "warmup key frames: " << fixed(keyframe_v.bits_per_value(n), 3) << " bits/value\n"
              << "verified bit-exact every step: " << (verified ? "yes" : "NO") << "\n";
  }
  return verified ? 0 : 1;
}

}  // namespace

void register_bench_codec(CLI::App& bench, const std::string& command) {
  auto opts = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand("codec", "Shard codec on a realistic Adam trajectory, verified every step");
  cmd->add_option("--dtype", opts->dtype, "bf16 | fp16 | fp32")->capture_default_str();
  cmd->add_option("--values", opts->values, "values in the shard")->capture_default_str();
  cmd->add_option("--block", opts->block, "values per block (64..4096)")->capture_default_str();
  cmd->add_option("--steps", opts->steps, "optimizer steps, warmup included")->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "key-frame warmup steps")->capture_default_str();
  cmd->add_option("--mode", opts->mode, "exponent coding: auto | block | fine")->capture_default_str();
  cmd->add_option("--detect", opts->detect, "change detection: exact | hash")->capture_default_str();
  cmd->add_option("--lr", opts->learning_rate, "Adam learning rate")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "trajectory seed")->capture_default_str();
  cmd->add_option("--sample-every", opts->sample_every, "measure stateless/zstd every k steady steps")->capture_default_str();
  cmd->add_flag("--no-checksum", opts->no_checksum, "omit the content checksum");
  cmd->add_flag("--no-compare", opts->no_compare, "skip the block/stateless/zstd comparison rows");
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->add_flag("--quiet", opts->quiet, "no progress output");
  cmd->callback([opts, command]() { throw CommandExit(run(*opts, command)); });
}

}  // namespace ciera::tools
