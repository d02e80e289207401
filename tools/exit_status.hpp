// The exit statuses of every `ciera` command, the same as `ciera train`'s
// (python/ciera/train/launcher.py), so that a script can tell a bad command line from a run that
// failed, and either from a result that was not exact.
#pragma once

#include <string>

#include "ciera/error.hpp"

namespace ciera::tools {

enum ExitStatus : int {
  kExitDone = 0,      // done, and every result that must be exact was
  kExitFailed = 1,    // the work failed: a peer died or stalled past --timeout, a CUDA or I/O error
  kExitUsage = 2,     // a command line no run could use here, refused before any work
  kExitNotExact = 3,  // a result that must be exact was not (a benchmark's verification)
};

// What --help says of them, under every command.
inline constexpr const char* kExitStatusHelp =
    "Exit status: 0 done, every result that must be exact was; 1 the work failed (a peer died or "
    "stalled past --timeout, a device or I/O error); 2 a command line no run could use here; 3 "
    "a result that must be exact was not. `ciera train` exits the same way.";

// A command line no run could use here: an option's value, an input file that cannot be read,
// a device this machine lacks. Found by a command's parse step, before any work: status 2.
class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// A check in a command's parse step: unless `ok`, a UsageError whose `message` names the option.
inline void require(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

// Runs a command's parse step, `parse()`: whatever it throws (its own checks, or the library's
// when it reads an input file or a configuration) is the command line's fault, a UsageError.
template <class Parse>
auto parse_step(Parse&& parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
}

}  // namespace ciera::tools
