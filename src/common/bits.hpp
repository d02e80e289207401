// LSB-first bit packing (docs/format.md: packed symbol streams, fine-mode extra bits).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "ciera/error.hpp"

namespace ciera {

// Writes into a buffer the caller sized; padding bits of the last byte are 0.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  // `bits` <= 32 and `value` < 2^bits.
  // `bits` <= 32 and `value` < 2^bits. Flushes whole 32-bit words of data, never past them.
  void put(uint32_t value, unsigned bits) {
    acc_ |= uint64_t{value} << filled_;
    filled_ += bits;
    if (filled_ >= 32) {
      const uint32_t word = static_cast<uint32_t>(acc_);
      std::memcpy(out_ + written_, &word, 4);
      written_ += 4;
      acc_ >>= 32;
      filled_ -= 32;
    }
  }
  // Flushes the partial byte; returns the bytes written in total.
  uint64_t finish() {
    while (filled_ > 0) {
      out_[written_++] = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      filled_ = filled_ > 8 ? filled_ - 8 : 0;
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
    if (filled_ < bits) refill(bits);
    const uint32_t v = static_cast<uint32_t>(acc_ & ((uint64_t{1} << bits) - 1));
    acc_ >>= bits;
    filled_ -= bits;
    return v;
  }
  void refill(unsigned bits) {
    if (size_ - pos_ >= 8) {
      // Top up to at least 56 bits with one unaligned load.
      uint64_t word;
      std::memcpy(&word, data_ + pos_, 8);
      acc_ |= word << filled_;
      const unsigned take = (63 - filled_) / 8;
      pos_ += take;
      filled_ += 8 * take;
      acc_ &= filled_ == 64 ? ~uint64_t{0} : (uint64_t{1} << filled_) - 1;
      return;
    }
    while (filled_ < bits) {
      if (pos_ >= size_) {
        throw FormatError(std::string(what_) + ": bit stream ends early");
      }
      acc_ |= uint64_t{data_[pos_++]} << filled_;
      filled_ += 8;
    }
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
