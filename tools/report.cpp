#include "report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>

namespace ciera::tools {

Progress::Progress(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)), total_(std::max<uint64_t>(total, 1)), enabled_(enabled),
      tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::update(uint64_t done, const std::string& detail) {
  if (!enabled_) return;
  const double fraction = static_cast<double>(done) / static_cast<double>(total_);
  const double elapsed = clock_.seconds();
  const double eta = done > 0 ? elapsed * (1.0 - fraction) / fraction : 0.0;
  if (tty_) {
    constexpr int kWidth = 28;
    const int filled = static_cast<int>(fraction * kWidth);
    std::fprintf(stderr, "\r%s [%s%s] %3d%% %llu/%llu %5.1fs eta %5.1fs %s\033[K", label_.c_str(),
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                 static_cast<int>(fraction * 100), static_cast<unsigned long long>(done),
                 static_cast<unsigned long long>(total_), elapsed, eta, detail.c_str());
    std::fflush(stderr);
  } else {
    const int decile = static_cast<int>(fraction * 10);
    if (decile != last_decile_) {
      last_decile_ = decile;
      std::fprintf(stderr, "%s %3d%% (%llu/%llu) %.1fs %s\n", label_.c_str(),
                   static_cast<int>(fraction * 100), static_cast<unsigned long long>(done),
                   static_cast<unsigned long long>(total_), elapsed, detail.c_str());
    }
  }
}

void Progress::finish() {
  if (enabled_ && tty_) std::fprintf(stderr, "\n");
}

std::string Table::render() const {
  std::vector<size_t> width(header_.size(), 0);
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::ostringstream out;
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      out << (c == 0 ? cell + pad : "  " + pad + cell);
    }
    out << "\n";
  };
  line(header_);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  out << std::string(total - 2, '-') << "\n";
  for (const auto& row : rows_) line(row);
  return out.str();
}

std::string fixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

std::string machine_description() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return model + " (" + std::to_string(std::thread::hardware_concurrency()) + " cores)";
}

std::string command_line(int argc, char** argv) {
  // A rank `ciera bench` launched (ranks.cpp) has the executable's path for argv[0] and --child
  // last; the launcher hands it the line it was itself given.
  if (argc > 1 && std::string_view(argv[argc - 1]) == "--child") {
    if (const char* typed = std::getenv(kCommandLineVariable)) return typed;
  }
  std::string out;
  for (int i = 0; i < argc; ++i) {
    if (i) out += ' ';
    out += argv[i];
  }
  return out;
}

}  // namespace ciera::tools
