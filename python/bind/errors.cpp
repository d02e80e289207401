#include "bind.hpp"
#include "ciera/error.hpp"
#include "ciera/transport.hpp"

namespace ciera::python {

void bind_errors(py::module_& m) {
  // ciera.Error derives from RuntimeError; the message names the problem (a FormatError says
  // what is wrong with the payload, and the decoder it came from is unchanged and usable).
  auto base = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<FormatError>(m, "FormatError", base.ptr());
  py::register_exception<ConfigError>(m, "ConfigError", base.ptr());
  py::register_exception<CommError>(m, "CommError", base.ptr());
}

}  // namespace ciera::python
