// Output helpers shared by the ciera subcommands: timing, progress, tables, machine description.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/statistics.hpp"

namespace ciera::tools {

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// median() and mean() of samples: common/statistics.hpp, found from this namespace.

// A one-line progress bar on stderr: redrawn in place on a terminal, a line every ~10% otherwise.
class Progress {
 public:
  Progress(std::string label, uint64_t total, bool enabled);
  void update(uint64_t done, const std::string& detail = "");
  void finish();

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_;
  bool tty_;
  int last_decile_ = -1;
  Stopwatch clock_;
};

// A plain-text table with right-aligned numeric columns.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

std::string fixed(double value, int decimals);
// "AMD EPYC (2 cores)" and the like, for benchmark reports.
std::string machine_description();
// The environment variable in which a launcher of ranks passes its own command line to them.
inline constexpr const char* kCommandLineVariable = "CIERA_COMMAND_LINE";
// The command line as typed, for reports (in a launched rank, its launcher's).
std::string command_line(int argc, char** argv);
// `j` as JSON text (`indent` as nlohmann's dump() takes it). Strings that are not UTF-8 (a path
// or an argument in another encoding, from the command line) get U+FFFD for each bad byte rather
// than failing the report after the work is done.
inline std::string json_text(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ciera::tools
