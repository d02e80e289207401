// A self-describing stream of byte symbols: packed, constant or rANS, whichever is smallest
// (docs/format.md, "Symbol stream"). The symbol count is not stored; both sides know it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "entropy/histogram.hpp"
#include "entropy/rans.hpp"
#include "entropy/stream_header.hpp"

namespace ciera::entropy {

// Symbols presented in chunks, so that a coder can stream exponents straight out of a shard
// without materialising a whole plane. Chunks are visited forwards (histogram) and backwards
// (rANS encodes last to first).
class SymbolSource {
 public:
  virtual ~SymbolSource() = default;
  virtual size_t chunk_count() const = 0;
  virtual size_t max_chunk_symbols() const = 0;
  // Symbols of chunk `i`: either a view into the source or written into `scratch`
  // (max_chunk_symbols() bytes).
  virtual std::span<const uint8_t> chunk(size_t i, uint8_t* scratch) const = 0;
};

// A source over one contiguous array.
class ArraySource final : public SymbolSource {
 public:
  explicit ArraySource(std::span<const uint8_t> symbols) : symbols_(symbols) {}
  size_t chunk_count() const override { return symbols_.empty() ? 0 : 1; }
  size_t max_chunk_symbols() const override { return 0; }
  std::span<const uint8_t> chunk(size_t, uint8_t*) const override { return symbols_; }

 private:
  std::span<const uint8_t> symbols_;
};

// What a written stream holds.
struct StreamStats {
  StreamMethod method = StreamMethod::kPacked;
  uint64_t symbols = 0;
  uint64_t bytes = 0;         // header included
  double entropy_bits = 0;    // n * H0 of the symbols
};

Histogram histogram_of(const SymbolSource& source, std::vector<uint8_t>& scratch);

// Largest stream of `symbols` symbols below 2^symbol_bits (the packed fallback's size).
uint64_t symbol_stream_bound(uint64_t symbols, unsigned symbol_bits);
// Size write_symbol_stream would produce (exact for packed/constant; rANS within a few bytes).
uint64_t estimate_stream_bytes(const Histogram& hist, unsigned symbol_bits);

// Writes `source` as one stream at `out` (capacity >= symbol_stream_bound). `hist` must be the
// source's histogram (histogram_of). `scratch` is reused between calls.
StreamStats write_symbol_stream(const SymbolSource& source, const Histogram& hist,
                                unsigned symbol_bits, uint8_t* out, uint64_t capacity,
                                std::vector<uint8_t>& scratch);

// Reads one stream of `symbols` symbols, each at most `max_symbol`, from the front of `in`
// (advancing it past the stream). Symbols are read in order in any number of get() calls.
class SymbolStreamReader {
 public:
  void open(ByteReader& in, uint64_t symbols, unsigned max_symbol, const char* what);
  void get(uint8_t* out, size_t n);
  // Throws FormatError unless exactly the announced symbols were read and the body was canonical.
  void finish();
  StreamMethod method() const { return method_; }

 private:
  StreamMethod method_ = StreamMethod::kPacked;
  uint64_t symbols_ = 0;
  uint64_t read_ = 0;
  unsigned width_ = 0;
  unsigned max_symbol_ = 0;
  unsigned max_read_ = 0;  // largest packed symbol read, for the canonical-width check
  unsigned min_read_ = 255;  // smallest: a packed stream of one distinct symbol is not canonical
  uint8_t constant_ = 0;
  BitReader bits_;
  RansDecoder rans_;
  const char* what_ = "symbol stream";
};

}  // namespace ciera::entropy
