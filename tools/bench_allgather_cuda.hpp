// `ciera bench allgather --device cuda` and ciera_nccl_bench (tools/ciera_nccl_bench.cpp, the
// same measurement without the tool's dependencies, for a bare GPU machine): for each size,
// ncclAllGather and the compressed allgather engine on device memory gather the same bytes
// (the benchmark trajectory, tools/trajectory.hpp, copied to the device each step), W ranks as
// threads of this process, each with its own NCCL communicator, rank r on GPU r mod (GPUs).
// Every step's engine output is compared with the ncclAllGather output element by element, and
// the ncclAllGather outputs are checked to hold each rank's input and to agree across ranks,
// as nccl-tests' -c does. Times are each step's slowest rank, medians over the steps after the
// warmup; algbw = gathered bytes / time, busbw = algbw * (W - 1) / W (nccl-tests' definitions).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ciera/error.hpp"
#include "exit_status.hpp"

namespace ciera::tools {

// The benchmark cannot run here: no GPU, no NCCL, or an NCCL too old for ranks sharing a GPU.
// The text is one line naming what is missing. `ciera bench allgather --device cuda` and
// ciera_nccl_bench exit 2 for it, as for any command line this machine cannot run.
class NcclBenchUnavailable : public UsageError {
 public:
  using UsageError::UsageError;
};

struct NcclBenchOptions {
  int ranks = 4;
  // Bytes each allgather gathers (its output on every rank, as nccl-tests counts size); each is
  // rounded down to whole values per rank.
  std::vector<uint64_t> sizes{uint64_t{4} << 20, uint64_t{64} << 20, uint64_t{256} << 20};
  std::string dtype = "bf16";
  uint32_t steps = 15;   // optimizer steps, warmup included
  uint32_t warmup = 5;   // the engine's raw warmup gathers; not timed
  uint32_t block = 512;  // values per block
  unsigned threads = 2;  // engine worker threads per rank
  double lr = 1e-4;
  uint64_t seed = 1;
  double timeout_s = 60;  // longest a collective waits for its peers
  bool json = false;
  bool quiet = false;
  std::string command;  // the command line, for the report
};

// "4M,64M,1G" (K, M, G: binary multiples; plain numbers are bytes). Throws ConfigError naming
// `option` for anything else.
std::vector<uint64_t> parse_byte_sizes(const std::string& text, const std::string& option);

// Throws ConfigError naming the option for any bad value (before any work).
void check_nccl_bench_options(const NcclBenchOptions& options);

struct NcclBenchSize {
  uint64_t bytes = 0;     // gathered per allgather, after rounding to whole values per rank
  double nccl_s = 0;      // ncclAllGather: median over steady steps of the slowest rank
  double ciera_s = 0;     // the engine, the same
  // All the engine sent per step (every rank's payloads and its control records and verdicts,
  // control_bytes of them), means over the steady steps.
  double wire_bytes = 0, control_bytes = 0;
  double encode_s = 0, exchange_s = 0, decode_s = 0;  // the engine's split, slowest rank, medians
  uint64_t wrong_elements = 0;     // engine output != ncclAllGather output, all ranks and steps
  uint64_t own_slot_wrong = 0;     // ncclAllGather output's own slot != the rank's input
  uint64_t disagreeing_steps = 0;  // steps whose ncclAllGather outputs differ between ranks
};

struct NcclBenchResult {
  std::string gpu;                // "NVIDIA H200"
  int gpus = 0;                   // devices the ranks are spread over
  bool ranks_share_gpus = false;  // more ranks than GPUs (NCCL_MULTI_RANK_GPU_ENABLE)
  std::string nccl_version;       // the loaded library's
  std::vector<NcclBenchSize> sizes;
  bool verified() const;  // every check above came out clean
};

// Throws NcclBenchUnavailable when it cannot run here, ConfigError for bad options, CommError if
// a collective fails (a rank timed out), ciera::Error for a CUDA failure.
NcclBenchResult measure_nccl_allgather(const NcclBenchOptions& options);

// The result as one JSON object, and as the table the commands print.
std::string nccl_bench_json(const NcclBenchOptions& options, const NcclBenchResult& result);
std::string nccl_bench_table(const NcclBenchOptions& options, const NcclBenchResult& result);

// Measures, prints (JSON with options.json, else the table) and returns the exit status: 0 when
// every output was verified, 3 if not (exit_status.hpp). Throws what measure_nccl_allgather throws.
int run_bench_allgather_cuda(const NcclBenchOptions& options);

}  // namespace ciera::tools
