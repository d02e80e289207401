#include "analysis/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "analysis/json_text.hpp"
#include "ciera/error.hpp"
#include "common/text.hpp"

namespace ciera {
namespace {

// The reference implementation refuses larger headers too (safetensors MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeEntry {
  std::string_view name;
  uint32_t bits;  // per value; sub-byte types exist (F4, F6_*)
  std::optional<DType> ciera;
};

// Every dtype of the safetensors format, so that a file is validated whole even when it holds
// tensors CIERA does not analyse.
constexpr DTypeEntry kDTypes[] = {
    {"BOOL", 8, std::nullopt},    {"U8", 8, std::nullopt},      {"I8", 8, std::nullopt},
    {"F8_E5M2", 8, std::nullopt}, {"F8_E4M3", 8, std::nullopt}, {"F8_E8M0", 8, std::nullopt},
    {"F4", 4, std::nullopt},      {"F6_E2M3", 6, std::nullopt}, {"F6_E3M2", 6, std::nullopt},
    {"I16", 16, std::nullopt},    {"U16", 16, std::nullopt},    {"F16", 16, DType::kFP16},
    {"BF16", 16, DType::kBF16},   {"I32", 32, std::nullopt},    {"U32", 32, std::nullopt},
    {"F32", 32, DType::kFP32},    {"F64", 64, std::nullopt},    {"I64", 64, std::nullopt},
    {"U64", 64, std::nullopt},    {"C64", 64, std::nullopt},
};

const DTypeEntry* find_dtype(std::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

class HeaderError {
 public:
  explicit HeaderError(const std::filesystem::path& path) : prefix_(path.string() + ": ") {}
  [[noreturn]] void file(const std::string& what) const { throw FormatError(prefix_ + what); }
  [[noreturn]] void tensor(const std::string& name, const std::string& what) const {
    throw FormatError(prefix_ + "tensor '" + name + "': " + what);
  }

 private:
  std::string prefix_;
};

std::string describe(const nlohmann::json& value) { return json_excerpt(value, 60); }

SafetensorsTensor parse_entry(const HeaderError& error, const std::string& name,
                              const nlohmann::json& entry, uint64_t data_bytes, uint64_t& begin,
                              uint64_t& end) {
  if (!entry.is_object()) error.tensor(name, "entry is " + describe(entry) + ", not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) error.tensor(name, std::string("entry has no \"") + key + "\"");
  }
  SafetensorsTensor tensor;
  tensor.name = name;
  const nlohmann::json& dtype = entry["dtype"];
  if (!dtype.is_string()) error.tensor(name, "dtype " + describe(dtype) + " is not a string");
  tensor.dtype = dtype.get<std::string>();
  const DTypeEntry* known = find_dtype(tensor.dtype);
  if (known == nullptr) error.tensor(name, "unknown dtype \"" + tensor.dtype + "\"");
  tensor.ciera_dtype = known->ciera;

  const nlohmann::json& shape = entry["shape"];
  if (!shape.is_array()) error.tensor(name, "shape " + describe(shape) + " is not an array");
  uint64_t values = 1;
  for (const nlohmann::json& dim : shape) {
    if (!dim.is_number_unsigned()) {
      error.tensor(name,
                   "shape " + describe(shape) + " has an entry that is not a non-negative integer");
    }
    const uint64_t d = dim.get<uint64_t>();
    if (__builtin_mul_overflow(values, d, &values))
      error.tensor(name, "shape " + describe(shape) + " overflows");
    tensor.shape.push_back(d);
  }
  tensor.num_values = values;

  const nlohmann::json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    error.tensor(name,
                 "data_offsets " + describe(offsets) + " is not a pair of non-negative integers");
  }
  begin = offsets[0].get<uint64_t>();
  end = offsets[1].get<uint64_t>();
  if (begin > end) {
    error.tensor(name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                           "] end before they begin");
  }
  if (end > data_bytes) {
    error.tensor(name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                           "] reach past the " + std::to_string(data_bytes) +
                           " bytes of data (truncated file?)");
  }
  uint64_t bits = 0;
  if (__builtin_mul_overflow(values, uint64_t{known->bits}, &bits) || bits % 8 != 0 ||
      bits / 8 != end - begin) {
    error.tensor(name, "shape " + describe(shape) + " of " + tensor.dtype + " needs " +
                           (bits % 8 == 0 ? std::to_string(bits / 8) + " bytes"
                                          : "a fractional byte count") +
                           " but data_offsets [" + std::to_string(begin) + ", " +
                           std::to_string(end) + "] hold " + std::to_string(end - begin));
  }
  return tensor;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  const HeaderError error(path);
  // Closed on every way out of here: the mapping keeps the file open.
  struct Descriptor {
    int fd;
    ~Descriptor() {
      if (fd >= 0) ::close(fd);
    }
  } const file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) error.file(std::string("cannot open: ") + std::strerror(errno));
  struct stat info {};
  if (::fstat(file.fd, &info) != 0) error.file(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) error.file("not a regular file");
  const uint64_t file_bytes = static_cast<uint64_t>(info.st_size);
  if (file_bytes < 8) {
    error.file("is " + std::to_string(file_bytes) +
               " bytes, shorter than the 8-byte header length (truncated?)");
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (mapping == MAP_FAILED) error.file(std::string("cannot map: ") + std::strerror(errno));
  mapping_ = mapping;
  mapping_bytes_ = file_bytes;

  try {
    const auto* bytes = static_cast<const std::byte*>(mapping_);
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i)
      header_bytes = (header_bytes << 8) | std::to_integer<uint64_t>(bytes[i]);
    if (header_bytes > file_bytes - 8) {
      error.file("header length " + std::to_string(header_bytes) + " exceeds the " +
                 std::to_string(file_bytes - 8) +
                 " bytes after it (truncated, or not a safetensors file?)");
    }
    if (header_bytes > kMaxHeaderBytes) {
      error.file("header length " + std::to_string(header_bytes) +
                 " exceeds the format's limit of " + std::to_string(kMaxHeaderBytes) + " bytes");
    }
    const auto* header = reinterpret_cast<const char*>(bytes + 8);
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(header, header + header_bytes);
    } catch (const nlohmann::json::exception& e) {
      error.file(std::string("header is not valid JSON: ") + e.what());
    }
    if (!json.is_object()) error.file("header is " + describe(json) + ", not a JSON object");

    const uint64_t data_offset = 8 + header_bytes;
    const uint64_t data_bytes = file_bytes - data_offset;
    struct Range {
      uint64_t begin, end;
      size_t tensor;
    };
    std::vector<Range> ranges;
    for (const auto& [name, entry] : json.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object())
          error.file("__metadata__ is " + describe(entry) + ", not an object");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string())
            error.file("__metadata__ \"" + key + "\" is " + describe(value) + ", not a string");
          metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      uint64_t begin = 0, end = 0;
      tensors_.push_back(parse_entry(error, name, entry, data_bytes, begin, end));
      tensors_.back().bytes = {bytes + data_offset + begin, static_cast<size_t>(end - begin)};
      ranges.push_back({begin, end, tensors_.size() - 1});
    }

    // The format requires the tensors to tile the data exactly: no overlap, no hole.
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t covered = 0;
    const SafetensorsTensor* previous = nullptr;
    for (const Range& r : ranges) {
      const SafetensorsTensor& t = tensors_[r.tensor];
      if (r.begin < covered) {
        error.tensor(t.name, "data [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                 ") overlaps tensor '" + previous->name + "' (which ends at " +
                                 std::to_string(covered) + ")");
      }
      if (r.begin > covered) {
        error.tensor(t.name, "data starts at " + std::to_string(r.begin) +
                                 " but the tensors before it end at " + std::to_string(covered) +
                                 ": the format allows no holes");
      }
      covered = r.end;
      previous = &t;
    }
    if (covered != data_bytes) {
      error.file(std::to_string(data_bytes - covered) +
                 " bytes after the last tensor's data belong to no tensor");
    }
    std::sort(
        tensors_.begin(), tensors_.end(),
        [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
    // Names, shapes and metadata are copied out: a series of checkpoints need not keep every
    // header (up to 100 MB each) resident.
    release({bytes, static_cast<size_t>(data_offset)});
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

void SafetensorsFile::unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
}

void SafetensorsFile::release(std::span<const std::byte> bytes) const {
  if (bytes.empty()) return;
  [[maybe_unused]] const auto* mapping = static_cast<const std::byte*>(mapping_);
  assert(bytes.data() >= mapping && bytes.data() + bytes.size() <= mapping + mapping_bytes_);
  static const uintptr_t page_bytes = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) / page_bytes * page_bytes;
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data() + bytes.size());
  // The mapping is private and read-only, so no page of it was ever copied on write: dropping
  // one loses nothing, the next read faults the file's bytes in again. The pages are rounded
  // outward (the mapping starts on a page, and the kernel rounds the length up inside the
  // mapping's last page). Advice only: where it fails the pages stay resident, nothing worse.
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it =
      std::lower_bound(tensors_.begin(), tensors_.end(), name,
                       [](const SafetensorsTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

}  // namespace ciera
