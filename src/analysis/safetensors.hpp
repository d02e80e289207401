// A read-only, memory-mapped safetensors file (https://github.com/huggingface/safetensors,
// "Format"): an 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
// Part of the ciera_analysis target (it needs nlohmann_json; the core library does not).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ciera/dtype.hpp"

namespace ciera {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;                 // as written in the file: "BF16", "F32", "I64", ...
  std::optional<DType> ciera_dtype;  // BF16, F16 or F32; empty for dtypes CIERA does not carry
  std::vector<uint64_t> shape;
  uint64_t num_values = 0;
  std::span<const std::byte> bytes;  // inside the mapping
};

class SafetensorsFile {
 public:
  // Maps the file and validates the whole header: length, JSON, every entry's dtype, shape and
  // data_offsets (inside the data, no overlap, no hole, size = product(shape) * dtype size).
  // Throws FormatError naming the file and, where one is at fault, the tensor.
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when absent.
  const SafetensorsTensor* find(std::string_view name) const;
  // Drops the pages holding `bytes` (a range inside this file, such as a tensor's bytes or a
  // window of them) from the process's resident memory, so that reading a series of checkpoints
  // larger than memory keeps only what is in use mapped. The data stays readable: a later read
  // maps it in again from the file. Whole pages go, so a neighbour's bytes on the pages at either
  // end may need mapping in again too.
  void release(std::span<const std::byte> bytes) const;

 private:
  void unmap();

  std::filesystem::path path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace ciera
