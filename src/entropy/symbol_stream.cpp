#include "entropy/symbol_stream.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "ciera/error.hpp"

namespace ciera::entropy {
namespace {

unsigned packed_width(const Histogram& hist) {
  return std::max(1u, static_cast<unsigned>(std::bit_width(hist.max_symbol())));
}

uint64_t packed_body_bytes(uint64_t symbols, unsigned width) { return (symbols * width + 7) / 8; }

std::span<const uint8_t> ensure_chunk(const SymbolSource& source, size_t i,
                                      std::vector<uint8_t>& scratch) {
  if (scratch.size() < source.max_chunk_symbols()) scratch.resize(source.max_chunk_symbols());
  return source.chunk(i, scratch.data());
}

void write_header(uint8_t* out, StreamMethod method, uint8_t arg, uint64_t body_bytes) {
  out[0] = static_cast<uint8_t>(method);
  out[kStreamArgumentAt] = arg;
  store_le64(out + kStreamBodyBytesAt, body_bytes);
}

StreamStats write_packed(const SymbolSource& source, const Histogram& hist, uint8_t* out,
                         std::vector<uint8_t>& scratch) {
  const unsigned width = packed_width(hist);
  const uint64_t body = packed_body_bytes(hist.total, width);
  write_header(out, StreamMethod::kPacked, static_cast<uint8_t>(width), body);
  uint8_t* dst = out + kStreamHeaderBytes;
  if (width == 8) {
    for (size_t c = 0; c < source.chunk_count(); ++c) {
      const auto symbols = ensure_chunk(source, c, scratch);
      std::memcpy(dst, symbols.data(), symbols.size());
      dst += symbols.size();
    }
  } else {
    BitWriter bits(dst);
    for (size_t c = 0; c < source.chunk_count(); ++c) {
      for (uint8_t s : ensure_chunk(source, c, scratch)) bits.put(s, width);
    }
    bits.finish();
  }
  return {StreamMethod::kPacked, hist.total, kStreamHeaderBytes + body, 0};
}

// Returns 0 when the rANS stream would not fit below `capacity` bytes.
uint64_t write_rans(const SymbolSource& source, const Histogram& hist, const RansModel& model,
                    uint8_t* out, uint64_t capacity, std::vector<uint8_t>& scratch) {
  const uint64_t segments = rans_segment_count(hist.total);
  uint8_t* lengths_at = model.write_table(out + kStreamHeaderBytes);
  uint8_t* bytes_at = lengths_at + 4 * (segments - 1);
  if (bytes_at + kRansStateBytes * segments > out + capacity) return 0;
  RansEncoder encoder(model);
  encoder.begin(out + capacity, bytes_at, hist.total, lengths_at);
  for (size_t c = source.chunk_count(); c-- > 0;) {
    const auto symbols = ensure_chunk(source, c, scratch);
    if (!encoder.put_reverse(symbols.data(), symbols.size())) return 0;
  }
  const uint64_t coded = static_cast<uint64_t>(out + capacity - encoder.bytes_begin());
  std::memmove(bytes_at, encoder.bytes_begin(), coded);
  const uint64_t body = static_cast<uint64_t>(bytes_at - (out + kStreamHeaderBytes)) + coded;
  write_header(out, StreamMethod::kRans, 0, body);
  return kStreamHeaderBytes + body;
}

// The size of a rANS stream of `hist` under `model`, to within the rounding of its last words.
uint64_t rans_stream_estimate(const Histogram& hist, const RansModel& model) {
  constexpr uint64_t kByteQ16 = uint64_t{8} << 16;
  return kStreamHeaderBytes + model.table_bytes() + rans_framing_bytes(hist.total) +
         (model.cost_q16(hist) + kByteQ16 - 1) / kByteQ16;
}

}  // namespace

Histogram histogram_of(const SymbolSource& source, std::vector<uint8_t>& scratch) {
  Histogram hist;
  for (size_t c = 0; c < source.chunk_count(); ++c) {
    const auto symbols = ensure_chunk(source, c, scratch);
    hist.add(symbols.data(), symbols.size());
  }
  return hist;
}

uint64_t symbol_stream_bound(uint64_t symbols, unsigned symbol_bits) {
  return kStreamHeaderBytes + packed_body_bytes(symbols, symbol_bits);
}

uint64_t estimate_stream_bytes(const Histogram& hist, unsigned symbol_bits) {
  (void)symbol_bits;
  if (hist.total == 0 || hist.distinct() == 1) return kStreamHeaderBytes;
  const uint64_t packed = kStreamHeaderBytes + packed_body_bytes(hist.total, packed_width(hist));
  return std::min(packed, rans_stream_estimate(hist, RansModel::from_histogram(hist)));
}

StreamStats write_symbol_stream(const SymbolSource& source, const Histogram& hist,
                                unsigned symbol_bits, uint8_t* out, uint64_t capacity,
                                std::vector<uint8_t>& scratch) {
  const uint64_t bound = symbol_stream_bound(hist.total, symbol_bits);
  if (capacity < bound) {
    throw std::logic_error("write_symbol_stream: capacity below symbol_stream_bound");
  }
  const double entropy_bits = hist.entropy_bits() * static_cast<double>(hist.total);
  if (hist.total > 0 && hist.distinct() == 1) {
    write_header(out, StreamMethod::kConstant, static_cast<uint8_t>(hist.max_symbol()), 0);
    return {StreamMethod::kConstant, hist.total, kStreamHeaderBytes, entropy_bits};
  }
  const unsigned width = packed_width(hist);
  const uint64_t packed_bytes = kStreamHeaderBytes + packed_body_bytes(hist.total, width);
  if (hist.total > 0) {
    // The choice is made on integers only (docs/architecture.md, "Deterministic encoding"):
    // rANS is tried when its estimate is below the packed size, and kept when it fits in it.
    const RansModel model = RansModel::from_histogram(hist);
    if (rans_stream_estimate(hist, model) < packed_bytes) {
      const uint64_t written = write_rans(source, hist, model, out, packed_bytes, scratch);
      if (written != 0) return {StreamMethod::kRans, hist.total, written, entropy_bits};
    }
  }
  StreamStats stats = write_packed(source, hist, out, scratch);
  stats.entropy_bits = entropy_bits;
  return stats;
}

void SymbolStreamReader::open(ByteReader& in, uint64_t symbols, unsigned max_symbol,
                              const char* what) {
  what_ = what;
  symbols_ = symbols;
  read_ = 0;
  max_symbol_ = max_symbol;
  const uint8_t method = in.u8();
  const uint8_t arg = in.u8();
  const uint64_t body = in.u64();
  in.need(body);
  ByteReader body_reader(in.cursor(), body, what);
  in.take(body);
  max_read_ = 0;
  min_read_ = 255;
  // The canonical-form checks the stream alone allows (docs/format.md, "Canonical form");
  // corruption is the content checksum's to catch.
  if (symbols == 0 && !(method == static_cast<uint8_t>(StreamMethod::kPacked) && arg == 1)) {
    throw FormatError(std::string(what) + ": an empty stream must be packed with width 1");
  }
  switch (method) {
    case static_cast<uint8_t>(StreamMethod::kPacked): {
      method_ = StreamMethod::kPacked;
      if (arg < 1 || arg > 8) {
        throw FormatError(std::string(what) + ": packed symbol width " + std::to_string(arg) +
                          " is invalid");
      }
      width_ = arg;
      if (body != packed_body_bytes(symbols, width_)) {
        throw FormatError(std::string(what) + ": packed body is " + std::to_string(body) +
                          " bytes, expected " + std::to_string(packed_body_bytes(symbols, width_)));
      }
      bits_ = BitReader(body_reader.cursor(), body, what);
      return;
    }
    case static_cast<uint8_t>(StreamMethod::kConstant):
      method_ = StreamMethod::kConstant;
      if (body != 0) throw FormatError(std::string(what) + ": constant stream with a body");
      if (arg > max_symbol) {
        throw FormatError(std::string(what) + ": symbol " + std::to_string(arg) +
                          " exceeds the largest allowed, " + std::to_string(max_symbol));
      }
      constant_ = arg;
      return;
    case static_cast<uint8_t>(StreamMethod::kRans): {
      method_ = StreamMethod::kRans;
      if (arg != 0) throw FormatError(std::string(what) + ": rANS stream argument must be 0");
      const RansModel model = RansModel::read_table(body_reader, max_symbol, what);
      rans_.begin(model, body_reader.cursor(), body_reader.remaining(), symbols, what);
      return;
    }
    default:
      throw FormatError(std::string(what) + ": unknown stream method " + std::to_string(method));
  }
}

void SymbolStreamReader::get(uint8_t* out, size_t n) {
  if (n > symbols_ - read_) {
    throw FormatError(std::string(what_) + ": more symbols requested than the stream holds");
  }
  switch (method_) {
    case StreamMethod::kPacked:
      if (width_ == 8) {
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(bits_.get(8));
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(bits_.get(width_));
      }
      for (size_t i = 0; i < n; ++i) {
        if (out[i] > max_symbol_) {
          throw FormatError(std::string(what_) + ": symbol " + std::to_string(out[i]) +
                            " exceeds the largest allowed, " + std::to_string(max_symbol_));
        }
        max_read_ = std::max<unsigned>(max_read_, out[i]);
        min_read_ = std::min<unsigned>(min_read_, out[i]);
      }
      break;
    case StreamMethod::kConstant:
      std::memset(out, constant_, n);
      break;
    case StreamMethod::kRans:
      rans_.get(out, n);
      break;
  }
  read_ += n;
}

void SymbolStreamReader::finish() {
  if (read_ != symbols_) {
    throw FormatError(std::string(what_) + ": " + std::to_string(symbols_ - read_) +
                      " symbols left unread");
  }
  if (method_ == StreamMethod::kPacked) {
    if (!bits_.exhausted_canonically()) {
      throw FormatError(std::string(what_) + ": packed stream has non-zero padding");
    }
    if (symbols_ > 0 && width_ != std::max(1u, static_cast<unsigned>(std::bit_width(max_read_)))) {
      throw FormatError(std::string(what_) + ": packed width " + std::to_string(width_) +
                        " is not the narrowest that holds its symbols");
    }
    if (symbols_ > 0 && min_read_ == max_read_) {
      throw FormatError(std::string(what_) +
                        ": packed stream of one distinct symbol (canonical "
                        "form: a constant stream)");
    }
  }
  if (method_ == StreamMethod::kRans) rans_.finish();
}

}  // namespace ciera::entropy
