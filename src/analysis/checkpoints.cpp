#include "analysis/checkpoints.hpp"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <span>
#include <system_error>
#include <utility>

#include "ciera/error.hpp"

namespace ciera {

namespace fs = std::filesystem;

namespace {

// Why a folder without safetensors may have been given: a torch.distributed.checkpoint folder
// (one with a .metadata file, as `ciera train --checkpoint-every` writes under
// <run>/checkpoints/), given itself, among the folder's subfolders, or in its checkpoints/ (a run
// folder), holds sharded state to resume from, not one file per step.
std::string no_safetensors_hint(const fs::path& dir) {
  std::error_code error;
  const auto resumable = [&](const fs::path& p) {
    return fs::is_regular_file(p / ".metadata", error);
  };
  std::optional<fs::path> found;
  if (resumable(dir)) found = dir;
  for (const fs::path& parent : {dir, dir / "checkpoints"}) {
    if (found || !fs::is_directory(parent, error)) continue;
    for (const auto& entry : fs::directory_iterator(parent, error)) {
      if (entry.is_directory(error) && resumable(entry.path())) {
        found = entry.path();
        break;
      }
    }
  }
  if (!found) return "";
  return " (" + found->string() +
         " is a torch.distributed.checkpoint folder, for resuming: ciera analyze reads one "
         "safetensors file per step, as `ciera train --save-checkpoints DIR` writes them)";
}

std::vector<fs::path> checkpoints_in_directory(const fs::path& dir) {
  std::vector<std::pair<uint64_t, fs::path>> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".safetensors") continue;
    const fs::path& file = entry.path();
    if (file.stem().string().find("-of-") != std::string::npos) {
      throw ConfigError(file.string() +
                        " looks like one part of a sharded checkpoint; ciera analyze takes one "
                        "safetensors file per checkpoint");
    }
    const auto step = checkpoint_step_number(file);
    if (!step) {
      throw ConfigError(
          dir.string() + ": cannot order " + file.filename().string() +
          ": its name holds no step number (name checkpoints like step_000120.safetensors, "
          "or list the files in order)");
    }
    found.emplace_back(*step, file);
  }
  std::sort(found.begin(), found.end());
  for (size_t i = 1; i < found.size(); ++i) {
    if (found[i].first == found[i - 1].first) {
      throw ConfigError(dir.string() + ": " + found[i - 1].second.filename().string() + " and " +
                        found[i].second.filename().string() + " have the same step number " +
                        std::to_string(found[i].first));
    }
  }
  if (found.empty())
    throw ConfigError(dir.string() + ": no *.safetensors files" + no_safetensors_hint(dir));
  std::vector<fs::path> files;
  for (auto& [step, file] : found) files.push_back(std::move(file));
  return files;
}

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

}  // namespace

std::optional<uint64_t> checkpoint_step_number(const fs::path& file) {
  const std::string stem = file.stem().string();
  size_t end = stem.size();
  while (end > 0 && !std::isdigit(static_cast<unsigned char>(stem[end - 1]))) --end;
  size_t begin = end;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(stem[begin - 1]))) --begin;
  if (begin == end || end - begin > 18) return std::nullopt;
  return std::stoull(stem.substr(begin, end - begin));
}

std::vector<fs::path> list_checkpoints(const std::vector<std::string>& arguments) {
  std::vector<fs::path> files;
  for (const std::string& argument : arguments) {
    const fs::path path(argument);
    if (fs::is_directory(path)) {
      for (fs::path& file : checkpoints_in_directory(path)) files.push_back(std::move(file));
    } else {
      files.push_back(path);  // SafetensorsFile reports a missing or unreadable file
    }
  }
  // One checkpoint twice (a directory and a file in it, or two spellings of one path) would
  // count its transitions twice, or add a step without changes.
  std::map<fs::path, const fs::path*> seen;
  for (const fs::path& file : files) {
    std::error_code error;
    const fs::path absolute = fs::absolute(file).lexically_normal();
    fs::path key = fs::weakly_canonical(absolute, error);
    if (error) key = absolute;
    const auto [at, inserted] = seen.emplace(key, &file);
    if (!inserted) {
      throw ConfigError("checkpoint " + key.string() + " is given twice (as " +
                        at->second->string() + " and " + file.string() + ")");
    }
  }
  if (files.size() < 2) {
    // A path that does not exist is what the user should hear of, not the count.
    for (const fs::path& file : files) {
      std::error_code error;
      if (!fs::exists(file, error))
        throw ConfigError("checkpoint " + file.string() + " does not exist");
    }
    throw ConfigError("ciera analyze needs at least two checkpoints to compare, got " +
                      std::to_string(files.size()));
  }
  return files;
}

std::optional<std::vector<uint64_t>> checkpoint_steps(const std::vector<fs::path>& files) {
  std::vector<uint64_t> steps;
  for (const fs::path& file : files) {
    const std::optional<uint64_t> step = checkpoint_step_number(file);
    if (!step) return std::nullopt;
    steps.push_back(*step);
  }
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i] == steps[i - 1]) return std::nullopt;  // names numbered by something else
  }
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i] < steps[i - 1]) {
      throw ConfigError("checkpoints out of step order: " + files[i - 1].string() + " (step " +
                        std::to_string(steps[i - 1]) + ") is given before " + files[i].string() +
                        " (step " + std::to_string(steps[i]) +
                        "); list them in training order, or give their folder");
    }
  }
  return steps;
}

std::vector<SafetensorsFile> open_checkpoint_series(const std::vector<fs::path>& paths,
                                                    bool only_ciera_dtypes) {
  std::vector<SafetensorsFile> files;
  files.reserve(paths.size());
  for (const fs::path& p : paths) files.emplace_back(p);
  if (files.empty()) return files;
  const auto checked = [&](const SafetensorsTensor& t) {
    return !only_ciera_dtypes || t.ciera_dtype.has_value();
  };
  const SafetensorsFile& first = files.front();
  for (size_t c = 1; c < files.size(); ++c) {
    const SafetensorsFile& other = files[c];
    for (const SafetensorsTensor& t : first.tensors()) {
      if (!checked(t)) continue;
      const SafetensorsTensor* u = other.find(t.name);
      const std::string where = other.path().string() + ": tensor '" + t.name + "' ";
      if (u == nullptr)
        throw FormatError(where + "is missing (it is in " + first.path().string() + ")");
      if (u->dtype != t.dtype) {
        throw FormatError(where + "is " + u->dtype + " but " + t.dtype + " in " +
                          first.path().string());
      }
      if (u->shape != t.shape) {
        throw FormatError(where + "has shape " + shape_string(u->shape) + " but " +
                          shape_string(t.shape) + " in " + first.path().string());
      }
    }
    for (const SafetensorsTensor& u : other.tensors()) {
      if (!checked(u)) continue;
      const SafetensorsTensor* t = first.find(u.name);
      const std::string where = other.path().string() + ": tensor '" + u.name + "' ";
      if (t == nullptr) throw FormatError(where + "is not in " + first.path().string());
      if (!checked(*t)) {  // unsupported in the first, so not compared: name the difference
        throw FormatError(where + "is " + u.dtype + " but " + t->dtype + " in " +
                          first.path().string());
      }
    }
  }
  return files;
}

void compare_in_windows(const std::vector<SafetensorsFile>& files, std::string_view name,
                        std::vector<TensorComparison>& comparisons, uint64_t window_values,
                        const std::function<void(uint64_t values_done)>& after_window) {
  if (window_values == 0)
    throw ConfigError("compare_in_windows: a window must hold at least one value");
  if (comparisons.empty()) return;
  // Every checkpoint's copy is checked against every counter before any work, so that a mismatch
  // is refused rather than half counted.
  std::vector<std::span<const std::byte>> tensor_bytes(files.size());
  std::vector<bool> used(files.size(), false);
  for (const TensorComparison& c : comparisons) {
    for (const size_t index : {c.before, c.after}) {
      if (index >= files.size()) {
        throw ConfigError("compare_in_windows: checkpoint " + std::to_string(index) +
                          " of a series of " + std::to_string(files.size()));
      }
      const std::string where = files[index].path().string() + ": tensor '" + std::string(name);
      const SafetensorsTensor* t = files[index].find(name);
      if (t == nullptr) throw ConfigError(where + "' is missing");
      const ChunkedChangeCounter& counter = c.counter;
      if (t->ciera_dtype != counter.dtype() || t->num_values != counter.num_values()) {
        throw ConfigError(where + "' holds " + std::to_string(t->num_values) + " " + t->dtype +
                          " values, but its comparison was made for " +
                          std::to_string(counter.num_values()) + " " +
                          std::string(dtype_name(counter.dtype())) + " values");
      }
      if (counter.values_added() != 0) {
        throw ConfigError(where + "': its comparison has already counted " +
                          std::to_string(counter.values_added()) + " values");
      }
      tensor_bytes[index] = t->bytes;
      used[index] = true;
    }
  }
  const ChunkedChangeCounter& counter = comparisons.front().counter;
  const uint64_t num_values = counter.num_values();
  const uint32_t value_bytes = dtype_info(counter.dtype()).value_bytes;
  for (uint64_t first = 0; first < num_values; first += window_values) {
    const uint64_t count = std::min(window_values, num_values - first);
    const size_t offset = first * value_bytes;
    const size_t bytes = count * value_bytes;
    for (TensorComparison& c : comparisons) {
      c.counter.add(tensor_bytes[c.before].subspan(offset, bytes),
                    tensor_bytes[c.after].subspan(offset, bytes));
    }
    for (size_t f = 0; f < files.size(); ++f) {
      if (used[f]) files[f].release(tensor_bytes[f].subspan(offset, bytes));
    }
    if (after_window) after_window(first + count);
  }
}

}  // namespace ciera
