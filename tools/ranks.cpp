#include "ranks.hpp"

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ciera/error.hpp"
#include "ciera/mpi.hpp"
#include "commands.hpp"
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

// CIERA_LINKLAB, else the script installed with this executable (`cmake --install`: the
// install's data dir, CIERA_BIN_TO_DATA from its bin dir, then ciera/linklab.sh; a wheel:
// ciera/bin/ciera and ciera/share/linklab.sh), else the source tree's (a build's tool): an
// installed tool must not depend on the checkout it was built from still being there.
std::string linklab_script() {
  if (const char* p = std::getenv("CIERA_LINKLAB")) return p;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));  // .../bin
#ifdef CIERA_BIN_TO_DATA
    const std::string installed = "/" CIERA_BIN_TO_DATA "/ciera/linklab.sh";
#else
    const std::string installed = "/../share/ciera/linklab.sh";
#endif
    for (const std::string& beside : {installed, std::string("/../share/linklab.sh")}) {
      if (access((dir + beside).c_str(), X_OK) == 0) return dir + beside;
    }
  }
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

// The link lab's "this machine cannot host the lab" (not root, no namespaces, a tool missing;
// scripts/linklab.sh), which the tests take for a skip: passed on as ours, the lab's line said.
constexpr int kExitLabRefused = 77;

// After a signal passed on: how long the rank launcher has to end before the processes under it
// are killed (the link lab gives mpirun 15 s of it), and then how long it has to end itself (the
// lab removing its namespaces) before it is killed too.
constexpr std::chrono::seconds kEndGrace{30};
constexpr std::chrono::seconds kTeardownGrace{15};

// The rank launcher while it runs, and the signal last passed on to it (0: none).
volatile pid_t g_launcher = 0;
volatile std::sig_atomic_t g_forwarded = 0;

void end_launcher(pid_t launcher) {
  kill(launcher, SIGTERM);
  kill(launcher, SIGCONT);
}

// What the rank launcher had to be made to do after a signal passed on to it.
enum class Escalation {
  kNone,      // it ended by itself
  kUnder,     // the processes under it were killed (mpirun, the ranks), and then it ended
  kLauncher,  // it was killed too
};

// The start time of process `pid` (field 22 of /proc/PID/stat), which tells it from a later
// process given the same pid; the parent's pid in `parent`. Empty if it is gone.
std::string start_time(pid_t pid, pid_t* parent = nullptr) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return "";
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return "";
  std::vector<std::string> fields;  // from the state on: field N of proc(5) is [N - 3]
  for (size_t i = close + 2; i < stat.size();) {
    const size_t end = std::min(stat.find(' ', i), stat.size());
    fields.push_back(stat.substr(i, end - i));
    i = end + 1;
  }
  if (fields.size() < 20) return "";
  if (parent) *parent = static_cast<pid_t>(std::atol(fields[1].c_str()));
  return fields[19];
}

// Every process under `root` (the link lab's script: mpirun, its ranks, ip netns exec; or
// mpirun: its ranks), each with its start time. As `ciera train`'s launcher finds them
// (python/ciera/train/launcher.py, _descendants).
std::map<pid_t, std::string> descendants(pid_t root) {
  std::map<pid_t, std::vector<pid_t>> children;
  std::map<pid_t, std::string> started;
  if (DIR* proc = opendir("/proc")) {
    while (const dirent* entry = readdir(proc)) {
      char* end = nullptr;
      const long pid = std::strtol(entry->d_name, &end, 10);
      if (pid <= 0 || *end != '\0') continue;
      pid_t parent = 0;
      std::string start = start_time(static_cast<pid_t>(pid), &parent);
      if (start.empty()) continue;  // gone meanwhile
      children[parent].push_back(static_cast<pid_t>(pid));
      started[static_cast<pid_t>(pid)] = std::move(start);
    }
    closedir(proc);
  }
  std::map<pid_t, std::string> found;
  std::vector<pid_t> todo = {root};
  while (!todo.empty()) {
    const pid_t pid = todo.back();
    todo.pop_back();
    for (pid_t child : children[pid]) {
      if (found.emplace(child, started[child]).second) todo.push_back(child);
    }
  }
  return found;
}

// `sig` to each of `processes` (pid -> start time) that is still the process it was.
void signal_each(const std::map<pid_t, std::string>& processes, int sig) {
  for (const auto& [pid, start] : processes) {
    if (start_time(pid) == start) kill(pid, sig);
  }
}

// Our exit status from the rank launcher's wait status: its own 0..3 (a rank's status or abort
// code) as they are, and the link lab's refusal (77) as it is; anything else (a rank killed by a
// signal, the launcher's own failure) is the work failing, 1, said in one line, or 128 + N after a
// signal N passed on to it (`escalation`: what it had to be made to do).
int launcher_status(int status, const char* launcher, bool lab, Escalation escalation) {
  if (g_forwarded != 0) {
    const char* name = g_forwarded == SIGINT    ? "SIGINT"
                       : g_forwarded == SIGTERM ? "SIGTERM"
                                                : "SIGHUP";
    if (escalation == Escalation::kLauncher) {
      std::fprintf(stderr,
                   "ciera: interrupted (%s); %s did not end within %lld s, nor within %lld s of "
                   "its ranks being killed, and was killed too%s\n",
                   name, launcher, static_cast<long long>(kEndGrace.count()),
                   static_cast<long long>(kTeardownGrace.count()),
                   lab ? ": the lab's namespaces may be left (the next lab run removes them)" : "");
    } else if (escalation == Escalation::kUnder) {
      std::fprintf(stderr,
                   "ciera: interrupted (%s); %s did not end within %lld s: the processes under it "
                   "(its ranks) were killed\n",
                   name, launcher, static_cast<long long>(kEndGrace.count()));
    } else {
      std::fprintf(stderr, "ciera: interrupted (%s); the ranks were ended\n", name);
    }
    return 128 + g_forwarded;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) <= kExitNotExact) return WEXITSTATUS(status);
  if (lab && WIFEXITED(status) && WEXITSTATUS(status) == kExitLabRefused) return kExitLabRefused;
  if (WIFEXITED(status)) {
    std::fprintf(stderr,
                 "ciera: error: %s exited with status %d: a rank ended abnormally (killed, or "
                 "crashed) before it could report\n",
                 launcher, WEXITSTATUS(status));
  } else {
    std::fprintf(stderr, "ciera: error: %s was killed by signal %d\n", launcher,
                 WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  }
  return kExitFailed;
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
  const bool lab = links.link_gbit > 0 || links.link_lab;
  if (lab) {
    // The lab's mpirun: the one ciera was built with, as below (unless the caller names one).
    setenv("CIERA_LINKLAB_MPIRUN", CIERA_MPIEXEC, 0);
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
  std::string shown;
  for (auto& a : cmd) shown += shell_quote(a) + " ";
  // The rank launcher runs as a child, so that its status can be read as ours: mpirun exits with
  // a rank's abort code (1, 2, 3), but with 128 + N when a rank was killed by signal N, and a
  // status of ours is 0..3 (tools/exit_status.hpp). A SIGINT, SIGTERM or SIGHUP sent to this
  // process alone goes on to the launcher, which ends the ranks.
  // As `ciera train`'s launcher does: SIGTERM, which mpirun passes on to the ranks (the link lab
  // to mpirun), and SIGCONT for a stopped one; a second signal does not cut that short. Set before
  // the fork, so that no signal finds the launcher started and this process unprepared.
  struct sigaction forward {};
  forward.sa_handler = [](int sig) {
    if (g_forwarded != 0) return;
    g_forwarded = sig;
    if (g_launcher > 0) end_launcher(g_launcher);
  };
  sigemptyset(&forward.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &forward, nullptr);
  signal(SIGCHLD, SIG_DFL);  // a caller's SIG_IGN would make waitpid fail (ECHILD)
  std::fflush(nullptr);
  const pid_t launcher = fork();
  if (launcher < 0)
    throw Error("could not launch ranks (fork: " + std::string(std::strerror(errno)) + ")");
  if (launcher == 0) {
    execvp(args[0], args.data());
    std::fprintf(stderr, "ciera: error: could not launch ranks (%s): %s\n", std::strerror(errno),
                 shown.c_str());
    _exit(kExitFailed);
  }
  g_launcher = launcher;
  if (g_forwarded != 0) end_launcher(launcher);  // a signal during the fork
  // Polled, so that a signal between a look at g_forwarded and a blocking wait cannot go unseen.
  // After a signal, as `ciera train`'s launcher ends its own (launcher.py, _end): SIGCONT to every
  // process under the launcher; if it has not ended in kEndGrace, SIGKILL to those processes, not
  // to it, so that the link lab's script still removes its namespaces; only if it has not ended
  // kTeardownGrace after that, SIGKILL to it. The processes under it are looked for every second
  // while it runs (ranks it started after the signal count too), and whatever of them outlived it
  // is killed at the end.
  using Clock = std::chrono::steady_clock;
  int status = 0;
  std::optional<Clock::time_point> signalled_at;
  Clock::time_point looked_at;
  std::map<pid_t, std::string> under;
  Escalation escalation = Escalation::kNone;
  for (;;) {
    const pid_t waited = waitpid(launcher, &status, WNOHANG);
    if (waited == launcher) break;
    if (waited < 0 && errno != EINTR)
      throw Error("cannot wait for the ranks' launcher: " + std::string(std::strerror(errno)));
    const Clock::time_point now = Clock::now();
    if (g_forwarded != 0 && !signalled_at) {
      signalled_at = looked_at = now;
      under = descendants(launcher);
      signal_each(under, SIGCONT);
    }
    if (signalled_at) {
      if (now - looked_at >= std::chrono::seconds(1)) {
        looked_at = now;
        under.merge(descendants(launcher));
      }
      if (escalation == Escalation::kNone && now - *signalled_at > kEndGrace) {
        under.merge(descendants(launcher));
        signal_each(under, SIGKILL);
        escalation = Escalation::kUnder;
      } else if (escalation == Escalation::kUnder &&
                 now - *signalled_at > kEndGrace + kTeardownGrace) {
        kill(launcher, SIGKILL);
        escalation = Escalation::kLauncher;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (signalled_at) signal_each(under, SIGKILL);
  throw CommandExit(launcher_status(status, args[0], lab, escalation));
}

// Every rank must have been given the same options (mpirun's MPMD form can give each its own, and
// a rank with other sizes or steps would fail in MPI, wait out the timeout, or mix its figures into
// the report): checked before any work, a UsageError naming the first option that differs.
void require_same_options(int argc, char** argv) {
  std::vector<std::string> mine;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--child") mine.emplace_back(argv[i]);
  }
  std::string text;
  for (const std::string& arg : mine) text += arg + '\0';
  const std::vector<std::string> all =
      mpi_allgather_bytes(MPI_COMM_WORLD, text, mpi_timeout(), "the ranks' options");
  const auto args_of = [&](size_t r) {
    std::vector<std::string> args;
    std::string_view view = all[r];
    for (size_t end; (end = view.find('\0')) != std::string_view::npos; view.remove_prefix(end + 1))
      args.emplace_back(view.substr(0, end));
    return args;
  };
  const std::vector<std::string> first = args_of(0);
  for (size_t r = 1; r < all.size(); ++r) {
    const std::vector<std::string> other = args_of(r);
    if (other == first) continue;
    size_t i = 0;
    while (i < first.size() && i < other.size() && first[i] == other[i]) ++i;
    const auto shown = [&](const std::vector<std::string>& args) {
      if (i >= args.size()) return std::string("nothing");
      const bool value = i > 0 && args[i - 1].rfind("--", 0) == 0 && args[i].rfind("--", 0) != 0;
      return "'" + (value ? args[i - 1] + " " : "") + args[i] + "'";
    };
    throw UsageError("the ranks were given different options: rank " + std::to_string(r) + " has " +
                     shown(other) + " where rank 0 has " + shown(first) +
                     " (every rank runs the same command)");
  }
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

int run_mpi_rank(double timeout_s, int argc, char** argv, const std::function<int()>& body) {
  g_mpi_timeout = std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(timeout_s * 1000))));
  const int provided = mpi_init(nullptr, nullptr, mpi_timeout());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    if (provided < MPI_THREAD_MULTIPLE) throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
    require_same_options(argc, argv);
    const int status = body();
    mpi_shutdown(kExitFailed, mpi_timeout());
    return status;
  } catch (const UsageError& e) {  // the same on every rank: a command line no run could use
    std::fprintf(stderr, "ciera (rank %d): error: %s\n", rank, e.what());
    mpi_abort(kExitUsage);
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
double sum_over_ranks(double mine) { return reduce_over_ranks(mine, MPI_DOUBLE, MPI_SUM); }

}  // namespace ciera::tools
