// A training run's checkpoints, in order, for `ciera analyze` (docs/analysis.md). Part of the
// ciera_analysis target.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "analysis/safetensors.hpp"
#include "ciera/analysis.hpp"

namespace ciera {

// The step number in a checkpoint's file name: its last run of digits ("step_00120" -> 120).
std::optional<uint64_t> checkpoint_step_number(const std::filesystem::path& file);

// Checkpoint files in training order: files as given, each directory replaced by its
// *.safetensors files ordered by step number. Throws ConfigError for a directory that cannot be
// ordered (a name without a step number, two files of one step, a sharded checkpoint's parts),
// for a checkpoint given twice, and for fewer than two checkpoints in all.
std::vector<std::filesystem::path> list_checkpoints(const std::vector<std::string>& arguments);

// The training step of each checkpoint, from the step numbers in their names, when every name
// holds one and they increase in the order given; nullopt when the names do not number the steps
// (a name without a number, or two with the same one): the checkpoints are then taken as
// consecutive steps. Throws ConfigError for distinct numbers out of order, as a shell glob gives
// them (step_100 sorts before step_20): counting step 100 -> 20 would be silently wrong.
std::optional<std::vector<uint64_t>> checkpoint_steps(
    const std::vector<std::filesystem::path>& files);

// Opens (memory-maps) every checkpoint and checks that each holds exactly the tensors of the
// first, with the same dtypes and shapes. With `only_ciera_dtypes`, tensors of a dtype CIERA does
// not carry (I64, F64, ...) are left out of that check, in every checkpoint: they are not
// compared, so one may be missing or added. Throws FormatError naming the checkpoint and tensor.
std::vector<SafetensorsFile> open_checkpoint_series(const std::vector<std::filesystem::path>& paths,
                                                    bool only_ciera_dtypes = false);

// One tensor compared between two checkpoints of a series (indices into it); `counter` is made
// for the tensor's dtype and size, with the grid wanted.
struct TensorComparison {
  size_t before;
  size_t after;
  ChunkedChangeCounter counter;
};

// Runs every comparison of tensor `name` over the series `files`, window by window: the values
// [v, v + window_values) of each checkpoint are compared for all the comparisons at once, then
// released (SafetensorsFile::release), so resident memory stays near (checkpoints in the
// comparisons) x (window) whatever the size of the tensor, and a caller can report progress
// inside it. `after_window(values_done)` is called after each window. Throws ConfigError for a
// window of no values, a checkpoint index outside the series, or a tensor that is missing or does
// not match a counter's dtype and size.
void compare_in_windows(const std::vector<SafetensorsFile>& files, std::string_view name,
                        std::vector<TensorComparison>& comparisons, uint64_t window_values,
                        const std::function<void(uint64_t values_done)>& after_window = {});

}  // namespace ciera
