// `ciera bench allgather`: the compressed allgather engine against plain MPI_Allgatherv of the
// same inputs, in the same run, over W ranks (optionally through the link lab's shaped links).
// Every step checks the engine's output against the raw result byte for byte on every rank and
// sums the wrong elements over ranks, as nccl-tests does.
//
// Run without MPI around it, the command launches itself: under mpirun, or under
// scripts/linklab.sh when --link-gbit is given.
#include <mpi.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ciera/ciera.hpp"
#include "ciera/engine.hpp"
#include "ciera/mpi.hpp"
#include "commands.hpp"
#include "report.hpp"
#include "trajectory.hpp"

#ifndef CIERA_SOURCE_DIR
#define CIERA_SOURCE_DIR "."
#endif
#ifndef CIERA_MPIEXEC
#define CIERA_MPIEXEC "mpirun"
#endif

namespace ciera::tools {
namespace {

struct Options {
  int ranks = 4;
  uint64_t params = 16ull << 20;
  std::string dtype = "bf16";
  uint32_t steps = 60;
  uint32_t warmup = 30;
  uint32_t buckets = 4;
  uint32_t block = 512;
  double link_gbit = 0;
  double delay_ms = 0;
  bool link_lab = false;
  std::string codec = "ciera";
  unsigned threads = 1;
  double lr = 1e-4;
  uint64_t seed = 1;
  double timeout_s = 300;
  bool json = false;
  bool quiet = false;
  bool child = false;
};

bool under_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_RANK") != nullptr; }

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string linklab_script() {
  if (const char* p = std::getenv("CIERA_LINKLAB")) return p;
  return std::string(CIERA_SOURCE_DIR) + "/scripts/linklab.sh";
}

// Re-executes this command under mpirun or the link lab with --child appended.
[[noreturn]] void launch(const Options& o, int argc, char** argv) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw Error("cannot find the ciera executable to launch ranks");
  self[n] = '\0';
  std::vector<std::string> child = {self};
  for (int i = 1; i < argc; ++i) child.push_back(argv[i]);
  child.push_back("--child");
  std::vector<std::string> cmd;
  if (o.link_gbit > 0 || o.link_lab) {
    cmd = {linklab_script(), "--ranks", std::to_string(o.ranks), "--gbit", fixed(o.link_gbit, 3),
           "--delay-ms", fixed(o.delay_ms, 3), "--"};
  } else {
    cmd = {CIERA_MPIEXEC, "--oversubscribe", "--allow-run-as-root", "--mca", "mpi_yield_when_idle", "1",
           "-np", std::to_string(o.ranks)};
  }
  cmd.insert(cmd.end(), child.begin(), child.end());
  std::vector<char*> args;
  for (auto& a : cmd) args.push_back(a.data());
  args.push_back(nullptr);
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  execvp(args[0], args.data());
  std::string shown;
  for (auto& a : cmd) shown += shell_quote(a) + " ";
  throw Error("could not launch ranks (" + std::string(std::strerror(errno)) + "): " + shown);
}

double max_over_ranks(double mine) {
  double all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return all;
}

int run_child(const Options& o, const std::string& command) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != o.ranks) {
    throw ConfigError("launched with " + std::to_string(world) + " ranks but --ranks is " + std::to_string(o.ranks));
  }
  const DType dtype = parse_dtype(o.dtype);
  const uint32_t vb = dtype_info(dtype).value_bytes;

  // The model: `buckets` layers of equal size, each one flat parameter sharded FSDP-style.
  std::vector<BucketLayout> layouts;
  const uint64_t per_bucket = o.params / o.buckets;
  const ShardPolicy policy = o.codec == "raw" ? ShardPolicy::kRaw : ShardPolicy::kCiera;
  if (o.codec != "raw" && o.codec != "ciera" && o.codec != "auto") {
    throw ConfigError("--codec must be raw, ciera or auto");
  }
  for (uint32_t b = 0; b < o.buckets; ++b) {
    layouts.push_back(BucketLayout::fsdp_split("layer" + std::to_string(b), dtype,
                                               {b + 1 == o.buckets ? o.params - per_bucket * b : per_bucket},
                                               world, policy));
  }
  // Each rank simulates only its own shards of the global trajectory.
  std::vector<std::unique_ptr<AdamTrajectory>> shards;
  uint64_t global_first = 0;
  for (const BucketLayout& l : layouts) {
    TrajectoryOptions t;
    t.num_values = l.rank_values(rank);
    t.first_index = global_first + l.rank_offset(rank) / vb;
    t.dtype = dtype;
    t.learning_rate = o.lr;
    t.seed = o.seed;
    shards.push_back(std::make_unique<AdamTrajectory>(t));
    global_first += l.total_bytes() / vb;
  }

  auto transport = make_mpi_transport(MPI_COMM_WORLD);
  EngineConfig config;
  config.codec.block_values = o.block;
  config.warmup_steps = o.warmup;
  config.worker_threads = o.threads;
  config.adaptive = o.codec == "auto";
  config.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  CompressedAllgather engine(*transport, config, layouts);

  std::vector<std::vector<std::byte>> raw_out(layouts.size()), ciera_out(layouts.size());
  std::vector<std::vector<int>> counts(layouts.size()), displs(layouts.size());
  for (size_t b = 0; b < layouts.size(); ++b) {
    raw_out[b].resize(layouts[b].total_bytes());
    ciera_out[b].resize(layouts[b].total_bytes());
    for (int r = 0; r < world; ++r) {
      counts[b].push_back(static_cast<int>(layouts[b].rank_bytes(r)));
      displs[b].push_back(static_cast<int>(layouts[b].rank_offset(r)));
    }
  }
  uint64_t raw_bytes = 0;
  for (const BucketLayout& l : layouts) raw_bytes += l.total_bytes();

  std::vector<double> raw_s, ciera_s, wire_bytes, encode_s, decode_s, exchange_s;
  uint64_t wrong_total = 0;
  Progress progress("bench allgather", o.steps, rank == 0 && !o.quiet);
  for (uint32_t step = 0; step < o.steps; ++step) {
    if (step > 0) {
      for (auto& s : shards) s->step();
    }
    // Raw baseline: nonblocking MPI_Allgatherv of every bucket, then wait for all.
    MPI_Barrier(MPI_COMM_WORLD);
    Stopwatch raw_clock;
    std::vector<MPI_Request> requests(layouts.size());
    for (size_t b = 0; b < layouts.size(); ++b) {
      MPI_Iallgatherv(shards[b]->values().data(), counts[b][rank], MPI_BYTE, raw_out[b].data(),
                      counts[b].data(), displs[b].data(), MPI_BYTE, MPI_COMM_WORLD, &requests[b]);
    }
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    const double raw_time = max_over_ranks(raw_clock.seconds());

    // The engine: every bucket started at once (encoding overlaps the exchanges), then waited.
    MPI_Barrier(MPI_COMM_WORLD);
    Stopwatch ciera_clock;
    std::vector<CompressedAllgather::Ticket> tickets;
    for (size_t b = 0; b < layouts.size(); ++b) tickets.push_back(engine.start(b, shards[b]->values(), ciera_out[b]));
    double step_wire = 0, step_encode = 0, step_decode = 0, step_exchange = 0;
    for (auto t : tickets) {
      const GatherStats s = engine.wait(t);
      step_wire += static_cast<double>(s.wire_bytes);
      step_encode = std::max(step_encode, s.encode_s);
      step_decode += s.decode_s;
      // Gathers batched into one round share its exchange, and each reports all of it.
      step_exchange = std::max(step_exchange, s.exchange_s);
    }
    const double ciera_time = max_over_ranks(ciera_clock.seconds());

    uint64_t wrong = 0;
    for (size_t b = 0; b < layouts.size(); ++b) {
      for (size_t i = 0; i < raw_out[b].size(); i += vb) {
        wrong += std::memcmp(raw_out[b].data() + i, ciera_out[b].data() + i, vb) != 0;
      }
    }
    uint64_t wrong_everywhere = 0;
    MPI_Allreduce(&wrong, &wrong_everywhere, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    wrong_total += wrong_everywhere;
    if (step >= o.warmup) {
      raw_s.push_back(raw_time);
      ciera_s.push_back(ciera_time);
      wire_bytes.push_back(step_wire);
      encode_s.push_back(max_over_ranks(step_encode));
      decode_s.push_back(max_over_ranks(step_decode));
      exchange_s.push_back(max_over_ranks(step_exchange));
    }
    progress.update(step + 1, "raw " + fixed(raw_time * 1e3, 1) + " ms, ciera " + fixed(ciera_time * 1e3, 1) +
                                  " ms" + (wrong_total ? ", WRONG ELEMENTS" : ""));
  }
  progress.finish();

  if (rank == 0) {
    const double raw_ms = median(raw_s) * 1e3;
    const double ciera_ms = median(ciera_s) * 1e3;
    const double wire = median(wire_bytes);
    const double algbw = raw_bytes / (ciera_ms / 1e3) / 1e9;
    const double raw_algbw = raw_bytes / (raw_ms / 1e3) / 1e9;
    const double bus = static_cast<double>(world - 1) / world;
    nlohmann::json j;
    j["command"] = command;
    j["machine"] = machine_description();
    j["config"] = {{"ranks", world},          {"params", o.params},   {"dtype", o.dtype},
                   {"steps", o.steps},        {"warmup", o.warmup},   {"buckets", o.buckets},
                   {"block", o.block},        {"codec", o.codec},     {"link_gbit", o.link_gbit},
                   {"delay_ms", o.delay_ms},  {"threads", o.threads}, {"transport", "mpi"}};
    j["raw_ms"] = raw_ms;
    j["ciera_ms"] = ciera_ms;
    j["speedup"] = raw_ms / ciera_ms;
    j["bytes_raw"] = raw_bytes;
    j["bytes_wire"] = wire;
    j["ratio"] = raw_bytes / wire;
    j["algbw_GBps"] = algbw;
    j["busbw_GBps"] = algbw * bus;
    j["raw_algbw_GBps"] = raw_algbw;
    j["raw_busbw_GBps"] = raw_algbw * bus;
    j["encode_ms"] = median(encode_s) * 1e3;
    j["decode_ms"] = median(decode_s) * 1e3;
    j["exchange_ms"] = median(exchange_s) * 1e3;
    j["wrong_elements"] = wrong_total;
    j["verified"] = wrong_total == 0;
    j["cache_bytes_per_rank"] = engine.cache_bytes();
    if (o.json) {
      std::cout << j.dump(2) << std::endl;
    } else {
      std::cout << "ciera bench allgather: " << world << " ranks, " << o.params << " " << o.dtype << " params in "
                << o.buckets << " buckets, " << o.steps << " steps (" << o.warmup << " warmup), links "
                << (o.link_gbit > 0 ? fixed(o.link_gbit, 2) + " Gbit/s (link lab)" : std::string(o.link_lab ? "unshaped (link lab)" : "unshaped (mpirun on one host)"))
                << "\nmachine: " << machine_description() << "\n\n";
      Table t({"", "time/step (ms)", "wire bytes", "algbw GB/s", "busbw GB/s"});
      t.add({"MPI_Allgatherv (raw)", fixed(raw_ms, 2), std::to_string(raw_bytes), fixed(raw_algbw, 3), fixed(raw_algbw * bus, 3)});
      t.add({"CIERA engine (" + o.codec + ")", fixed(ciera_ms, 2), fixed(wire, 0), fixed(algbw, 3), fixed(algbw * bus, 3)});
      std::cout << t.render() << "\n"
                << "speedup " << fixed(raw_ms / ciera_ms, 3) << "x, wire ratio " << fixed(raw_bytes / wire, 3)
                << "x; engine time split (slowest rank, medians): encode " << fixed(median(encode_s) * 1e3, 2)
                << " ms (overlapped), exchange " << fixed(median(exchange_s) * 1e3, 2) << " ms, decode "
                << fixed(median(decode_s) * 1e3, 2) << " ms\n"
                << "wrong elements (all ranks, all steps): " << wrong_total << "\n";
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return wrong_total == 0 ? 0 : 1;
}

// One rank's life: MPI up, the benchmark (engine and transport gone before MPI is), MPI down.
// An error is reported by the rank that sees it; the engine raises collective errors on every
// rank, so each prints the same text.
int run_rank(const Options& o, const std::string& command) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    if (provided < MPI_THREAD_MULTIPLE) throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
    const int status = run_child(o, command);
    MPI_Finalize();
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera (rank %d): error: %s\n", rank, e.what());
    std::fflush(stderr);
    _exit(2);  // peers may be gone: MPI_Finalize could wait for them forever
  }
}

}  // namespace

void register_bench_allgather(CLI::App& bench, const std::string& command, int argc, char** argv) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand("allgather", "Compressed allgather engine vs MPI_Allgatherv, verified every step");
  cmd->add_option("--ranks", o->ranks, "ranks (processes)")->capture_default_str();
  cmd->add_option("--params", o->params, "parameters in the model")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "bf16 | fp16 | fp32")->capture_default_str();
  cmd->add_option("--steps", o->steps, "optimizer steps, warmup included")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "engine warmup steps (raw) before exponent reuse")->capture_default_str();
  cmd->add_option("--buckets", o->buckets, "layers the parameters are split into")->capture_default_str();
  cmd->add_option("--block", o->block, "values per block")->capture_default_str();
  cmd->add_option("--link-gbit", o->link_gbit, "shape every link to this rate (link lab; 0 = no lab)")->capture_default_str();
  cmd->add_option("--delay-ms", o->delay_ms, "one-way link delay in the link lab")->capture_default_str();
  cmd->add_flag("--link-lab", o->link_lab, "run in the link lab even without shaping (TCP over veth)");
  cmd->add_option("--codec", o->codec,
                  "engine: raw (no coding), ciera (always), auto (per bucket, whichever is faster here)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "engine worker threads per rank")->capture_default_str();
  cmd->add_option("--lr", o->lr, "Adam learning rate of the trajectory")->capture_default_str();
  cmd->add_option("--seed", o->seed, "trajectory seed")->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "seconds a collective may wait for peers")->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object (rank 0)");
  cmd->add_flag("--quiet", o->quiet, "no progress output");
  cmd->add_flag("--child", o->child, "internal: this process is one launched rank")->group("");
  cmd->callback([o, command, argc, argv]() {
    if (!o->child && !under_mpi()) launch(*o, argc, argv);
    // Inside the link lab the links are what the lab says, whatever this rank was told.
    if (const char* g = std::getenv("CIERA_LINKLAB_GBIT")) {
      o->link_lab = true;
      o->link_gbit = std::atof(g);
      if (const char* d = std::getenv("CIERA_LINKLAB_DELAY_MS")) o->delay_ms = std::atof(d);
    }
    throw CommandExit(run_rank(*o, command));
  });
}

}  // namespace ciera::tools
