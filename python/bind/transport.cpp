// Transports Python can hand to the engine: loopback threads (tests), Python callables (e.g.
// torch.distributed on the process group a training job already uses) and Open MPI.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bind.hpp"
#include "ciera/loopback.hpp"
#include "ciera/transport.hpp"
#if defined(CIERA_WITH_MPI)
#include "ciera/mpi.hpp"
#endif
#if defined(CIERA_WITH_NCCL)
#include "ciera/nccl.hpp"
#endif

namespace ciera::python {
namespace {

// `seconds` as a transport's deadline; anything but a finite number > 0 is a ValueError naming
// `what`.
[[maybe_unused]] std::chrono::milliseconds milliseconds_of(double seconds, const char* what) {
  if (!(std::isfinite(seconds) && seconds > 0 && seconds < 1e9)) {
    throw py::value_error(std::string(what) +
                          ": timeout_s must be a finite number of seconds > 0, got " +
                          std::to_string(seconds));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

// A Transport whose collectives are Python callables. Called from the engine's communication
// thread, so each call takes the GIL. On host memory the callables receive memoryviews over
// CIERA's buffers; for a CUDA engine (`device`), whose transport is handed device memory only
// (include/ciera/backend.hpp), they receive (address, bytes) pairs of device memory instead, for
// torch to wrap (ciera.fsdp.transport). Either way the data must be in place when they return.
class PythonTransport final : public Transport {
 public:
  PythonTransport(int rank, int size, py::object allgather, py::object allgatherv,
                  py::object barrier, std::string name, bool device, py::object alltoallv)
      : rank_(rank),
        size_(size),
        device_(device),
        allgather_(std::move(allgather)),
        allgatherv_(std::move(allgatherv)),
        barrier_(std::move(barrier)),
        alltoallv_(std::move(alltoallv)),
        name_(std::move(name)) {}
  ~PythonTransport() override {
    py::gil_scoped_acquire gil;
    allgather_ = py::object();
    allgatherv_ = py::object();
    barrier_ = py::object();
    alltoallv_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return name_; }

  void allgather(const void* in, size_t bytes, void* out) override {
    call("allgather", [&](LentViews& lent) {
      allgather_(lent.view(in, bytes, true), lent.view(out, bytes * size_, false));
    });
  }

  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    uint64_t total = 0;
    for (int r = 0; r < size_; ++r) total = std::max(total, displs[r] + counts[r]);
    call("allgatherv", [&](LentViews& lent) {
      allgatherv_(lent.view(in, counts[rank_], true), lent.view(out, total, false),
                  std::vector<uint64_t>(counts.begin(), counts.end()),
                  std::vector<uint64_t>(displs.begin(), displs.end()));
    });
  }

  // The callable gets the whole input and output and the four count and displacement lists.
  void alltoallv(const void* in, std::span<const uint64_t> send_counts,
                 std::span<const uint64_t> send_displs, void* out,
                 std::span<const uint64_t> recv_counts,
                 std::span<const uint64_t> recv_displs) override {
    if (alltoallv_.is_none())
      Transport::alltoallv(in, send_counts, send_displs, out, recv_counts, recv_displs);
    auto extent = [](std::span<const uint64_t> counts, std::span<const uint64_t> displs) {
      uint64_t total = 0;
      for (size_t r = 0; r < counts.size(); ++r) total = std::max(total, displs[r] + counts[r]);
      return total;
    };
    auto list = [](std::span<const uint64_t> v) {
      return std::vector<uint64_t>(v.begin(), v.end());
    };
    call("alltoallv", [&](LentViews& lent) {
      alltoallv_(lent.view(in, extent(send_counts, send_displs), true),
                 lent.view(out, extent(recv_counts, recv_displs), false), list(send_counts),
                 list(send_displs), list(recv_counts), list(recv_displs));
    });
  }

  void barrier() override {
    call("barrier", [&](LentViews&) { barrier_(); });
  }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  // The views of CIERA's memory that one call hands its callable, released (memoryview.release())
  // once it returns or raises: a view it kept raises on use instead of reaching buffers that CIERA
  // reuses or frees. An array made from a view (np.frombuffer) shares its memory, not its release.
  class LentViews {
   public:
    explicit LentViews(bool device) : device_(device) {}
    LentViews(const LentViews&) = delete;
    LentViews& operator=(const LentViews&) = delete;
    ~LentViews() {
      for (const py::object& view : views_) {
        // Fails only while a C extension holds an export of the view; nothing to do about it.
        PyObject* result = PyObject_CallMethod(view.ptr(), "release", nullptr);
        if (result == nullptr) PyErr_Clear();
        Py_XDECREF(result);
      }
    }

    py::object view(const void* data, uint64_t bytes, bool readonly) {
      if (device_) return py::make_tuple(reinterpret_cast<uintptr_t>(data), bytes);
      views_.push_back(py::memoryview::from_memory(const_cast<void*>(data),
                                                   static_cast<ssize_t>(bytes), readonly));
      return views_.back();
    }

   private:
    bool device_;
    std::vector<py::object> views_;
  };

  template <typename F>
  void call(const char* what, F&& body) {
    py::gil_scoped_acquire gil;
    LentViews lent(device_);
    try {
      body(lent);
    } catch (py::error_already_set& e) {
      throw CommError(name_ + " " + what + " failed on rank " + std::to_string(rank_) + ": " +
                      e.what());
    }
  }

  int rank_;
  int size_;
  bool device_;
  py::object allgather_, allgatherv_, barrier_, alltoallv_;
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
         std::string name, bool device, py::object alltoallv) -> std::shared_ptr<Transport> {
        if (size < 1) {
          throw py::value_error("python_transport: size must be at least 1, got " +
                                std::to_string(size));
        }
        if (rank < 0 || rank >= size) {
          throw py::value_error("python_transport: rank " + std::to_string(rank) +
                                " is not in 0.." + std::to_string(size - 1) + " (size " +
                                std::to_string(size) + ")");
        }
        return std::make_shared<PythonTransport>(rank, size, std::move(allgather),
                                                 std::move(allgatherv), std::move(barrier),
                                                 std::move(name), device, std::move(alltoallv));
      },
      py::arg("rank"), py::arg("size"), py::arg("allgather"), py::arg("allgatherv"),
      py::arg("barrier"), py::arg("name") = "python", py::arg("device") = false,
      py::arg("alltoallv") = py::none(),
      "The memoryviews the callables get are released when they return: the data must be in "
      "place by then. device: the callables get (address, bytes) of device memory instead of "
      "memoryviews; "
      "alltoallv(input, output, send_counts, send_displs, recv_counts, recv_displs), if given, "
      "serves the lossless collectives");
#if defined(CIERA_WITH_NCCL)
  m.def(
      "nccl_unique_id",
      [] {
        const nccl::UniqueId id = nccl::make_unique_id();
        return py::bytes(reinterpret_cast<const char*>(id.bytes.data()), id.bytes.size());
      },
      "Rank 0's NCCL unique id (bytes), for every rank's nccl_transport().");
  m.def(
      "nccl_transport",
      [](py::bytes id_bytes, int rank, int size, int device,
         double timeout_s) -> std::shared_ptr<Transport> {
        const std::string raw = id_bytes;
        nccl::UniqueId id;
        if (raw.size() != id.bytes.size()) {
          throw py::value_error("nccl_transport: the unique id is " + std::to_string(raw.size()) +
                                " bytes, expected " + std::to_string(id.bytes.size()));
        }
        std::memcpy(id.bytes.data(), raw.data(), raw.size());
        nccl::Options options;
        options.device = device;
        options.timeout = milliseconds_of(timeout_s, "nccl_transport");
        py::gil_scoped_release release;  // collective: waits for the peers
        return nccl::make_transport(id, rank, size, options);
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"),
      py::arg("timeout_s") = 120.0);
  m.def("nccl_version", &nccl::library_version,
        "The version of the NCCL library CIERA loads (CommError if it cannot be loaded).");
#endif
#if defined(CIERA_WITH_MPI)
  m.def(
      "mpi_init",
      [](double timeout_s) {
        const auto timeout = milliseconds_of(timeout_s, "mpi_init");
        int provided = 0;
        {
          py::gil_scoped_release release;  // waits for every rank of the job
          provided = mpi_init(nullptr, nullptr, timeout);
        }
        if (provided < MPI_THREAD_MULTIPLE)
          throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
      },
      py::arg("timeout_s") = 120.0,
      "Initialises MPI once for this process; past `timeout_s` in MPI's start-up (a peer dead or "
      "stalled before it) the process ends with one line naming it.");
  m.def(
      "mpi_shutdown",
      [](int abort_code, double timeout_s) {
        const auto timeout = milliseconds_of(timeout_s, "mpi_shutdown");
        py::gil_scoped_release release;  // MPI_Finalize waits for every rank of the job
        mpi_shutdown(abort_code, timeout);
      },
      py::arg("abort_code") = 1, py::arg("timeout_s") = 120.0,
      "MPI_Finalize, or after a failed collective of this process MPI_Abort (which ends the job "
      "and this process with `abort_code`): never waits for a dead or stopped peer (past "
      "`timeout_s` in MPI_Finalize the process ends with `abort_code`).");
  m.def("mpi_abort", [](int code) { mpi_abort(code); }, py::arg("code"),
        "Ends this process and the whole MPI job at once with exit status `code`.");
  m.def("mpi_communication_failed", &mpi_communication_failed,
        "Whether a collective of an MPI transport of this process failed or timed out.");
  m.def(
      "mpi_transport",
      [](std::optional<std::vector<int>> ranks, double timeout_s) -> std::shared_ptr<Transport> {
        const auto timeout = milliseconds_of(timeout_s, "mpi_transport");
        py::gil_scoped_release release;  // collective over the world
        if (!ranks) return make_mpi_transport(MPI_COMM_WORLD, timeout);
        return make_mpi_transport(MPI_COMM_WORLD, *ranks, timeout);
      },
      py::arg("ranks") = py::none(), py::arg("timeout_s") = 120.0,
      "Open MPI transport on the world, or with `ranks` (world ranks, this one among them) on that "
      "subgroup: collective over the world, each rank naming its own group. Its collectives, and "
      "the set-up, wait at most `timeout_s` for the peers.");
#endif
}

}  // namespace ciera::python
