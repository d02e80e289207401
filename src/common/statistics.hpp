// Medians and means of timing samples, for every layer and tool that reports or decides on them.
#pragma once

#include <algorithm>
#include <vector>

namespace ciera {

// The middle value; for an even count the mean of the two middle ones. 0 for no samples.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// The arithmetic mean; 0 for no samples.
inline double mean(const std::vector<double>& values) {
  if (values.empty()) return 0.0;
  double sum = 0;
  for (const double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

}  // namespace ciera
