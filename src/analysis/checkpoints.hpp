// A training run's checkpoints, in order, for `ciera analyze` (docs/analysis.md). Part of the
// ciera_analysis target.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "analysis/safetensors.hpp"

namespace ciera {

// The step number in a checkpoint's file name: its last run of digits ("step_00120" -> 120).
std::optional<uint64_t> checkpoint_step_number(const std::filesystem::path& file);

// Checkpoint files in training order: files as given, each directory replaced by its
// *.safetensors files ordered by step number. Throws ConfigError for a directory that cannot be
// ordered (a name without a step number, two files of one step, a sharded checkpoint's parts),
// for a checkpoint given twice, and for fewer than two checkpoints in all.
std::vector<std::filesystem::path> list_checkpoints(const std::vector<std::string>& arguments);

// Opens (memory-maps) every checkpoint and checks that each holds exactly the tensors of the
// first, with the same dtypes and shapes. Throws FormatError naming the checkpoint and tensor.
std::vector<SafetensorsFile> open_checkpoint_series(
    const std::vector<std::filesystem::path>& paths);

}  // namespace ciera
