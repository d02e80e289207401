// LSB-first bit packing (docs/format.md: packed symbol streams, fine-mode extra bits).
#pragma once

#include <cstdint>
#include <string>

#include "ciera/error.hpp"

namespace ciera {

// Writes into a buffer the caller sized; padding bits of the last byte are 0.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  // `bits` <= 32 and `value` < 2^bits.
  void put(uint32_t value, unsigned bits) {
    acc_ |= uint64_t{value} << filled_;
    filled_ += bits;
    while (filled_ >= 8) {
      out_[written_++] = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      filled_ -= 8;
    }
  }
  // Flushes the partial byte; returns the bytes written in total.
  uint64_t finish() {
    if (filled_ > 0) {
      out_[written_++] = static_cast<uint8_t>(acc_);
      acc_ = 0;
      filled_ = 0;
    }
    return written_;
  }

 private:
  uint8_t* out_;
  uint64_t written_ = 0;
  uint64_t acc_ = 0;
  unsigned filled_ = 0;
};

// Reads untrusted bits; running past the end throws FormatError naming `what`.
class BitReader {
 public:
  BitReader() = default;
  BitReader(const uint8_t* data, uint64_t size, const char* what)
      : data_(data), size_(size), what_(what) {}
  // `bits` <= 32.
  uint32_t get(unsigned bits) {
    while (filled_ < bits) {
      if (pos_ >= size_) {
        throw FormatError(std::string(what_) + ": bit stream ends early");
      }
      acc_ |= uint64_t{data_[pos_++]} << filled_;
      filled_ += 8;
    }
    const uint32_t v = static_cast<uint32_t>(acc_ & ((uint64_t{1} << bits) - 1));
    acc_ >>= bits;
    filled_ -= bits;
    return v;
  }
  // True when every byte was consumed and the unread bits of the last byte are 0 (canonical).
  bool exhausted_canonically() const { return pos_ == size_ && filled_ < 8 && acc_ == 0; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
  uint64_t acc_ = 0;
  unsigned filled_ = 0;
  const char* what_ = "bit stream";
};

}  // namespace ciera
