// LosslessCollectives: the compressed reduce-scatter and alltoallv (include/ciera/collectives.hpp).
// Buffers cross as the buffer protocol or CPU tensors (HostBuffer); each call releases the GIL.
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bind.hpp"
#include "ciera/collectives.hpp"
#include "ciera/error.hpp"

namespace ciera::python {
namespace {

// A call's input and output, held for the call: buffers of `dtype` values (`adds`: a reduction's,
// see HostBuffer::check_elements). Where this rank cannot pass them (not a buffer, a DTensor,
// another dtype, an output that requires grad), `refuse` (a LosslessCollectives::refuse_*
// method) fails the call on every rank, and this rank raises why (check_on_every_rank).
// `more()`: the call's other checks, covered alike.
struct CallBuffers {
  std::optional<HostBuffer> input, output;

  CallBuffers(LosslessCollectives& self, void (LosslessCollectives::*refuse)(const std::string&),
              const std::string& call, py::handle in, py::handle out, DType dtype, bool adds,
              const std::function<void()>& more = {}) {
    check_on_every_rank(
        [&] {
          input.emplace(in, false, (call + " input").c_str());
          output.emplace(out, true, (call + " output").c_str());
          input->check_elements(dtype, (call + " input").c_str(), adds);
          output->check_elements(dtype, (call + " output").c_str(), adds);
          if (more) more();
        },
        [&](const std::string& reason) {
          py::gil_scoped_release release;
          (self.*refuse)(reason);
        });
  }
};

// A sequence of value counts (a list, a tuple, a NumPy array of integers): ValueError naming
// `what` for an item that is not a whole number in 0..2^64 - 1 (a negative count from one rank's
// routing), where pybind11's conversion would raise a TypeError on this rank alone.
std::vector<uint64_t> counts_of(py::handle counts, const char* what) {
  if (!py::hasattr(counts, "__iter__")) {
    throw py::type_error(std::string(what) + " must be a sequence of counts, not " +
                         std::string(py::str(py::type::of(counts).attr("__name__"))));
  }
  std::vector<uint64_t> out;
  for (py::handle item : counts) {
    const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(item.ptr()));
    if (!index) {
      PyErr_Clear();
      throw py::type_error(std::string(what) + " holds " + std::string(py::repr(item)) +
                           ", not a whole number");
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow < 0 || (overflow == 0 && value < 0)) {
      throw py::value_error(std::string(what) + " holds " + std::string(py::repr(item)) +
                            ": a count must be >= 0");
    }
    const unsigned long long count = PyLong_AsUnsignedLongLong(index.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error(std::string(what) + " holds " + std::string(py::repr(item)) +
                            ", more than 2^64 - 1");
    }
    out.push_back(count);
  }
  return out;
}

}  // namespace

void bind_collectives(py::module_& m) {
  py::enum_<ReduceOp>(m, "ReduceOp").value("sum", ReduceOp::kSum).value("avg", ReduceOp::kAvg);
  py::enum_<CollectiveCoding>(m, "CollectiveCoding")
      .value("raw", CollectiveCoding::kRaw)
      .value("exponent", CollectiveCoding::kExponent)
      .value("auto", CollectiveCoding::kAuto);
  m.def("parse_collective_coding",
        [](const std::string& name) { return parse_collective_coding(name); });

  py::class_<CollectivesConfig>(m, "CollectivesConfig")
      .def(py::init<>())
      .def_readwrite("coding", &CollectivesConfig::coding)
      .def_readwrite("content_checksum", &CollectivesConfig::content_checksum)
      .def_readwrite("block_values", &CollectivesConfig::block_values)
      .def_readwrite("slice_values", &CollectivesConfig::slice_values)
      .def_readwrite("frame_values", &CollectivesConfig::frame_values)
      .def_readwrite("worker_threads", &CollectivesConfig::worker_threads)
      .def_readwrite("worker_niceness", &CollectivesConfig::worker_niceness)
      .def("validate", &CollectivesConfig::validate);

  py::class_<CollectiveStats>(m, "CollectiveStats")
      .def_readonly("raw_bytes", &CollectiveStats::raw_bytes)
      .def_readonly("wire_bytes", &CollectiveStats::wire_bytes)
      .def_readonly("control_bytes", &CollectiveStats::control_bytes)
      .def_readonly("coded_slices", &CollectiveStats::coded_slices)
      .def_readonly("compressed", &CollectiveStats::compressed)
      .def_readonly("coded_values", &CollectiveStats::coded_values)
      .def_readonly("coded_exponent_bytes", &CollectiveStats::coded_exponent_bytes)
      .def_readonly("exponent_entropy_bits", &CollectiveStats::exponent_entropy_bits)
      .def_readonly("encode_s", &CollectiveStats::encode_s)
      .def_readonly("exchange_s", &CollectiveStats::exchange_s)
      .def_readonly("decode_s", &CollectiveStats::decode_s)
      .def_readonly("reduce_s", &CollectiveStats::reduce_s)
      .def_readonly("arrival_wait_s", &CollectiveStats::arrival_wait_s)
      .def_readonly("busiest_link_raw_bytes", &CollectiveStats::busiest_link_raw_bytes)
      .def_readonly("busiest_link_wire_bytes", &CollectiveStats::busiest_link_wire_bytes);

  py::class_<LosslessCollectives>(m, "LosslessCollectives")
      .def(py::init([](std::shared_ptr<Transport> transport, const CollectivesConfig& config) {
             return std::make_unique<LosslessCollectives>(std::move(transport), config);
           }),
           py::arg("transport"), py::arg("config") = CollectivesConfig{})
      .def_property_readonly("rank", &LosslessCollectives::rank)
      .def_property_readonly("size", &LosslessCollectives::size)
      .def(
          "reduce_scatter",
          [](LosslessCollectives& self, DType dtype, ReduceOp op, py::handle in, py::handle out) {
            const CallBuffers buffers(self, &LosslessCollectives::refuse_reduce_scatter,
                                      "reduce_scatter", in, out, dtype, /*adds=*/true);
            py::gil_scoped_release release;
            return self.reduce_scatter(dtype, op, buffers.input->bytes(),
                                       buffers.output->writable_bytes());
          },
          py::arg("dtype"), py::arg("op"), py::arg("input"), py::arg("output"),
          "output (on rank r) = the rank-order sum (or average) of every rank's part r of input. "
          "Arguments this rank cannot pass (not a buffer, a DTensor, a tensor of another dtype, "
          "an output that requires grad) fail the call on every rank. A tensor output's version "
          "counter is bumped, as by an in-place op. One thread at a time per object.")
      .def(
          "alltoallv",
          [](LosslessCollectives& self, DType dtype, py::handle in, py::handle send_counts,
             py::handle out, py::handle recv_counts) {
            std::vector<uint64_t> send_values, recv_values;
            const CallBuffers buffers(self, &LosslessCollectives::refuse_alltoallv, "alltoallv", in,
                                      out, dtype, /*adds=*/false, [&] {
                                        send_values = counts_of(send_counts, "send_values");
                                        recv_values = counts_of(recv_counts, "recv_values");
                                      });
            py::gil_scoped_release release;
            return self.alltoallv(dtype, buffers.input->bytes(), send_values,
                                  buffers.output->writable_bytes(), recv_values);
          },
          py::arg("dtype"), py::arg("input"), py::arg("send_values"), py::arg("output"),
          py::arg("recv_values"))
      .def(
          "refuse_reduce_scatter",
          [](LosslessCollectives& self, const std::string& reason) {
            py::gil_scoped_release release;
            self.refuse_reduce_scatter(reason);
          },
          py::arg("reason"),
          "Takes part in the next reduce_scatter only to refuse it: raises ConfigError with "
          "`reason` here, and on every other rank an error naming this one.")
      .def(
          "refuse_alltoallv",
          [](LosslessCollectives& self, const std::string& reason) {
            py::gil_scoped_release release;
            self.refuse_alltoallv(reason);
          },
          py::arg("reason"), "As refuse_reduce_scatter, for the next alltoallv.")
      .def(
          "pass_through_reduce_scatter",
          [](LosslessCollectives& self, const std::string& reason) {
            py::gil_scoped_release release;
            self.pass_through_reduce_scatter(reason);
          },
          py::arg("reason"),
          "Takes part in the next reduce_scatter only to leave it to the caller's own "
          "reduce-scatter (`reason`: why). Returns once every rank has done the same (one record "
          "exchanged); where some ranks ran the call instead, raises ConfigError on every rank "
          "naming both sides and the reasons.");
}

}  // namespace ciera::python
