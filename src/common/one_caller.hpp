// For a class whose calls must come from one thread at a time (a collective's buffers, sequence
// number and call records are one call's): held for a call, it makes a second thread's call while
// one is in flight a std::logic_error naming both, where it would otherwise race on that state and
// pair its exchanges with the wrong calls of the peers.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

namespace ciera {

class OneCaller {
 public:
  // `busy`: the object's flag; `owner`: its class, `call`: the call being made (for the error).
  OneCaller(std::atomic<const char*>& busy, const char* owner, const char* call) : busy_(busy) {
    const char* expected = nullptr;
    if (!busy_.compare_exchange_strong(expected, call)) {
      throw std::logic_error(std::string(owner) + ": " + call +
                             " was called while another thread's " + expected +
                             " call on the same object is in flight (one thread at a time)");
    }
  }
  ~OneCaller() { busy_.store(nullptr); }
  OneCaller(const OneCaller&) = delete;
  OneCaller& operator=(const OneCaller&) = delete;

 private:
  std::atomic<const char*>& busy_;
};

}  // namespace ciera
