// ciera_nccl_bench: `ciera bench allgather --device cuda` without the tool's dependencies (no
// CLI11, JSON library or MPI), for a bare GPU machine: the same measurement and the same report
// (bench_allgather_cuda.hpp). The table goes to stdout; --json FILE also writes the JSON report
// there (as ciera_cuda_bench does), rewritten whole after each size, so a run killed at its time
// limit keeps the sizes it finished (each size is a measurement of its own: fresh communicators
// and engine, the same trajectory as in one run of all sizes).
//
//   ciera_nccl_bench [--ranks W] [--sizes 4M,64M,256M] [--dtype bf16|fp16|fp32] [--steps S]
//                    [--warmup K] [--block B] [--threads T] [--lr X] [--seed N] [--timeout SEC]
//                    [--json FILE] [--quiet]
//
// Exit status, as every `ciera` command's (exit_status.hpp): 0 every output verified; 1 the run
// failed (a collective, CUDA or I/O error); 2 a command line no run could use here, refused
// before any work: a bad option (one line naming it), or no GPU, no NCCL, or an NCCL too old for
// ranks sharing a GPU (as `ciera bench allgather --device cuda` refuses them); 3 an output that
// was not exact.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "bench_allgather_cuda.hpp"
#include "ciera/error.hpp"
#include "ciera/transport.hpp"
#include "exit_status.hpp"

namespace {

constexpr const char* kUsage =
    "usage: ciera_nccl_bench [--ranks W] [--sizes 4M,64M,256M] [--dtype bf16|fp16|fp32]\n"
    "                        [--steps S] [--warmup K] [--block B] [--threads T] [--lr X]\n"
    "                        [--seed N] [--timeout SEC] [--json FILE] [--quiet]\n";

struct Command {
  ciera::tools::NcclBenchOptions options;
  std::string json_file;
};

// A whole-string number, or ConfigError naming the option.
template <typename T>
T number(const std::string& option, const std::string& text) {
  try {
    size_t used = 0;
    T value{};
    if constexpr (std::is_floating_point_v<T>) {
      value = static_cast<T>(std::stod(text, &used));
    } else {
      if (text.empty() || text[0] == '-') throw std::invalid_argument("negative");
      value = static_cast<T>(std::stoull(text, &used));
    }
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw ciera::ConfigError(option + ": '" + text + "' is not a valid value");
}

Command parse(int argc, char** argv) {
  Command c;
  ciera::tools::NcclBenchOptions& o = c.options;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) o.command += ' ';
    o.command += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quiet") {
      o.quiet = true;
      continue;
    }
    if (i + 1 >= argc) throw ciera::ConfigError("unknown option or missing value: " + arg);
    const std::string value = argv[++i];
    if (arg == "--ranks") {
      o.ranks = static_cast<int>(number<unsigned>(arg, value));
    } else if (arg == "--sizes") {
      o.sizes = ciera::tools::parse_byte_sizes(value, arg);
    } else if (arg == "--dtype") {
      o.dtype = value;
    } else if (arg == "--steps") {
      o.steps = number<uint32_t>(arg, value);
    } else if (arg == "--warmup") {
      o.warmup = number<uint32_t>(arg, value);
    } else if (arg == "--block") {
      o.block = number<uint32_t>(arg, value);
    } else if (arg == "--threads") {
      o.threads = number<unsigned>(arg, value);
    } else if (arg == "--lr") {
      o.lr = number<double>(arg, value);
    } else if (arg == "--seed") {
      o.seed = number<uint64_t>(arg, value);
    } else if (arg == "--timeout") {
      o.timeout_s = number<double>(arg, value);
    } else if (arg == "--json") {
      c.json_file = value;
    } else {
      throw ciera::ConfigError("unknown option " + arg);
    }
  }
  ciera::tools::check_nccl_bench_options(o);
  if (!c.json_file.empty()) {
    // Checked before any work: a report that cannot be written is a bad option, not a lost run.
    const std::filesystem::path folder = std::filesystem::absolute(c.json_file).parent_path();
    if (!std::filesystem::is_directory(folder) || access(folder.c_str(), W_OK) != 0) {
      throw ciera::ConfigError("--json: cannot write in " + folder.string());
    }
  }
  return c;
}

// Rewrites `path` whole (a temporary file renamed over it: a reader never sees half a report).
void write_report(const std::string& path, const std::string& json) {
  const std::string part = path + ".part";
  std::FILE* f = std::fopen(part.c_str(), "w");
  const bool written = f != nullptr && std::fputs(json.c_str(), f) >= 0;
  if (f == nullptr || std::fclose(f) != 0 || !written ||
      std::rename(part.c_str(), path.c_str()) != 0) {
    throw ciera::Error("cannot write " + path);
  }
}

int run(const Command& c) {
  ciera::tools::NcclBenchResult result;
  for (const uint64_t bytes : c.options.sizes) {
    ciera::tools::NcclBenchOptions one = c.options;
    one.sizes = {bytes};
    ciera::tools::NcclBenchResult size;
    try {
      size = ciera::tools::measure_nccl_allgather(one);
    } catch (...) {
      // The sizes done so far are in the JSON already; their table goes to the log too.
      if (!result.sizes.empty()) {
        std::fputs(ciera::tools::nccl_bench_table(c.options, result).c_str(), stdout);
      }
      std::fflush(stdout);
      throw;
    }
    if (result.sizes.empty()) {
      result = size;
    } else {
      result.sizes.push_back(size.sizes.at(0));
    }
    if (!c.json_file.empty()) {
      write_report(c.json_file, ciera::tools::nccl_bench_json(c.options, result));
    }
  }
  std::fputs(ciera::tools::nccl_bench_table(c.options, result).c_str(), stdout);
  std::fflush(stdout);
  return result.verified() ? ciera::tools::kExitDone : ciera::tools::kExitNotExact;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  Command command;
  try {
    command = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera_nccl_bench: error: %s\n%s", e.what(), kUsage);
    return ciera::tools::kExitUsage;
  }
  try {
    return run(command);
  } catch (
      const ciera::tools::NcclBenchUnavailable& e) {  // a UsageError: no run can use this machine
    std::fprintf(stderr, "ciera_nccl_bench: %s\n", e.what());
    return ciera::tools::kExitUsage;
  } catch (const std::exception& e) {  // after the parse step: the work failed
    std::fprintf(stderr, "ciera_nccl_bench: %s\n", e.what());
    return ciera::tools::kExitFailed;
  }
}
