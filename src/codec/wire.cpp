#include "codec/wire.hpp"

#include <string>

#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"

namespace ciera::wire {
namespace {

uint32_t header_checksum(const uint8_t* header) {
  return static_cast<uint32_t>(checksum64(header, field::kHeaderChecksum));
}

}  // namespace

void write_header(const Header& h, uint8_t* out) {
  store_le32(out + field::kMagic, kMagic);
  out[field::kVersion] = kVersion;
  out[field::kDtype] = static_cast<uint8_t>(h.dtype);
  out[field::kKind] = static_cast<uint8_t>(h.kind);
  out[field::kSection] = static_cast<uint8_t>(h.section);
  store_le16(out + field::kFlags, h.flags);
  store_le16(out + field::kReserved16, 0);
  store_le32(out + field::kBlockValues, h.block_values);
  store_le64(out + field::kNumValues, h.num_values);
  store_le32(out + field::kEpoch, h.epoch);
  store_le32(out + field::kStream, h.stream);
  store_le64(out + field::kSequence, h.sequence);
  store_le64(out + field::kBitmapBytes, h.bitmap_bytes);
  store_le64(out + field::kSignMantissaBytes, h.sign_mantissa_bytes);
  store_le64(out + field::kExponentBytes, h.exponent_bytes);
  store_le64(out + field::kContentChecksum, h.content_checksum);
  store_le32(out + field::kHeaderChecksum, header_checksum(out));
  store_le32(out + field::kReserved32, 0);
}

namespace {

// read_header(), or with `trailing` the header of a payload that more bytes may follow.
Header parse_header(const uint8_t* p, size_t size, bool trailing) {
  static_assert(kVersion == kFormatVersion);
  if (size < kHeaderBytes) {
    throw FormatError("payload truncated: " + std::to_string(size) + " bytes, the header alone needs " +
                      std::to_string(kHeaderBytes));
  }
  if (load_le32(p + field::kMagic) != kMagic) throw FormatError("not a CIERA payload (bad magic)");
  if (p[field::kVersion] != kVersion) {
    throw FormatError("unsupported CIERA format version " + std::to_string(p[field::kVersion]) +
                      " (this build reads version " + std::to_string(kVersion) + ")");
  }
  if (load_le32(p + field::kHeaderChecksum) != header_checksum(p)) {
    throw FormatError("payload header is corrupt (header checksum mismatch)");
  }
  if (load_le16(p + field::kReserved16) != 0 || load_le32(p + field::kReserved32) != 0) {
    throw FormatError("payload header has non-zero reserved fields");
  }
  Header h;
  const uint8_t dtype = p[field::kDtype], kind = p[field::kKind], section = p[field::kSection];
  if (!is_valid_dtype_code(dtype)) {
    throw FormatError("payload has unknown dtype code " + std::to_string(dtype));
  }
  h.dtype = static_cast<DType>(dtype);
  if (kind < static_cast<uint8_t>(FrameKind::kKey) ||
      kind > static_cast<uint8_t>(FrameKind::kValueDelta)) {
    throw FormatError("payload has unknown frame kind " + std::to_string(kind));
  }
  h.kind = static_cast<FrameKind>(kind);
  if (section > static_cast<uint8_t>(ExponentSection::kDifferences)) {
    throw FormatError("payload has unknown exponent section kind " + std::to_string(section));
  }
  h.section = static_cast<ExponentSection>(section);
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
  h.flags = load_le16(p + field::kFlags);
  if ((h.flags & ~kFlagContentChecksum) != 0) {
    throw FormatError("payload has unknown flags " + std::to_string(h.flags));
  }
  h.block_values = load_le32(p + field::kBlockValues);
  if (h.block_values < CodecConfig::kMinBlockValues || h.block_values > CodecConfig::kMaxBlockValues) {
    throw FormatError("payload block size " + std::to_string(h.block_values) + " is out of range");
  }
  h.num_values = load_le64(p + field::kNumValues);
  if (h.num_values > kMaxShardValues) {
    throw FormatError("payload claims " + std::to_string(h.num_values) +
                      " values, more than a shard may hold (2^48)");
  }
  h.epoch = load_le32(p + field::kEpoch);
  h.stream = load_le32(p + field::kStream);
  h.sequence = load_le64(p + field::kSequence);
  h.bitmap_bytes = load_le64(p + field::kBitmapBytes);
  h.sign_mantissa_bytes = load_le64(p + field::kSignMantissaBytes);
  h.exponent_bytes = load_le64(p + field::kExponentBytes);
  h.content_checksum = load_le64(p + field::kContentChecksum);
  if (!h.has_content_checksum() && h.content_checksum != 0) {
    throw FormatError("payload carries a checksum value without the checksum flag");
  }
  // Section lengths are checked one at a time against the bytes actually present, so no sum can
  // overflow and a huge claimed length is rejected before anything is sized from it.
  uint64_t left = size - kHeaderBytes;
  const auto take = [&](uint64_t bytes) {
    if (bytes > left) {
      throw FormatError("payload truncated: its sections need more than the " +
                        std::to_string(size) + " bytes received");
    }
    left -= bytes;
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
