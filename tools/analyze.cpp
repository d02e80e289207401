// `ciera analyze`: exponent-change characterisation of a training run from consecutive
// safetensors checkpoints (paper §2.2-2.4, observations O2-O4; docs/analysis.md). Checkpoints are
// memory-mapped and each tensor is read a window at a time in all of them, what was read released
// at once, so resident memory stays near (checkpoints) x (window) however large the checkpoints.
// Parse (options checked, checkpoints opened and their headers checked) -> count (an
// AnalyzeResult) -> render (tables or JSON).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "analysis/checkpoints.hpp"
#include "analysis/safetensors.hpp"
#include "ciera/analysis.hpp"
#include "ciera/error.hpp"
#include "commands.hpp"
#include "report.hpp"

namespace ciera::tools {
namespace {

// The command line as CLI11 binds it: raw values, not yet checked.
struct Options {
  std::vector<std::string> checkpoints;
  uint32_t warmup = 0;
  std::vector<uint32_t> worlds = ChangeGrid{}.worlds;
  std::vector<uint32_t> blocks = ChangeGrid{}.block_values;
  uint32_t max_interval = 1;
  bool skip_unsupported = false;
  bool uneven_steps = false;
  bool json = false;
  std::string json_file;
  std::string plot_dir;
  bool quiet = false;
};

// The tensors to compare (those of a dtype CIERA carries), with the shard type of each.
struct TensorInput {
  const SafetensorsTensor* tensor;  // in the first checkpoint
  ShardType type;
};

// The checked options and the opened checkpoint series.
struct Request {
  Options options;
  std::string command;
  ChangeGrid grid;
  std::vector<SafetensorsFile> files;  // in training order
  uint32_t steps = 0;                  // transitions: files - 1
  // The training step of each file, from its name; empty when the names do not number the
  // steps (the files are then taken as consecutive steps).
  std::vector<uint64_t> step_numbers;
  // Training steps from one checkpoint to the next, when known and the same throughout.
  std::optional<uint64_t> step_spacing;
  std::vector<TensorInput> tensors;
  std::vector<std::string> skipped;  // tensors of an unsupported dtype
  uint64_t work_bytes = 0;           // bytes of one checkpoint's tensors to compare
};

void check_options(const Options& o) {
  if (!o.plot_dir.empty()) {
    throw ConfigError(
        "--plot is drawn by the Python entry point: install the package (scripts/python-env.sh) "
        "and run `ciera analyze ... --plot DIR` from it");
  }
  ChangeGrid{o.worlds, o.blocks}.validate();
  if (o.worlds.empty() || o.blocks.empty()) {
    throw ConfigError("--worlds and --blocks need at least one value");
  }
  // A value twice would be a duplicate column of every table, as `simulate --gpus` refuses.
  for (const auto& [flag, values] :
       {std::pair{"--worlds", &o.worlds}, std::pair{"--blocks", &o.blocks}}) {
    for (size_t i = 0; i < values->size(); ++i) {
      if (std::find(values->begin(), values->begin() + i, (*values)[i]) != values->begin() + i)
        throw ConfigError(std::string(flag) + ": " + std::to_string((*values)[i]) +
                          " is given twice");
    }
  }
  if (o.max_interval < 1) throw ConfigError("--max-interval must be at least 1");
  if (!o.json_file.empty()) {
    // "--json-file --quiet" took the option as the file's name.
    if (o.json_file.starts_with("-"))
      throw ConfigError("--json-file needs a file name, got " + o.json_file);
    std::error_code error;
    if (std::filesystem::is_directory(o.json_file, error))
      throw ConfigError("--json-file " + o.json_file + ": a folder, not a file");
    const std::filesystem::path dir =
        std::filesystem::absolute(std::filesystem::path(o.json_file)).parent_path();
    if (!std::filesystem::is_directory(dir))
      throw ConfigError("--json-file: directory " + dir.string() + " does not exist");
  }
}

// Every transition weighs the same in the means and the check intervals count checkpoints, so
// both mean something only when the checkpoints are evenly spaced: a 10-step and a 70-step gap
// averaged, or "interval 2" spanning 80 steps, would read as per-step figures. Uneven spacing is
// refused unless --uneven-steps says the user wants per-transition figures anyway.
void check_step_spacing(Request& r, const std::vector<std::filesystem::path>& paths) {
  const std::vector<uint64_t>& steps = r.step_numbers;
  if (steps.size() < 2) return;
  const uint64_t first_gap = steps[1] - steps[0];
  for (size_t i = 2; i < steps.size(); ++i) {
    const uint64_t gap = steps[i] - steps[i - 1];
    if (gap == first_gap) continue;
    if (r.options.uneven_steps) return;  // no spacing to report
    throw ConfigError(
        "checkpoints unevenly spaced: " + paths[i - 1].filename().string() + " -> " +
        paths[i].filename().string() + " is " + std::to_string(gap) + " training steps, but " +
        paths[0].filename().string() + " -> " + paths[1].filename().string() + " is " +
        std::to_string(first_gap) +
        "; the per-step means and check intervals would mix transitions of different lengths. "
        "Give evenly spaced checkpoints, or pass --uneven-steps to count every transition as one "
        "whatever its length");
  }
  r.step_spacing = first_gap;
}

// Opens the checkpoints and picks the tensors to compare; throws for unevenly spaced steps
// (unless --uneven-steps), too few transitions after the warmup, a tensor of an unsupported
// dtype (unless --skip-unsupported) or no values to compare at all.
Request parse(const Options& o, const std::string& command) {
  check_options(o);
  Request r;
  r.options = o;
  r.command = command;
  r.grid = ChangeGrid{o.worlds, o.blocks};
  const std::vector<std::filesystem::path> paths = list_checkpoints(o.checkpoints);
  if (auto steps = checkpoint_steps(paths)) r.step_numbers = std::move(*steps);
  check_step_spacing(r, paths);
  r.files = open_checkpoint_series(paths, o.skip_unsupported);
  r.steps = static_cast<uint32_t>(r.files.size() - 1);
  if (o.warmup >= r.steps) {
    throw ConfigError("--warmup " + std::to_string(o.warmup) + " leaves none of the " +
                      std::to_string(r.steps) + " step transitions to measure");
  }
  for (const SafetensorsTensor& t : r.files.front().tensors()) {
    if (!t.ciera_dtype) {
      if (!o.skip_unsupported) {
        throw FormatError(
            r.files.front().path().string() + ": tensor '" + t.name + "' has dtype " + t.dtype +
            ", which ciera analyze does not handle (BF16, F16, F32); pass --skip-unsupported to "
            "leave such tensors out");
      }
      r.skipped.push_back(t.name);
      continue;
    }
    r.tensors.push_back({&t, classify_parameter(t.name)});
    r.work_bytes += t.bytes.size();
  }
  if (r.tensors.empty()) {
    throw FormatError(r.files.front().path().string() + ": no BF16, F16 or F32 tensor to analyse");
  }
  // A rate of 0 changed out of 0 values would read as "nothing changed".
  if (r.work_bytes == 0) {
    throw FormatError(r.files.front().path().string() + ": its " +
                      std::to_string(r.tensors.size()) +
                      " BF16, F16 and F32 tensors are all empty: no values to compare");
  }
  return r;
}

// ---- Counting --------------------------------------------------------------------------------

struct TensorResult {
  const TensorInput* input;
  ChangeCounts total;  // after warmup
};

struct IntervalResult {
  uint32_t interval;
  ChangeCounts counts;  // element counts only
};

struct AnalyzeResult {
  ChangeStatistics stats;
  std::vector<TensorResult> tensors;
  std::vector<IntervalResult> intervals;  // check interval k = 1, 2, ... --max-interval
  double seconds = 0;
};

// Resident memory is bounded by reading each tensor a window at a time in every checkpoint
// (compare_in_windows), the window sized so that all checkpoints' windows together stay near
// kResidentBudgetBytes; between kMinWindowBytes (fewer, larger madvise calls when there are many
// checkpoints) and kMaxWindowBytes (progress moves at least every 16 MB of a tensor).
constexpr uint64_t kResidentBudgetBytes = uint64_t{256} << 20;
constexpr uint64_t kMinWindowBytes = uint64_t{1} << 20;
constexpr uint64_t kMaxWindowBytes = uint64_t{16} << 20;
// Progress is redrawn at most this often inside a tensor: a redraw per window would flood a
// terminal when windows take milliseconds.
constexpr double kProgressSeconds = 0.2;

uint64_t window_bytes(size_t checkpoints) {
  return std::clamp(kResidentBudgetBytes / std::max<size_t>(checkpoints, 1), kMinWindowBytes,
                    kMaxWindowBytes);
}

// The comparisons of one tensor: each transition s - 1 -> s (over the grid), then the checks k
// checkpoints apart (Figure 5b), k > 1, between checkpoints both after warmup (element counts
// only).
std::vector<TensorComparison> comparisons_of(const Request& r, const SafetensorsTensor& tensor,
                                             const std::vector<IntervalResult>& intervals) {
  const DType dtype = *tensor.ciera_dtype;
  std::vector<TensorComparison> comparisons;
  for (uint32_t s = 1; s <= r.steps; ++s) {
    comparisons.push_back({s - 1, s, ChunkedChangeCounter(dtype, tensor.num_values, r.grid)});
  }
  const ChangeGrid elements_only{{}, {}};
  for (size_t i = 1; i < intervals.size(); ++i) {
    const uint32_t k = intervals[i].interval;
    for (uint32_t first = r.options.warmup; first + k <= r.steps; ++first) {
      comparisons.push_back(
          {first, first + k, ChunkedChangeCounter(dtype, tensor.num_values, elements_only)});
    }
  }
  return comparisons;
}

AnalyzeResult count(const Request& r) {
  const Options& o = r.options;
  Stopwatch clock;
  AnalyzeResult result{ChangeStatistics(r.grid, o.warmup), {}, {}, 0};
  for (uint32_t k = 1; k <= std::min(o.max_interval, r.steps - o.warmup); ++k) {
    result.intervals.push_back({k, ChangeCounts{}});
  }
  Progress progress("analyze", r.work_bytes, !o.quiet);
  const uint64_t window = window_bytes(r.files.size());
  uint64_t done_bytes = 0;
  for (const TensorInput& input : r.tensors) {
    const SafetensorsTensor& tensor = *input.tensor;
    const std::string detail = "reading " + tensor.name;
    progress.update(done_bytes, detail);
    Stopwatch since_update;
    const uint32_t value_bytes = dtype_info(*tensor.ciera_dtype).value_bytes;
    std::vector<TensorComparison> comparisons = comparisons_of(r, tensor, result.intervals);
    compare_in_windows(r.files, tensor.name, comparisons, window / value_bytes,
                       [&](uint64_t values_done) {
                         if (since_update.seconds() < kProgressSeconds) return;
                         progress.update(done_bytes + values_done * value_bytes, detail);
                         since_update = Stopwatch();
                       });
    TensorResult& t = result.tensors.emplace_back(TensorResult{&input, ChangeCounts(r.grid)});
    for (const TensorComparison& c : comparisons) {
      const ChangeCounts& counts = c.counter.counts();
      if (c.after == c.before + 1) {  // transition s = c.after
        const auto s = static_cast<uint32_t>(c.after);
        result.stats.add(s, input.type, counts);
        if (s > o.warmup) {
          t.total += counts;
          result.intervals.front().counts += counts;
        }
      } else {
        result.intervals[c.after - c.before - 1].counts += counts;
      }
    }
    done_bytes += tensor.bytes.size();
  }
  progress.update(done_bytes, "done");
  progress.finish();
  result.seconds = clock.seconds();
  return result;
}

// ---- Rendering -------------------------------------------------------------------------------

// A (W x B) table as a list per W of values per B.
template <typename F>
nlohmann::json per_cell(const ChangeGrid& grid, F value) {
  nlohmann::json rows = nlohmann::json::array();
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    nlohmann::json row = nlohmann::json::array();
    for (size_t b = 0; b < grid.block_values.size(); ++b) row.push_back(value(grid.cell(w, b)));
    rows.push_back(row);
  }
  return rows;
}

// `step_transitions`: the checkpoint transitions the counts cover (every tensor is compared in
// each), not c.transitions, which counts tensor transitions and so grows with the tensors summed.
nlohmann::json counts_json(const ChangeCounts& c, const ChangeGrid& grid,
                           uint64_t step_transitions) {
  nlohmann::json shard_rate = nlohmann::json::array();
  for (size_t w = 0; w < grid.worlds.size(); ++w) shard_rate.push_back(c.shard_change_rate(w));
  return {{"transitions", step_transitions},
          {"values", c.values},
          {"changed_values", c.changed_values},
          {"element_change_rate", c.element_change_rate()},
          {"blocks", per_cell(grid, [&](size_t i) { return c.blocks[i]; })},
          {"changed_blocks", per_cell(grid, [&](size_t i) { return c.changed_blocks[i]; })},
          {"block_change_rate", per_cell(grid, [&](size_t i) { return c.block_change_rate(i); })},
          {"shards", c.shards},
          {"changed_shards", c.changed_shards},
          {"shard_change_rate", shard_rate}};
}

// {type: counts} for the shard types `counts_of` has seen at all.
template <typename CountsOf>
nlohmann::json by_type_json(const ChangeGrid& grid, uint64_t step_transitions, CountsOf counts_of) {
  nlohmann::json by_type = nlohmann::json::object();
  for (size_t t = 0; t < kShardTypeCount; ++t) {
    const ChangeCounts& c = counts_of(static_cast<ShardType>(t));
    if (c.transitions > 0) {
      by_type[std::string(to_string(static_cast<ShardType>(t)))] =
          counts_json(c, grid, step_transitions);
    }
  }
  return by_type;
}

std::string percent(double rate, int decimals) { return fixed(100.0 * rate, decimals); }

// The (W, B) the per-type table and the box plots single out: the paper's W = 4, B = 512 when the
// grid has them (Figure 4).
struct DetailCell {
  size_t world_index = 0;
  size_t block_index = 0;
};

DetailCell detail_cell(const ChangeGrid& grid) {
  DetailCell d;
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    if (grid.worlds[w] == 4) d.world_index = w;
  }
  for (size_t b = 0; b < grid.block_values.size(); ++b) {
    if (grid.block_values[b] == 512) d.block_index = b;
  }
  return d;
}

// The training step of checkpoint `index`, or null when the names do not number the steps.
nlohmann::json step_number_json(const Request& r, size_t index) {
  if (r.step_numbers.empty()) return nullptr;
  return r.step_numbers[index];
}

nlohmann::json steps_json(const Request& r, const AnalyzeResult& result) {
  nlohmann::json steps = nlohmann::json::array();
  for (uint32_t s = 1; s <= r.steps; ++s) {
    steps.push_back({{"step", s},
                     {"from", r.files[s - 1].path().string()},
                     {"to", r.files[s].path().string()},
                     {"from_step", step_number_json(r, s - 1)},
                     {"to_step", step_number_json(r, s)},
                     {"warmup", s <= r.options.warmup},
                     {"counts", counts_json(result.stats.step(s), r.grid, 1)},
                     {"by_type", by_type_json(r.grid, 1, [&](ShardType t) -> const ChangeCounts& {
                        return result.stats.step(s, t);
                      })}});
  }
  return steps;
}

// Checkpoint pairs compared at interval i (each tensor compared once in each).
uint64_t interval_pairs(const Request& r, const IntervalResult& i) {
  return i.counts.transitions / std::max<size_t>(1, r.tensors.size());
}

nlohmann::json analyze_json(const Request& r, const AnalyzeResult& result) {
  const ChangeGrid& grid = r.grid;
  nlohmann::json j;
  j["command"] = r.command;
  j["checkpoints"] = nlohmann::json::array();
  for (const SafetensorsFile& f : r.files) j["checkpoints"].push_back(f.path().string());
  j["checkpoint_steps"] =
      r.step_numbers.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.step_numbers);
  j["step_spacing"] = r.step_spacing ? nlohmann::json(*r.step_spacing) : nlohmann::json(nullptr);
  j["warmup"] = r.options.warmup;
  j["grid"] = {{"worlds", grid.worlds}, {"block_values", grid.block_values}};
  const DetailCell detail = detail_cell(grid);
  j["detail"] = {{"world", grid.worlds[detail.world_index]},
                 {"block_values", grid.block_values[detail.block_index]}};
  j["skipped_tensors"] = r.skipped;
  j["steps"] = steps_json(r, result);
  const uint64_t measured = r.steps - r.options.warmup;
  j["total"] = counts_json(result.stats.total(), grid, measured);
  j["by_type"] = by_type_json(
      grid, measured, [&](ShardType t) -> const ChangeCounts& { return result.stats.total(t); });
  j["tensors"] = nlohmann::json::array();
  for (const TensorResult& t : result.tensors) {
    const SafetensorsTensor& tensor = *t.input->tensor;
    j["tensors"].push_back({{"name", tensor.name},
                            {"type", to_string(t.input->type)},
                            {"dtype", tensor.dtype},
                            {"shape", tensor.shape},
                            {"counts", counts_json(t.total, grid, measured)}});
  }
  // The intervals asked for; `intervals` stops at the checkpoints' span after the warmup.
  j["max_interval"] = r.options.max_interval;
  j["intervals"] = nlohmann::json::array();
  for (const IntervalResult& i : result.intervals) {
    j["intervals"].push_back(
        {{"interval", i.interval},
         {"training_steps",
          r.step_spacing ? nlohmann::json(i.interval * *r.step_spacing) : nlohmann::json(nullptr)},
         {"pairs", interval_pairs(r, i)},
         {"values", i.counts.values},
         {"changed_values", i.counts.changed_values},
         {"element_change_rate", i.counts.element_change_rate()}});
  }
  j["seconds"] = result.seconds;
  return j;
}

// What the text report needs beyond the result: the shard types present and their tensors.
struct ReportContext {
  const Request& request;
  const AnalyzeResult& result;
  std::vector<ShardType> present;
  std::array<size_t, kShardTypeCount> tensors_by_type{};
  uint64_t measured_steps;  // after warmup
};

void print_summary(const ReportContext& c, std::ostream& out) {
  const Request& r = c.request;
  std::map<std::string, size_t> dtypes;
  uint64_t values = 0;
  for (const TensorInput& t : r.tensors) {
    ++dtypes[t.tensor->dtype];
    values += t.tensor->num_values;
  }
  std::string dtype_list;
  for (const auto& [name, count] : dtypes) {
    dtype_list += (dtype_list.empty() ? "" : ", ") + std::to_string(count) + " " + name;
  }
  out << "ciera analyze: " << r.files.size() << " checkpoints, " << r.steps
      << " transitions between them (" << r.options.warmup << " warmup, left out of every mean)\n"
      << "steps: ";
  if (r.step_numbers.empty()) {
    out << "the file names do not number them; the checkpoints are taken as consecutive steps\n";
  } else {
    out << r.step_numbers.front() << " to " << r.step_numbers.back();
    if (r.step_spacing) {
      out << ", every " << *r.step_spacing << " training step" << (*r.step_spacing == 1 ? "" : "s")
          << "\n";
    } else {
      out << ", unevenly spaced (--uneven-steps): every transition counts as one in the means, "
             "whatever its length\n";
    }
  }
  out << "tensors: " << r.tensors.size() << " (" << dtype_list << "), " << values
      << " values per checkpoint";
  if (!r.skipped.empty()) out << "; " << r.skipped.size() << " skipped (unsupported dtype)";
  out << "\nshards: each tensor flat, ceil(n/W) values per rank; blocks cut inside each shard\n\n";
}

// O2: element change rate per step, overall and per shard type present.
void print_per_step(const ReportContext& c, std::ostream& out) {
  const Request& r = c.request;
  const ChangeStatistics& stats = c.result.stats;
  const bool numbered = !r.step_numbers.empty();
  std::vector<std::string> header = {numbered ? "steps" : "transition", "to checkpoint",
                                     "changed values", "change (%)"};
  for (ShardType t : c.present) header.push_back(std::string(to_string(t)) + " (%)");
  Table per_step(header);
  constexpr uint32_t kShownSteps = 12;
  const uint32_t steps = r.steps;
  for (uint32_t s = 1; s <= steps; ++s) {
    if (steps > 2 * kShownSteps && s == kShownSteps + 1) {
      per_step.add({"... " + std::to_string(steps - 2 * kShownSteps) + " more"});
      s = steps - kShownSteps;
      continue;
    }
    const ChangeCounts& counts = stats.step(s);
    const std::string transition = numbered ? std::to_string(r.step_numbers[s - 1]) + " -> " +
                                                  std::to_string(r.step_numbers[s])
                                            : std::to_string(s);
    std::vector<std::string> row = {transition + (s <= r.options.warmup ? " (warmup)" : ""),
                                    r.files[s].path().filename().string(),
                                    std::to_string(counts.changed_values),
                                    percent(counts.element_change_rate(), 3)};
    for (ShardType t : c.present) row.push_back(percent(stats.step(s, t).element_change_rate(), 3));
    per_step.add(row);
  }
  out << "Exponent changes per transition (O2: values whose exponent differs from the checkpoint "
         "before)\n"
      << per_step.render();
  const ChangeCounts& total = stats.total();
  out << "mean after warmup: " << percent(total.element_change_rate(), 3) << "% of values per "
      << (r.step_spacing && *r.step_spacing > 1
              ? "transition of " + std::to_string(*r.step_spacing) + " training steps"
              : std::string(r.step_spacing ? "step" : "transition"))
      << " (" << total.changed_values << " of " << total.values << ")\n\n";
}

// O4: by shard type, at the detail cell.
void print_by_type(const ReportContext& c, std::ostream& out) {
  const ChangeGrid& grid = c.request.grid;
  const DetailCell detail = detail_cell(grid);
  const std::string w = std::to_string(grid.worlds[detail.world_index]);
  const std::string b = std::to_string(grid.block_values[detail.block_index]);
  const size_t cell = grid.cell(detail.world_index, detail.block_index);
  Table by_type({"shard type", "tensors", "values", "change (%)",
                 "blocks changed W=" + w + " B=" + b + " (%)", "shards changed W=" + w + " (%)"});
  auto type_row = [&](const std::string& name, size_t count, const ChangeCounts& counts) {
    by_type.add({name, std::to_string(count), std::to_string(counts.values / c.measured_steps),
                 percent(counts.element_change_rate(), 3),
                 percent(counts.block_change_rate(cell), 1),
                 percent(counts.shard_change_rate(detail.world_index), 1)});
  };
  for (ShardType t : c.present) {
    type_row(std::string(to_string(t)), c.tensors_by_type[static_cast<size_t>(t)],
             c.result.stats.total(t));
  }
  type_row("all", c.result.tensors.size(), c.result.stats.total());
  out << "By shard type, after warmup (O4)\n" << by_type.render() << "\n";
}

// O3: reusable blocks and shard change rate; then the check intervals (Figure 5b).
void print_reuse(const ReportContext& c, std::ostream& out) {
  const ChangeGrid& grid = c.request.grid;
  const ChangeCounts& total = c.result.stats.total();
  std::vector<std::string> block_header = {"W"};
  for (uint32_t b : grid.block_values) block_header.push_back("B=" + std::to_string(b));
  Table reusable(block_header);
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    std::vector<std::string> row = {std::to_string(grid.worlds[w])};
    for (size_t b = 0; b < grid.block_values.size(); ++b) {
      row.push_back(percent(1.0 - total.block_change_rate(grid.cell(w, b)), 1));
    }
    reusable.add(row);
  }
  out << "Reusable blocks (%) after warmup (O3: blocks with no changed exponent)\n"
      << reusable.render() << "\n";

  Table shards({"W", "shards per step", "changed (%)", "reusable (%)"});
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    shards.add({std::to_string(grid.worlds[w]), std::to_string(total.shards[w] / c.measured_steps),
                percent(total.shard_change_rate(w), 1),
                percent(1.0 - total.shard_change_rate(w), 1)});
  }
  out << "Shard change rate after warmup (O3: shards with any changed exponent)\n"
      << shards.render();
}

void print_intervals(const ReportContext& c, std::ostream& out) {
  if (c.result.intervals.size() <= 1) {
    if (c.request.options.max_interval > 1) {
      out << "\nNo check interval above 1: after the warmup the checkpoints hold no two "
             "checkpoints more than 1 apart (--max-interval "
          << c.request.options.max_interval << ")\n";
    }
    return;
  }
  const std::optional<uint64_t> spacing = c.request.step_spacing;
  std::vector<std::string> header = {"check interval k", "pairs", "change (%)"};
  if (spacing) header.insert(header.begin() + 1, "training steps");
  Table by_interval(header);
  for (const IntervalResult& i : c.result.intervals) {
    std::vector<std::string> row = {std::to_string(i.interval),
                                    std::to_string(interval_pairs(c.request, i)),
                                    percent(i.counts.element_change_rate(), 3)};
    if (spacing) row.insert(row.begin() + 1, std::to_string(i.interval * *spacing));
    by_interval.add(row);
  }
  out << "\nExponents changed between checkpoints k apart (Figure 5b)\n" << by_interval.render();
  const uint32_t widest = c.result.intervals.back().interval;
  if (widest < c.request.options.max_interval) {  // said, not capped silently
    out << "(up to " << widest << ", not --max-interval " << c.request.options.max_interval
        << ": after the warmup the checkpoints span " << widest << " transitions)\n";
  }
}

void print_report(const Request& r, const AnalyzeResult& result, std::ostream& out) {
  ReportContext c{r, result, {}, {}, r.steps - r.options.warmup};
  for (const TensorInput& t : r.tensors) ++c.tensors_by_type[static_cast<size_t>(t.type)];
  for (size_t t = 0; t < kShardTypeCount; ++t) {
    if (c.tensors_by_type[t] > 0) c.present.push_back(static_cast<ShardType>(t));
  }
  print_summary(c, out);
  print_per_step(c, out);
  print_by_type(c, out);
  print_reuse(c, out);
  print_intervals(c, out);
  out << "\nanalysed in " << fixed(result.seconds, 2) << " s\n";
}

int run(const Request& r) {
  const Options& o = r.options;
  if (!r.skipped.empty() && !o.quiet) {
    std::cerr << "ciera analyze: skipping " << r.skipped.size()
              << " tensor(s) of unsupported dtype, e.g. '" << r.skipped.front() << "'\n";
  }
  if (!r.step_numbers.empty() && !r.step_spacing) {  // --uneven-steps: loud, even with --quiet
    std::cerr << "ciera analyze: warning: checkpoints unevenly spaced (steps";
    for (uint64_t step : r.step_numbers) std::cerr << " " << step;
    std::cerr << "): means and check intervals are per transition, not per training step\n";
  }
  const AnalyzeResult result = count(r);
  const nlohmann::json j = analyze_json(r, result);
  if (!o.json_file.empty()) {
    std::ofstream out(o.json_file);
    out << json_text(j) << "\n";
    if (!out) throw ConfigError("cannot write " + o.json_file);
  }
  if (o.json) {
    std::cout << json_text(j) << std::endl;
  } else {
    print_report(r, result, std::cout);
  }
  return 0;
}

}  // namespace

void register_analyze(CLI::App& app, const std::string& command) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "analyze",
      "Exponent-change statistics of consecutive safetensors checkpoints (paper §2, O2-O4)");
  cmd->add_option(
         "checkpoints", o->checkpoints,
         "checkpoint files in training order, or directories of *.safetensors ordered by the step "
         "number in their names")
      ->required();
  cmd->add_option("--warmup", o->warmup,
                  "transitions between checkpoints (the first ones) left out of the means")
      ->capture_default_str();
  cmd->add_option("--worlds", o->worlds, "world sizes W to shard each tensor over (a list)")
      ->capture_default_str();
  cmd->add_option("--blocks", o->blocks, "block sizes B, in values (a list)")
      ->capture_default_str();
  cmd->add_option("--max-interval", o->max_interval,
                  "also compare checkpoints up to this many checkpoints apart (Figure 5b)")
      ->capture_default_str();
  cmd->add_flag("--uneven-steps", o->uneven_steps,
                "accept checkpoints whose step numbers are unevenly spaced; every transition "
                "then counts as one whatever its length");
  cmd->add_flag("--skip-unsupported", o->skip_unsupported,
                "leave out tensors that are not BF16, F16 or F32 (they need not be in every "
                "checkpoint)");
  cmd->add_flag("--json", o->json, "print one JSON object on one line instead of the tables");
  cmd->add_option("--json-file", o->json_file, "also write the JSON object to this file");
  cmd->add_option("--plot", o->plot_dir,
                  "folder to write PNG figures into (Python entry point only)")
      ->type_name("DIR");
  cmd->add_flag("--quiet", o->quiet, "no progress output");
  cmd->footer(
      "A list option (--worlds, --blocks) takes every value that follows it: give the "
      "checkpoints first, or end the list with -- or another option (--worlds 4 8 -- ckpts/).\n\n"
      "Exit status: 0 done; 1 the analysis failed after its checks (a report that could not be "
      "written); 2 a command line or checkpoints no analysis could use, refused before any work "
      "(a missing, malformed or mismatched checkpoint, unevenly spaced steps).");
  cmd->callback([o, command]() {
    const Request request = parse_step([&] { return parse(*o, command); });
    throw CommandExit(run(request));
  });
}

}  // namespace ciera::tools
