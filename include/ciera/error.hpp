// Errors thrown by the CIERA library. Every error names what is wrong in words a user can act on.
#pragma once

#include <stdexcept>
#include <string>

namespace ciera {

// Base of all CIERA errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A payload that is malformed, truncated, corrupted, out of sequence or meant for another
// configuration. The decoder's state is unchanged when this is thrown.
class FormatError : public Error {
 public:
  using Error::Error;
};

// An invalid configuration, or configurations that disagree between peers.
class ConfigError : public Error {
 public:
  using Error::Error;
};

}  // namespace ciera
