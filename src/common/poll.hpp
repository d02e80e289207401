// Waiting on something that only polling can tell (an MPI request, a transfer beside a task):
// calls a test until it holds, backing off from yielding to short sleeps.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

namespace ciera {

// A timeout as a caller gave it (a transport's, a wait's), or std::invalid_argument naming `who`
// if it is negative: zero waits forever, and the waits below read a negative one as zero too,
// so a bound the caller got wrong would become a hang.
inline std::chrono::milliseconds checked_timeout(std::chrono::milliseconds timeout,
                                                 const std::string& who) {
  if (timeout.count() < 0) {
    throw std::invalid_argument(who + ": the timeout must not be negative (" +
                                std::to_string(timeout.count()) + " ms; zero waits forever)");
  }
  return timeout;
}

// Calls `test` until it returns true (then true) or `timeout` passes (then false; 0: no
// deadline). Between calls it yields, then sleeps with growing pauses up to 200 us, so that
// oversubscribed ranks do not steal each other's cores, unless `*progress` changed (something
// moved: look again soon).
template <typename Test>
bool poll_until(Test&& test, std::chrono::milliseconds timeout,
                const uint64_t* progress = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(0);
  uint64_t seen = progress ? *progress : 0;
  for (;;) {
    if (test()) return true;
    if (progress && *progress != seen) {
      seen = *progress;
      pause = std::chrono::microseconds(0);
    }
    if (timeout.count() > 0 && std::chrono::steady_clock::now() - start > timeout) return false;
    if (pause.count() == 0) {
      sched_yield();
      pause = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
}

}  // namespace ciera
