// Transports Python can hand to the engine: loopback threads (tests), Python callables (e.g.
// torch.distributed on the process group a training job already uses) and Open MPI.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bind.hpp"
#include "ciera/loopback.hpp"
#include "ciera/transport.hpp"
#if defined(CIERA_WITH_MPI)
#include "ciera/mpi.hpp"
#endif

namespace ciera::python {
namespace {

// A Transport whose collectives are Python callables. Called from the engine's communication
// thread, so each call takes the GIL; the callables receive writable memoryviews over CIERA's
// buffers.
class PythonTransport final : public Transport {
 public:
  PythonTransport(int rank, int size, py::object allgather, py::object allgatherv,
                  py::object barrier, std::string name)
      : rank_(rank),
        size_(size),
        allgather_(std::move(allgather)),
        allgatherv_(std::move(allgatherv)),
        barrier_(std::move(barrier)),
        name_(std::move(name)) {}
  ~PythonTransport() override {
    py::gil_scoped_acquire gil;
    allgather_ = py::object();
    allgatherv_ = py::object();
    barrier_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return name_; }

  void allgather(const void* in, size_t bytes, void* out) override {
    call("allgather", [&] { allgather_(view(in, bytes, true), view(out, bytes * size_, false)); });
  }

  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    uint64_t total = 0;
    for (int r = 0; r < size_; ++r) total = std::max(total, displs[r] + counts[r]);
    call("allgatherv", [&] {
      allgatherv_(view(in, counts[rank_], true), view(out, total, false),
                  std::vector<uint64_t>(counts.begin(), counts.end()),
                  std::vector<uint64_t>(displs.begin(), displs.end()));
    });
  }

  void barrier() override {
    call("barrier", [&] { barrier_(); });
  }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  static py::memoryview view(const void* data, uint64_t bytes, bool readonly) {
    return py::memoryview::from_memory(const_cast<void*>(data), static_cast<ssize_t>(bytes),
                                       readonly);
  }

  template <typename F>
  void call(const char* what, F&& body) {
    py::gil_scoped_acquire gil;
    try {
      body();
    } catch (py::error_already_set& e) {
      throw CommError(name_ + " " + what + " failed on rank " + std::to_string(rank_) + ": " +
                      e.what());
    }
  }

  int rank_;
  int size_;
  py::object allgather_, allgatherv_, barrier_;
  std::string name_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(120)};
};

// LoopbackWorld is opaque in the C++ API; Python holds it through this handle.
struct PyLoopbackWorld {
  std::shared_ptr<LoopbackWorld> world;
};

}  // namespace

void bind_transport(py::module_& m) {
  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("size", &Transport::size)
      .def_property_readonly("name", [](const Transport& t) { return std::string(t.name()); });

  py::class_<PyLoopbackWorld>(m, "LoopbackWorld");
  m.def(
      "loopback_world", [](int size) { return PyLoopbackWorld{make_loopback_world(size)}; },
      py::arg("size"));
  m.def(
      "loopback_transport",
      [](const PyLoopbackWorld& world, int rank) -> std::shared_ptr<Transport> {
        return make_loopback_transport(world.world, rank);
      },
      py::arg("world"), py::arg("rank"));
  m.def(
      "python_transport",
      [](int rank, int size, py::object allgather, py::object allgatherv, py::object barrier,
         std::string name) -> std::shared_ptr<Transport> {
        return std::make_shared<PythonTransport>(rank, size, std::move(allgather),
                                                 std::move(allgatherv), std::move(barrier),
                                                 std::move(name));
      },
      py::arg("rank"), py::arg("size"), py::arg("allgather"), py::arg("allgatherv"),
      py::arg("barrier"), py::arg("name") = "python");
#if defined(CIERA_WITH_MPI)
  m.def("mpi_init", [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (provided < MPI_THREAD_MULTIPLE)
        throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
    }
  });
  m.def("mpi_shutdown", [](int abort_code) { mpi_shutdown(abort_code); }, py::arg("abort_code") = 1,
        "MPI_Finalize, or after a failed collective of this process MPI_Abort (which ends the job "
        "and this process with `abort_code`): never waits for a dead or stopped peer.");
  m.def("mpi_abort", [](int code) { mpi_abort(code); }, py::arg("code"),
        "Ends this process and the whole MPI job at once with exit status `code`.");
  m.def("mpi_communication_failed", &mpi_communication_failed,
        "Whether a collective of an MPI transport of this process failed or timed out.");
  m.def("mpi_transport",
        []() -> std::shared_ptr<Transport> { return make_mpi_transport(MPI_COMM_WORLD); });
#endif
}

}  // namespace ciera::python
