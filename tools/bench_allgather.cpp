// `ciera bench allgather`: the compressed allgather engine against plain MPI_Allgatherv of the
// same inputs, in the same run, over W ranks (optionally through the link lab's shaped links).
// `ciera bench broadcast`: the same for a weight broadcast (one rank's buffers to all others,
// as a trainer sends each step's weights to replicas that keep the last ones) against
// MPI_Bcast: the engine gathers a bucket that only the root holds values of. Every step checks
// the engine's output against the raw result byte for byte on every rank and sums the wrong
// elements over ranks, as nccl-tests does.
//
// Run without MPI around it, the command launches itself: under mpirun, or under
// scripts/linklab.sh when --link-gbit is given (with --nodes K --ranks-per-node R, the lab's
// two-level network: R ranks per node, one shaped uplink per node). In the lab the report also
// counts the bytes each contender puts on the uplinks: the inter-node traffic. Parse (every option
// checked, before any rank is launched) -> measure on every rank (an AllgatherResult on rank 0) ->
// render (table or JSON).
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ciera/ciera.hpp"
#include "ciera/engine.hpp"
#include "ciera/mpi.hpp"
#include "commands.hpp"
#if defined(CIERA_WITH_NCCL)
#include "bench_allgather_cuda.hpp"
#endif
#include "ranks.hpp"
#include "report.hpp"
#include "trajectory.hpp"

namespace ciera::tools {
namespace {

// The command line as CLI11 binds it: raw values, not yet checked.
struct Options {
  int ranks = 4;
  bool ranks_given = false;
  int nodes = 0;  // with ranks_per_node: the link lab's two-level network
  int ranks_per_node = 0;
  bool nodes_given = false;  // either of the two
  uint64_t params = 16ull << 20;
  std::string dtype = "bf16";
  uint32_t steps = 60;
  uint32_t warmup = 30;  // 1 with --codec delta unless given: value-delta frames have no warmup
  bool warmup_given = false;
  uint32_t buckets = 4;
  uint32_t block = 512;
  double link_gbit = 0;
  double delay_ms = 0;
  bool link_lab = false;
  std::string codec = "ciera";
  unsigned threads = 1;
  double lr = 1e-4;
  uint64_t seed = 1;
  double timeout_s = 60;
  bool json = false;
  bool quiet = false;
  bool child = false;
  std::string device = "cpu";
  std::string sizes;  // --device cuda
  bool broadcast = false;  // `ciera bench broadcast`
  int root = 0;
};

struct Request {
  Options options;  // as given, ranks = nodes x ranks_per_node (the link lab's environment may
                    // override the links on a rank)
  std::string command;
  DType dtype = DType::kBF16;
  uint32_t value_bytes = 2;
};

Request parse(const Options& o, const std::string& command) {
  Request r;
  r.options = o;
  r.command = command;
  r.dtype = parse_dtype(o.dtype);
  r.value_bytes = dtype_info(r.dtype).value_bytes;
  const bool lab = o.link_gbit > 0 || o.link_lab;
  if (o.nodes_given) {
    require(o.nodes >= 1 && o.ranks_per_node >= 1,
            "--nodes and --ranks-per-node go together, each at least 1");
    const int64_t world = int64_t{o.nodes} * o.ranks_per_node;
    require(!o.ranks_given || o.ranks == world,
            "--ranks " + std::to_string(o.ranks) + " disagrees with --nodes " +
                std::to_string(o.nodes) + " --ranks-per-node " + std::to_string(o.ranks_per_node) +
                " (" + std::to_string(world) + " ranks)");
    // Without the lab every rank shares one host's memory: nodes would be a label only.
    require(lab,
            "--nodes and --ranks-per-node place the ranks on the link lab's nodes; add "
            "--link-gbit G (or --link-lab)");
    require(world <= kLinkLabMaxRanks, "--nodes " + std::to_string(o.nodes) + " --ranks-per-node " +
                                           std::to_string(o.ranks_per_node) +
                                           ": the link lab has room for at most " +
                                           std::to_string(kLinkLabMaxRanks) + " ranks");
    r.options.ranks = static_cast<int>(world);
  }
  require(r.options.ranks >= 2, "--ranks must be at least 2 (one rank has nobody to send to)");
  require(o.sizes.empty(),
          "--sizes applies to --device cuda; on the CPU --params and --buckets size the gathers");
  require(o.params >= 1, "--params must be at least 1");
  require(o.buckets >= 1, "--buckets must be at least 1");
  require(o.buckets <= o.params, "--buckets must not exceed --params");
  // MPI_Allgatherv counts and displacements are ints: the largest (last) bucket must fit.
  const uint64_t per_bucket = o.params / o.buckets;
  const uint64_t last_bucket = o.params - per_bucket * (o.buckets - 1);
  require(last_bucket <= static_cast<uint64_t>(INT_MAX) / r.value_bytes,
          "--params " + std::to_string(o.params) + " in " + std::to_string(o.buckets) +
              " buckets makes a bucket of more than 2^31 bytes, too large for MPI_Allgatherv; "
              "use more --buckets");
  // As `ciera train --codec delta`: the first step carries the key frames, every later one is
  // the steady state.
  require(o.codec == "raw" || o.codec == "ciera" || o.codec == "auto" || o.codec == "delta",
          "--codec must be raw, ciera, auto or delta");
  if (o.codec == "delta" && !o.warmup_given) r.options.warmup = 1;
  // The engine's first compressed gather carries key frames (every exponent; for delta every
  // value): the last warmup step, never one of the steady steps the figures describe.
  require(o.codec == "raw" || r.options.warmup >= 1,
          "--warmup must be at least 1 with --codec " + o.codec +
              ": the first compressed gather carries the key frames, outside the steady state");
  require_steps_after_warmup(o.steps, r.options.warmup, o.warmup_given);
  CodecConfig codec;
  codec.dtype = r.dtype;
  require_block_option(o.block);
  // The engine checks it too, but only once every rank has started: one line here instead.
  require(o.threads <= kMaxWorkerThreads, "--threads must be at most " +
                                              std::to_string(kMaxWorkerThreads) + " (got " +
                                              std::to_string(o.threads) + ")");
  codec.block_values = o.block;
  codec.validate();
  require(
      !o.broadcast || (o.root >= 0 && o.root < r.options.ranks),
      "--root " + std::to_string(o.root) + " is not a rank of " + std::to_string(r.options.ranks));
  require(std::isfinite(o.lr) && o.lr > 0, "--lr must be a finite number > 0");
  require(std::isfinite(o.timeout_s) && o.timeout_s > 0 && o.timeout_s <= 86400,
          "--timeout must be a number of seconds > 0 and at most 86400");
  require(std::isfinite(o.link_gbit) && o.link_gbit >= 0, "--link-gbit must be >= 0");
  require(std::isfinite(o.delay_ms) && o.delay_ms >= 0, "--delay-ms must be >= 0");
  require(o.delay_ms == 0 || lab,
          "--delay-ms delays the link lab's links: give --link-gbit or --link-lab too");
  // The link lab puts the ranks on one /24 beside its hub (scripts/linklab.sh).
  require(!lab || o.ranks <= kLinkLabMaxRanks, "--ranks " + std::to_string(o.ranks) +
                                                   ": the link lab has room for at most " +
                                                   std::to_string(kLinkLabMaxRanks) + " ranks");
  return r;
}

// The model: `buckets` layers of equal size, each one flat parameter sharded FSDP-style, or for
// a broadcast held whole by the root (the other ranks hold none of it: an allgather of such a
// bucket is a broadcast).
std::vector<BucketLayout> make_layouts(const Request& r, int world) {
  const Options& o = r.options;
  std::vector<BucketLayout> layouts;
  const uint64_t per_bucket = o.params / o.buckets;
  const ShardPolicy policy = o.codec == "auto" ? ShardPolicy::kCiera : parse_shard_policy(o.codec);
  for (uint32_t b = 0; b < o.buckets; ++b) {
    const std::string name = "layer" + std::to_string(b);
    const uint64_t values = b + 1 == o.buckets ? o.params - per_bucket * b : per_bucket;
    if (!o.broadcast) {
      layouts.push_back(BucketLayout::fsdp_split(name, r.dtype, {values}, world, policy));
      continue;
    }
    BucketLayout l;
    l.name = name;
    l.dtype = r.dtype;
    l.shard_values.assign(static_cast<size_t>(world), {0});
    l.shard_values[static_cast<size_t>(o.root)] = {values};
    l.policy = {policy};
    layouts.push_back(std::move(l));
  }
  return layouts;
}

// Each rank simulates only its own shards of the global trajectory.
std::vector<std::unique_ptr<AdamTrajectory>> make_shards(const Request& r,
                                                         const std::vector<BucketLayout>& layouts,
                                                         int rank) {
  std::vector<std::unique_ptr<AdamTrajectory>> shards;
  uint64_t global_first = 0;
  for (const BucketLayout& l : layouts) {
    TrajectoryOptions t;
    t.num_values = l.rank_values(rank);
    t.first_index = global_first + l.rank_offset(rank) / r.value_bytes;
    t.dtype = r.dtype;
    t.learning_rate = r.options.lr;
    t.seed = r.options.seed;
    shards.push_back(std::make_unique<AdamTrajectory>(t));
    global_first += l.total_bytes() / r.value_bytes;
  }
  return shards;
}

// Per-step medians' inputs (steady steps, slowest rank) and the totals, as rank 0 reports them.
struct AllgatherResult {
  int world = 0;
  uint64_t raw_bytes = 0;  // one step's gathered output, all buckets
  std::vector<double> raw_s, ciera_s, wire_bytes, control_bytes, encode_s, decode_s, exchange_s;
  // The link lab's inter-node bytes in each contender's part of a step (uplink_bytes_sent()),
  // empty outside the lab.
  std::vector<double> inter_node_raw_bytes, inter_node_ciera_bytes;
  uint64_t wrong_total = 0;
  size_t cache_bytes_per_rank = 0;
};

// One step's times, each the slowest rank's.
struct StepTimes {
  double raw_s = 0, ciera_s = 0;
  // This rank's. wire_bytes: all the engine sent (every rank's payloads, and control_bytes of
  // control records and verdicts, which MPI does not send).
  double wire_bytes = 0, control_bytes = 0, encode_s = 0, decode_s = 0, exchange_s = 0;
};

// The gathers of one run: the shards, the engine, and both outputs of every bucket.
class AllgatherBench {
 public:
  AllgatherBench(const Request& r, int rank, int world)
      : request_(r),
        rank_(rank),
        layouts_(make_layouts(r, world)),
        shards_(make_shards(r, layouts_, rank)),
        transport_(make_mpi_transport(MPI_COMM_WORLD, mpi_timeout())),
        raw_out_(layouts_.size()),
        ciera_out_(layouts_.size()),
        counts_(layouts_.size()),
        displs_(layouts_.size()) {
    EngineConfig config;
    config.codec.block_values = r.options.block;
    // Raw until the last warmup step, which carries the key frames (check_options).
    config.warmup_steps = r.options.warmup > 0 ? r.options.warmup - 1 : 0;
    config.worker_threads = r.options.threads;
    config.adaptive = r.options.codec == "auto";
    config.timeout = mpi_timeout();  // --timeout, as run_mpi_rank took it
    engine_ = std::make_unique<CompressedAllgather>(*transport_, config, layouts_);
    for (size_t b = 0; b < layouts_.size(); ++b) {
      raw_out_[b].resize(layouts_[b].total_bytes());
      ciera_out_[b].resize(layouts_[b].total_bytes());
      for (int peer = 0; peer < world; ++peer) {
        counts_[b].push_back(static_cast<int>(layouts_[b].rank_bytes(peer)));
        displs_[b].push_back(static_cast<int>(layouts_[b].rank_offset(peer)));
      }
    }
  }

  uint64_t raw_bytes() const {
    uint64_t total = 0;
    for (const BucketLayout& l : layouts_) total += l.total_bytes();
    return total;
  }
  size_t cache_bytes() const { return engine_->cache_bytes(); }

  void advance() {
    for (auto& s : shards_) s->step();
  }

  // Raw baseline: nonblocking MPI_Allgatherv (or MPI_Ibcast) of every bucket, then wait for all.
  double gather_raw() {
    const bool broadcast = request_.options.broadcast;
    const int root = request_.options.root;
    if (broadcast && rank_ == root) {
      // The root broadcasts from the buffer it holds its weights in.
      for (size_t b = 0; b < layouts_.size(); ++b) {
        std::memcpy(raw_out_[b].data(), shards_[b]->values().data(), raw_out_[b].size());
      }
    }
    barrier();
    Stopwatch raw_clock;
    std::vector<MPI_Request> requests(layouts_.size());
    for (size_t b = 0; b < layouts_.size(); ++b) {
      if (broadcast) {
        MPI_Ibcast(raw_out_[b].data(), counts_[b][root], MPI_BYTE, root, MPI_COMM_WORLD, &requests[b]);
      } else {
        MPI_Iallgatherv(shards_[b]->values().data(), counts_[b][rank_], MPI_BYTE, raw_out_[b].data(),
                        counts_[b].data(), displs_[b].data(), MPI_BYTE, MPI_COMM_WORLD, &requests[b]);
      }
    }
    wait_all(requests, broadcast ? "MPI_Ibcast (the plain MPI baseline)"
                                 : "MPI_Iallgatherv (the plain MPI baseline)");
    return max_over_ranks(raw_clock.seconds());
  }

  // The engine: every bucket started at once (encoding overlaps the exchanges), then waited.
  // Its outputs first hold the complement of MPI's (gather_raw() runs first), so a value the
  // engine left unwritten (a receiver's stale copy from the step before) cannot match.
  void gather_engine(StepTimes& t) {
    for (size_t b = 0; b < layouts_.size(); ++b) {
      for (size_t i = 0; i < ciera_out_[b].size(); ++i) ciera_out_[b][i] = ~raw_out_[b][i];
    }
    barrier();
    Stopwatch ciera_clock;
    std::vector<CompressedAllgather::Ticket> tickets;
    for (size_t b = 0; b < layouts_.size(); ++b) tickets.push_back(engine_->start(b, shards_[b]->values(), ciera_out_[b]));
    for (auto ticket : tickets) {
      const GatherStats s = engine_->wait(ticket);
      t.wire_bytes += static_cast<double>(s.wire_bytes + s.control_bytes);
      t.control_bytes += static_cast<double>(s.control_bytes);
      t.encode_s = std::max(t.encode_s, s.encode_s);
      t.decode_s += s.decode_s;
      // Gathers batched into one round share its exchange, and each reports all of it.
      t.exchange_s = std::max(t.exchange_s, s.exchange_s);
    }
    t.ciera_s = max_over_ranks(ciera_clock.seconds());
  }

  // Elements where the engine's output differs from MPI's, summed over all ranks.
  uint64_t wrong_elements() const {
    const uint32_t vb = request_.value_bytes;
    uint64_t wrong = 0;
    for (size_t b = 0; b < layouts_.size(); ++b) {
      for (size_t i = 0; i < raw_out_[b].size(); i += vb) {
        wrong += std::memcmp(raw_out_[b].data() + i, ciera_out_[b].data() + i, vb) != 0;
      }
    }
    return sum_over_ranks(wrong);
  }

 private:
  const Request& request_;
  int rank_;
  std::vector<BucketLayout> layouts_;
  std::vector<std::unique_ptr<AdamTrajectory>> shards_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<CompressedAllgather> engine_;
  std::vector<std::vector<std::byte>> raw_out_, ciera_out_;
  std::vector<std::vector<int>> counts_, displs_;
};

AllgatherResult measure(const Request& r, int rank, int world) {
  const Options& o = r.options;
  AllgatherBench bench(r, rank, world);
  AllgatherResult result;
  result.world = world;
  result.raw_bytes = bench.raw_bytes();
  Progress progress(o.broadcast ? "bench broadcast" : "bench allgather", o.steps, rank == 0 && !o.quiet);
  const bool counting_uplinks = rank == 0 && uplink_bytes_sent().has_value();
  const auto uplink_bytes = [&] { return counting_uplinks ? uplink_bytes_sent().value_or(0) : 0; };
  for (uint32_t step = 0; step < o.steps; ++step) {
    if (step > 0) bench.advance();
    StepTimes t;
    // Each reading follows a collective every rank has finished, so between two of them lie one
    // contender's gathers plus a barrier and an allreduce (a few hundred bytes).
    const uint64_t before_raw = uplink_bytes();
    t.raw_s = bench.gather_raw();
    const uint64_t before_ciera = uplink_bytes();
    bench.gather_engine(t);
    const uint64_t after = uplink_bytes();
    result.wrong_total += bench.wrong_elements();
    if (step >= o.warmup && counting_uplinks) {
      result.inter_node_raw_bytes.push_back(static_cast<double>(before_ciera - before_raw));
      result.inter_node_ciera_bytes.push_back(static_cast<double>(after - before_ciera));
    }
    if (step >= o.warmup) {
      result.raw_s.push_back(t.raw_s);
      result.ciera_s.push_back(t.ciera_s);
      result.wire_bytes.push_back(t.wire_bytes);
      result.control_bytes.push_back(t.control_bytes);
      result.encode_s.push_back(max_over_ranks(t.encode_s));
      result.decode_s.push_back(max_over_ranks(t.decode_s));
      result.exchange_s.push_back(max_over_ranks(t.exchange_s));
    }
    progress.update(step + 1, "raw " + fixed(t.raw_s * 1e3, 1) + " ms, ciera " + fixed(t.ciera_s * 1e3, 1) +
                                  " ms" + (result.wrong_total ? ", WRONG ELEMENTS" : ""));
  }
  progress.finish();
  result.cache_bytes_per_rank = bench.cache_bytes();
  return result;
}

// ---- Rendering (rank 0) --------------------------------------------------------------------

nlohmann::json allgather_json(const Request& r, const AllgatherResult& result) {
  const Options& o = r.options;
  const double raw_ms = median(result.raw_s) * 1e3;
  const double ciera_ms = median(result.ciera_s) * 1e3;
  // Bytes are means (with --codec auto, steps of either mode: a median would drop the few
  // probes of the other), times medians.
  const double wire = mean(result.wire_bytes);
  const double raw_bytes = static_cast<double>(result.raw_bytes);
  const double algbw = raw_bytes / (ciera_ms / 1e3) / 1e9;
  const double raw_algbw = raw_bytes / (raw_ms / 1e3) / 1e9;
  // nccl-tests' bus bandwidth: (W-1)/W of the algorithm bandwidth for an allgather, all of it
  // for a broadcast.
  const double bus = o.broadcast ? 1.0 : static_cast<double>(result.world - 1) / result.world;
  nlohmann::json j;
  j["command"] = r.command;
  j["machine"] = machine_description();
  j["config"] = {{"ranks", result.world},   {"params", o.params},   {"dtype", o.dtype},
                 {"steps", o.steps},        {"warmup", o.warmup},   {"buckets", o.buckets},
                 {"block", o.block},        {"codec", o.codec},     {"link_gbit", o.link_gbit},
                 {"delay_ms", o.delay_ms},  {"threads", o.threads}, {"transport", "mpi"},
                 {"lr", o.lr},              {"seed", o.seed},
                 {"collective", o.broadcast ? "broadcast" : "allgather"}};
  if (o.broadcast) j["config"]["root"] = o.root;
  j["config"]["nodes"] = o.nodes;  // ranks n*R .. n*R+R-1 share node n (Links)
  j["config"]["ranks_per_node"] = o.ranks_per_node;
  j["raw_ms"] = raw_ms;
  j["ciera_ms"] = ciera_ms;
  j["speedup"] = raw_ms / ciera_ms;
  j["bytes_raw"] = result.raw_bytes;
  j["bytes_wire"] = wire;
  j["bytes_control"] = mean(result.control_bytes);  // of bytes_wire
  j["ratio"] = raw_bytes / wire;
  j["algbw_GBps"] = algbw;
  j["busbw_GBps"] = algbw * bus;
  j["raw_algbw_GBps"] = raw_algbw;
  j["raw_busbw_GBps"] = raw_algbw * bus;
  j["encode_ms"] = median(result.encode_s) * 1e3;
  j["decode_ms"] = median(result.decode_s) * 1e3;
  j["exchange_ms"] = median(result.exchange_s) * 1e3;
  j["wrong_elements"] = result.wrong_total;
  j["verified"] = result.wrong_total == 0;
  j["cache_bytes_per_rank"] = result.cache_bytes_per_rank;
  if (!result.inter_node_raw_bytes.empty()) {
    j["inter_node_bytes_raw"] = median(result.inter_node_raw_bytes);
    j["inter_node_bytes_ciera"] = median(result.inter_node_ciera_bytes);
  }
  return j;
}

// The table reads the same numbers as the JSON object, so the two never disagree.
void print_report(const Request& r, const nlohmann::json& j, std::ostream& out) {
  const Options& o = r.options;
  const double raw_ms = j["raw_ms"].get<double>(), ciera_ms = j["ciera_ms"].get<double>();
  const double raw_algbw = j["raw_algbw_GBps"].get<double>(), algbw = j["algbw_GBps"].get<double>();
  const int world = j["config"]["ranks"].get<int>();
  const double bus = o.broadcast ? 1.0 : static_cast<double>(world - 1) / world;
  const uint64_t raw_bytes = j["bytes_raw"].get<uint64_t>();
  const double wire = j["bytes_wire"].get<double>();
  out << (o.broadcast ? "ciera bench broadcast (root " + std::to_string(o.root) + "): "
                      : std::string("ciera bench allgather: "))
      << world << " ranks, " << o.params << " " << o.dtype << " params in " << o.buckets
      << " buckets, " << o.steps << " steps (" << o.warmup << " warmup), links "
      << describe_links({o.link_gbit, o.delay_ms, o.link_lab, o.nodes, o.ranks_per_node})
      << "\nmachine: " << j["machine"].get<std::string>() << "\n\n";
  Table t({"", "time/step (ms)", "wire bytes", "algbw GB/s", "busbw GB/s"});
  t.add({o.broadcast ? "MPI_Bcast (raw)" : "MPI_Allgatherv (raw)", fixed(raw_ms, 2), std::to_string(raw_bytes), fixed(raw_algbw, 3), fixed(raw_algbw * bus, 3)});
  t.add({"CIERA engine (" + o.codec + ")", fixed(ciera_ms, 2), fixed(wire, 0), fixed(algbw, 3), fixed(algbw * bus, 3)});
  out << t.render() << "\n"
      << "speedup " << fixed(raw_ms / ciera_ms, 3) << "x, wire ratio " << fixed(raw_bytes / wire, 3)
      << "x; engine time split (slowest rank, medians): encode "
      << fixed(j["encode_ms"].get<double>(), 2) << " ms (overlapped), exchange "
      << fixed(j["exchange_ms"].get<double>(), 2) << " ms, decode "
      << fixed(j["decode_ms"].get<double>(), 2) << " ms\n"
      << "wire bytes are means over the steady steps; the engine's hold "
      << fixed(j["bytes_control"].get<double>(), 0)
      << " of control records and verdicts, which MPI does not send\n"
      << "wrong elements (all ranks, all steps): " << j["wrong_elements"].get<uint64_t>() << "\n";
  if (j.contains("inter_node_bytes_raw")) {
    const double raw_inter = j["inter_node_bytes_raw"].get<double>();
    const double ciera_inter = j["inter_node_bytes_ciera"].get<double>();
    out << "inter-node bytes per step (all node uplinks, frames whole, medians): "
        << (o.broadcast ? "MPI_Bcast " : "MPI_Allgatherv ") << fixed(raw_inter, 0) << ", engine "
        << fixed(ciera_inter, 0) << " (" << fixed(raw_inter / ciera_inter, 3) << "x fewer)\n";
  }
}

int run_child(const Request& r) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != r.options.ranks) {
    throw UsageError("launched with " + std::to_string(world) + " ranks but --ranks is " +
                     std::to_string(r.options.ranks));
  }
  const AllgatherResult result = measure(r, rank, world);
  if (rank == 0) {
    const nlohmann::json j = allgather_json(r, result);
    if (r.options.json) {
      std::cout << json_text(j, 2) << std::endl;
    } else {
      print_report(r, j, std::cout);
    }
  }
  barrier();
  return result.wrong_total == 0 ? kExitDone : kExitNotExact;
}

// --device cuda: ncclAllGather against the engine on device memory (bench_allgather_cuda.hpp).
int run_cuda(const Options& o, const std::string& command) {
#if defined(CIERA_WITH_NCCL)
  const NcclBenchOptions options = parse_step([&] {
    require(o.link_gbit == 0 && !o.link_lab && !o.nodes_given,
            "--link-gbit, --link-lab, --nodes and --ranks-per-node apply to --device cpu");
    require(o.codec == "ciera",
            "--codec applies to --device cpu; on --device cuda the engine codes every shard with "
            "exponent reuse (ciera) against ncclAllGather");
    NcclBenchOptions d;
    d.ranks = o.ranks;
    d.dtype = o.dtype;
    d.sizes = o.sizes.empty()
                  ? std::vector<uint64_t>{o.params * dtype_info(parse_dtype(o.dtype)).value_bytes}
                  : parse_byte_sizes(o.sizes, "--sizes");
    d.steps = o.steps;
    d.warmup = o.warmup;
    d.block = o.block;
    d.threads = o.threads;
    d.lr = o.lr;
    d.seed = o.seed;
    d.timeout_s = o.timeout_s;
    d.json = o.json;
    d.quiet = o.quiet;
    d.command = command;
    check_nccl_bench_options(d);
    return d;
  });
  return run_bench_allgather_cuda(options);
#else
  (void)o;
  (void)command;
  throw UsageError(
      "--device cuda: this build of ciera has no NCCL transport (build with nvcc and "
      "nccl.h: scripts/nccl-header.sh)");
#endif
}

}  // namespace

namespace {

// The options `bench allgather` and `bench broadcast` share.
void add_options(CLI::App* cmd, const std::shared_ptr<Options>& o) {
  cmd->add_option("--ranks", o->ranks, "ranks (processes)")
      ->capture_default_str()
      ->each([o](const std::string&) { o->ranks_given = true; });
  cmd->add_option("--nodes", o->nodes,
                  "link lab nodes, one shaped uplink each (with --ranks-per-node; ranks = "
                  "nodes x ranks per node)")
      ->each([o](const std::string&) { o->nodes_given = true; });
  cmd->add_option("--ranks-per-node", o->ranks_per_node,
                  "link lab ranks sharing each node's uplink (unshaped links between them)")
      ->each([o](const std::string&) { o->nodes_given = true; });
  cmd->add_option("--params", o->params, "parameters in the model")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "bf16 | fp16 | fp32")->capture_default_str();
  cmd->add_option("--steps", o->steps, "optimizer steps, warmup included")->capture_default_str();
  cmd->add_option("--warmup", o->warmup,
                  "steps before the steady state reported; the engine's raw warmup before exponent "
                  "reuse (default: 30; 1 with --codec delta, which has no warmup)")
      ->each([o](const std::string&) { o->warmup_given = true; });
  cmd->add_option("--buckets", o->buckets, "layers the parameters are split into")->capture_default_str();
  cmd->add_option("--block", o->block, "values per block")->capture_default_str();
  cmd->add_option("--link-gbit", o->link_gbit,
                  "shape every link (with --nodes: every node's uplink) to this rate (link lab; "
                  "0 = no lab)")
      ->capture_default_str();
  cmd->add_option("--delay-ms", o->delay_ms, "one-way link delay in the link lab")->capture_default_str();
  cmd->add_flag("--link-lab", o->link_lab, "run in the link lab even without shaping (TCP over veth)");
  cmd->add_option(
         "--codec", o->codec,
         "engine: raw (no coding), ciera (exponent reuse, always), auto (whichever of raw and "
         "ciera is faster here, for the whole engine, re-probed now and then), delta (value-delta "
         "frames: receivers keep the previous values)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads,
                  "engine worker threads per rank (0: each rank codes on its calling thread)")
      ->capture_default_str();
  cmd->add_option("--lr", o->lr, "Adam learning rate of the trajectory")->capture_default_str();
  cmd->add_option("--seed", o->seed, "trajectory seed")->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "seconds a collective may wait for peers")->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object (rank 0)");
  cmd->add_flag("--quiet", o->quiet, "no progress output");
  cmd->add_flag("--child", o->child, "internal: this process is one launched rank")->group("");
}

// Checks the options, then (from the command line) launches the ranks, or (as one of them) runs.
[[noreturn]] void run_cpu(const std::shared_ptr<Options>& o, const std::string& command, int argc, char** argv) {
  Request request = parse_step([&] { return parse(*o, command); });
  Options& r = request.options;
  const Links links =
      launch_or_join(r.ranks, {r.link_gbit, r.delay_ms, r.link_lab, r.nodes, r.ranks_per_node},
                     r.child, argc, argv);
  r.link_gbit = links.link_gbit;
  r.delay_ms = links.delay_ms;
  r.link_lab = links.link_lab;
  r.nodes = links.nodes;
  r.ranks_per_node = links.ranks_per_node;
  throw CommandExit(run_mpi_rank(r.timeout_s, argc, argv, [&] { return run_child(request); }));
}

}  // namespace

void register_bench_allgather(CLI::App& bench, const std::string& command, int argc, char** argv) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand("allgather", "Compressed allgather engine vs MPI_Allgatherv, verified every step");
  add_options(cmd, o);
  cmd->add_option("--device", o->device,
                  "cpu (ranks are MPI processes) | cuda (ranks are threads on the GPUs, over NCCL)")
      ->capture_default_str();
  cmd->add_option("--sizes", o->sizes, "--device cuda: bytes per allgather, e.g. 4M,64M,256M (default: --params)");
  cmd->callback([o, command, argc, argv]() {
    if (o->device == "cuda") throw CommandExit(run_cuda(*o, command));
    require(o->device == "cpu", "--device must be cpu or cuda, not '" + o->device + "'");
    run_cpu(o, command, argc, argv);
  });
}

void register_bench_broadcast(CLI::App& bench, const std::string& command, int argc, char** argv) {
  auto o = std::make_shared<Options>();
  o->broadcast = true;
  o->codec = "delta";
  CLI::App* cmd = bench.add_subcommand(
      "broadcast", "Weight broadcast from one rank through the engine vs MPI_Bcast, verified every step");
  add_options(cmd, o);
  cmd->add_option("--root", o->root, "the rank whose weights are broadcast")->capture_default_str();
  cmd->callback([o, command, argc, argv]() { run_cpu(o, command, argc, argv); });
}

}  // namespace ciera::tools
