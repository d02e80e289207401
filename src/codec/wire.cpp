#include "codec/wire.hpp"

#include <string>

#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"

namespace ciera::wire {
namespace {

constexpr size_t kHeaderChecksumOffset = 72;

uint32_t header_checksum(const uint8_t* header) {
  return static_cast<uint32_t>(checksum64(header, kHeaderChecksumOffset));
}

}  // namespace

void write_header(const Header& h, uint8_t* out) {
  store_le32(out + 0, kMagic);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(h.dtype);
  out[6] = static_cast<uint8_t>(h.kind);
  out[7] = static_cast<uint8_t>(h.section);
  store_le16(out + 8, h.flags);
  store_le16(out + 10, 0);
  store_le32(out + 12, h.block_values);
  store_le64(out + 16, h.num_values);
  store_le32(out + 24, h.epoch);
  store_le32(out + 28, h.stream);
  store_le64(out + 32, h.sequence);
  store_le64(out + 40, h.bitmap_bytes);
  store_le64(out + 48, h.sign_mantissa_bytes);
  store_le64(out + 56, h.exponent_bytes);
  store_le64(out + 64, h.content_checksum);
  store_le32(out + kHeaderChecksumOffset, header_checksum(out));
  store_le32(out + 76, 0);
}

namespace {

// read_header(), or with `trailing` the header of a payload that more bytes may follow.
Header parse_header(const uint8_t* p, size_t size, bool trailing) {
  static_assert(kVersion == kFormatVersion);
  if (size < kHeaderBytes) {
    throw FormatError("payload truncated: " + std::to_string(size) + " bytes, the header alone needs " +
                      std::to_string(kHeaderBytes));
  }
  if (load_le32(p) != kMagic) throw FormatError("not a CIERA payload (bad magic)");
  if (p[4] != kVersion) {
    throw FormatError("unsupported CIERA format version " + std::to_string(p[4]) +
                      " (this build reads version " + std::to_string(kVersion) + ")");
  }
  if (load_le32(p + kHeaderChecksumOffset) != header_checksum(p)) {
    throw FormatError("payload header is corrupt (header checksum mismatch)");
  }
  if (load_le16(p + 10) != 0 || load_le32(p + 76) != 0) {
    throw FormatError("payload header has non-zero reserved fields");
  }
  Header h;
  if (!is_valid_dtype_code(p[5])) {
    throw FormatError("payload has unknown dtype code " + std::to_string(p[5]));
  }
  h.dtype = static_cast<DType>(p[5]);
  if (p[6] < static_cast<uint8_t>(FrameKind::kKey) || p[6] > static_cast<uint8_t>(FrameKind::kValueDelta)) {
    throw FormatError("payload has unknown frame kind " + std::to_string(p[6]));
  }
  h.kind = static_cast<FrameKind>(p[6]);
  if (p[7] > static_cast<uint8_t>(ExponentSection::kDifferences)) {
    throw FormatError("payload has unknown exponent section kind " + std::to_string(p[7]));
  }
  h.section = static_cast<ExponentSection>(p[7]);
  // Key frames carry the full section; exponent-delta frames unchanged, block or fine;
  // value-delta frames unchanged or differences.
  const bool paired = h.kind == FrameKind::kKey ? h.section == ExponentSection::kFull
                      : h.kind == FrameKind::kDelta
                          ? h.section != ExponentSection::kFull &&
                                h.section != ExponentSection::kDifferences
                          : h.section == ExponentSection::kUnchanged ||
                                h.section == ExponentSection::kDifferences;
  if (!paired) {
    throw FormatError("payload pairs a " + std::string(frame_kind_name(h.kind)) +
                      " frame with a '" + std::string(exponent_section_name(h.section)) +
                      "' exponent section");
  }
  h.flags = load_le16(p + 8);
  if ((h.flags & ~kFlagContentChecksum) != 0) {
    throw FormatError("payload has unknown flags " + std::to_string(h.flags));
  }
  h.block_values = load_le32(p + 12);
  if (h.block_values < CodecConfig::kMinBlockValues || h.block_values > CodecConfig::kMaxBlockValues) {
    throw FormatError("payload block size " + std::to_string(h.block_values) + " is out of range");
  }
  h.num_values = load_le64(p + 16);
  if (h.num_values > kMaxShardValues) {
    throw FormatError("payload claims " + std::to_string(h.num_values) +
                      " values, more than a shard may hold (2^48)");
  }
  h.epoch = load_le32(p + 24);
  h.stream = load_le32(p + 28);
  h.sequence = load_le64(p + 32);
  h.bitmap_bytes = load_le64(p + 40);
  h.sign_mantissa_bytes = load_le64(p + 48);
  h.exponent_bytes = load_le64(p + 56);
  h.content_checksum = load_le64(p + 64);
  if (!h.has_content_checksum() && h.content_checksum != 0) {
    throw FormatError("payload carries a checksum value without the checksum flag");
  }
  // Section lengths are checked one at a time against the bytes actually present, so no sum can
  // overflow and a huge claimed length is rejected before anything is sized from it.
  uint64_t left = size - kHeaderBytes;
  const auto take = [&](uint64_t section) {
    if (section > left) {
      throw FormatError("payload truncated: its sections need more than the " +
                        std::to_string(size) + " bytes received");
    }
    left -= section;
  };
  take(h.bitmap_bytes);
  take(h.padding_bytes());
  take(h.sign_mantissa_bytes);
  take(h.exponent_bytes);
  if (left != 0 && !trailing) {
    throw FormatError("payload has " + std::to_string(left) + " trailing bytes after its sections");
  }
  for (uint64_t at = kHeaderBytes + h.bitmap_bytes; at < h.sign_mantissa_at(); ++at) {
    if (p[at] != 0) {
      throw FormatError("payload has a non-zero padding byte before its sign-mantissa plane (offset " +
                        std::to_string(at) + ")");
    }
  }
  return h;
}

}  // namespace

Header read_header(const uint8_t* p, size_t size) { return parse_header(p, size, false); }

Header read_leading_header(const uint8_t* p, size_t size) { return parse_header(p, size, true); }

}  // namespace ciera::wire
