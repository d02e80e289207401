#include "ranks.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ciera/error.hpp"
#include "ciera/mpi.hpp"
#include "exit_status.hpp"
#include "report.hpp"

#ifndef CIERA_SOURCE_DIR
#define CIERA_SOURCE_DIR "."
#endif
#ifndef CIERA_MPIEXEC
#define CIERA_MPIEXEC "mpirun"
#endif

namespace ciera::tools {
namespace {

// run_mpi_rank's timeout: rounded up, at least 1 ms (0 would mean no deadline to mpi_init and
// mpi_shutdown).
std::chrono::milliseconds g_mpi_timeout{60000};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string linklab_script() {
  if (const char* p = std::getenv("CIERA_LINKLAB")) return p;
  return std::string(CIERA_SOURCE_DIR) + "/scripts/linklab.sh";
}

template <typename T>
T reduce_over_ranks(T mine, MPI_Datatype type, MPI_Op op) {
  T all{};
  MPI_Request request;
  MPI_Iallreduce(&mine, &all, 1, type, op, MPI_COMM_WORLD, &request);
  wait_all({&request, 1}, "MPI_Iallreduce");
  return all;
}

bool under_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_RANK") != nullptr;
}

[[noreturn]] void launch_ranks(int ranks, const Links& links, int argc, char** argv) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw Error("cannot find the ciera executable to launch ranks");
  self[n] = '\0';
  std::vector<std::string> child = {self};
  for (int i = 1; i < argc; ++i) child.push_back(argv[i]);
  child.push_back("--child");
  std::vector<std::string> cmd;
  if (links.link_gbit > 0 || links.link_lab) {
    cmd = {linklab_script()};
    if (links.nodes > 0) {
      cmd.insert(cmd.end(), {"--nodes", std::to_string(links.nodes), "--ranks-per-node",
                             std::to_string(links.ranks_per_node)});
    } else {
      cmd.insert(cmd.end(), {"--ranks", std::to_string(ranks)});
    }
    cmd.insert(cmd.end(),
               {"--gbit", fixed(links.link_gbit, 3), "--delay-ms", fixed(links.delay_ms, 3), "--"});
  } else {
    cmd = {CIERA_MPIEXEC, "--oversubscribe",     "--allow-run-as-root",
           "--mca",       "mpi_yield_when_idle", "1",
           "-np",         std::to_string(ranks)};
  }
  cmd.insert(cmd.end(), child.begin(), child.end());
  std::vector<char*> args;
  for (auto& a : cmd) args.push_back(a.data());
  args.push_back(nullptr);
  setenv(kCommandLineVariable, command_line(argc, argv).c_str(), 1);  // for the ranks' reports
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  execvp(args[0], args.data());
  std::string shown;
  for (auto& a : cmd) shown += shell_quote(a) + " ";
  throw Error("could not launch ranks (" + std::string(std::strerror(errno)) + "): " + shown);
}

}  // namespace

Links launch_or_join(int ranks, Links links, bool child, int argc, char** argv) {
  if (!child && !under_mpi()) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (ranks > kMaxRanksPerCore * cores) {
      throw UsageError("--ranks " + std::to_string(ranks) + ": more than " +
                       std::to_string(kMaxRanksPerCore) + " ranks a core, and this machine has " +
                       std::to_string(cores) + (cores == 1 ? " core" : " cores"));
    }
    launch_ranks(ranks, links, argc, argv);
  }
  links.nodes = 1;
  links.ranks_per_node = ranks;
  if (const char* g = std::getenv("CIERA_LINKLAB_GBIT")) {
    links.link_lab = true;
    links.link_gbit = std::atof(g);
    if (const char* d = std::getenv("CIERA_LINKLAB_DELAY_MS")) links.delay_ms = std::atof(d);
    const char* nodes = std::getenv("CIERA_LINKLAB_NODES");
    const char* per_node = std::getenv("CIERA_LINKLAB_RANKS_PER_NODE");
    links.nodes = nodes ? std::atoi(nodes) : ranks;
    links.ranks_per_node = per_node ? std::atoi(per_node) : 1;
  }
  return links;
}

std::string describe_links(const Links& links) {
  if (!links.link_lab && links.link_gbit == 0) return "unshaped (mpirun on one host)";
  const std::string speed =
      links.link_gbit > 0 ? fixed(links.link_gbit, 2) + " Gbit/s" : "unshaped";
  // The congestion control the lab gave the ranks' connections (scripts/linklab.sh).
  const char* set = std::getenv("CIERA_LINKLAB_CC");
  const std::string cc = set != nullptr ? set : "cubic";
  const std::string lab = " (link lab, " + (cc == "default" ? "the host's TCP" : "TCP " + cc) + ")";
  if (links.ranks_per_node <= 1) return speed + lab;
  return speed + " per node uplink, " + std::to_string(links.nodes) + " nodes of " +
         std::to_string(links.ranks_per_node) + " ranks" + lab;
}

std::optional<uint64_t> uplink_bytes_sent() {
  const char* hub_pid = std::getenv("CIERA_LINKLAB_HUB_PID");
  const char* uplinks = std::getenv("CIERA_LINKLAB_UPLINKS");
  if (!hub_pid || !uplinks) return std::nullopt;
  std::vector<std::string> wanted;
  for (std::string_view list = uplinks; !list.empty();) {
    const size_t comma = std::min(list.find(','), list.size());
    wanted.emplace_back(list.substr(0, comma));
    list.remove_prefix(std::min(comma + 1, list.size()));
  }
  std::ifstream dev(std::string("/proc/") + hub_pid + "/net/dev");
  // "  <name>: <rx bytes> <rx packets> ...": the hub's end receives what the node sends.
  uint64_t sent = 0;
  size_t found = 0;
  for (std::string line; std::getline(dev, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t start = line.find_first_not_of(' ');
    const std::string name = line.substr(start, colon - start);
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    sent += std::strtoull(line.c_str() + colon + 1, nullptr, 10);
    ++found;
  }
  if (found != wanted.size()) return std::nullopt;
  return sent;
}

int run_mpi_rank(double timeout_s, const std::function<int()>& body) {
  g_mpi_timeout = std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(timeout_s * 1000))));
  const int provided = mpi_init(nullptr, nullptr, mpi_timeout());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    if (provided < MPI_THREAD_MULTIPLE) throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
    const int status = body();
    mpi_shutdown(2, mpi_timeout());
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera (rank %d): error: %s\n", rank, e.what());
    mpi_abort(kExitFailed);
  }
}

std::chrono::milliseconds mpi_timeout() { return g_mpi_timeout; }

void wait_all(std::span<MPI_Request> requests, const char* what) {
  mpi_wait_all(requests, mpi_timeout(), what);
}

void barrier() {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  wait_all({&request, 1}, "MPI_Ibarrier");
}

double max_over_ranks(double mine) { return reduce_over_ranks(mine, MPI_DOUBLE, MPI_MAX); }
uint64_t sum_over_ranks(uint64_t mine) { return reduce_over_ranks(mine, MPI_UINT64_T, MPI_SUM); }

}  // namespace ciera::tools
