#include "entropy/histogram.hpp"

#include <cmath>

namespace ciera::entropy {

void Histogram::add(const uint8_t* symbols, size_t n) {
  SymbolCounter<256> counter;
  counter.add(symbols, n);
  counter.add_to(*this);
}

unsigned densest_count_window(const uint32_t (*tables)[256]) {
  uint64_t count[256];
  for (unsigned s = 0; s < 256; ++s) {
    count[s] = uint64_t{tables[0][s]} + tables[1][s] + tables[2][s] + tables[3][s];
  }
  uint64_t mass = 0;
  return densest_window(count, kCountWindow, &mass);
}

unsigned Histogram::distinct() const {
  unsigned d = 0;
  for (uint64_t c : count) d += c != 0;
  return d;
}

unsigned Histogram::max_symbol() const {
  for (unsigned s = 256; s-- > 0;) {
    if (count[s] != 0) return s;
  }
  return 0;
}

double Histogram::entropy_bits() const {
  if (total == 0) return 0.0;
  const double n = static_cast<double>(total);
  double h = 0.0;
  for (uint64_t c : count) {
    if (c != 0) {
      const double p = static_cast<double>(c) / n;
      h -= p * std::log2(p);
    }
  }
  return h;
}

}  // namespace ciera::entropy
