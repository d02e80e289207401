// Payload layout constants and header (de)serialisation: docs/format.md, "Header". Shared by the
// encoder and the decoder, which never include each other.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ciera/codec.hpp"
#include "ciera/dtype.hpp"
#include "codec/fine_alphabet.hpp"
#include "common/host_device.hpp"

namespace ciera::wire {

inline constexpr uint32_t kMagic = 0x52454943;  // "CIER" read as a little-endian u32
inline constexpr uint8_t kVersion = 5;
inline constexpr size_t kHeaderBytes = 80;
inline constexpr uint16_t kFlagContentChecksum = 1;
// A sign-mantissa plane of at least kAlignedPlaneBytes starts at a multiple of kPlaneAlignment
// bytes from the payload's start, after zero padding (docs/format.md, "Padding"): in a 64-byte
// aligned buffer it takes aligned, non-temporal stores. Smaller planes, which are not streamed,
// follow the bitmap directly and cost no padding.
inline constexpr uint64_t kPlaneAlignment = 64;
inline constexpr uint64_t kAlignedPlaneBytes = 64 * 1024;

// Where each field of the header begins (docs/format.md, "Header"), in bytes from its start.
namespace field {
inline constexpr size_t kMagic = 0;               // u32
inline constexpr size_t kVersion = 4;             // u8
inline constexpr size_t kDtype = 5;               // u8, DType
inline constexpr size_t kKind = 6;                // u8, FrameKind
inline constexpr size_t kSection = 7;             // u8, ExponentSection
inline constexpr size_t kFlags = 8;               // u16
inline constexpr size_t kReserved16 = 10;         // u16, 0
inline constexpr size_t kBlockValues = 12;        // u32
inline constexpr size_t kNumValues = 16;          // u64
inline constexpr size_t kEpoch = 24;              // u32
inline constexpr size_t kStream = 28;             // u32
inline constexpr size_t kSequence = 32;           // u64
inline constexpr size_t kBitmapBytes = 40;        // u64
inline constexpr size_t kSignMantissaBytes = 48;  // u64
inline constexpr size_t kExponentBytes = 56;      // u64
inline constexpr size_t kContentChecksum = 64;    // u64
inline constexpr size_t kHeaderChecksum = 72;     // u32, of the 72 bytes before it
inline constexpr size_t kReserved32 = 76;         // u32, 0
static_assert(kReserved32 + 4 == kHeaderBytes);
}  // namespace field

// Offset of the sign-mantissa plane after a bitmap of `bitmap_bytes` (which the caller has
// bounded by the payload's size, so nothing overflows).
CIERA_HD inline uint64_t sign_mantissa_offset(uint64_t bitmap_bytes, uint64_t sign_mantissa_bytes) {
  const uint64_t end = kHeaderBytes + bitmap_bytes;
  if (sign_mantissa_bytes < kAlignedPlaneBytes) return end;
  return end + (kPlaneAlignment - end % kPlaneAlignment) % kPlaneAlignment;
}

struct Header {
  DType dtype = DType::kBF16;
  FrameKind kind = FrameKind::kKey;
  ExponentSection section = ExponentSection::kFull;
  uint16_t flags = 0;
  uint32_t block_values = 0;
  uint64_t num_values = 0;
  uint32_t stream = 0;
  uint32_t epoch = 0;
  uint64_t sequence = 0;
  uint64_t bitmap_bytes = 0;
  uint64_t sign_mantissa_bytes = 0;
  uint64_t exponent_bytes = 0;
  uint64_t content_checksum = 0;

  bool has_content_checksum() const { return (flags & kFlagContentChecksum) != 0; }
  uint64_t sign_mantissa_at() const { return sign_mantissa_offset(bitmap_bytes, sign_mantissa_bytes); }
  uint64_t padding_bytes() const { return sign_mantissa_at() - kHeaderBytes - bitmap_bytes; }
  uint64_t payload_bytes() const { return sign_mantissa_at() + sign_mantissa_bytes + exponent_bytes; }
};

// The error text of a frame whose reconstruction fails its content checksum; `state` names what
// the receiver holds that the sender's may disagree with ("the previous values", ...).
inline std::string content_checksum_mismatch(std::string_view state) {
  return "content checksum mismatch: the reconstructed shard differs from what was sent (payload "
         "corrupted, or sender and receiver disagree about " +
         std::string(state) + ")";
}

// Writes the 80 header bytes, header checksum included.
void write_header(const Header& header, uint8_t* out);
// Parses and validates the header of `payload` on its own terms (magic, version, header checksum,
// known codes, zero reserved fields, consistent section lengths, zero padding, exact payload
// length). Does not compare against any configuration. Throws FormatError.
Header read_header(const uint8_t* payload, size_t size);
// The same for the payload at the start of `bytes`, which more bytes may follow: its sections
// must lie within `size`, and payload_bytes() is where it ends.
Header read_leading_header(const uint8_t* bytes, size_t size);

inline uint64_t block_count(uint64_t num_values, uint32_t block_values) {
  return (num_values + block_values - 1) / block_values;
}
inline uint64_t bitmap_bytes_for(uint64_t num_values, uint32_t block_values) {
  return (block_count(num_values, block_values) + 7) / 8;
}

}  // namespace ciera::wire
