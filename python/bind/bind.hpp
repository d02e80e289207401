// The Python extension ciera._ext, one bind function per area of the C++ API. The binding only
// marshals: C++ structs become classes with read-only properties, memory crosses as the buffer
// protocol or as a data pointer and a byte count (torch tensors are read through data_ptr(), so
// the extension never links libtorch), every call that moves or codes data releases the GIL, and
// C++ errors become Python exceptions (ciera.FormatError, ConfigError, CommError).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>

#include "ciera/dtype.hpp"

namespace ciera::python {

namespace py = pybind11;

void bind_errors(py::module_& m);     // errors.cpp: the exception classes
void bind_config(py::module_& m);     // config.cpp: dtypes, policies, CodecConfig, EngineConfig
void bind_codec(py::module_& m);      // codec.cpp: ShardEncoder, ShardDecoder, stateless coding
void bind_transport(py::module_& m);  // transport.cpp: loopback, Python callables, Open MPI
void bind_engine(py::module_& m);     // engine.cpp: BucketLayout, GatherStats, Engine
void bind_selection(py::module_& m);  // selection.cpp: cost model, change monitor, selector
void bind_analysis(py::module_& m);   // analysis.cpp: shard types, exponent-change statistics
void bind_collectives(py::module_& m);  // collectives.cpp: lossless reduce-scatter and alltoallv

// `bytes` bytes of memory at `address` (a data pointer from Python, e.g. Tensor.data_ptr(), that
// the argument `what` gave). A null address with bytes to read is a ValueError: nothing checks
// the memory behind an integer, but address 0 is certainly not memory (an unallocated tensor, a
// DTensor's data_ptr()).
template <typename T>
std::span<T> bytes_at(uintptr_t address, uint64_t bytes, const char* what) {
  if (address == 0 && bytes != 0) {
    throw pybind11::value_error(std::string(what) + " is a null pointer (0) for " +
                                std::to_string(bytes) + " bytes");
  }
  return {reinterpret_cast<T*>(address), static_cast<size_t>(bytes)};
}

// One thread at a time in the calls on `object` that hold this, for classes bound as they are
// (no busy flag of their own): a call releases the GIL while it works, so a second thread could
// otherwise enter and race on the object's state (a ChangeMonitor's swap of its buffers tore
// them: a crash, a double free). The second call is a RuntimeError naming `what`, nothing done.
class InUse {
 public:
  InUse(const void* object, const char* what) : object_(object) {
    std::lock_guard lock(mutex());
    if (!objects().insert(object).second) {
      throw std::runtime_error(std::string(what) + " is in use by another thread");
    }
  }
  ~InUse() {
    std::lock_guard lock(mutex());
    objects().erase(object_);
  }
  InUse(const InUse&) = delete;
  InUse& operator=(const InUse&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_set<const void*>& objects() {
    static std::unordered_set<const void*> in_use;
    return in_use;
  }
  const void* object_;
};

// The memory of a Python object, held for as long as this lives: anything with the buffer
// protocol (bytes, bytearray, memoryview, NumPy arrays), which must be C-contiguous; or a CPU
// torch.Tensor (any object with data_ptr(), numel(), element_size() and is_contiguous()),
// which must be contiguous and, if `writable`, not require grad (autograd cannot record what
// CIERA writes). Throws ValueError/TypeError naming `what` otherwise. Destroyed with the GIL held.
class HostBuffer {
 public:
  HostBuffer(py::handle object, bool writable, const char* what);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  std::span<std::byte> writable_bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }

  // ConfigError naming `what` if the buffer's own element type (a tensor's dtype, a buffer's
  // format) is not `dtype`: a floating type other than `dtype`, or elements of another size.
  // Untyped bytes and same-sized integers (uint16 views of BF16 values) pass where the values
  // are only moved. Where they are added (`added`: a reduction), a torch tensor must be of
  // `dtype` itself: torch has every dtype CIERA adds, so an integer or bool tensor there is a
  // mistake whose bits would be summed as floats. (NumPy has no bfloat16: its same-sized
  // integers still pass, as the values' bits.)
  void check_elements(DType dtype, const char* what, bool added = false) const;

 private:
  // What the object says its elements are; bytes with no type say nothing.
  struct Elements {
    std::string name;            // "torch.float32", "float16", ...; empty for untyped bytes
    size_t bytes = 1;            // bytes per element
    bool floating = false;       // a floating (or complex) type
    std::optional<DType> dtype;  // the CIERA dtype it is, if any
  };
  static Elements elements_of(const Py_buffer& view);

  Py_buffer view_{};
  bool have_view_ = false;
  // A writable torch tensor: its version counter is bumped when this is released, as torch's own
  // in-place operations do, since its memory is written behind autograd's back (a saved tensor
  // then fails backward() instead of giving a wrong gradient).
  py::object written_tensor_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Elements elements_;
};

// A collective call's arguments, checked on one rank: `check()` builds and checks them here; if
// it throws, this rank still takes part in the call, by `refuse(reason)` (the library's refusal:
// every rank's call fails at once, naming this rank; called with the GIL held, it releases it),
// and then raises the argument's own error. Thrown here alone, the error would leave the peers
// waiting for this rank until the timeout.
template <typename Check, typename Refuse>
void check_on_every_rank(Check&& check, Refuse&& refuse) {
  try {
    check();
  } catch (const std::exception& e) {
    const std::string reason = e.what();
    try {
      refuse(reason);
    } catch (const std::exception&) {
      // The refusal as this rank's library raised it: the argument's error says more.
    }
    throw;
  }
}

}  // namespace ciera::python
