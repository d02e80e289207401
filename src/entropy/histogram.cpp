#include "entropy/histogram.hpp"

#include <cmath>

namespace ciera::entropy {

void Histogram::add(const uint8_t* symbols, size_t n) {
  // Four sub-histograms break the store-to-load dependency on runs of equal symbols (exponent
  // planes are full of them).
  uint32_t sub[4][256] = {};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++sub[0][symbols[i]];
    ++sub[1][symbols[i + 1]];
    ++sub[2][symbols[i + 2]];
    ++sub[3][symbols[i + 3]];
  }
  for (; i < n; ++i) ++sub[0][symbols[i]];
  for (unsigned s = 0; s < 256; ++s) {
    count[s] += uint64_t{sub[0][s]} + sub[1][s] + sub[2][s] + sub[3][s];
  }
  total += n;
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
