// Excerpts of untrusted JSON for error messages, safe at any nesting depth. Header-only: the
// simulator's readers use it too, and its library does not link the analysis layer's.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/text.hpp"

namespace ciera {

// `value` as compact JSON text, at most `bytes` of it (cut with "..."), made without recursion
// and without writing more than the excerpt: nlohmann's dump() recurses once per level, and a
// header nested 10^5 deep (a few hundred KB of '[') overflowed the stack while an error message
// was being written about it (found by fuzzing the safetensors and trace readers).
inline std::string json_excerpt(const nlohmann::json& value, size_t bytes) {
  using Json = nlohmann::json;
  const auto scalar = [](const Json& j) {
    return j.dump(-1, ' ', false, Json::error_handler_t::replace);
  };
  struct Level {
    const Json* container;
    Json::const_iterator next;
    bool first = true;
  };
  std::string out;
  std::vector<Level> levels;
  const auto enter = [&](const Json& j) {
    if (!j.is_structured()) {
      out += scalar(j);
      return;
    }
    out += j.is_object() ? '{' : '[';
    levels.push_back({&j, j.cbegin()});
  };
  enter(value);
  // One byte past the excerpt is enough for shortened() to see that it was cut.
  while (!levels.empty() && out.size() <= bytes) {
    Level& level = levels.back();
    if (level.next == level.container->cend()) {
      out += level.container->is_object() ? '}' : ']';
      levels.pop_back();
      continue;
    }
    if (!level.first) out += ',';
    level.first = false;
    if (level.container->is_object()) out += scalar(Json(level.next.key())) + ':';
    const Json& child = *level.next;
    ++level.next;  // before enter(), which may grow `levels` and move `level`
    enter(child);
  }
  return shortened(out, bytes);
}

}  // namespace ciera
