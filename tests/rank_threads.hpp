// One thread per rank of an in-process test world, and what each rank threw: the loop the
// multi-rank tests (collectives, engine, backends, selection) share.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace ciera::testing {

// Runs `rank_body(r)` for every rank r of `world`, each on a thread of its own, and waits for
// all of them. Returns each rank's error text: "" if its body returned, never "" if it threw.
inline std::vector<std::string> on_rank_threads(int world,
                                                const std::function<void(int rank)>& rank_body) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::string& error = errors[static_cast<size_t>(r)];
      try {
        rank_body(r);
      } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "an exception with an empty message";
      } catch (...) {
        error = "an exception that is not a std::exception";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Each rank's body returned: one failure per rank that threw, naming it and its error.
inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace ciera::testing
