// The `ciera` command-line tool: benchmarks, analysis and simulation.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <new>
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
    throw ciera::tools::UsageError(
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
    if (word.empty()) return "";  // CLI11's to report
    if (word[0] == '-') {         // --help, --version; no other option comes before a command
      if (at->get_option_no_throw(word.substr(0, word.find('='))) != nullptr) return "";
      return "unknown option '" + word + "' for `" + path +
             "`, which needs a command first: one of " + names;
    }
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

// CLI11 2.1 reads "-1" into an unsigned 64-bit option as 2^64 - 1 (strtoull wraps it around)
// and a number past 2^64 - 1 as 2^64 - 1, so that a command's own range check then named a
// number the user never typed ("--values 18446744073709551615 is too large"). Every unsigned
// option of `app` and its commands takes decimal digits only, as many as fit in 64 bits.
// A list option (--worlds 4 8 16) takes every value that follows it, so a word that is not a
// number there is most often an argument meant for the command (a file) placed after the list.
std::string whole_number_problem(const std::string& text, bool list) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
    return "'" + text + "' is not a whole number >= 0" +
           (list ? " (a list option takes every value that follows it: give the command's other "
                   "arguments before it)"
                 : "");
  }
  errno = 0;
  std::strtoull(text.c_str(), nullptr, 10);
  return errno == ERANGE ? text + " is larger than 2^64 - 1" : "";
}

void check_unsigned_options(CLI::App& app) {
  static const CLI::Validator whole_number(
      [](std::string& text) { return whole_number_problem(text, false); }, "", "whole number");
  static const CLI::Validator whole_numbers(
      [](std::string& text) { return whole_number_problem(text, true); }, "", "whole number");
  for (CLI::Option* option : app.get_options()) {
    if (option->get_type_name() == "UINT")
      option->check(option->get_items_expected_max() > 1 ? whole_numbers : whole_number);
  }
  for (CLI::App* command : app.get_subcommands(std::function<bool(CLI::App*)>{}))
    check_unsigned_options(*command);
}

// A command's report that could not be written (a full disk, a closed pipe) is the work failing,
// not done: `status`, unless standard output refused what was printed to it.
int with_output_written(int status) {
  std::cout.flush();
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int error = errno;
  if (!flushed || !std::cout || std::ferror(stdout)) {
    std::fprintf(stderr, "ciera: error: the output could not be written to standard output%s%s\n",
                 error != 0 ? ": " : "", error != 0 ? std::strerror(error) : "");
    return ciera::tools::kExitFailed;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ciera::tools;
  CLI::App app{"CIERA: lossless compressed allgather for sharded MoE training"};
  app.set_version_flag("--version", version_text(), "Print the version, commit and wire format");
  app.require_subcommand(1);
  app.footer(kExitStatusHelp);
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
  check_unsigned_options(app);
  try {
    if (const std::string problem = command_problem(app, argc, argv); !problem.empty())
      throw UsageError(problem);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" of status 0; every other parse error is one line,
    // as the commands' own checks are.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string message = e.what();
    // CLI11's words for an option given twice: "--params: At Most 1 required but received 2".
    if (const size_t at = message.find(": At Most 1 required but received ");
        at != std::string::npos) {
      message = message.substr(0, at) + " given more than once";
    }
    std::fprintf(stderr, "ciera: error: %s (see --help)\n", message.c_str());
    return kExitUsage;
  } catch (const CommandExit& done) {
    return with_output_written(done.status);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ciera: error: %s\n", e.what());
    return kExitUsage;
  } catch (const std::bad_alloc&) {  // "std::bad_alloc" alone names nothing a user can act on
    std::fprintf(stderr,
                 "ciera: error: out of memory: the sizes asked for need more memory than "
                 "this machine gave\n");
    return ciera::tools::kExitFailed;
  } catch (const std::exception& e) {  // after the parse step: the work failed
    std::fprintf(stderr, "ciera: error: %s\n", e.what());
    return kExitFailed;
  }
  return with_output_written(kExitDone);
}
