// The `ciera` command-line tool: benchmarks, analysis and simulation.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "commands.hpp"
#include "report.hpp"

namespace {

// "ciera 0.1.0 (commit 1a2b3c4), wire format 4": what a bug report needs to name the build.
std::string version_text() {
  return std::string("ciera ") + ciera::kLibraryVersion + " (commit " + ciera::kGitCommit +
         "), wire format " + std::to_string(ciera::kFormatVersion);
}

// `ciera train` is the Python training job. The native tool lists it, so that `ciera --help`
// names every command, and says where to run it if it is called here.
void register_train_pointer(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "train", "Train an MoE with FSDP2, plain and through CIERA, side by side (Python)");
  cmd->prefix_command();  // its options are the Python job's
  cmd->callback([] {
    throw ciera::ConfigError(
        "`ciera train` is the Python training job: install the package (scripts/python-env.sh) "
        "and run `ciera train` from it");
  });
}

// A word where a command is expected that names none, or no word at all: CLI11 would only say
// "A subcommand is required", so the tool names the commands it could have been.
std::string command_problem(CLI::App& app, int argc, char** argv) {
  CLI::App* at = &app;
  std::string path = "ciera";
  for (int i = 1;; ++i) {
    const std::vector<CLI::App*> commands = at->get_subcommands(std::function<bool(CLI::App*)>{});
    if (commands.empty()) return "";
    std::string names;
    for (CLI::App* c : commands) names += (names.empty() ? "" : ", ") + c->get_name();
    if (i == argc) return "`" + path + "` needs a command: one of " + names;
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') return "";  // --help, --version, or CLI11's to report
    CLI::App* next = nullptr;
    for (CLI::App* c : commands) {
      if (c->check_name(word)) next = c;
    }
    if (next == nullptr)
      return "unknown command '" + word + "' for `" + path + "` (one of " + names + ")";
    at = next;
    path += " " + word;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ciera::tools;
  CLI::App app{"CIERA: lossless compressed allgather for sharded MoE training"};
  app.set_version_flag("--version", version_text(), "Print the version, commit and wire format");
  app.require_subcommand(1);
  const std::string command = command_line(argc, argv);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that verify what they time");
  bench->require_subcommand(1);
  register_bench_codec(*bench, command);
#if defined(CIERA_WITH_MPI)
  register_bench_allgather(*bench, command, argc, argv);
  register_bench_broadcast(*bench, command, argc, argv);
  register_bench_collectives(*bench, command, argc, argv);
#endif
  register_analyze(app, command);
  register_simulate(app, command);
  register_train_pointer(app);
  try {
    if (const std::string problem = command_problem(app, argc, argv); !problem.empty())
      throw ciera::ConfigError(problem);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" of status 0; every other parse error is one line,
    // as the commands' own checks are.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "ciera: error: %s (see --help)\n", e.what());
    return 2;
  } catch (const CommandExit& done) {
    return done.status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
