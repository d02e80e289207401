// LSB-first bit packing (docs/format.md: packed symbol streams, fine-mode extra bits).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

// A BitWriter without branches, for hot loops: every put() stores a whole 8-byte word, so the
// buffer needs 8 bytes of slack beyond the bits written. Same output as BitWriter.
class SlackBitWriter {
 public:
  explicit SlackBitWriter(uint8_t* out) : out_(out) {}
  // `bits` <= 32 and `value` < 2^bits.
  void put(uint32_t value, unsigned bits) { put_wide(value, bits); }
  // `bits` <= 56 and `value` < 2^bits (the accumulator holds at most 7 + 56 bits).
  void put_wide(uint64_t value, unsigned bits) {
    acc_ |= value << filled_;
    filled_ += bits;
    std::memcpy(out_ + written_, &acc_, 8);
    const unsigned bytes = filled_ >> 3;
    written_ += bytes;
    acc_ >>= 8 * bytes;  // filled_ <= 63, so bytes <= 7
    filled_ &= 7;
  }
  // Flushes the partial byte; returns the bytes written in total.
  uint64_t finish() {
    if (filled_ > 0) out_[written_++] = static_cast<uint8_t>(acc_);
    return written_;
  }
  // Bits written so far.
  uint64_t bits() const { return 8 * written_ + filled_; }
  // Goes on writing into `out`, which holds a copy of what was written so far (a grown buffer).
  void relocate(uint8_t* out) { out_ = out; }

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

// Reads a bit stream whose total length the caller has already checked against its size, so
// get() needs neither a bounds check nor a branch. The bytes are copied into a buffer with 8
// bytes of zero slack so that every read can load a whole word.
class PaddedBitReader {
 public:
  // `scratch` is reused between streams.
  PaddedBitReader(const uint8_t* data, uint64_t size, std::vector<uint8_t>& scratch)
      : size_(size) {
    scratch.assign(size + 8, 0);
    if (size != 0) std::memcpy(scratch.data(), data, size);
    data_ = scratch.data();
  }
  uint64_t size_bits() const { return 8 * size_; }
  uint64_t position() const { return pos_; }
  // For hot loops that keep the position in a register (byte stores elsewhere in the loop could
  // otherwise alias pos_ and force it through memory): read at `pos` with read(), then move on.
  static uint32_t read(const uint8_t* data, uint64_t pos, unsigned bits) {
    uint64_t word;
    std::memcpy(&word, data + (pos >> 3), 8);
    return static_cast<uint32_t>((word >> (pos & 7)) & ((uint64_t{1} << bits) - 1));
  }
  const uint8_t* data() const { return data_; }
  void set_position(uint64_t pos) { pos_ = pos; }
  // `bits` <= 32; the caller guarantees position() + bits <= size_bits().
  uint32_t get(unsigned bits) {
    const uint32_t v = read(data_, pos_, bits);
    pos_ += bits;
    return v;
  }
  // Same meaning as BitReader::exhausted_canonically: every byte used, and the bits of the last
  // byte after position() are 0.
  bool exhausted_canonically() const {
    if ((pos_ + 7) / 8 != size_) return false;
    return (pos_ & 7) == 0 || (data_[pos_ >> 3] >> (pos_ & 7)) == 0;
  }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
};

}  // namespace ciera
