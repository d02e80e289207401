// Byte-symbol histograms and their order-0 entropy.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>

namespace ciera::entropy {

struct Histogram {
  std::array<uint64_t, 256> count{};
  uint64_t total = 0;

  void add(const uint8_t* symbols, size_t n);
  unsigned distinct() const;
  unsigned max_symbol() const;  // 0 when empty
  // Order-0 entropy in bits per symbol (0 when empty).
  double entropy_bits() const;
};

// A histogram taken chunk by chunk while the symbols are made (each chunk still in L1), of
// symbols below `Alphabet` (a power of two; larger bits are ignored). Four sub-tables break the
// store-to-load dependency on runs of equal symbols (exponent planes are full of them), and stay
// between chunks: a chunk costs its symbols only. Histogram::add counts through one too.
template <unsigned Alphabet>
class SymbolCounter {
  static_assert(Alphabet > 0 && Alphabet <= 256 && (Alphabet & (Alphabet - 1)) == 0);

 public:
  void add(const uint8_t* symbols, size_t n) {
    // (The mask keeps a stray symbol inside the tables; callers only pass symbols below Alphabet.)
    assert(std::all_of(symbols, symbols + n, [](uint8_t s) { return s < Alphabet; }));
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      ++sub_[0][symbols[i] & (Alphabet - 1)];
      ++sub_[1][symbols[i + 1] & (Alphabet - 1)];
      ++sub_[2][symbols[i + 2] & (Alphabet - 1)];
      ++sub_[3][symbols[i + 3] & (Alphabet - 1)];
    }
    for (; i < n; ++i) ++sub_[0][symbols[i] & (Alphabet - 1)];
    pending_ += n;
    if (pending_ >= kFoldAt) fold();  // before a 32-bit count could wrap
  }
  void clear() { (void)take(); }
  // Adds everything added since the last take() to `h` (this counter unchanged).
  void add_to(Histogram& h) const {
    for (unsigned s = 0; s < Alphabet; ++s) {
      h.count[s] += hist_.count[s] + sub_[0][s] + sub_[1][s] + sub_[2][s] + sub_[3][s];
    }
    h.total += hist_.total + pending_;
  }
  // Everything added since the last take(), which starts the next histogram.
  Histogram take() {
    fold();
    Histogram h = hist_;
    hist_ = Histogram{};
    return h;
  }

 private:
  static constexpr uint64_t kFoldAt = uint64_t{1} << 31;
  void fold() {
    for (unsigned s = 0; s < Alphabet; ++s) {
      hist_.count[s] += uint64_t{sub_[0][s]} + sub_[1][s] + sub_[2][s] + sub_[3][s];
      sub_[0][s] = sub_[1][s] = sub_[2][s] = sub_[3][s] = 0;
    }
    hist_.total += pending_;
    pending_ = 0;
  }
  uint32_t sub_[4][Alphabet] = {};
  uint64_t pending_ = 0;
  Histogram hist_;
};

}  // namespace ciera::entropy
