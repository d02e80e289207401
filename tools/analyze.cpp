// `ciera analyze`: exponent-change characterisation of a training run from consecutive
// safetensors checkpoints (paper §2.2-2.4, observations O2-O4; docs/analysis.md). Checkpoints are
// memory-mapped and walked tensor by tensor, so memory stays at one mapping per checkpoint.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
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

struct Options {
  std::vector<std::string> checkpoints;
  uint32_t warmup = 0;
  std::vector<uint32_t> worlds = ChangeGrid{}.worlds;
  std::vector<uint32_t> blocks = ChangeGrid{}.block_values;
  uint32_t max_interval = 1;
  bool skip_unsupported = false;
  bool json = false;
  std::string json_file;
  std::string plot_dir;
  bool quiet = false;
};

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

nlohmann::json counts_json(const ChangeCounts& c, const ChangeGrid& grid) {
  nlohmann::json shard_rate = nlohmann::json::array();
  for (size_t w = 0; w < grid.worlds.size(); ++w) shard_rate.push_back(c.shard_change_rate(w));
  return {{"transitions", c.transitions},
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

std::string percent(double rate, int decimals) { return fixed(100.0 * rate, decimals); }

struct TensorResult {
  const SafetensorsTensor* tensor;
  ShardType type;
  ChangeCounts total;  // after warmup
};

struct IntervalResult {
  uint32_t interval;
  ChangeCounts counts;  // element counts only
};

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

void print_report(std::ostream& out, const Options& o, const std::vector<SafetensorsFile>& files,
                  const ChangeStatistics& stats, const std::vector<TensorResult>& tensors,
                  const std::vector<IntervalResult>& intervals,
                  const std::vector<std::string>& skipped, double seconds) {
  const ChangeGrid& grid = stats.grid();
  const uint32_t steps = stats.steps();
  const DetailCell detail = detail_cell(grid);
  const uint32_t detail_w = grid.worlds[detail.world_index];
  const uint32_t detail_b = grid.block_values[detail.block_index];
  const size_t detail_cell_index = grid.cell(detail.world_index, detail.block_index);

  std::map<std::string, size_t> dtypes;
  uint64_t values = 0;
  std::array<size_t, kShardTypeCount> tensors_by_type{};
  for (const TensorResult& r : tensors) {
    ++dtypes[r.tensor->dtype];
    values += r.tensor->num_values;
    ++tensors_by_type[static_cast<size_t>(r.type)];
  }
  std::string dtype_list;
  for (const auto& [name, count] : dtypes) {
    dtype_list += (dtype_list.empty() ? "" : ", ") + std::to_string(count) + " " + name;
  }
  out << "ciera analyze: " << files.size() << " checkpoints, " << steps << " step transitions ("
      << o.warmup << " warmup, left out of every mean)\n"
      << "tensors: " << tensors.size() << " (" << dtype_list << "), " << values
      << " values per checkpoint";
  if (!skipped.empty()) out << "; " << skipped.size() << " skipped (unsupported dtype)";
  out << "\nshards: FSDP-style, ceil(n/W) values of each tensor per rank; blocks cut inside each "
         "shard\n\n";

  // O2: element change rate per step, overall and per shard type present.
  std::vector<ShardType> present;
  for (size_t t = 0; t < kShardTypeCount; ++t) {
    if (tensors_by_type[t] > 0) present.push_back(static_cast<ShardType>(t));
  }
  std::vector<std::string> header = {"step", "to checkpoint", "changed values", "change (%)"};
  for (ShardType t : present) header.push_back(std::string(to_string(t)) + " (%)");
  Table per_step(header);
  constexpr uint32_t kShownSteps = 12;
  for (uint32_t s = 1; s <= steps; ++s) {
    if (steps > 2 * kShownSteps && s == kShownSteps + 1) {
      per_step.add({"... " + std::to_string(steps - 2 * kShownSteps) + " more"});
      s = steps - kShownSteps;
      continue;
    }
    const ChangeCounts& c = stats.step(s);
    std::vector<std::string> row = {
        std::to_string(s) + (s <= o.warmup ? " (warmup)" : ""), files[s].path().filename().string(),
        std::to_string(c.changed_values), percent(c.element_change_rate(), 3)};
    for (ShardType t : present) row.push_back(percent(stats.step(s, t).element_change_rate(), 3));
    per_step.add(row);
  }
  out << "Exponent changes per step (O2: values whose exponent differs from the step before)\n"
      << per_step.render();
  const ChangeCounts& total = stats.total();
  out << "mean after warmup: " << percent(total.element_change_rate(), 3)
      << "% of values per step (" << total.changed_values << " of " << total.values << ")\n\n";

  // O4: by shard type.
  Table by_type(
      {"shard type", "tensors", "values", "change (%)",
       "blocks changed W=" + std::to_string(detail_w) + " B=" + std::to_string(detail_b) + " (%)",
       "shards changed W=" + std::to_string(detail_w) + " (%)"});
  const uint64_t measured_steps = steps - o.warmup;
  auto type_row = [&](const std::string& name, size_t count, const ChangeCounts& c) {
    by_type.add({name, std::to_string(count), std::to_string(c.values / measured_steps),
                 percent(c.element_change_rate(), 3),
                 percent(c.block_change_rate(detail_cell_index), 1),
                 percent(c.shard_change_rate(detail.world_index), 1)});
  };
  for (ShardType t : present)
    type_row(std::string(to_string(t)), tensors_by_type[static_cast<size_t>(t)], stats.total(t));
  type_row("all", tensors.size(), total);
  out << "By shard type, after warmup (O4)\n" << by_type.render() << "\n";

  // O3: reusable blocks and shard change rate.
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
    shards.add({std::to_string(grid.worlds[w]), std::to_string(total.shards[w] / measured_steps),
                percent(total.shard_change_rate(w), 1),
                percent(1.0 - total.shard_change_rate(w), 1)});
  }
  out << "Shard change rate after warmup (O3: shards with any changed exponent)\n"
      << shards.render();

  if (intervals.size() > 1) {
    Table by_interval({"check interval", "pairs", "change (%)"});
    for (const IntervalResult& r : intervals) {
      by_interval.add({std::to_string(r.interval),
                       std::to_string(r.counts.transitions / std::max<size_t>(1, tensors.size())),
                       percent(r.counts.element_change_rate(), 3)});
    }
    out << "\nExponents changed between checks k steps apart (Figure 5b)\n" << by_interval.render();
  }
  out << "\nanalysed in " << fixed(seconds, 2) << " s\n";
}

int run(const Options& o, const std::string& command) {
  if (!o.plot_dir.empty()) {
    throw ConfigError(
        "--plot is drawn by the Python entry point: install the package (scripts/python-env.sh) "
        "and run `ciera analyze ... --plot DIR` from it");
  }
  ChangeGrid grid{o.worlds, o.blocks};
  grid.validate();
  if (grid.worlds.empty() || grid.block_values.empty()) {
    throw ConfigError("--worlds and --blocks need at least one value");
  }
  if (o.max_interval < 1) throw ConfigError("--max-interval must be at least 1");
  Stopwatch clock;

  const std::vector<SafetensorsFile> files =
      open_checkpoint_series(list_checkpoints(o.checkpoints));
  const uint32_t steps = static_cast<uint32_t>(files.size() - 1);
  if (o.warmup >= steps) {
    throw ConfigError("--warmup " + std::to_string(o.warmup) + " leaves none of the " +
                      std::to_string(steps) + " step transitions to measure");
  }

  std::vector<std::string> skipped;
  std::vector<TensorResult> tensors;
  uint64_t work_bytes = 0;
  for (const SafetensorsTensor& t : files.front().tensors()) {
    if (!t.ciera_dtype) {
      if (!o.skip_unsupported) {
        throw FormatError(
            files.front().path().string() + ": tensor '" + t.name + "' has dtype " + t.dtype +
            ", which ciera analyze does not handle (BF16, F16, F32); pass --skip-unsupported to "
            "leave such tensors out");
      }
      skipped.push_back(t.name);
      continue;
    }
    tensors.push_back({&t, classify_parameter(t.name), ChangeCounts(grid)});
    work_bytes += t.bytes.size();
  }
  if (tensors.empty()) {
    throw FormatError(files.front().path().string() + ": no BF16, F16 or F32 tensor to analyse");
  }
  if (!skipped.empty() && !o.quiet) {
    std::cerr << "ciera analyze: skipping " << skipped.size()
              << " tensor(s) of unsupported dtype, e.g. '" << skipped.front() << "'\n";
  }

  ChangeStatistics stats(grid, o.warmup);
  std::vector<IntervalResult> intervals;
  for (uint32_t k = 1; k <= std::min(o.max_interval, steps - o.warmup); ++k) {
    intervals.push_back({k, ChangeCounts{}});
  }
  const ChangeGrid elements_only{{}, {}};

  Progress progress("analyze", work_bytes, !o.quiet);
  uint64_t done_bytes = 0;
  for (TensorResult& r : tensors) {
    const DType dtype = *r.tensor->ciera_dtype;
    for (uint32_t s = 1; s <= steps; ++s) {
      const ChangeCounts counts =
          count_exponent_changes(dtype, files[s - 1].find(r.tensor->name)->bytes,
                                 files[s].find(r.tensor->name)->bytes, grid);
      stats.add(s, r.type, counts);
      if (s > o.warmup) {
        r.total += counts;
        intervals.front().counts += counts;
      }
    }
    // Check intervals k > 1 (Figure 5b): checkpoints i and i + k, both after warmup.
    for (size_t i = 1; i < intervals.size(); ++i) {
      const uint32_t k = intervals[i].interval;
      for (uint32_t first = o.warmup; first + k <= steps; ++first) {
        intervals[i].counts +=
            count_exponent_changes(dtype, files[first].find(r.tensor->name)->bytes,
                                   files[first + k].find(r.tensor->name)->bytes, elements_only);
      }
    }
    done_bytes += r.tensor->bytes.size();
    progress.update(done_bytes, r.tensor->name);
  }
  progress.finish();
  const double seconds = clock.seconds();

  nlohmann::json j;
  j["command"] = command;
  j["checkpoints"] = nlohmann::json::array();
  for (const SafetensorsFile& f : files) j["checkpoints"].push_back(f.path().string());
  j["warmup"] = o.warmup;
  j["grid"] = {{"worlds", grid.worlds}, {"block_values", grid.block_values}};
  const DetailCell detail = detail_cell(grid);
  j["detail"] = {{"world", grid.worlds[detail.world_index]},
                 {"block_values", grid.block_values[detail.block_index]}};
  j["skipped_tensors"] = skipped;
  nlohmann::json step_list = nlohmann::json::array();
  for (uint32_t s = 1; s <= steps; ++s) {
    nlohmann::json by_type = nlohmann::json::object();
    for (size_t t = 0; t < kShardTypeCount; ++t) {
      const ChangeCounts& c = stats.step(s, static_cast<ShardType>(t));
      if (c.transitions > 0)
        by_type[std::string(to_string(static_cast<ShardType>(t)))] = counts_json(c, grid);
    }
    step_list.push_back({{"step", s},
                         {"from", files[s - 1].path().string()},
                         {"to", files[s].path().string()},
                         {"warmup", s <= o.warmup},
                         {"counts", counts_json(stats.step(s), grid)},
                         {"by_type", by_type}});
  }
  j["steps"] = step_list;
  j["total"] = counts_json(stats.total(), grid);
  nlohmann::json total_by_type = nlohmann::json::object();
  for (size_t t = 0; t < kShardTypeCount; ++t) {
    const ChangeCounts& c = stats.total(static_cast<ShardType>(t));
    if (c.transitions > 0)
      total_by_type[std::string(to_string(static_cast<ShardType>(t)))] = counts_json(c, grid);
  }
  j["by_type"] = total_by_type;
  nlohmann::json tensor_list = nlohmann::json::array();
  for (const TensorResult& r : tensors) {
    tensor_list.push_back({{"name", r.tensor->name},
                           {"type", to_string(r.type)},
                           {"dtype", r.tensor->dtype},
                           {"shape", r.tensor->shape},
                           {"counts", counts_json(r.total, grid)}});
  }
  j["tensors"] = tensor_list;
  nlohmann::json interval_list = nlohmann::json::array();
  for (const IntervalResult& r : intervals) {
    interval_list.push_back({{"interval", r.interval},
                             {"values", r.counts.values},
                             {"changed_values", r.counts.changed_values},
                             {"element_change_rate", r.counts.element_change_rate()}});
  }
  j["intervals"] = interval_list;
  j["seconds"] = seconds;

  if (!o.json_file.empty()) {
    std::ofstream out(o.json_file);
    out << j.dump() << "\n";
    if (!out) throw ConfigError("cannot write " + o.json_file);
  }
  if (o.json) {
    std::cout << j.dump() << std::endl;
  } else {
    print_report(std::cout, o, files, stats, tensors, intervals, skipped, seconds);
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
  cmd->add_option("--warmup", o->warmup, "step transitions left out of the means")
      ->capture_default_str();
  cmd->add_option("--worlds", o->worlds, "world sizes W to shard each tensor over")
      ->capture_default_str();
  cmd->add_option("--blocks", o->blocks, "block sizes B, in values")->capture_default_str();
  cmd->add_option("--max-interval", o->max_interval,
                  "also compare checkpoints up to this many steps apart (Figure 5b)")
      ->capture_default_str();
  cmd->add_flag("--skip-unsupported", o->skip_unsupported,
                "leave out tensors that are not BF16, F16 or F32");
  cmd->add_flag("--json", o->json, "print one JSON object on one line instead of the tables");
  cmd->add_option("--json-file", o->json_file, "also write the JSON object to this file");
  cmd->add_option("--plot", o->plot_dir, "PNG figures (Python entry point only)");
  cmd->add_flag("--quiet", o->quiet, "no progress output");
  cmd->callback([o, command]() { throw CommandExit(run(*o, command)); });
}

}  // namespace ciera::tools
