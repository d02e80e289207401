// Reading JSON input (cluster configs, rates, traces) with errors that name the file and the full
// path of the offending field, e.g. `trace run.json: field "buckets[2].forward_s" must be >= 0`.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "analysis/json_text.hpp"
#include "ciera/config.hpp"
#include "ciera/error.hpp"
#include "common/text.hpp"

namespace ciera::sim::detail {

using Json = nlohmann::json;

inline Json parse_json(const std::string& text, const std::string& origin) {
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw ConfigError(origin + ": not valid JSON: " + e.what());
  } catch (const Json::exception& e) {  // a number beyond a double (1e400): out_of_range
    throw ConfigError(origin + ": not readable JSON: " + e.what());
  }
}

inline std::string describe_json(const Json& value) { return json_excerpt(value, 40); }

// One JSON object and where it sits in its file.
class Fields {
 public:
  Fields(const Json& object, std::string path, std::string origin)
      : object_(object), path_(std::move(path)), origin_(std::move(origin)) {
    if (!object_.is_object())
      fail(path_.empty() ? "the top level" : quoted(path_), "must be an object");
  }

  std::string path_of(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }
  bool has(const char* key) const { return object_.contains(key) && !object_.at(key).is_null(); }

  const Json& required(const char* key) const {
    if (!has(key)) throw ConfigError(origin_ + ": missing field " + quoted(path_of(key)));
    return object_.at(key);
  }

  double number(const char* key) const {
    const Json& value = required(key);
    if (!value.is_number() || !std::isfinite(value.get<double>())) {
      fail(quoted(path_of(key)), "must be a number (got " + describe_json(value) + ")");
    }
    return value.get<double>();
  }
  // Times, byte counts and rates are at most 1e18 (an exabyte, thirty billion years): products of
  // such numbers in a projection stay finite, where 1e300 made infinite times and NaN ratios.
  static constexpr double kLargest = 1e18;
  double non_negative(const char* key) const {
    const double value = number(key);
    if (!(value >= 0 && value <= kLargest))
      fail(quoted(path_of(key)),
           "must be >= 0 and at most 1e18 (got " + describe_json(required(key)) + ")");
    return value;
  }
  double positive(const char* key) const {
    const double value = number(key);
    if (!(value > 0 && value <= kLargest))
      fail(quoted(path_of(key)),
           "must be > 0 and at most 1e18 (got " + describe_json(required(key)) + ")");
    return value;
  }
  double fraction(const char* key) const {
    const double value = number(key);
    if (value < 0 || value > 1) {
      fail(quoted(path_of(key)),
           "must be a fraction in [0, 1] (got " + describe_json(required(key)) + ")");
    }
    return value;
  }
  uint64_t count(const char* key) const {
    const Json& value = required(key);
    if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0)) {
      fail(quoted(path_of(key)),
           "must be a non-negative integer (got " + describe_json(value) + ")");
    }
    return value.get<uint64_t>();
  }
  // A block size B in values, in the range the codec accepts.
  uint32_t block_values(const char* key) const {
    const uint64_t block = count(key);
    if (block < CodecConfig::kMinBlockValues || block > CodecConfig::kMaxBlockValues) {
      fail(quoted(path_of(key)), "must be in " + std::to_string(CodecConfig::kMinBlockValues) +
                                     ".." + std::to_string(CodecConfig::kMaxBlockValues) +
                                     " (got " + std::to_string(block) + ")");
    }
    return static_cast<uint32_t>(block);
  }
  bool boolean(const char* key) const {
    const Json& value = required(key);
    if (!value.is_boolean())
      fail(quoted(path_of(key)), "must be true or false (got " + describe_json(value) + ")");
    return value.get<bool>();
  }
  std::string string(const char* key) const {
    const Json& value = required(key);
    if (!value.is_string())
      fail(quoted(path_of(key)), "must be a string (got " + describe_json(value) + ")");
    return value.get<std::string>();
  }
  Fields object(const char* key) const { return Fields(required(key), path_of(key), origin_); }
  const Json& array(const char* key) const {
    const Json& value = required(key);
    if (!value.is_array())
      fail(quoted(path_of(key)), "must be an array (got " + describe_json(value) + ")");
    return value;
  }
  Fields element(const Json& array_value, const char* key, size_t index) const {
    return Fields(array_value.at(index), path_of(key) + "[" + std::to_string(index) + "]", origin_);
  }

  const Json& json() const { return object_; }
  const std::string& origin() const { return origin_; }
  [[noreturn]] void fail(const std::string& what, const std::string& problem) const {
    throw ConfigError(origin_ + ": " + (what.rfind('"', 0) == 0 ? "field " : "") + what + " " +
                      problem);
  }

 private:
  static std::string quoted(const std::string& s) { return "\"" + s + "\""; }
  const Json& object_;
  std::string path_;
  std::string origin_;
};

}  // namespace ciera::sim::detail
