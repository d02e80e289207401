// Little-endian loads/stores and a bounds-checked reader for parsing untrusted bytes.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "ciera/error.hpp"
#include "common/host_device.hpp"

static_assert(std::endian::native == std::endian::little,
              "CIERA supports little-endian hosts only (the wire format is little-endian)");

namespace ciera {

inline uint16_t load_le16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_le32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_le16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof v); }
inline void store_le32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }
inline void store_le64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, sizeof v); }

// Whether two byte ranges share a byte (an empty range shares none). Compared as addresses,
// since `<` on pointers into different objects is unspecified.
inline bool ranges_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto a_at = reinterpret_cast<uintptr_t>(a);
  const auto b_at = reinterpret_cast<uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && a_at < b_at + b_bytes && b_at < a_at + a_bytes;
}

// Reads untrusted bytes; every read past the end throws FormatError naming `what`.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, uint64_t size, const char* what)
      : data_(data), size_(size), what_(what) {}

  uint64_t remaining() const { return size_ - pos_; }
  uint64_t position() const { return pos_; }
  const uint8_t* cursor() const { return data_ + pos_; }

  void need(uint64_t bytes) const {
    if (bytes > remaining()) {
      throw FormatError(std::string(what_) + ": truncated (needs " + std::to_string(bytes) +
                        " more bytes, " + std::to_string(remaining()) + " left)");
    }
  }
  uint8_t u8() {
    need(1);
    return data_[pos_++];
  }
  uint32_t u32() {
    need(4);
    const uint32_t v = load_le32(data_ + pos_);
    pos_ += 4;
    return v;
  }
  uint64_t u64() {
    need(8);
    const uint64_t v = load_le64(data_ + pos_);
    pos_ += 8;
    return v;
  }
  // LEB128 in its shortest form (a last byte of 0 after another is refused), at most `max_bits`
  // significant bits.
  uint64_t varint(unsigned max_bits) {
    uint64_t v = 0;
    for (unsigned shift = 0;; shift += 7) {
      const uint8_t byte = u8();
      if (shift >= max_bits || (shift + 7 > max_bits && (byte & 0x7F) >> (max_bits - shift) != 0)) {
        throw FormatError(std::string(what_) + ": varint exceeds " + std::to_string(max_bits) + " bits");
      }
      v |= uint64_t{byte & 0x7Fu} << shift;
      if (byte == 0 && shift > 0) {
        throw FormatError(std::string(what_) + ": varint is not in its shortest form");
      }
      if ((byte & 0x80) == 0) return v;
    }
  }
  const uint8_t* take(uint64_t bytes) {
    need(bytes);
    const uint8_t* p = data_ + pos_;
    pos_ += bytes;
    return p;
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const char* what_;
};

CIERA_HD inline uint8_t* put_varint(uint8_t* out, uint64_t v) {
  while (v >= 0x80) {
    *out++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *out++ = static_cast<uint8_t>(v);
  return out;
}

}  // namespace ciera
