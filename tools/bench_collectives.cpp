// `ciera bench alltoall`: CIERA's lossless alltoallv (LosslessCollectives) against MPI_Alltoallv
// of the same parts, in the same run: the token exchange of an expert-parallel MoE layer, each
// rank sending every token's hidden vector to the ranks of the experts it is routed to (top-2 of
// 8 experts per rank, drawn anew each step). The activations are synthetic (normal values with a
// log-normal scale per hidden channel, as RMS-normalised hidden states with outlier channels
// have) or read from a safetensors file of [tokens, hidden] BF16 tensors (`ciera train
// --capture-activations` writes the inputs of a run's MoE layers).
//
// `ciera bench reduce-scatter`: CIERA's lossless reduce-scatter against the same reduction
// uncompressed (the rank-order twin, whose bits it must match) and MPI_Reduce_scatter_block
// (FP32 only: MPI adds in its own order) on synthetic gradients (normal values, a log-normal
// scale per 4096-value block, as gradients of different layers and rows have).
//
// Every step checks CIERA's result byte for byte (against MPI_Alltoallv, or against the twin and
// the twin against a reference sum computed here in the documented order) and sums the wrong
// elements over ranks. Launched like `bench allgather` (ranks.hpp): under
// mpirun, or in the link lab with --link-gbit.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "analysis/safetensors.hpp"
#include "ciera/collectives.hpp"
#include "ciera/mpi.hpp"
#include "commands.hpp"
#include "common/floats.hpp"
#include "ranks.hpp"
#include "report.hpp"

namespace ciera::tools {
namespace {

struct Options {
  std::string collective;  // "alltoall" | "reduce-scatter"
  int ranks = 4;
  uint64_t tokens = 2048;     // alltoall: tokens per rank per step
  uint32_t hidden = 1024;     // alltoall: values per token (synthetic)
  bool hidden_given = false;
  uint64_t values = 4 << 20;  // reduce-scatter: output values per rank
  std::string dtype = "bf16";
  std::string input;  // alltoall: safetensors of [tokens, hidden] BF16 activations
  std::string coding = "exponent";
  uint64_t slice_values = CollectivesConfig{}.slice_values;
  uint64_t frame_values = CollectivesConfig{}.frame_values;
  unsigned threads = CollectivesConfig{}.worker_threads;
  int niceness = CollectivesConfig{}.worker_niceness;
  uint32_t steps = 20;
  uint32_t warmup = 3;
  bool warmup_given = false;
  double link_gbit = 0, delay_ms = 0;
  bool link_lab = false;
  uint64_t seed = 1;
  double timeout_s = 60;
  bool json = false, quiet = false, child = false;
};

struct Request {
  Options o;
  std::string command;
  DType dtype = DType::kBF16;
  CollectiveCoding coding = CollectiveCoding::kExponent;
  std::vector<uint16_t> activations;  // alltoall from --input: rows of `hidden` values
};

// Reduce-scatter's --dtype: BF16 or FP32 gradients, the only ones a refusal lists (the library
// also knows FP16, which this benchmark does not run). Alltoall carries BF16 activations.
DType gradient_dtype(const std::string& name) {
  std::optional<DType> dtype;
  try {
    dtype = parse_dtype(name);
  } catch (const ConfigError&) {
  }  // refused below, with the dtypes this benchmark runs
  require(dtype == DType::kBF16 || dtype == DType::kFP32,
          "--dtype must be bf16 or fp32 (gradients), got '" + name + "'");
  return *dtype;
}

CollectivesConfig config_of(const Request& r, CollectiveCoding coding);

Request parse(const Options& o, const std::string& command) {
  Request r;
  r.o = o;
  r.command = command;
  r.dtype = o.collective == "alltoall" ? DType::kBF16 : gradient_dtype(o.dtype);
  // The library's parser also takes raw, which is the baseline this benchmark runs anyway.
  require(
      o.coding == "exponent" || o.coding == "auto",
      "--coding must be exponent or auto (raw is the baseline this benchmark runs anyway), got '" +
          o.coding + "'");
  r.coding = parse_collective_coding(o.coding);
  require(o.ranks >= 2, "--ranks must be at least 2 (one rank has nobody to send to)");
  require(o.slice_values >= 1, "--slice-values must be at least 1");
  require(o.frame_values >= 1, "--frame-values must be at least 1");
  require_steps_after_warmup(o.steps, o.warmup, o.warmup_given);
  require(std::isfinite(o.timeout_s) && o.timeout_s > 0 && o.timeout_s <= 86400,
          "--timeout must be a number of seconds > 0 and at most 86400");
  require(std::isfinite(o.link_gbit) && o.link_gbit >= 0, "--link-gbit must be >= 0");
  require(std::isfinite(o.delay_ms) && o.delay_ms >= 0, "--delay-ms must be >= 0");
  require(o.delay_ms == 0 || o.link_gbit > 0 || o.link_lab,
          "--delay-ms delays the link lab's links: give --link-gbit or --link-lab too");
  require(!(o.link_gbit > 0 || o.link_lab) || o.ranks <= kLinkLabMaxRanks,
          "--ranks " + std::to_string(o.ranks) + ": the link lab has room for at most " +
              std::to_string(kLinkLabMaxRanks) + " ranks");
  const uint64_t value_bytes = dtype_info(r.dtype).value_bytes;
  if (o.collective == "alltoall") {
    require(o.tokens >= 1 && o.hidden >= 1, "--tokens and --hidden must be at least 1");
    if (!o.input.empty()) {
      require(!o.hidden_given, "--hidden: the activations of --input give the values per token");
      const SafetensorsFile file(o.input);
      for (const SafetensorsTensor& t : file.tensors()) {
        // Every tensor is activations: one of another dtype, or none, was skipped without a word.
        require(t.ciera_dtype == DType::kBF16,
                "--input " + o.input + ": tensor '" + t.name + "' is " + t.dtype +
                    "; --input takes BF16 activations [tokens, hidden]");
        require(t.shape.size() == 2, "--input " + o.input + ": tensor '" + t.name + "' has " +
                                         std::to_string(t.shape.size()) +
                                         " dimensions; activations are [tokens, hidden]");
        require(t.num_values > 0, "--input " + o.input + ": tensor '" + t.name +
                                      "' has no values (shape [" + std::to_string(t.shape[0]) +
                                      ", " + std::to_string(t.shape[1]) + "])");
        if (r.activations.empty()) r.o.hidden = static_cast<uint32_t>(t.shape.back());
        // One layer's activations: tensors of another width were dropped without a word.
        require(t.shape.back() == r.o.hidden,
                "--input " + o.input + ": tensor '" + t.name + "' has " +
                    std::to_string(t.shape.back()) + " values per token, the first tensor " +
                    std::to_string(r.o.hidden) + "; give a file of one hidden size");
        const size_t at = r.activations.size();
        r.activations.resize(at + t.num_values);
        std::memcpy(r.activations.data() + at, t.bytes.data(), t.bytes.size());
      }
      require(!r.activations.empty(), "--input " + o.input +
                                          ": no tensor in it; --input takes BF16 activations "
                                          "[tokens, hidden]");
    }
    // MPI_Alltoallv's counts are ints: the most a rank can send one peer is all its tokens, twice.
    // Divided, not multiplied: a product of large --tokens and --hidden would wrap around.
    require(o.tokens <= static_cast<uint64_t>(INT_MAX) /
                            (2 * value_bytes * std::max<uint64_t>(r.o.hidden, 1)),
            "--tokens x --hidden: more than 2^31 bytes for one peer, too large for MPI_Alltoallv");
  } else {
    require(o.values >= 1, "--values must be at least 1");
    require(o.values <= static_cast<uint64_t>(INT_MAX) / value_bytes,
            "--values: more than 2^31 bytes per rank, too large for MPI_Reduce_scatter_block");
  }
  // --threads, --frame-values and the rest as the library takes them: here, one line and status
  // 2, not an error from every rank under mpirun's abort.
  config_of(r, r.coding).validate();
  return r;
}

CollectivesConfig config_of(const Request& r, CollectiveCoding coding) {
  CollectivesConfig c;
  c.coding = coding;
  c.slice_values = r.o.slice_values;
  c.frame_values = r.o.frame_values;
  c.worker_threads = r.o.threads;
  c.worker_niceness = r.o.niceness;
  return c;
}

// CIERA's collectives with --coding and their uncoded twin, on one MPI transport that waits no
// longer than --timeout.
std::pair<LosslessCollectives, LosslessCollectives> contenders(const Request& r) {
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD, mpi_timeout());
  return {LosslessCollectives(transport, config_of(r, r.coding)),
          LosslessCollectives(transport, config_of(r, CollectiveCoding::kRaw))};
}

// ---- Data ------------------------------------------------------------------------------------

uint16_t bf16_of(float f) { return float_to_bf16(f); }

// Activation-like BF16 rows: channel c of every token ~ N(0, scale[c]), scale log-normal.
std::vector<uint16_t> synthetic_tokens(uint64_t tokens, uint32_t hidden, uint64_t seed) {
  std::mt19937_64 channels(12345), rng(seed);
  std::lognormal_distribution<float> channel_scale(0.0f, 0.7f);
  std::vector<float> scale(hidden);
  for (float& s : scale) s = channel_scale(channels);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> out(tokens * hidden);
  for (uint64_t t = 0; t < tokens; ++t)
    for (uint32_t c = 0; c < hidden; ++c) out[t * hidden + c] = bf16_of(normal(rng) * scale[c]);
  return out;
}

// Gradient-like values: N(0, s) with s log-normal per 4096-value block around 1e-4.
std::vector<std::byte> synthetic_gradients(DType dtype, uint64_t values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<float> block_scale(std::log(1e-4f), 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  std::vector<std::byte> out(values * value_bytes);
  float scale = 0;
  for (uint64_t i = 0; i < values; ++i) {
    if (i % 4096 == 0) scale = block_scale(rng);
    const float f = normal(rng) * scale;
    if (dtype == DType::kBF16) {
      const uint16_t b = bf16_of(f);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &f, 4);
    }
  }
  return out;
}

// ---- Measuring (every rank) ------------------------------------------------------------------

struct Result {
  int world = 0;
  // wire_bytes: the parts as sent and the call records and verdicts (control_bytes, also apart);
  // twin_bytes: the same for the uncoded twin, whose records MPI's own collective does not send.
  std::vector<double> raw_s, twin_s, ciera_s, raw_bytes, wire_bytes, control_bytes, twin_bytes,
      encode_s, decode_s, reduce_s, exchange_s;
  uint64_t wrong = 0, coded_values = 0, coded_exponent_bytes = 0;
  uint64_t busiest_raw = 0, busiest_wire = 0;  // over the steps: each call's busiest link
  double entropy_bits = 0;
  uint32_t hidden = 0;

  // One steady step: the three times (each the slowest rank's) and CIERA's stats (the twin's for
  // its bytes), the bytes and the coding summed over every rank (CollectiveStats holds this
  // rank's alone; until stop 67 rank 0's were reported as the mean link's); collective.
  void add_step(double raw, double twin, double ciera, const CollectiveStats& s,
                const CollectiveStats& twin_stats) {
    raw_s.push_back(raw);
    twin_s.push_back(twin);
    ciera_s.push_back(ciera);
    // Per rank, as "bytes sent/rank" says: the mean over ranks.
    raw_bytes.push_back(static_cast<double>(sum_over_ranks(s.raw_bytes)) / world);
    wire_bytes.push_back(static_cast<double>(sum_over_ranks(s.wire_bytes + s.control_bytes)) /
                         world);
    control_bytes.push_back(static_cast<double>(sum_over_ranks(s.control_bytes)) / world);
    twin_bytes.push_back(
        static_cast<double>(sum_over_ranks(twin_stats.wire_bytes + twin_stats.control_bytes)) /
        world);
    encode_s.push_back(max_over_ranks(s.encode_s));
    exchange_s.push_back(max_over_ranks(s.exchange_s));
    decode_s.push_back(max_over_ranks(s.decode_s));
    reduce_s.push_back(max_over_ranks(s.reduce_s));
    coded_values += sum_over_ranks(s.coded_values);
    coded_exponent_bytes += sum_over_ranks(s.coded_exponent_bytes);
    busiest_raw +=
        s.busiest_link_raw_bytes;  // the same on every rank (every rank reads every record)
    busiest_wire += s.busiest_link_wire_bytes;
    entropy_bits += sum_over_ranks(s.exponent_entropy_bits);
  }
};

// One step's token exchange: this rank's tokens, routed to ranks by top-2 of 8 experts per rank.
struct Exchange {
  std::vector<uint16_t> send;
  std::vector<uint64_t> send_values, recv_values;
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
};

Exchange route(const Request& r, int rank, int world, uint32_t step) {
  const uint64_t tokens = r.o.tokens;
  const uint32_t hidden = r.o.hidden;
  std::vector<uint16_t> mine;
  if (r.activations.empty()) {
    mine = synthetic_tokens(tokens, hidden,
                            r.o.seed * 1000003 + step * 131 + static_cast<uint64_t>(rank));
  } else {
    const uint64_t rows = r.activations.size() / hidden;
    mine.resize(tokens * hidden);
    for (uint64_t t = 0; t < tokens; ++t) {
      const uint64_t row = (static_cast<uint64_t>(rank) * tokens + step * 7919 + t) % rows;
      std::memcpy(mine.data() + t * hidden, r.activations.data() + row * hidden, hidden * 2);
    }
  }
  std::mt19937_64 rng(r.o.seed * 7 + step * 1009 + static_cast<uint64_t>(rank));
  const int experts = 8 * world;
  std::vector<std::vector<uint64_t>> to(static_cast<size_t>(world));
  for (uint64_t t = 0; t < tokens; ++t) {
    const int first = static_cast<int>(rng() % experts);
    int second = static_cast<int>(rng() % (experts - 1));
    if (second >= first) ++second;
    to[static_cast<size_t>(first / 8)].push_back(t);
    to[static_cast<size_t>(second / 8)].push_back(t);
  }
  Exchange x;
  x.send_values.resize(static_cast<size_t>(world));
  for (int p = 0; p < world; ++p) {
    x.send_displs.push_back(static_cast<int>(x.send.size()));
    for (uint64_t t : to[static_cast<size_t>(p)])
      x.send.insert(x.send.end(), mine.begin() + static_cast<ptrdiff_t>(t * hidden),
                    mine.begin() + static_cast<ptrdiff_t>((t + 1) * hidden));
    x.send_values[static_cast<size_t>(p)] = to[static_cast<size_t>(p)].size() * hidden;
    x.send_counts.push_back(static_cast<int>(x.send_values[static_cast<size_t>(p)]));
  }
  // What each peer sends here (the routing is known before the data moves, as in an MoE layer).
  x.recv_counts.resize(static_cast<size_t>(world));
  MPI_Request request;
  MPI_Ialltoall(x.send_counts.data(), 1, MPI_INT, x.recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD,
                &request);
  wait_all({&request, 1}, "MPI_Ialltoall (routing counts)");
  int received = 0;
  for (int p = 0; p < world; ++p) {
    x.recv_displs.push_back(received);
    received += x.recv_counts[static_cast<size_t>(p)];
    x.recv_values.push_back(static_cast<uint64_t>(x.recv_counts[static_cast<size_t>(p)]));
  }
  return x;
}

// Before each timed contender: the link lab's token bucket lets a burst through at once
// (max(rate / 400, 128 KiB)) after an idle spell and refills in about 2.5 ms at 1 Gbit/s; only
// the contender that followed data generation got it (MPI_Alltoallv measured 4.3 Gbit/s on a
// 1 Gbit/s link), so every contender now starts after the same idle spell.
void idle_gap() { std::this_thread::sleep_for(std::chrono::milliseconds(10)); }

Result measure_alltoall(const Request& r, int rank, int world) {
  auto [ciera, twin] = contenders(r);
  Result result;
  result.world = world;
  result.hidden = r.o.hidden;
  Progress progress("bench alltoall", r.o.steps, rank == 0 && !r.o.quiet);
  for (uint32_t step = 0; step < r.o.steps; ++step) {
    const Exchange x = route(r, rank, world, step);
    uint64_t total = 0;
    for (uint64_t v : x.recv_values) total += v;
    std::vector<uint16_t> raw_out(total), twin_out(total), ciera_out(total);
    barrier();
    idle_gap();
    Stopwatch raw_clock;
    MPI_Request request;
    MPI_Ialltoallv(x.send.data(), x.send_counts.data(), x.send_displs.data(), MPI_UINT16_T,
                   raw_out.data(), x.recv_counts.data(), x.recv_displs.data(), MPI_UINT16_T,
                   MPI_COMM_WORLD, &request);
    wait_all({&request, 1}, "MPI_Ialltoallv (the plain MPI baseline)");
    const double raw_s = max_over_ranks(raw_clock.seconds());
    // Both outputs start as the complement of MPI's: an element a call leaves unwritten is
    // wrong. (The coded call once wrote over the twin's correct output, so it could not fail
    // there, and the twin's own output went unchecked.)
    for (uint64_t i = 0; i < total; ++i)
      twin_out[i] = ciera_out[i] = static_cast<uint16_t>(~raw_out[i]);
    barrier();
    idle_gap();
    Stopwatch twin_clock;
    const CollectiveStats twin_stats =
        twin.alltoallv(DType::kBF16, std::as_bytes(std::span(x.send)), x.send_values,
                       std::as_writable_bytes(std::span(twin_out)), x.recv_values);
    const double twin_s = max_over_ranks(twin_clock.seconds());
    barrier();
    idle_gap();
    Stopwatch ciera_clock;
    const CollectiveStats s =
        ciera.alltoallv(DType::kBF16, std::as_bytes(std::span(x.send)), x.send_values,
                        std::as_writable_bytes(std::span(ciera_out)), x.recv_values);
    const double ciera_s = max_over_ranks(ciera_clock.seconds());
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < total; ++i)
      wrong += raw_out[i] != ciera_out[i] || raw_out[i] != twin_out[i];
    result.wrong += sum_over_ranks(wrong);
    if (step >= r.o.warmup) result.add_step(raw_s, twin_s, ciera_s, s, twin_stats);
    progress.update(step + 1, "raw " + fixed(raw_s * 1e3, 1) + " ms, ciera " +
                                  fixed(ciera_s * 1e3, 1) + " ms" +
                                  (result.wrong ? ", WRONG ELEMENTS" : ""));
  }
  progress.finish();
  return result;
}

// This rank's part of the reduce-scatter, computed here from every rank's input (each rank's is
// synthetic_gradients of its own seed, so any rank can make them all): the documented order,
// ((x0 + x1) + x2) + ... in FP32, BF16 widened exactly and rounded once to nearest even
// (docs/collectives.md). A reference apart from the collectives' code, so that a wrong
// reduction the coded call and its uncoded twin share cannot pass.
std::vector<std::byte> reference_reduce_scatter(DType dtype, uint64_t n, int rank, int world,
                                                const std::vector<uint64_t>& seeds) {
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  std::vector<float> sum(n);
  for (int from = 0; from < world; ++from) {
    const auto input = synthetic_gradients(dtype, n * static_cast<uint64_t>(world), seeds[from]);
    const std::byte* part = input.data() + static_cast<uint64_t>(rank) * n * value_bytes;
    for (uint64_t i = 0; i < n; ++i) {
      float x;
      if (dtype == DType::kBF16) {
        uint16_t b;
        std::memcpy(&b, part + 2 * i, 2);
        x = bf16_to_float(b);
      } else {
        std::memcpy(&x, part + 4 * i, 4);
      }
      sum[i] = from == 0 ? x : sum[i] + x;  // x0 itself, not 0 + x0: a -0 stays -0
    }
  }
  std::vector<std::byte> out(n * value_bytes);
  for (uint64_t i = 0; i < n; ++i) {
    if (dtype == DType::kBF16) {
      const uint16_t b = bf16_of(sum[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &sum[i], 4);
    }
  }
  return out;
}

uint64_t gradient_seed(const Request& r, uint32_t step, int rank) {
  return r.o.seed * 1000003 + step * 131 + static_cast<uint64_t>(rank);
}

Result measure_reduce_scatter(const Request& r, int rank, int world) {
  auto [ciera, twin] = contenders(r);
  const uint64_t n = r.o.values;
  const uint32_t value_bytes = dtype_info(r.dtype).value_bytes;
  std::vector<std::byte> ciera_out(n * value_bytes), twin_out(n * value_bytes),
      mpi_out(n * value_bytes);
  Result result;
  result.world = world;
  Progress progress("bench reduce-scatter", r.o.steps, rank == 0 && !r.o.quiet);
  for (uint32_t step = 0; step < r.o.steps; ++step) {
    const auto input = synthetic_gradients(r.dtype, n * static_cast<uint64_t>(world),
                                           gradient_seed(r, step, rank));
    double raw_s = 0;
    if (r.dtype == DType::kFP32) {  // MPI has no BF16 sum
      barrier();
      idle_gap();
      Stopwatch raw_clock;
      MPI_Request request;
      MPI_Ireduce_scatter_block(input.data(), mpi_out.data(), static_cast<int>(n), MPI_FLOAT,
                                MPI_SUM, MPI_COMM_WORLD, &request);
      wait_all({&request, 1}, "MPI_Ireduce_scatter_block (MPI's own reduction)");
      raw_s = max_over_ranks(raw_clock.seconds());
    }
    barrier();
    idle_gap();
    Stopwatch twin_clock;
    const CollectiveStats twin_stats =
        twin.reduce_scatter(r.dtype, ReduceOp::kSum, input, twin_out);
    const double twin_s = max_over_ranks(twin_clock.seconds());
    // The complement of the twin's result: an element the coded call leaves unwritten is wrong
    // (the buffer held the previous step's, or zeros, which an unwritten element matched).
    for (size_t i = 0; i < ciera_out.size(); ++i) ciera_out[i] = ~twin_out[i];
    barrier();
    idle_gap();
    Stopwatch ciera_clock;
    const CollectiveStats s = ciera.reduce_scatter(r.dtype, ReduceOp::kSum, input, ciera_out);
    const double ciera_s = max_over_ranks(ciera_clock.seconds());
    std::vector<uint64_t> seeds(static_cast<size_t>(world));
    for (int from = 0; from < world; ++from) seeds[from] = gradient_seed(r, step, from);
    const auto reference = reference_reduce_scatter(r.dtype, n, rank, world, seeds);
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = i * value_bytes;
      wrong += std::memcmp(ciera_out.data() + at, twin_out.data() + at, value_bytes) != 0 ||
               std::memcmp(twin_out.data() + at, reference.data() + at, value_bytes) != 0;
    }
    result.wrong += sum_over_ranks(wrong);
    if (step >= r.o.warmup) result.add_step(raw_s, twin_s, ciera_s, s, twin_stats);
    progress.update(step + 1, "twin " + fixed(twin_s * 1e3, 1) + " ms, ciera " +
                                  fixed(ciera_s * 1e3, 1) + " ms" +
                                  (result.wrong ? ", WRONG ELEMENTS" : ""));
  }
  progress.finish();
  return result;
}

// ---- Rendering (rank 0) ----------------------------------------------------------------------

nlohmann::json to_json(const Request& r, const Result& x) {
  const Options& o = r.o;
  const bool alltoall = o.collective == "alltoall";
  // Bytes and coding over every rank's coded parts (summed over ranks by add_step); wire and the
  // twin's bytes with the call records and verdicts.
  double raw = 0, wire = 0, control = 0, twin_bytes = 0;
  for (size_t i = 0; i < x.raw_bytes.size(); ++i) {
    raw += x.raw_bytes[i], wire += x.wire_bytes[i];
    control += x.control_bytes[i], twin_bytes += x.twin_bytes[i];
  }
  nlohmann::json j;
  j["command"] = r.command;
  j["machine"] = machine_description();
  j["config"] = {{"collective", o.collective}, {"ranks", x.world},       {"dtype", o.dtype},
                 {"coding", o.coding},         {"steps", o.steps},       {"warmup", o.warmup},
                 {"link_gbit", o.link_gbit},   {"delay_ms", o.delay_ms}, {"seed", o.seed},
                 {"transport", "mpi"}};
  j["config"]["slice_values"] = o.slice_values;
  j["config"]["frame_values"] = o.frame_values;
  j["config"]["threads"] = o.threads;
  j["config"]["worker_niceness"] = o.niceness;
  if (alltoall) {
    j["config"]["tokens"] = o.tokens;
    j["config"]["hidden"] = x.hidden;
    j["config"]["input"] = o.input.empty() ? "synthetic" : o.input;
    j["mpi_ms"] = median(x.raw_s) * 1e3;
    j["twin_ms"] = median(x.twin_s) * 1e3;
    j["speedup"] = median(x.raw_s) / median(x.ciera_s);
    j["speedup_over_twin"] = median(x.twin_s) / median(x.ciera_s);
  } else {
    j["config"]["values"] = o.values;
    j["mpi_ms"] =
        r.dtype == DType::kFP32 ? nlohmann::json(median(x.raw_s) * 1e3) : nlohmann::json(nullptr);
    j["twin_ms"] = median(x.twin_s) * 1e3;
    j["speedup"] = median(x.twin_s) / median(x.ciera_s);
    j["reduce_ms"] = median(x.reduce_s) * 1e3;
  }
  j["ciera_ms"] = median(x.ciera_s) * 1e3;
  // Means, as the ratio below: medians beside a ratio of sums disagreed under --coding auto.
  const double steps = std::max<double>(1.0, static_cast<double>(x.raw_bytes.size()));
  j["bytes_raw"] = raw / steps;
  j["bytes_wire"] = wire / steps;        // all CIERA sent: the parts and bytes_control
  j["bytes_control"] = control / steps;  // its call records and verdicts
  j["bytes_twin"] = twin_bytes / steps;  // the uncoded twin's parts and records
  // Over all CIERA sent: MPI's own collective sends bytes_raw, no records (the twin's are more).
  j["ratio"] = wire > 0 ? raw / wire : 0.0;
  j["bits_per_value"] = raw > 0 ? 8.0 * dtype_info(r.dtype).value_bytes * wire / raw : 0.0;
  j["speedup_over_ratio"] =
      j["ratio"].get<double>() > 0 ? j["speedup"].get<double>() / j["ratio"].get<double>() : 0.0;
  // The slowest link's ratio (CollectiveStats::busiest_link_*): the speedup the links allow.
  j["busiest_link_ratio"] =
      x.busiest_wire > 0 ? static_cast<double>(x.busiest_raw) / x.busiest_wire : 0.0;
  j["encode_ms"] = median(x.encode_s) * 1e3;
  j["decode_ms"] = median(x.decode_s) * 1e3;
  j["exchange_ms"] = median(x.exchange_s) * 1e3;
  j["exponent_bits_per_value"] =
      x.coded_values ? 8.0 * x.coded_exponent_bytes / x.coded_values : 0.0;
  j["exponent_entropy_per_value"] = x.coded_values ? x.entropy_bits / x.coded_values : 0.0;
  // No ratio to an entropy of 0 (all exponents alike: an expert that got no tokens): null.
  j["exponent_overhead_vs_entropy"] =
      x.entropy_bits > 0 ? nlohmann::json(8.0 * x.coded_exponent_bytes / x.entropy_bits - 1)
                         : nlohmann::json(nullptr);
  j["wrong_elements"] = x.wrong;
  j["verified"] = x.wrong == 0;
  return j;
}

void print_report(const Request& r, const nlohmann::json& j, std::ostream& out) {
  const Options& o = r.o;
  const bool alltoall = o.collective == "alltoall";
  out << "ciera bench " << o.collective << ": " << j["config"]["ranks"].get<int>() << " ranks, "
      << (alltoall ? std::to_string(o.tokens) + " tokens x " +
                         std::to_string(j["config"]["hidden"].get<uint32_t>()) +
                         " bf16 per rank, top-2 of 8 experts per rank (" +
                         j["config"]["input"].get<std::string>() + ")"
                   : std::to_string(o.values) + " " + o.dtype +
                         " values out per rank (synthetic gradients)")
      << ", " << o.steps << " steps (" << o.warmup << " warmup), links "
      << describe_links({o.link_gbit, o.delay_ms, o.link_lab})
      << "\nmachine: " << j["machine"].get<std::string>() << "\n\n";
  Table t({"", "time/step (ms)", "bytes sent/rank"});
  // CIERA's rows with their call records and verdicts, which the MPI rows do not send.
  const std::string raw_bytes = fixed(j["bytes_raw"].get<double>(), 0);
  const std::string twin_bytes = fixed(j["bytes_twin"].get<double>(), 0);
  if (alltoall) {
    t.add({"MPI_Alltoallv (raw)", fixed(j["mpi_ms"].get<double>(), 2), raw_bytes});
    t.add({"CIERA, raw (the same protocol, uncoded)", fixed(j["twin_ms"].get<double>(), 2),
           twin_bytes});
  } else {
    if (!j["mpi_ms"].is_null())
      t.add({"MPI_Reduce_scatter_block (its own order)", fixed(j["mpi_ms"].get<double>(), 2),
             raw_bytes});
    t.add({"CIERA, rank order, raw (the twin)", fixed(j["twin_ms"].get<double>(), 2), twin_bytes});
  }
  t.add({"CIERA, rank order, " + o.coding, fixed(j["ciera_ms"].get<double>(), 2),
         fixed(j["bytes_wire"].get<double>(), 0)});
  out << t.render() << "\nCIERA's bytes hold its call records and verdicts ("
      << fixed(j["bytes_control"].get<double>(), 0) << " in the " << o.coding
      << " row), which MPI does not send"
      << "\nspeedup " << fixed(j["speedup"].get<double>(), 3) << "x over "
      << (alltoall ? "MPI" : "the twin") << ", byte ratio " << fixed(j["ratio"].get<double>(), 3)
      << "x (" << fixed(j["bits_per_value"].get<double>(), 2) << " bits/value); speedup / ratio "
      << fixed(j["speedup_over_ratio"].get<double>(), 3) << "\nbusiest link: byte ratio "
      << fixed(j["busiest_link_ratio"].get<double>(), 3)
      << "x (the most one rank sent or received in a call; the ratio above is the mean link's)"
      << "\ncoded exponents: " << fixed(j["exponent_bits_per_value"].get<double>(), 3)
      << " bits/value as sent, order-0 entropy "
      << fixed(j["exponent_entropy_per_value"].get<double>(), 3) << " ("
      << (j["exponent_overhead_vs_entropy"].is_null()
              ? std::string("no entropy to compare with")
              : fixed(100 * j["exponent_overhead_vs_entropy"].get<double>(), 2) + "% above")
      << ")\n"
      << "wrong elements (all ranks, all steps): " << j["wrong_elements"].get<uint64_t>() << "\n";
}

int run_child(const Request& r) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != r.o.ranks) {
    throw UsageError("launched with " + std::to_string(world) + " ranks but --ranks is " +
                     std::to_string(r.o.ranks));
  }
  const Result result = r.o.collective == "alltoall" ? measure_alltoall(r, rank, world)
                                                     : measure_reduce_scatter(r, rank, world);
  if (rank == 0) {
    const nlohmann::json j = to_json(r, result);
    if (r.o.json) {
      std::cout << json_text(j, 2) << std::endl;
    } else {
      print_report(r, j, std::cout);
    }
  }
  barrier();
  return result.wrong == 0 ? kExitDone : kExitNotExact;
}

void add_common_options(CLI::App* cmd, const std::shared_ptr<Options>& o) {
  cmd->add_option("--ranks", o->ranks, "ranks (processes)")->capture_default_str();
  cmd->add_option("--coding", o->coding,
                  "exponent (parts coded where smaller) | auto (coded or raw, "
                  "whichever the ranks measure faster)")
      ->capture_default_str();
  cmd->add_option(
         "--slice-values", o->slice_values,
         "values per slice: parts move in rounds of one slice each, coding overlapping the "
         "exchange")
      ->capture_default_str();
  cmd->add_option("--frame-values", o->frame_values,
                  "values per coded frame within a slice, each with an rANS table of its own")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "worker threads coding beside the exchange (0: none)")
      ->capture_default_str();
  cmd->add_option("--worker-niceness", o->niceness,
                  "the workers' nice value, 0..19: above 0 they give way to the transport's thread")
      ->check(CLI::Range(0, 19))
      ->capture_default_str();
  cmd->add_option("--steps", o->steps, "exchanges, warmup included")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "exchanges left out of the medians")
      ->capture_default_str()
      ->each([o](const std::string&) { o->warmup_given = true; });
  cmd->add_option("--link-gbit", o->link_gbit,
                  "shape every link to this rate (link lab; 0 = no lab)")
      ->capture_default_str();
  cmd->add_option("--delay-ms", o->delay_ms, "one-way link delay in the link lab")
      ->capture_default_str();
  cmd->add_flag("--link-lab", o->link_lab,
                "run in the link lab even without shaping (TCP over veth)");
  cmd->add_option("--seed", o->seed, "data and routing seed")->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "seconds a collective may wait for peers")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object (rank 0)");
  cmd->add_flag("--quiet", o->quiet, "no progress output");
  cmd->add_flag("--child", o->child, "internal: this process is one launched rank")->group("");
}

[[noreturn]] void run(const std::shared_ptr<Options>& o, const std::string& command, int argc,
                      char** argv) {
  Request request = parse_step([&] { return parse(*o, command); });
  const Links links =
      launch_or_join(o->ranks, {o->link_gbit, o->delay_ms, o->link_lab}, o->child, argc, argv);
  request.o.link_gbit = links.link_gbit;
  request.o.delay_ms = links.delay_ms;
  request.o.link_lab = links.link_lab;
  throw CommandExit(
      run_mpi_rank(request.o.timeout_s, argc, argv, [&] { return run_child(request); }));
}

}  // namespace

void register_bench_collectives(CLI::App& bench, const std::string& command, int argc,
                                char** argv) {
  auto a = std::make_shared<Options>();
  a->collective = "alltoall";
  CLI::App* alltoall = bench.add_subcommand(
      "alltoall",
      "Lossless alltoallv of MoE token activations vs MPI_Alltoallv, verified every step");
  add_common_options(alltoall, a);
  alltoall->add_option("--tokens", a->tokens, "tokens per rank per step")->capture_default_str();
  alltoall->add_option("--hidden", a->hidden, "values per token (synthetic activations)")
      ->capture_default_str()
      ->each([a](const std::string&) { a->hidden_given = true; });
  alltoall->add_option(
      "--input", a->input,
      "safetensors of [tokens, hidden] BF16 activations (ciera train --capture-activations) "
      "instead of synthetic ones; their rows are reused in turn when --tokens (per rank, per "
      "step) asks for more than the file holds");
  alltoall->callback([a, command, argc, argv]() { run(a, command, argc, argv); });

  auto s = std::make_shared<Options>();
  s->collective = "reduce-scatter";
  s->dtype = "fp32";
  CLI::App* scatter =
      bench.add_subcommand("reduce-scatter",
                           "Lossless reduce-scatter of gradients vs the same reduction "
                           "uncompressed, verified bit for bit every step");
  add_common_options(scatter, s);
  scatter->add_option("--values", s->values, "output values per rank")->capture_default_str();
  scatter->add_option("--dtype", s->dtype, "fp32 | bf16 gradients")->capture_default_str();
  scatter->callback([s, command, argc, argv]() { run(s, command, argc, argv); });
}

}  // namespace ciera::tools
