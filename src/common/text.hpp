// Texts cut to a byte limit (error messages in fixed-size record fields, excerpts in messages)
// without splitting a UTF-8 character: a cut inside one leaves bytes that are not UTF-8, and
// Python (the binding) refuses to turn such a message into an exception's text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ciera {

// The largest character boundary of `text` at or before byte `at` (at most text.size()).
inline size_t utf8_boundary(std::string_view text, size_t at) {
  // A UTF-8 continuation byte is 10xxxxxx: back off until `at` falls before a lead byte.
  while (at > 0 && at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) --at;
  return at;
}

// The longest prefix of `text` of at most `bytes` bytes that ends at a character boundary.
inline std::string_view utf8_prefix(std::string_view text, size_t bytes) {
  if (text.size() <= bytes) return text;
  return text.substr(0, utf8_boundary(text, bytes));
}

// `text` itself if it has at most `bytes` bytes, else its utf8_prefix of `bytes` - 3 bytes and
// "...".
inline std::string shortened(std::string_view text, size_t bytes) {
  if (text.size() <= bytes) return std::string(text);
  return std::string(utf8_prefix(text, bytes - 3)) + "...";
}

// `n` as an English ordinal: "1st", "2nd", "3rd", "4th", "11th", "21st", "112th".
inline std::string ordinal(uint64_t n) {
  const uint64_t last_two = n % 100;
  const char* suffix = last_two >= 11 && last_two <= 13 ? "th"
                       : n % 10 == 1                    ? "st"
                       : n % 10 == 2                    ? "nd"
                       : n % 10 == 3                    ? "rd"
                                                        : "th";
  return std::to_string(n) + suffix;
}

}  // namespace ciera
