// `ciera bench allgather --device cuda` and ciera_nccl_bench (bench_allgather_cuda.hpp). No
// dependency beyond the library, ciera::cuda, ciera::nccl and the trajectory, so that the same
// measurement runs on a GPU machine without the tool's (CLI11, nlohmann_json, MPI): the JSON and
// the table are written here, once, for both front-ends.
#include "bench_allgather_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ciera/cuda.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "ciera/nccl.hpp"
#include "commands.hpp"
#include "common/checksum.hpp"
#include "common/statistics.hpp"
#include "json_string.hpp"
#include "trajectory.hpp"

namespace ciera::tools {
namespace {

// ---- Small helpers ------------------------------------------------------------------------------

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One cudaMalloc, freed with its owner.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* bytes() const { return static_cast<std::byte*>(p); }
  void* p = nullptr;
};

struct Stream {
  Stream() {
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t s = nullptr;
};

// Elements (of `value_bytes` each) that differ between two buffers of `bytes` bytes.
uint64_t differing_elements(const std::byte* a, const std::byte* b, uint64_t bytes,
                            uint32_t value_bytes) {
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < bytes; i += value_bytes)
    wrong += std::memcmp(a + i, b + i, value_bytes) != 0;
  return wrong;
}

// "2.30.1" >= 2.30
bool version_at_least(const std::string& version, int major, int minor) {
  int have_major = 0, have_minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &have_major, &have_minor) != 2) return false;
  return have_major != major ? have_major > major : have_minor >= minor;
}

// ---- Measuring: one thread per rank -------------------------------------------------------------

// Where the rank threads meet on the host. Ranks that share a GPU share its CUDA context, and a
// call that waits for the whole device (cudaDeviceSynchronize, cudaFree, as the device coders'
// set-up makes) must not run while a peer's NCCL kernel on that GPU waits for this rank: it would
// wait for the kernel and the kernel for it, until the timeout. So no rank starts gathering
// before every rank has finished setting up. Bounded by the timeout, and a rank that fails
// releases the others, so the meeting itself never hangs.
class PhaseBarrier {
 public:
  explicit PhaseBarrier(int ranks) : ranks_(ranks) {}

  void arrive_and_wait(std::chrono::milliseconds timeout, const std::string& what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    const bool met =
        changed_.wait_for(lock, timeout, [&] { return generation_ != generation || abandoned_; });
    if (!met || generation_ == generation) {
      abandoned_ = true;
      changed_.notify_all();
      throw CommError("ranks did not all reach " + what + " within " +
                      std::to_string(timeout.count()) + " ms (a rank failed or is stalled)");
    }
  }
  void abandon() {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = true;
    changed_.notify_all();
  }

 private:
  const int ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool abandoned_ = false;
};

// What every rank thread reads.
struct Plan {
  explicit Plan(const NcclBenchOptions& o) : options(o), phase(o.ranks) {}
  const NcclBenchOptions& options;
  mutable PhaseBarrier phase;
  DType dtype = DType::kBF16;
  uint32_t value_bytes = 2;
  std::vector<uint64_t> per_rank_values;  // per size
  int gpus = 1;
  nccl::UniqueId baseline_id, engine_id;
};

// One rank's numbers for one size, one entry per step (times and stats of every step; the
// steady ones are picked when the ranks are combined).
struct RankSize {
  std::vector<double> nccl_s, ciera_s, wire_bytes, control_bytes, encode_s, exchange_s, decode_s;
  std::vector<uint64_t> nccl_digest;  // content checksum of the ncclAllGather output
  uint64_t wrong = 0, own_slot_wrong = 0;
};

struct RankOutcome {
  std::vector<RankSize> sizes;
  std::exception_ptr error;
};

void progress(const Plan& plan, size_t size, uint32_t step) {
  if (plan.options.quiet) return;
  const uint64_t bytes =
      plan.per_rank_values[size] * plan.value_bytes * static_cast<uint64_t>(plan.options.ranks);
  std::fprintf(stderr, "\rbench allgather --device cuda: %llu bytes, step %u/%u   ",
               static_cast<unsigned long long>(bytes), step + 1, plan.options.steps);
  if (step + 1 == plan.options.steps) std::fputc('\n', stderr);
  std::fflush(stderr);
}

// A rank: its two communicators (the baseline and barriers on one, the engine alone on the
// other, since an engine owns its transport), its buffers and engine, made once for all sizes.
void run_rank(const Plan& plan, int rank, RankOutcome& outcome) {
  const NcclBenchOptions& o = plan.options;
  const int world = o.ranks;
  const int device = rank % plan.gpus;
  check(cudaSetDevice(device), "cudaSetDevice");
  const nccl::Options transport_options{
      device, std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000))};
  const uint64_t max_values =
      *std::max_element(plan.per_rank_values.begin(), plan.per_rank_values.end());
  const uint64_t max_shard = max_values * plan.value_bytes;
  const uint64_t max_total = max_shard * static_cast<uint64_t>(world);
  // Device buffers live from before the first collective to after the last: cudaFree waits for
  // the whole device, and with ranks sharing a GPU a free between collectives would wait for a
  // peer's kernel that waits for this rank.
  DeviceBuffer d_in(max_shard), d_nccl(max_total), d_ciera(max_total);
  Stream copies;
  std::vector<std::byte> h_nccl(max_total), h_ciera(max_total);
  auto baseline = nccl::make_transport(plan.baseline_id, rank, world, transport_options);
  auto engine_transport = nccl::make_transport(plan.engine_id, rank, world, transport_options);

  // One bucket per size: each warms up on its own, and one engine serves the whole run.
  std::vector<BucketLayout> layouts;
  for (size_t i = 0; i < plan.per_rank_values.size(); ++i) {
    layouts.push_back(BucketLayout::fsdp_split(
        "size" + std::to_string(i), plan.dtype,
        {plan.per_rank_values[i] * static_cast<uint64_t>(world)}, world, ShardPolicy::kCiera));
  }
  EngineConfig config;
  config.codec.block_values = o.block;
  // Raw until the last warmup step, which carries the key frames: never a timed step.
  config.warmup_steps = o.warmup > 0 ? o.warmup - 1 : 0;
  config.worker_threads = o.threads;
  config.timeout = transport_options.timeout;
  CompressedAllgather engine(*engine_transport, config, std::move(layouts),
                             cuda::codec_backend(device));
  plan.phase.arrive_and_wait(transport_options.timeout, "the end of set-up");

  outcome.sizes.resize(plan.per_rank_values.size());
  for (size_t i = 0; i < plan.per_rank_values.size(); ++i) {
    RankSize& mine = outcome.sizes[i];
    const uint64_t shard = plan.per_rank_values[i] * plan.value_bytes;
    const uint64_t total = shard * static_cast<uint64_t>(world);
    TrajectoryOptions t;
    t.num_values = plan.per_rank_values[i];
    t.first_index = static_cast<uint64_t>(rank) * plan.per_rank_values[i];
    t.dtype = plan.dtype;
    t.learning_rate = o.lr;
    t.seed = o.seed;
    AdamTrajectory trajectory(t);
    for (uint32_t step = 0; step < o.steps; ++step) {
      if (step > 0) trajectory.step();
      // The caller's stream is a non-blocking one: the legacy default stream would wait for
      // every blocking stream of the device, other ranks' included.
      check(cudaMemcpyAsync(d_in.p, trajectory.values().data(), shard, cudaMemcpyHostToDevice,
                            copies.s),
            "cudaMemcpyAsync (input)");
      check(cudaStreamSynchronize(copies.s), "cudaStreamSynchronize (input)");

      baseline->barrier();
      auto start = std::chrono::steady_clock::now();
      baseline->allgather(d_in.p, shard, d_nccl.p);
      mine.nccl_s.push_back(seconds_since(start));
      // The engine's output first holds the complement of NCCL's (untimed), so a value it left
      // unwritten (last step's) cannot match.
      check(cudaMemcpyAsync(h_ciera.data(), d_nccl.p, total, cudaMemcpyDeviceToHost, copies.s),
            "cudaMemcpyAsync (ncclAllGather output, to complement)");
      check(cudaStreamSynchronize(copies.s), "cudaStreamSynchronize (complement)");
      for (uint64_t b = 0; b < total; ++b) h_ciera[b] = ~h_ciera[b];
      check(cudaMemcpyAsync(d_ciera.p, h_ciera.data(), total, cudaMemcpyHostToDevice, copies.s),
            "cudaMemcpyAsync (the complement into the engine's output)");
      check(cudaStreamSynchronize(copies.s), "cudaStreamSynchronize (complement)");

      baseline->barrier();
      start = std::chrono::steady_clock::now();
      const GatherStats g = engine.run(i, {d_in.bytes(), shard}, {d_ciera.bytes(), total});
      mine.ciera_s.push_back(seconds_since(start));
      // All the engine sent: payloads, and its control records and verdicts (NCCL sends none).
      mine.wire_bytes.push_back(static_cast<double>(g.wire_bytes + g.control_bytes));
      mine.control_bytes.push_back(static_cast<double>(g.control_bytes));
      mine.encode_s.push_back(g.encode_s);
      mine.exchange_s.push_back(g.exchange_s);
      mine.decode_s.push_back(g.decode_s);

      // Verification, outside the timed parts: every element, on the host.
      check(cudaMemcpyAsync(h_nccl.data(), d_nccl.p, total, cudaMemcpyDeviceToHost, copies.s),
            "cudaMemcpyAsync (ncclAllGather output)");
      check(cudaMemcpyAsync(h_ciera.data(), d_ciera.p, total, cudaMemcpyDeviceToHost, copies.s),
            "cudaMemcpyAsync (engine output)");
      check(cudaStreamSynchronize(copies.s), "cudaStreamSynchronize (outputs)");
      mine.own_slot_wrong +=
          differing_elements(h_nccl.data() + static_cast<uint64_t>(rank) * shard,
                             trajectory.values().data(), shard, plan.value_bytes);
      mine.nccl_digest.push_back(content_checksum64(h_nccl.data(), total));
      mine.wrong += differing_elements(h_nccl.data(), h_ciera.data(), total, plan.value_bytes);
      if (rank == 0) progress(plan, i, step);
    }
  }
  // No rank frees anything (engine, communicators, buffers) while a peer may still gather.
  baseline->barrier();
}

// Combines the ranks: each step's slowest rank, medians over the steady steps, sums of errors.
NcclBenchSize combine(const Plan& plan, const std::vector<RankOutcome>& ranks, size_t i) {
  const NcclBenchOptions& o = plan.options;
  NcclBenchSize s;
  s.bytes = plan.per_rank_values[i] * plan.value_bytes * static_cast<uint64_t>(o.ranks);
  std::vector<double> nccl_s, ciera_s, wire, control, encode_s, exchange_s, decode_s;
  for (uint32_t step = o.warmup; step < o.steps; ++step) {
    double n = 0, c = 0, e = 0, x = 0, d = 0;
    for (const RankOutcome& r : ranks) {
      const RankSize& m = r.sizes[i];
      n = std::max(n, m.nccl_s[step]);
      c = std::max(c, m.ciera_s[step]);
      e = std::max(e, m.encode_s[step]);
      x = std::max(x, m.exchange_s[step]);
      d = std::max(d, m.decode_s[step]);
    }
    nccl_s.push_back(n);
    ciera_s.push_back(c);
    encode_s.push_back(e);
    exchange_s.push_back(x);
    decode_s.push_back(d);
    wire.push_back(ranks[0].sizes[i].wire_bytes[step]);  // already all ranks' payloads and records
    control.push_back(ranks[0].sizes[i].control_bytes[step]);
  }
  s.nccl_s = median(nccl_s);
  s.ciera_s = median(ciera_s);
  s.wire_bytes = mean(wire);  // bytes: means, as bench allgather's
  s.control_bytes = mean(control);
  s.encode_s = median(encode_s);
  s.exchange_s = median(exchange_s);
  s.decode_s = median(decode_s);
  for (uint32_t step = 0; step < o.steps; ++step) {
    bool agree = true;
    for (const RankOutcome& r : ranks)
      agree = agree && r.sizes[i].nccl_digest[step] == ranks[0].sizes[i].nccl_digest[step];
    s.disagreeing_steps += agree ? 0 : 1;
  }
  for (const RankOutcome& r : ranks) {
    s.wrong_elements += r.sizes[i].wrong;
    s.own_slot_wrong += r.sizes[i].own_slot_wrong;
  }
  return s;
}

// ---- Rendering ----------------------------------------------------------------------------------

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char text[64];
  std::snprintf(text, sizeof text, "%.10g", v);
  return text;
}

std::string fixed(double v, int decimals) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, v);
  return text;
}

double per_second(double bytes, double seconds) { return seconds > 0 ? bytes / seconds : 0; }

}  // namespace

bool NcclBenchResult::verified() const {
  for (const NcclBenchSize& s : sizes) {
    if (s.wrong_elements != 0 || s.own_slot_wrong != 0 || s.disagreeing_steps != 0) return false;
  }
  return true;
}

std::vector<uint64_t> parse_byte_sizes(const std::string& text, const std::string& option) {
  std::vector<uint64_t> sizes;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
    const std::string unit = item.substr(digits);
    const int shift = unit.empty()                 ? 0
                      : unit == "K" || unit == "k" ? 10
                      : unit == "M"                ? 20
                      : unit == "G"                ? 30
                                                   : -1;
    require(digits > 0 && digits <= 12 && shift >= 0,
            option + ": '" + item + "' is not a size (a number of bytes, or with K, M or G)");
    const uint64_t value = std::stoull(item.substr(0, digits)) << shift;
    require(value > 0, option + ": sizes must be at least 1 byte");
    sizes.push_back(value);
    at = comma + 1;
  }
  return sizes;
}

void check_nccl_bench_options(const NcclBenchOptions& o) {
  const uint32_t value_bytes = dtype_info(parse_dtype(o.dtype)).value_bytes;
  require(o.ranks >= 1 && o.ranks <= 64, "--ranks must be in 1..64");
  require(!o.sizes.empty(), "--sizes: at least one size");
  for (const uint64_t bytes : o.sizes) {
    require(bytes >= static_cast<uint64_t>(o.ranks) * value_bytes,
            "--sizes: " + std::to_string(bytes) + " bytes is less than one " + o.dtype +
                " value per rank");
    require(bytes <= (uint64_t{16} << 30),
            "--sizes: " + std::to_string(bytes) + " bytes is more than 16 GiB");
  }
  require_steps_after_warmup(o.steps, o.warmup, true);
  require(o.warmup >= 1,
          "--warmup must be at least 1: the first compressed gather carries the key frames, "
          "outside the timed steps");
  CodecConfig codec;
  codec.dtype = parse_dtype(o.dtype);
  codec.block_values = o.block;
  codec.validate();
  require(o.threads >= 1, "--threads must be at least 1");
  require(std::isfinite(o.lr) && o.lr > 0, "--lr must be a finite number > 0");
  require(std::isfinite(o.timeout_s) && o.timeout_s > 0 && o.timeout_s < 86400,
          "--timeout must be a number of seconds in (0, 86400)");
}

NcclBenchResult measure_nccl_allgather(const NcclBenchOptions& o) {
  check_nccl_bench_options(o);
  std::string why;
  if (!nccl::available(&why)) throw NcclBenchUnavailable("--device cuda: " + why);
  if (!cuda::device_available(&why)) throw NcclBenchUnavailable("--device cuda: " + why);
  NcclBenchResult result;
  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  result.gpus = std::min(devices, o.ranks);
  result.ranks_share_gpus = o.ranks > devices;
  result.nccl_version = nccl::library_version();
  if (result.ranks_share_gpus) {
    if (!version_at_least(result.nccl_version, 2, 30)) {
      throw NcclBenchUnavailable(
          "--device cuda: " + std::to_string(o.ranks) + " ranks on " + std::to_string(devices) +
          " GPU(s) need NCCL 2.30 or newer (several ranks per GPU), but the NCCL loaded is " +
          result.nccl_version + "; use --ranks " + std::to_string(devices) +
          " or point CIERA_NCCL_LIBRARY at a newer libnccl.so.2");
    }
    // Read by NCCL when a communicator is made; an explicit setting of the caller's stays.
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
  }
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
  result.gpu = properties.name;

  Plan plan(o);
  plan.dtype = parse_dtype(o.dtype);
  plan.value_bytes = dtype_info(plan.dtype).value_bytes;
  for (const uint64_t bytes : o.sizes)
    plan.per_rank_values.push_back(bytes / plan.value_bytes / static_cast<uint64_t>(o.ranks));
  plan.gpus = result.gpus;
  plan.baseline_id = nccl::make_unique_id();
  plan.engine_id = nccl::make_unique_id();

  std::vector<RankOutcome> ranks(static_cast<size_t>(o.ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ranks; ++r) {
    threads.emplace_back([&plan, &ranks, r] {
      try {
        run_rank(plan, r, ranks[static_cast<size_t>(r)]);
      } catch (...) {
        ranks[static_cast<size_t>(r)].error = std::current_exception();
        plan.phase.abandon();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // A rank that failed for its own reason makes the others time out: report the cause, which is
  // the first error that is not a CommError, if there is one.
  std::exception_ptr first;
  for (const RankOutcome& r : ranks) {
    if (!r.error) continue;
    try {
      std::rethrow_exception(r.error);
    } catch (const CommError&) {
      if (!first) first = r.error;
    } catch (...) {
      first = r.error;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
  for (size_t i = 0; i < plan.per_rank_values.size(); ++i)
    result.sizes.push_back(combine(plan, ranks, i));
  return result;
}

std::string nccl_bench_json(const NcclBenchOptions& o, const NcclBenchResult& r) {
  const double bus = static_cast<double>(o.ranks - 1) / o.ranks;
  uint64_t wrong_total = 0;
  std::ostringstream j;
  j << "{\n  \"command\": " << json_string(o.command) << ",\n  \"gpu\": " << json_string(r.gpu)
    << ",\n  \"gpus\": " << r.gpus
    << ",\n  \"ranks_share_gpus\": " << (r.ranks_share_gpus ? "true" : "false")
    << ",\n  \"nccl_version\": " << json_string(r.nccl_version)
    << ",\n  \"config\": {\"ranks\": " << o.ranks << ", \"dtype\": " << json_string(o.dtype)
    << ", \"steps\": " << o.steps << ", \"warmup\": " << o.warmup << ", \"block\": " << o.block
    << ", \"threads\": " << o.threads << ", \"lr\": " << json_number(o.lr)
    << ", \"seed\": " << o.seed << ", \"transport\": \"nccl\", \"baseline\": \"ncclAllGather\"},\n"
    << "  \"sizes\": [";
  for (size_t i = 0; i < r.sizes.size(); ++i) {
    const NcclBenchSize& s = r.sizes[i];
    const double bytes = static_cast<double>(s.bytes);
    const double raw_algbw = per_second(bytes, s.nccl_s) / 1e9;
    const double algbw = per_second(bytes, s.ciera_s) / 1e9;
    wrong_total += s.wrong_elements;
    j << (i ? ",\n" : "\n") << "    {\"bytes_raw\": " << s.bytes
      << ", \"raw_ms\": " << json_number(s.nccl_s * 1e3)
      << ", \"raw_algbw_GBps\": " << json_number(raw_algbw)
      << ", \"raw_busbw_GBps\": " << json_number(raw_algbw * bus)
      << ", \"ciera_ms\": " << json_number(s.ciera_s * 1e3)
      << ", \"algbw_GBps\": " << json_number(algbw)
      << ", \"busbw_GBps\": " << json_number(algbw * bus)
      << ", \"bytes_wire\": " << json_number(s.wire_bytes)
      << ", \"bytes_control\": " << json_number(s.control_bytes)
      << ", \"ratio\": " << json_number(s.wire_bytes > 0 ? bytes / s.wire_bytes : 0)
      << ", \"speedup\": " << json_number(s.ciera_s > 0 ? s.nccl_s / s.ciera_s : 0)
      << ", \"encode_ms\": " << json_number(s.encode_s * 1e3)
      << ", \"exchange_ms\": " << json_number(s.exchange_s * 1e3)
      << ", \"decode_ms\": " << json_number(s.decode_s * 1e3)
      << ", \"wrong_elements\": " << s.wrong_elements
      << ", \"own_slot_wrong\": " << s.own_slot_wrong
      << ", \"disagreeing_steps\": " << s.disagreeing_steps << "}";
  }
  j << "\n  ],\n  \"wrong_elements\": " << wrong_total
    << ",\n  \"verified\": " << (r.verified() ? "true" : "false") << "\n}\n";
  return j.str();
}

std::string nccl_bench_table(const NcclBenchOptions& o, const NcclBenchResult& r) {
  const double bus = static_cast<double>(o.ranks - 1) / o.ranks;
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"bytes", "ncclAllGather ms", "algbw GB/s", "busbw GB/s", "CIERA ms", "algbw GB/s",
                  "busbw GB/s", "wire ratio", "speedup", "wrong"});
  uint64_t wrong = 0, own = 0, disagreeing = 0;
  for (const NcclBenchSize& s : r.sizes) {
    const double bytes = static_cast<double>(s.bytes);
    const double raw_algbw = per_second(bytes, s.nccl_s) / 1e9,
                 algbw = per_second(bytes, s.ciera_s) / 1e9;
    rows.push_back({std::to_string(s.bytes), fixed(s.nccl_s * 1e3, 3), fixed(raw_algbw, 2),
                    fixed(raw_algbw * bus, 2), fixed(s.ciera_s * 1e3, 3), fixed(algbw, 2),
                    fixed(algbw * bus, 2), s.wire_bytes > 0 ? fixed(bytes / s.wire_bytes, 3) : "-",
                    s.ciera_s > 0 ? fixed(s.nccl_s / s.ciera_s, 3) : "-",
                    std::to_string(s.wrong_elements)});
    wrong += s.wrong_elements;
    own += s.own_slot_wrong;
    disagreeing += s.disagreeing_steps;
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::ostringstream out;
  out << "ciera bench allgather --device cuda: " << o.ranks << " ranks (threads) on " << r.gpus
      << " x " << r.gpu << (r.ranks_share_gpus ? " (ranks share GPUs)" : "") << ", NCCL "
      << r.nccl_version << ", " << o.dtype << ", B = " << o.block << ", " << o.steps << " steps ("
      << o.warmup << " warmup, untimed)\n";
  out << "times: slowest rank, median of the steady steps; algbw = bytes / time, busbw = algbw * "
         "(W-1)/W\n\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t c = 0; c < rows[i].size(); ++c) {
      out << (c ? "  " : "") << std::string(width[c] - rows[i][c].size(), ' ') << rows[i][c];
    }
    out << "\n";
  }
  out << "\nwrong elements (CIERA vs ncclAllGather, all ranks, all steps): " << wrong << "\n"
      << "ncclAllGather outputs hold every rank's input and agree across ranks: "
      << (own == 0 && disagreeing == 0
              ? "yes"
              : "NO (" + std::to_string(own) + " wrong own-slot elements, " +
                    std::to_string(disagreeing) + " steps disagree)")
      << "\n";
  return out.str();
}

int run_bench_allgather_cuda(const NcclBenchOptions& options) {
  const NcclBenchResult result = measure_nccl_allgather(options);
  std::fputs(
      (options.json ? nccl_bench_json(options, result) : nccl_bench_table(options, result)).c_str(),
      stdout);
  std::fflush(stdout);
  return result.verified() ? kExitDone : kExitNotExact;
}

}  // namespace ciera::tools
