// A JSON string literal without a JSON library: for the GPU benchmarks, which build on the bare
// GPU image (no nlohmann/json there) and write their reports by hand.
#pragma once

#include <cstdio>
#include <string>

namespace ciera::tools {

// `text` as a JSON string, quotes included: '"' and '\' escaped, '\n' as "\n", the other control
// characters as \u00XX.
inline std::string json_string(const std::string& text) {
  std::string s = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      s += '\\';
      s += c;
    } else if (c == '\n') {
      s += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x",
                    static_cast<unsigned>(static_cast<unsigned char>(c)));
      s += escaped;
    } else {
      s += c;
    }
  }
  return s + "\"";
}

}  // namespace ciera::tools
