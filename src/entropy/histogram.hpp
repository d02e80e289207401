// Byte-symbol histograms and their order-0 entropy.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>

#include "entropy/kernels.hpp"

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

// Counts symbols below `Alphabet` into four tables in turn, so that runs of equal symbols
// (exponent planes are full of them) do not wait on one entry's store and load.
template <unsigned Alphabet>
inline void count_four_ways(const uint8_t* symbols, size_t n, uint32_t (*tables)[Alphabet]) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++tables[0][symbols[i] & (Alphabet - 1)];
    ++tables[1][symbols[i + 1] & (Alphabet - 1)];
    ++tables[2][symbols[i + 2] & (Alphabet - 1)];
    ++tables[3][symbols[i + 3] & (Alphabet - 1)];
  }
  for (; i < n; ++i) ++tables[0][symbols[i] & (Alphabet - 1)];
}

// The first of `width` consecutive entries of count[0, 256) whose sum is the largest (the lowest
// such), that sum in *mass: where a window of symbols holds most of them.
template <class Count>
unsigned densest_window(const Count* count, unsigned width, uint64_t* mass) {
  uint64_t sum = 0;
  for (unsigned s = 0; s < width; ++s) sum += count[s];
  *mass = sum;
  unsigned first = 0;
  for (unsigned base = 1; base + width <= 256; ++base) {
    sum += count[base + width - 1];
    sum -= count[base - 1];
    if (sum > *mass) {
      *mass = sum;
      first = base;
    }
  }
  return first;
}

// The densest_window of kCountWindow symbols over the four tables' counts together: the window
// EntropyKernels::count_symbols counts by vector.
unsigned densest_count_window(const uint32_t (*tables)[256]);

// A histogram taken chunk by chunk while the symbols are made (each chunk still in L1), of
// symbols below `Alphabet` (a power of two; larger bits are ignored). Four sub-tables stay
// between chunks, so a chunk costs its symbols only; they are folded into 64-bit counts before
// any could wrap. Byte symbols (Alphabet 256) go through the entropy kernels' count_symbols,
// which counts the densest window of them by vector (an exponent plane's: they cluster);
// Histogram::add counts through one too.
template <unsigned Alphabet>
class SymbolCounter {
  static_assert(Alphabet > 0 && Alphabet <= 256 && (Alphabet & (Alphabet - 1)) == 0);

 public:
  void add(const uint8_t* symbols, size_t n) {
    // (The mask keeps a stray symbol inside the tables; callers only pass symbols below Alphabet.)
    assert(std::all_of(symbols, symbols + n, [](uint8_t s) { return s < Alphabet; }));
    while (n > 0) {
      const size_t m = std::min<size_t>(n, kFoldAt);
      if constexpr (Alphabet == 256) {
        count_bytes(symbols, m);
      } else {
        count_four_ways<Alphabet>(symbols, m, sub_);
      }
      pending_ += m;
      if (pending_ >= kFoldAt) fold();  // before a 32-bit count could wrap
      symbols += m;
      n -= m;
    }
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
    since_window_ = kRechooseWindowAfter;
    return h;
  }

 private:
  static constexpr uint64_t kFoldAt = uint64_t{1} << 31;
  // The window is chosen again after this many symbols: the kernel's speed depends on it, its
  // counts never do. Gradients whose scale changes along a frame left 6% of their exponents
  // outside a window chosen every 2^16, 0.7% every 2^13, for 0.39 against 0.47 ns a symbol
  // (AVX2 EPYC; 2^12 is slower again, the choosing costing more than it saves).
  static constexpr uint64_t kRechooseWindowAfter = uint64_t{1} << 13;
  static constexpr size_t kWindowProbe = 1024;

  void count_bytes(const uint8_t* symbols, size_t n) {
    if (since_window_ >= kRechooseWindowAfter) {
      if (pending_ == 0) {
        // Nothing in the tables to place the window by: the first symbols place it.
        const size_t probe = std::min<size_t>(n, kWindowProbe);
        count_four_ways<256>(symbols, probe, sub_);
        symbols += probe;
        n -= probe;
      }
      window_ = densest_count_window(sub_);
      since_window_ = 0;
    }
    entropy_kernels().count_symbols(symbols, n, window_, sub_);
    since_window_ += n;
  }
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
  unsigned window_ = 0;                           // count_symbols' window (Alphabet 256)
  uint64_t since_window_ = kRechooseWindowAfter;  // symbols counted since it was chosen
};

}  // namespace ciera::entropy
