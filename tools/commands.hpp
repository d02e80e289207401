// Subcommands of the `ciera` tool. Each registers itself on the CLI11 app, binding its options
// to an Options struct, and its callback runs the command in three steps (house rule 15):
//   parse:   Options -> a checked Request; every check (and every input file read) happens
//            here, before any work, and a bad value throws UsageError naming the option;
//   compute: Request -> a result struct (with a progress bar on stderr where it is long);
//   render:  the result as a table, or as JSON with --json.
// It then throws CommandExit with the exit status (exit_status.hpp). Whatever the parse step
// throws leaves as a UsageError (parse_step), status 2; an error after it, status 1.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "ciera/config.hpp"
#include "exit_status.hpp"

namespace ciera::tools {

// --block, values per block: named as the option, before CodecConfig::validate() would name its
// field (block_values).
inline void require_block_option(uint64_t block) {
  require(block >= CodecConfig::kMinBlockValues && block <= CodecConfig::kMaxBlockValues,
          "--block must be in " + std::to_string(CodecConfig::kMinBlockValues) + ".." +
              std::to_string(CodecConfig::kMaxBlockValues) + " values (got " +
              std::to_string(block) + ")");
}

// --steps against --warmup: the steady state the benchmarks report is the steps after warmup.
// `warmup_given`: whether the user typed --warmup (else the message says it is the default).
inline void require_steps_after_warmup(uint64_t steps, uint64_t warmup, bool warmup_given) {
  require(steps > warmup,
          "--steps " + std::to_string(steps) + " must exceed --warmup " + std::to_string(warmup) +
              (warmup_given ? "" : " (the default)") +
              " to measure a steady state: give more --steps or a smaller --warmup");
}

struct CommandExit {
  int status;  // an ExitStatus
};

void register_bench_codec(CLI::App& bench, const std::string& command);
void register_bench_allgather(CLI::App& bench, const std::string& command, int argc, char** argv);
void register_bench_broadcast(CLI::App& bench, const std::string& command, int argc, char** argv);
// `bench alltoall` and `bench reduce-scatter` (bench_collectives.cpp)
void register_bench_collectives(CLI::App& bench, const std::string& command, int argc, char** argv);
void register_analyze(CLI::App& app, const std::string& command);
void register_simulate(CLI::App& app, const std::string& command);

}  // namespace ciera::tools
