#include <string>
#include <string_view>

#include "bind.hpp"
#include "ciera/error.hpp"

namespace ciera::python {
namespace {

std::string type_name(py::handle object) {
  return std::string(py::str(py::type::of(object).attr("__name__")));
}

// A torch.distributed DTensor (FSDP2's parameters are), found by name so that the extension
// needs no torch: its data_ptr() is 0 and its numel() counts every rank's shard.
bool is_dtensor(py::handle object) {
  for (py::handle base : py::type::of(object).attr("__mro__")) {
    if (std::string(py::str(base.attr("__name__"))) == "DTensor") return true;
  }
  return false;
}

// The CIERA dtype that a torch dtype (by name) is, if any.
std::optional<DType> dtype_of_torch(const std::string& name) {
  if (name == "torch.bfloat16") return DType::kBF16;
  if (name == "torch.float16") return DType::kFP16;
  if (name == "torch.float32") return DType::kFP32;
  return std::nullopt;
}

}  // namespace

// The buffer's format in the struct module's codes, after its byte-order mark: e, f and d are
// IEEE floats, g a long double, Z... a complex; anything else counts by its size only.
HostBuffer::Elements HostBuffer::elements_of(const Py_buffer& view) {
  std::string code = view.format ? view.format : "B";
  const bool big_endian = code.starts_with('>') || code.starts_with('!');
  if (!code.empty() && std::string_view("@=<>!").find(code[0]) != std::string_view::npos)
    code.erase(0, 1);
  Elements elements;
  elements.bytes = static_cast<size_t>(view.itemsize);
  const std::string order = big_endian ? "big-endian " : "";
  if (code == "e" || code == "f" || code == "d") {
    elements.name = order + (code == "e" ? "float16" : code == "f" ? "float32" : "float64");
    elements.floating = true;
    if (!big_endian && code == "e") elements.dtype = DType::kFP16;
    if (!big_endian && code == "f") elements.dtype = DType::kFP32;
  } else if (code == "g" || code.starts_with('Z')) {
    elements.name = "'" + code + "'";
    elements.floating = true;
  } else if (elements.bytes != 1) {
    elements.name = std::to_string(elements.bytes) + "-byte '" + code + "'";
  }
  return elements;
}

HostBuffer::HostBuffer(py::handle object, bool writable, const char* what) {
  if (PyObject_CheckBuffer(object.ptr())) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      throw py::value_error(std::string(what) + " must be a C-contiguous" +
                            (writable ? ", writable" : "") + " buffer (" + type_name(object) +
                            " is not)");
    }
    have_view_ = true;
    data_ = static_cast<std::byte*>(view_.buf);
    size_ = static_cast<size_t>(view_.len);
    elements_ = elements_of(view_);
  } else if (py::hasattr(object, "data_ptr") && py::hasattr(object, "element_size") &&
             py::hasattr(object, "numel")) {
    // A torch.Tensor, by duck typing: its memory is on the host only on the CPU device.
    if (is_dtensor(object)) {
      throw py::type_error(std::string(what) +
                           " is a DTensor (a sharded tensor, e.g. an FSDP2 parameter), which has "
                           "no memory of its own here: pass its local shard, .to_local()");
    }
    if (py::hasattr(object, "device") &&
        std::string(py::str(object.attr("device").attr("type"))) != "cpu") {
      throw py::value_error(std::string(what) + " must be in host memory (a CPU tensor)");
    }
    if (py::hasattr(object, "is_contiguous") && !object.attr("is_contiguous")().cast<bool>()) {
      throw py::value_error(std::string(what) + " must be a contiguous tensor");
    }
    if (writable && py::getattr(object, "requires_grad", py::bool_(false)).cast<bool>()) {
      throw py::value_error(std::string(what) +
                            " requires grad: CIERA writes it in place, which autograd cannot "
                            "record (pass one that does not, e.g. made under torch.no_grad())");
    }
    if (writable) written_tensor_ = py::reinterpret_borrow<py::object>(object);
    data_ = reinterpret_cast<std::byte*>(object.attr("data_ptr")().cast<uintptr_t>());
    elements_.bytes = object.attr("element_size")().cast<size_t>();
    size_ = object.attr("numel")().cast<size_t>() * elements_.bytes;
    if (py::hasattr(object, "dtype")) {
      const py::object dtype = object.attr("dtype");
      elements_.name = std::string(py::str(dtype));
      elements_.floating = py::getattr(dtype, "is_floating_point", py::bool_(false)).cast<bool>() ||
                           py::getattr(dtype, "is_complex", py::bool_(false)).cast<bool>();
      elements_.dtype = dtype_of_torch(elements_.name);
    }
  } else {
    throw py::type_error(std::string(what) +
                         " must be a buffer (bytes, bytearray, NumPy array) or a CPU tensor, not " +
                         type_name(object));
  }
  if (data_ == nullptr && size_ != 0) {
    if (have_view_) PyBuffer_Release(&view_);  // the destructor does not run for a throw here
    throw py::value_error(std::string(what) + " has no memory: a null data pointer for " +
                          std::to_string(size_) + " bytes");
  }
}

HostBuffer::~HostBuffer() {
  if (have_view_) PyBuffer_Release(&view_);
  if (written_tensor_) {
    try {
      py::module_::import("torch.autograd.graph").attr("increment_version")(written_tensor_);
    } catch (const py::error_already_set&) {  // a torch without it: nothing to bump
    }
  }
}

void HostBuffer::check_elements(DType dtype, const char* what, bool added) const {
  const bool other_float = elements_.floating && elements_.dtype != dtype;
  const bool other_size = elements_.bytes != 1 && elements_.bytes != dtype_info(dtype).value_bytes;
  const bool other_tensor =
      added && elements_.name.starts_with("torch.") && elements_.dtype != dtype;
  if (other_float || other_size || other_tensor) {
    throw ConfigError(std::string(what) + " holds " + elements_.name + " values, but dtype is " +
                      std::string(dtype_name(dtype)));
  }
}

}  // namespace ciera::python
