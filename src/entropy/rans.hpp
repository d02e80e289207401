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
  size_t table_bytes() const;
  uint8_t* write_table(uint8_t* out) const;
};

// Symbol `s`'s encoding constants under `model` (freq[s] >= 1).
RansEncSymbol rans_enc_symbol(const RansModel& model, unsigned s);

class RansEncoder {
 public:
  explicit RansEncoder(const RansModel& model);

  // Starts a stream of `total_symbols`; bytes are written downwards from `out_end`, never below
  // `out_limit`.
  void begin(uint8_t* out_end, uint8_t* out_limit, uint64_t total_symbols);
  // Encodes the chunk that ends where the previously encoded one began (chunks go last to first).
  // Returns false when the output would pass `out_limit` (the stream is then unusable).
  bool put_reverse(const uint8_t* symbols, size_t n);
  // After all symbols: the states to store and where the bytes begin (they end at `out_end`).
  void final_states(uint32_t states[kRansStates]) const;
  uint8_t* bytes_begin() const { return out_; }

 private:
  void encode_batch(const uint8_t* symbols, size_t n);

  std::array<RansEncSymbol, 256> symbols_{};
  RansGroupTables group_{};
  bool group_kernel_ = false;  // every symbol of the model is below kRansGroupSymbols
  uint32_t state_[kRansStates] = {};
  uint64_t next_index_ = 0;
  uint8_t* out_ = nullptr;
  uint8_t* limit_ = nullptr;
};

class RansDecoder {
 public:
  // `states` are the stored final states; `bytes` the renormalisation bytes. Throws FormatError.
  void begin(const RansModel& model, const uint32_t states[kRansStates], const uint8_t* bytes,
             uint64_t size, const char* what);
  void get(uint8_t* out, size_t n);
  // Throws FormatError unless the stream ended exactly where the encoder began.
  void finish() const;

 private:
  // `n` symbols, a multiple of kRansStates starting at state 0, whose bytes are known to be there.
  void get_unchecked(uint8_t* out, size_t n);
  // One symbol, checking every byte it reads.
  uint8_t take_checked();

  std::array<uint32_t, kRansTotal> slots_{};  // symbol | (freq - 1) << 8 | start << 20
  uint32_t state_[kRansStates] = {};
  uint64_t index_ = 0;
  const uint8_t* in_ = nullptr;
  const uint8_t* end_ = nullptr;
  const char* what_ = "rANS stream";
};

}  // namespace ciera::entropy
