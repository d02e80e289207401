// Subcommands of the `ciera` tool. Each registers itself on the CLI11 app; its callback runs the
// command and throws CommandExit with the exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ciera::tools {

struct CommandExit {
  int status;
};

void register_bench_codec(CLI::App& bench, const std::string& command);
void register_bench_allgather(CLI::App& bench, const std::string& command, int argc, char** argv);
void register_analyze(CLI::App& app, const std::string& command);
void register_simulate(CLI::App& app, const std::string& command);

}  // namespace ciera::tools
