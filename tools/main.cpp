// The `ciera` command-line tool: benchmarks, analysis and simulation.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "commands.hpp"
#include "report.hpp"

int main(int argc, char** argv) {
  using namespace ciera::tools;
  CLI::App app{"CIERA: lossless compressed allgather for sharded MoE training"};
  app.set_version_flag("--version", std::string(ciera::kLibraryVersion));
  app.require_subcommand(1);
  const std::string command = command_line(argc, argv);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that verify what they time");
  bench->require_subcommand(1);
  register_bench_codec(*bench, command);
#if defined(CIERA_WITH_MPI)
  register_bench_allgather(*bench, command, argc, argv);
#endif
  register_analyze(app, command);
  register_simulate(app, command);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const CommandExit& done) {
    return done.status;
  } catch (const ciera::Error& e) {
    std::fprintf(stderr, "ciera: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
