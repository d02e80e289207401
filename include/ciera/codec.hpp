// The shard codec: exponent reuse (paper §3.1, Algorithm 1) and, beyond the paper, value-delta
// streams (CodecConfig::stream_kind). Wire format: docs/format.md.
//
// One ShardEncoder per local shard on the sender, one ShardDecoder per peer shard on the
// receiver. The decoder owns the exponent cache that lets the encoder omit unchanged exponents.
// All buffers are caller-owned. encode() and decode() allocate only to grow their scratch to the
// most changes a frame has held so far (at most one per value): in a steady state, not at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "ciera/config.hpp"
#include "ciera/dtype.hpp"

namespace ciera {

// Numeric values are wire codes (docs/format.md, "Header").
enum class FrameKind : uint8_t {
  kKey = 1,    // carries every exponent; decodable without any cache
  kDelta = 2,  // carries only exponents that changed since the previous frame
  // Value-delta streams only: the exact difference of every value from the previous frame
  // (docs/format.md, "Value-delta frames").
  kValueDelta = 3,
};

// Numeric values are wire codes (docs/format.md, "Exponent section").
enum class ExponentSection : uint8_t {
  kFull = 0,       // key frame: all exponents as one symbol stream
  kUnchanged = 1,  // delta frame in which no block changed: empty section
  kBlock = 2,      // delta frame: all exponents of the changed blocks
  kFine = 3,       // delta frame: positions and steps of the changed exponents
  // Value-delta frames use kUnchanged (no value changed: empty) or this: every value's
  // difference, grouped three to a symbol, with escapes for the large ones.
  kDifferences = 4,
};

std::string_view frame_kind_name(FrameKind kind);
std::string_view exponent_section_name(ExponentSection section);

// The stream a payload belongs to (docs/format.md, "Streams"): one per sender and shard. Both
// sides are told it at setup; every payload carries it, and a decoder refuses a payload of
// another stream (misrouted: another peer's or another tensor's) and a frame its stream has
// already moved past (stale or replayed), key frames included.
struct StreamIdentity {
  // Agreed at setup, distinct for every (sender, shard) a receiver decodes.
  uint32_t stream = 0;
  // The sender's incarnation: draw it with new_stream_epoch() each time a sender starts, so that
  // nothing sent before a restart can pass for the new stream. A resynchronisation (the sender's
  // request_key_frame()) moves it on by one.
  uint32_t epoch = 1;
};

// A fresh random epoch for a sender that starts (or restarts) a stream.
uint32_t new_stream_epoch();

// How far ahead of the decoder's epoch a resynchronising key frame may be (serial-number
// arithmetic mod 2^32): the sender's epoch moves on by one per resynchronisation, so a few steps
// are normal, and a frame of an unrelated incarnation (a random epoch) almost never fits.
inline constexpr uint32_t kMaxResyncEpochs = 1u << 16;

// What one frame contained. Sizes are bytes unless named otherwise.
struct FrameStats {
  FrameKind kind = FrameKind::kKey;
  ExponentSection section = ExponentSection::kFull;
  uint32_t stream = 0;
  uint32_t epoch = 0;
  uint64_t sequence = 0;
  uint64_t payload_bytes = 0;
  uint64_t bitmap_bytes = 0;
  uint64_t sign_mantissa_bytes = 0;
  uint64_t exponent_bytes = 0;  // the whole exponent section
  uint64_t blocks = 0;
  uint64_t changed_blocks = 0;  // delta frames only
  // Values whose exponent differs from the previous frame. Known only to an encoder with exact
  // detection and to a decoder of a fine-coded frame; otherwise changed_values_known is false.
  uint64_t changed_values = 0;
  bool changed_values_known = false;
  // Over the symbol streams this frame entropy-coded with rANS (tables and states included):
  uint64_t entropy_symbols = 0;
  uint64_t entropy_coded_bytes = 0;
  double entropy_bound_bytes = 0;  // sum over those streams of n * H0 / 8 (order-0 entropy)
  // Over every exponent symbol stream, however it was coded:
  uint64_t coded_symbols = 0;
  double coded_symbols_entropy_bits = 0;  // sum of n * H0
};

// Upper bound on the payload of a shard of `num_values` values; allocate this once. More than
// kMaxShardValues values is a ConfigError (the bound would not fit 64 bits).
size_t max_payload_bytes(DType dtype, uint64_t num_values, uint32_t block_values);

// Expected delta frame of one shard of `values` values whose blocks change at rate
// `block_change_rate` and values at `value_change_rate` per step: header, bitmap, padding and
// sign-mantissa plane exactly, plus the exponent section as the smaller of block mode (q S_e,
// the paper's estimate) and, with exact detection, fine mode (kFineBytesPerChange per changed
// value and kFineBytesPerBlock per changed block; docs/architecture.md, "Fine coding"). The
// encoder sends whichever mode is smaller, so a real frame is at most about this size. For the
// selector (paper §3.2), which must not re-derive the wire layout. Throws ConfigError for a rate
// outside [0, 1] (or NaN).
double expected_payload_bytes(const CodecConfig& codec, DType dtype, uint64_t values,
                              double block_change_rate, double value_change_rate);
inline constexpr double kFineBytesPerChange = 1.5;
inline constexpr double kFineBytesPerBlock = 1.0;

// Codec state a rank holds for one shard of `values` values of `codec.dtype` it sends (`sender`:
// the copy of what it last sent) or receives (the exponent cache; for value-delta streams the
// previous values), in bytes. ShardEncoder/ShardDecoder's cache_bytes() report the same; for a
// peer scheme's stream, what its coders keep (SDP4Bit: its reconstruction on both sides; the
// stateless and int8 schemes nothing).
uint64_t codec_cache_bytes(const CodecConfig& codec, uint64_t values, bool sender);

// Sender side of one shard, of a stream of the shard codec's own kinds (exponent reuse,
// value-delta; a peer scheme's stream kind is a ConfigError: its coders are the engine's). At
// most kMaxShardValues values. One thread at a time (an encoder and a decoder are independent).
class ShardEncoder {
 public:
  // Every payload carries `identity`; its epoch is incremented by each request_key_frame().
  ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity = {});
  // An encoder of one key frame and nothing after it (stateless coding: encode_stateless): it
  // keeps no copy of what it sends, so it allocates no cache; a second encode() is a
  // std::logic_error.
  static ShardEncoder one_shot(const CodecConfig& config, uint64_t num_values,
                               StreamIdentity identity);
  ~ShardEncoder();
  ShardEncoder(ShardEncoder&&) noexcept;
  ShardEncoder& operator=(ShardEncoder&&) noexcept;

  // Encodes `shard` (num_values values, little-endian, any alignment) into `payload`, which must
  // hold at least max_payload_bytes() and must not overlap `shard`. Returns what was sent;
  // stats.payload_bytes is its length. A shard of another size, a payload buffer too small or
  // overlapping the shard is std::invalid_argument (the caller's mistake), and nothing changes.
  // The first frame, the first `warmup_steps` frames and the frame after request_key_frame()
  // are key frames.
  FrameStats encode(std::span<const std::byte> shard, std::span<std::byte> payload);

  // Makes the next frame a key frame that starts a new epoch (used to resynchronise a peer, whose
  // decoder must expect it: ShardDecoder::request_resync()).
  void request_key_frame();

  uint64_t num_values() const;
  size_t max_payload_bytes() const;
  const CodecConfig& config() const;
  uint32_t stream() const;
  uint32_t epoch() const;
  uint64_t next_sequence() const;
  // Bytes of persistent sender state, codec_cache_bytes(config, num_values, true): exact
  // detection one byte per value, hash detection 16 bytes per block; a value-delta stream the
  // values last sent (value_bytes per value); a one-shot encoder none.
  size_t cache_bytes() const;

 private:
  struct Impl;
  ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity,
               bool one_shot);
  Impl& state() const;  // std::logic_error once moved from
  std::unique_ptr<Impl> impl_;
};

// Receiver side of one peer shard; owns that shard's exponent cache. The same kinds and limit as
// ShardEncoder's; one thread at a time.
class ShardDecoder {
 public:
  // Receives the stream `expected` names: its first frame must be a key frame of exactly that
  // epoch (any sequence number), unless request_resync() lets it be a later one.
  ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected = {});
  // A decoder of one key frame and nothing after it (stateless coding: decode_stateless): it
  // keeps no cache; any other frame, or a second one, is a FormatError.
  static ShardDecoder one_shot(const CodecConfig& config, uint64_t num_values,
                               StreamIdentity expected);
  ~ShardDecoder();
  ShardDecoder(ShardDecoder&&) noexcept;
  ShardDecoder& operator=(ShardDecoder&&) noexcept;

  // Reconstructs the shard bit for bit into `shard` (num_values values, any alignment). Throws
  // FormatError for any payload that is malformed, truncated, of another stream, for another
  // configuration, or whose content checksum does not match, and for any frame out of sequence:
  // a delta frame must be the next of the current epoch; a key frame must be the next of the
  // current epoch (or the first one decoded), or of a later epoch after request_resync(). On
  // error the cache, epoch and sequence are unchanged and the contents of `shard` unspecified.
  // An output of another size than num_values values, or one that overlaps the payload, is
  // std::invalid_argument, and nothing changes.
  FrameStats decode(std::span<const std::byte> payload, std::span<std::byte> shard);

  // This receiver asked the sender to resynchronise (the sender's request_key_frame()): until a
  // key frame is decoded, one from a later epoch of the stream (at most kMaxResyncEpochs ahead)
  // is accepted too. Never needed for key frames within an epoch (the sender's warmup).
  void request_resync();
  // Forgets the cache and requests a resynchronisation: the next frame must be a key frame.
  void reset();

  bool has_cache() const;
  uint32_t stream() const;
  uint32_t epoch() const;
  uint64_t last_sequence() const;
  uint64_t num_values() const;
  const CodecConfig& config() const;
  // Bytes of persistent receiver state, codec_cache_bytes(config, num_values, false): the
  // exponent cache (one byte per value), or for a value-delta stream the previous values
  // (value_bytes per value); a one-shot decoder none.
  size_t cache_bytes() const;
  // The cached exponent of every value (when has_cache()) of an exponent-delta stream; empty for
  // a value-delta stream, which caches values, not exponents. For diagnostics and tests.
  std::span<const uint8_t> cached_exponents() const;

 private:
  struct Impl;
  ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected,
               bool one_shot);
  Impl& state() const;  // std::logic_error once moved from
  std::unique_ptr<Impl> impl_;
};

// Header fields of a payload, validated (magic, version, header checksum, known codes) but not
// checked against any configuration. Throws FormatError.
struct PayloadInfo {
  DType dtype;
  FrameKind kind;
  ExponentSection section;
  uint32_t block_values;
  uint64_t num_values;
  uint32_t stream;
  uint32_t epoch;
  uint64_t sequence;
  bool has_content_checksum;
  uint64_t payload_bytes;  // as the header's section lengths add up
};
PayloadInfo inspect_payload(std::span<const std::byte> payload);
// The same for the payload at the start of `bytes`, which more bytes may follow (payloads back
// to back): its sections must lie within `bytes`; payload_bytes is where it ends.
PayloadInfo inspect_leading_payload(std::span<const std::byte> bytes);

// Stateless one-shot coding: a key frame with every exponent entropy-coded (in the spirit of
// ZipCCL's exponent coding). `config.dtype` and `config.block_values` must match on both sides.
// Returns the payload length.
size_t encode_stateless(const CodecConfig& config, std::span<const std::byte> shard,
                        std::span<std::byte> payload);
// The same, with what the frame holds (its length is FrameStats::payload_bytes).
FrameStats encode_stateless_frame(const CodecConfig& config, std::span<const std::byte> shard,
                                  std::span<std::byte> payload);
void decode_stateless(const CodecConfig& config, std::span<const std::byte> payload,
                      std::span<std::byte> shard);

}  // namespace ciera
