// Static order-0 rANS over byte symbols: 12-bit frequencies, sixteen interleaved 32-bit states,
// 16-bit word renormalisation (docs/format.md, "Symbol stream", rANS). The paper codes changed
// exponents with nvCOMP's ANS (§3.1); this is the CPU counterpart. Sixteen states fill an
// AVX-512 register, so the encoder codes sixteen symbols per step where the kernels allow.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "common/bytes.hpp"
#include "entropy/histogram.hpp"
#include "entropy/rans_core.hpp"

namespace ciera::entropy {

// Normalised frequencies: sum to kRansTotal; every symbol present in the data has freq >= 1.
struct RansModel {
  std::array<uint16_t, 256> freq{};
  std::array<uint16_t, 256> start{};
  uint8_t first = 0;
  uint8_t last = 0;

  // `hist.total` must be > 0.
  static RansModel from_histogram(const Histogram& hist);
  // Parses and validates a serialised table; throws FormatError naming `what`.
  static RansModel read_table(ByteReader& in, unsigned max_symbol, const char* what);

  // Bits the coded symbols of `hist` take under this model (excluding table and states).
  double cost_bits(const Histogram& hist) const;
  // The same in fixed point (16 fraction bits), computed with integers only: what encoding
  // decisions use, so that every encoder (CPU or GPU) decides alike.
  uint64_t cost_q16(const Histogram& hist) const;
  size_t table_bytes() const;
  uint8_t* write_table(uint8_t* out) const;
};

// Symbol `s`'s encoding constants under `model` (freq[s] >= 1).
RansEncSymbol rans_enc_symbol(const RansModel& model, unsigned s);

class RansEncoder {
 public:
  explicit RansEncoder(const RansModel& model);
  // Not copied: its wide tables point into its own constants.
  RansEncoder(const RansEncoder&) = delete;
  RansEncoder& operator=(const RansEncoder&) = delete;

  // Starts a stream of `total_symbols`; bytes are written downwards from `out_end`, never below
  // `out_limit`. The byte length of every segment but the last goes to `lengths` (u32 each,
  // 4 * (rans_segment_count(total_symbols) - 1) bytes outside [out_limit, out_end)).
  void begin(uint8_t* out_end, uint8_t* out_limit, uint64_t total_symbols, uint8_t* lengths);
  // Encodes the chunk that ends where the previously encoded one began (chunks go last to first).
  // Returns false exactly when the stream does not fit above `out_limit` (then unusable).
  bool put_reverse(const uint8_t* symbols, size_t n);
  // After all symbols: the segments, first to last, each its sixteen final states (u32, state 0
  // first) then its words, begin here and end at `out_end`.
  uint8_t* bytes_begin() const { return out_; }

 private:
  // A segment's words take at most 2 bytes a symbol, then its states.
  static constexpr size_t kSegmentRoom = 2 * kRansSegmentSymbols + kRansStateBytes;
  void encode_batch(const uint8_t* symbols, size_t n);
  // The two whole segments at `symbols` (2 * kRansSegmentSymbols), coded together; the later one's
  // states are fresh and 2 * kSegmentRoom bytes are free below the words.
  void encode_pair(const uint8_t* symbols);
  bool encode_checked(const uint8_t* symbols, size_t n);
  // Stores the states below the words of the segment just finished and restarts them.
  void close_segment();

  std::array<RansEncSymbol, 256> symbols_{};
  bool group_kernel_ = false;  // every symbol of the model is below kRansGroupSymbols
  // The 64 most frequent consecutive symbols (symbols 0..63, the group kernels' tables, when
  // group_kernel_), and all of them.
  RansWideTables wide_{};
  uint32_t state_[kRansStates] = {};
  uint64_t next_index_ = 0;
  uint8_t* out_ = nullptr;
  uint8_t* limit_ = nullptr;
  uint8_t* segment_end_ = nullptr;
  uint8_t* lengths_ = nullptr;
  uint64_t segments_ = 0;
};

class RansDecoder {
 public:
  // `body` (`size` bytes) holds what follows the table: the segment lengths, then the segments
  // of a stream of `symbols` (> 0) symbols. Throws FormatError.
  void begin(const RansModel& model, const uint8_t* body, uint64_t size, uint64_t symbols,
             const char* what);
  // The next `n` symbols (in any number of calls; the caller never asks past the stream's end).
  void get(uint8_t* out, size_t n);
  // Throws FormatError unless every segment ended exactly where the encoder began it.
  void finish() const;

 private:
  void open_segment();
  uint64_t segment_symbols_of(uint64_t segment) const;
  // Where `segment`, whose bytes start at `begin`, ends.
  const uint8_t* segment_end(uint64_t segment, const uint8_t* begin) const;
  // A segment's start states, checked.
  void load_states(uint64_t segment, const uint8_t* at, uint32_t* states) const;
  // Decodes the segment just opened and the next one whole; returns the symbols written.
  size_t get_two_segments(uint8_t* out);
  void finish_segment() const;
  void get_in_segment(uint8_t* out, size_t n);
  // `n` symbols, a multiple of kRansStates starting at state 0, whose bytes are known to be there.
  void get_unchecked(uint8_t* out, size_t n);
  // One symbol, checking every byte it reads.
  uint8_t take_checked();

  std::array<uint32_t, kRansTotal> slots_{};  // symbol | (freq - 1) << 8 | start << 20
  uint32_t state_[kRansStates] = {};
  uint64_t index_ = 0;  // within the segment
  uint64_t symbols_ = 0;
  uint64_t segments_ = 0;
  uint64_t segment_ = 0;
  uint64_t segment_symbols_ = 0;
  const uint8_t* lengths_ = nullptr;
  const uint8_t* in_ = nullptr;
  const uint8_t* end_ = nullptr;  // of the segment
  const uint8_t* stream_end_ = nullptr;
  const char* what_ = "rANS stream";
};

}  // namespace ciera::entropy
