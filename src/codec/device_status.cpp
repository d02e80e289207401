// The host side of the GPU decoder's steps (codec/device_decode.hpp): its configuration, and the
// words for a refused frame, which match the CPU decoder's (decoder.cpp, wire.cpp) in substance.
#include <string>

#include "ciera/dtype.hpp"
#include "ciera/error.hpp"
#include "codec/device_decode.hpp"
#include "codec/device_encode.hpp"
#include "codec/limits.hpp"
#include "codec/wire.hpp"
#include "format/planes.hpp"

namespace ciera::codec::device {

DecodeConfig make_decode_config(const CodecConfig& config, uint64_t num_values) {
  config.validate();
  coder_config(config, num_values, /*one_shot=*/false, "cuda::ShardDecoder");
  const DTypeInfo info = dtype_info(config.dtype);
  DecodeConfig c;
  c.dtype = static_cast<uint8_t>(config.dtype);
  c.exponent_bits = static_cast<uint8_t>(info.exponent_bits);
  c.value_bytes = static_cast<uint8_t>(info.value_bytes);
  c.require_checksum = config.content_checksum ? 1 : 0;
  c.block_values = config.block_values;
  c.num_values = num_values;
  c.blocks = wire::block_count(num_values, config.block_values);
  c.bitmap_bytes = wire::bitmap_bytes_for(num_values, config.block_values);
  const format::SignMantissaLayout layout(config.dtype, num_values);
  c.sign_mantissa_bytes = layout.total_bytes();
  c.low_plane_bytes = layout.first_plane_bytes;
  c.value_delta = config.stream_kind == ciera::StreamKind::kValueDelta ? 1 : 0;
  return c;
}

EncodeConfig make_encode_config(const CodecConfig& config, uint64_t num_values) {
  config.validate();
  coder_config(config, num_values, /*one_shot=*/false, "cuda::ShardEncoder");
  const DTypeInfo info = dtype_info(config.dtype);
  EncodeConfig c;
  c.dtype = static_cast<uint8_t>(config.dtype);
  c.exponent_bits = static_cast<uint8_t>(info.exponent_bits);
  c.value_bytes = static_cast<uint8_t>(info.value_bytes);
  c.checksum = config.content_checksum ? 1 : 0;
  c.hash = config.detection == ChangeDetection::kHash ? 1 : 0;
  c.hash_bits = config.hash_bits;
  // Hash detection knows changed blocks, not changed values: block coding (as encoder.cpp).
  c.coding = static_cast<uint8_t>(c.hash ? ExponentCoding::kBlock : config.coding);
  c.block_values = config.block_values;
  c.num_values = num_values;
  c.blocks = wire::block_count(num_values, config.block_values);
  c.value_delta = config.stream_kind == ciera::StreamKind::kValueDelta ? 1 : 0;
  c.plane_bytes = format::SignMantissaLayout(config.dtype, num_values).total_bytes();
  c.sign_mantissa_bytes = c.plane_bytes;
  c.key_sign_mantissa_at = wire::sign_mantissa_offset(0, c.plane_bytes);
  c.capacity = max_payload_bytes(config.dtype, num_values, config.block_values);
  return c;
}

void set_frame(EncodeConfig& c, bool key, uint32_t stream, uint32_t epoch, uint64_t sequence) {
  c.key = key ? 1 : 0;
  c.stream = stream;
  c.epoch = epoch;
  c.sequence = sequence;
  if (c.value_delta && !key) {
    // A value-delta frame: no bitmap, no plane; the section follows the header.
    c.bitmap_bytes = 0;
    c.sign_mantissa_bytes = 0;
    c.sign_mantissa_at = wire::kHeaderBytes;
    return;
  }
  c.bitmap_bytes = key ? 0 : (c.blocks + 7) / 8;
  c.sign_mantissa_bytes = c.plane_bytes;
  c.sign_mantissa_at = wire::sign_mantissa_offset(c.bitmap_bytes, c.sign_mantissa_bytes);
}

std::string describe_status(uint32_t status, uint64_t d0, uint64_t d1) {
  const auto n = [](uint64_t v) { return std::to_string(v); };
  static const char* const kStreams[] = {"exponent stream",     "fine counts stream",
                                         "fine changes stream", "fine escapes stream",
                                         "difference groups stream", "difference escapes stream"};
  const char* stream = d0 < 6 ? kStreams[d0] : "stream";
  switch (status) {
    case kOk: return "ok";
    case kTruncated: return "payload truncated: its sections need more bytes than were received";
    case kBadMagic: return "not a CIERA payload (bad magic)";
    case kBadVersion:
      return "unsupported CIERA format version " + n(d0) + " (this build reads version " +
             n(wire::kVersion) + ")";
    case kHeaderChecksum: return "payload header is corrupt (header checksum mismatch)";
    case kReservedNonZero: return "payload header has non-zero reserved fields";
    case kBadCode: return "payload has an unknown code " + n(d1) + " at header offset " + n(d0);
    case kKindSectionMismatch: return "payload pairs a frame kind with the wrong exponent section";
    case kBadFlags: return "payload has unknown flags " + n(d0);
    case kBadBlockSize: return "payload block size " + n(d0) + " is out of range";
    case kChecksumWithoutFlag: return "payload carries a checksum value without the checksum flag";
    case kTrailingBytes: return "payload or exponent section has " + n(d0) + " trailing bytes";
    case kPaddingNonZero:
      return "payload has a non-zero padding byte before its sign-mantissa plane (offset " + n(d0) + ")";
    case kConfigMismatch:
      return "payload header field at offset " + n(d0) + " is " + n(d1) +
             ", which this decoder's configuration does not expect (dtype, block size, value "
             "count, sign-mantissa or bitmap length)";
    case kChecksumRequired: return "payload carries no content checksum but this decoder requires one";
    case kMisrouted: return "misrouted payload: it belongs to stream " + n(d0) + ", not this decoder's";
    case kNoCache:
      return "delta frame cannot be decoded: this decoder holds no cache (exponents or previous values) "
             "and needs a key frame";
    case kOutOfSequence:
      return "stale or out-of-sequence frame (epoch " + n(d0) + ", sequence " + n(d1) + ")";
    case kUnrequestedEpoch:
      return "key frame starts a new epoch (" + n(d0) + "), but this receiver asked for no resynchronisation";
    case kTooFarAhead: return "key frame is " + n(d0) + " epochs ahead: not a resynchronisation of this stream";
    case kSignMantissaPadding: return "sign-mantissa plane has non-zero padding bits";
    case kBitmapPastEnd: return "bitmap marks a block past the end of the shard";
    case kSectionBitmapMismatch: return "exponent section kind does not match the bitmap";
    case kStreamMalformed: return std::string(stream) + " is malformed";
    case kSymbolTooLarge: return std::string(stream) + " holds symbol " + n(d1) + ", above the largest allowed";
    case kFineCountTooLarge: return "fine exponent section claims " + n(d1) + " changed values in block " + n(d0);
    case kFineBadEscape: return "fine escapes stream holds step " + n(d0) + ", which has its own step class";
    case kFinePastBlock: return "fine exponent section places a change past the end of block " + n(d0);
    case kFineExtraBits: return "fine extra bits end early, are not fully used or have non-zero padding";
    case kContentChecksum:
      return wire::content_checksum_mismatch("the cached exponents or values");
    case kWrongStreamKind:
      return d0 == 3 ? "payload is a value-delta frame but this decoder receives an exponent-reuse stream"
                     : "payload is an exponent-delta frame but this decoder receives a value-delta stream";
    case kDifferenceClassPastEnd:
      return "difference groups stream gives a class to values past the end of the shard";
    case kDifferenceEscapeTooLarge:
      return "difference section escapes a difference of " + n(d0) + ", beyond the dtype's width";
    case kDifferenceExtraBits:
      return "difference section has " + n(d0) + " bytes of extra bits, its escapes need " + n(d1) +
             " (or its extra bits have non-zero padding)";
    case kDifferenceNoChange:
      return "'differences' section in which no value changed (canonical form: 'unchanged')";
    case kBlockUnchanged:
      return "bitmap marks block " + n(d0) +
             " as changed, but none of its exponents differs from the cached ones "
             "(canonical form: its bit is 0)";
    default: return "refused with unknown status " + n(status);
  }
}

}  // namespace ciera::codec::device
