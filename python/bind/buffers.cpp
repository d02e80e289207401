#include <string>

#include "bind.hpp"

namespace ciera::python {

HostBuffer::HostBuffer(py::handle object, bool writable, const char* what) {
  if (PyObject_CheckBuffer(object.ptr())) {
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      throw py::value_error(
          std::string(what) + " must be a C-contiguous" + (writable ? ", writable" : "") +
          " buffer (" + std::string(py::str(py::type::of(object).attr("__name__"))) + " is not)");
    }
    have_view_ = true;
    data_ = static_cast<std::byte*>(view_.buf);
    size_ = static_cast<size_t>(view_.len);
    return;
  }
  // A torch.Tensor, by duck typing: its memory is on the host only on the CPU device.
  if (py::hasattr(object, "data_ptr") && py::hasattr(object, "element_size") &&
      py::hasattr(object, "numel")) {
    if (py::hasattr(object, "device") &&
        std::string(py::str(object.attr("device").attr("type"))) != "cpu") {
      throw py::value_error(std::string(what) + " must be in host memory (a CPU tensor)");
    }
    if (py::hasattr(object, "is_contiguous") && !object.attr("is_contiguous")().cast<bool>()) {
      throw py::value_error(std::string(what) + " must be a contiguous tensor");
    }
    data_ = reinterpret_cast<std::byte*>(object.attr("data_ptr")().cast<uintptr_t>());
    size_ = object.attr("numel")().cast<size_t>() * object.attr("element_size")().cast<size_t>();
    return;
  }
  throw py::type_error(std::string(what) +
                       " must be a buffer (bytes, bytearray, NumPy array) or a CPU tensor, not " +
                       std::string(py::str(py::type::of(object).attr("__name__"))));
}

HostBuffer::~HostBuffer() {
  if (have_view_) PyBuffer_Release(&view_);
}

}  // namespace ciera::python
