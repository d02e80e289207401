// The one binding file of the Python package (module ciera._ext). It does not link libtorch:
// tensors cross as raw data pointers and byte counts, and every call that moves or codes data
// releases the GIL. C++ errors become Python exceptions (FormatError, ConfigError, CommError).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ciera/ciera.hpp"
#include "ciera/engine.hpp"
#include "ciera/loopback.hpp"
#if defined(CIERA_WITH_MPI)
#include "ciera/mpi.hpp"
#endif

namespace py = pybind11;
using namespace ciera;

namespace {

template <typename T>
std::span<T> bytes_at(uintptr_t address, uint64_t bytes) {
  return {reinterpret_cast<T*>(address), static_cast<size_t>(bytes)};
}

// A Transport whose collectives are Python callables (for example torch.distributed on the
// process group a training job already uses). Called from the engine's communication thread,
// so each call takes the GIL; the callables receive writable memoryviews over CIERA's buffers.
class PythonTransport final : public Transport {
 public:
  PythonTransport(int rank, int size, py::object allgather, py::object allgatherv, py::object barrier,
                  std::string name)
      : rank_(rank), size_(size), allgather_(std::move(allgather)), allgatherv_(std::move(allgatherv)),
        barrier_(std::move(barrier)), name_(std::move(name)) {}
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
    call("allgather", [&] {
      allgather_(view(in, bytes, true), view(out, bytes * size_, false));
    });
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
    return py::memoryview::from_memory(const_cast<void*>(data), static_cast<ssize_t>(bytes), readonly);
  }

  template <typename F>
  void call(const char* what, F&& body) {
    py::gil_scoped_acquire gil;
    try {
      body();
    } catch (py::error_already_set& e) {
      throw CommError(name_ + " " + what + " failed on rank " + std::to_string(rank_) + ": " + e.what());
    }
  }

  int rank_;
  int size_;
  py::object allgather_, allgatherv_, barrier_;
  std::string name_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(120)};
};

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "CIERA: lossless compressed allgather for sharded MoE training (C++ core)";
  m.attr("__version__") = kLibraryVersion;
  m.attr("format_version") = kFormatVersion;
  m.attr("with_mpi") =
#if defined(CIERA_WITH_MPI)
      true;
#else
      false;
#endif

  auto base = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<FormatError>(m, "FormatError", base.ptr());
  py::register_exception<ConfigError>(m, "ConfigError", base.ptr());
  py::register_exception<CommError>(m, "CommError", base.ptr());

  py::enum_<DType>(m, "DType").value("bf16", DType::kBF16).value("fp16", DType::kFP16).value("fp32", DType::kFP32);
  py::enum_<ChangeDetection>(m, "ChangeDetection")
      .value("exact", ChangeDetection::kExact)
      .value("hash", ChangeDetection::kHash);
  py::enum_<ExponentCoding>(m, "ExponentCoding")
      .value("auto", ExponentCoding::kAuto)
      .value("block", ExponentCoding::kBlock)
      .value("fine", ExponentCoding::kFine);
  py::enum_<ShardPolicy>(m, "ShardPolicy").value("raw", ShardPolicy::kRaw).value("ciera", ShardPolicy::kCiera);
  py::enum_<WarmupMode>(m, "WarmupMode").value("raw", WarmupMode::kRaw).value("key_frames", WarmupMode::kKeyFrames);

  py::class_<CodecConfig>(m, "CodecConfig")
      .def(py::init<>())
      .def_readwrite("dtype", &CodecConfig::dtype)
      .def_readwrite("block_values", &CodecConfig::block_values)
      .def_readwrite("warmup_steps", &CodecConfig::warmup_steps)
      .def_readwrite("detection", &CodecConfig::detection)
      .def_readwrite("coding", &CodecConfig::coding)
      .def_readwrite("content_checksum", &CodecConfig::content_checksum)
      .def("validate", &CodecConfig::validate);

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("codec", &EngineConfig::codec)
      .def_readwrite("warmup_steps", &EngineConfig::warmup_steps)
      .def_readwrite("warmup", &EngineConfig::warmup)
      .def_readwrite("adaptive", &EngineConfig::adaptive)
      .def_readwrite("worker_threads", &EngineConfig::worker_threads)
      .def_property(
          "timeout_s", [](const EngineConfig& c) { return c.timeout.count() / 1000.0; },
          [](EngineConfig& c, double s) { c.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); });

  py::class_<BucketLayout>(m, "BucketLayout")
      .def(py::init<>())
      .def_readwrite("name", &BucketLayout::name)
      .def_readwrite("dtype", &BucketLayout::dtype)
      .def_readwrite("shard_values", &BucketLayout::shard_values)
      .def_readwrite("policy", &BucketLayout::policy)
      .def_static("fsdp_split", &BucketLayout::fsdp_split, py::arg("name"), py::arg("dtype"),
                  py::arg("param_values"), py::arg("ranks"), py::arg("policy") = ShardPolicy::kCiera)
      .def("rank_bytes", &BucketLayout::rank_bytes)
      .def("rank_offset", &BucketLayout::rank_offset)
      .def("total_bytes", &BucketLayout::total_bytes)
      .def("validate", &BucketLayout::validate);

  py::class_<GatherStats>(m, "GatherStats")
      .def_readonly("step", &GatherStats::step)
      .def_readonly("warmup", &GatherStats::warmup)
      .def_readonly("compressed", &GatherStats::compressed)
      .def_readonly("resynchronised", &GatherStats::resynchronised)
      .def_readonly("raw_bytes", &GatherStats::raw_bytes)
      .def_readonly("wire_bytes", &GatherStats::wire_bytes)
      .def_readonly("local_payload_bytes", &GatherStats::local_payload_bytes)
      .def_readonly("encode_s", &GatherStats::encode_s)
      .def_readonly("exchange_s", &GatherStats::exchange_s)
      .def_readonly("decode_s", &GatherStats::decode_s)
      .def_readonly("total_s", &GatherStats::total_s);

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("size", &Transport::size)
      .def_property_readonly("name", [](const Transport& t) { return std::string(t.name()); });

  // LoopbackWorld is opaque in the C++ API; Python holds it through this handle.
  struct PyLoopbackWorld {
    std::shared_ptr<LoopbackWorld> world;
  };
  py::class_<PyLoopbackWorld>(m, "LoopbackWorld");
  m.def("loopback_world", [](int size) { return PyLoopbackWorld{make_loopback_world(size)}; }, py::arg("size"));
  m.def(
      "loopback_transport",
      [](const PyLoopbackWorld& world, int rank) -> std::shared_ptr<Transport> {
        return make_loopback_transport(world.world, rank);
      },
      py::arg("world"), py::arg("rank"));
  m.def(
      "python_transport",
      [](int rank, int size, py::object allgather, py::object allgatherv, py::object barrier, std::string name)
          -> std::shared_ptr<Transport> {
        return std::make_shared<PythonTransport>(rank, size, std::move(allgather), std::move(allgatherv),
                                                 std::move(barrier), std::move(name));
      },
      py::arg("rank"), py::arg("size"), py::arg("allgather"), py::arg("allgatherv"), py::arg("barrier"),
      py::arg("name") = "python");
#if defined(CIERA_WITH_MPI)
  m.def("mpi_init", [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (provided < MPI_THREAD_MULTIPLE) throw CommError("MPI does not provide MPI_THREAD_MULTIPLE");
    }
  });
  m.def("mpi_finalize", [] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
  m.def("mpi_transport", []() -> std::shared_ptr<Transport> { return make_mpi_transport(MPI_COMM_WORLD); });
#endif

  // The engine keeps the transport alive as long as it lives.
  struct PyEngine {
    std::shared_ptr<Transport> transport;
    std::unique_ptr<CompressedAllgather> engine;
  };
  py::class_<PyEngine>(m, "Engine")
      .def(py::init([](std::shared_ptr<Transport> transport, EngineConfig config, std::vector<BucketLayout> buckets) {
             auto e = std::make_unique<PyEngine>();
             e->transport = transport;
             py::gil_scoped_release release;  // the agreement is collective
             e->engine = std::make_unique<CompressedAllgather>(*transport, std::move(config), std::move(buckets));
             return e;
           }),
           py::arg("transport"), py::arg("config"), py::arg("buckets"))
      .def(
          "start",
          [](PyEngine& e, size_t bucket, uintptr_t input, uint64_t input_bytes, uintptr_t output, uint64_t output_bytes) {
            py::gil_scoped_release release;
            return e.engine->start(bucket, bytes_at<const std::byte>(input, input_bytes),
                                   bytes_at<std::byte>(output, output_bytes));
          },
          py::arg("bucket"), py::arg("input_ptr"), py::arg("input_bytes"), py::arg("output_ptr"), py::arg("output_bytes"))
      .def(
          "wait",
          [](PyEngine& e, CompressedAllgather::Ticket ticket) {
            py::gil_scoped_release release;
            return e.engine->wait(ticket);
          },
          py::arg("ticket"))
      .def(
          "run",
          [](PyEngine& e, size_t bucket, uintptr_t input, uint64_t input_bytes, uintptr_t output, uint64_t output_bytes) {
            py::gil_scoped_release release;
            return e.engine->run(bucket, bytes_at<const std::byte>(input, input_bytes),
                                 bytes_at<std::byte>(output, output_bytes));
          },
          py::arg("bucket"), py::arg("input_ptr"), py::arg("input_bytes"), py::arg("output_ptr"), py::arg("output_bytes"))
      .def("reset_caches", [](PyEngine& e) { e.engine->reset_caches(); })
      .def("set_policy", [](PyEngine& e, size_t bucket, size_t param, ShardPolicy p) { e.engine->set_policy(bucket, param, p); })
      .def("bucket", [](PyEngine& e, size_t b) { return e.engine->bucket(b); })
      .def_property_readonly("bucket_count", [](PyEngine& e) { return e.engine->bucket_count(); })
      .def_property_readonly("cache_bytes", [](PyEngine& e) { return e.engine->cache_bytes(); })
      .def_property_readonly("rank", [](PyEngine& e) { return e.engine->rank(); })
      .def_property_readonly("world_size", [](PyEngine& e) { return e.engine->world_size(); })
      .def("close", [](PyEngine& e) {
        py::gil_scoped_release release;  // joining the communication thread may need the GIL
        e.engine.reset();
      });

  // Statistics: how many of n values have a different exponent in `now` than in `before`
  // (the paper's exponent change rate, §2.2), and a copy of `now` into `before` for next time.
  m.def(
      "exponent_changes",
      [](DType dtype, uintptr_t before, uintptr_t now, uint64_t n, bool update) {
        py::gil_scoped_release release;
        const DTypeInfo info = dtype_info(dtype);
        const unsigned shift = info.sign_mantissa_bits - 1;
        const uint32_t mask = ((1u << info.exponent_bits) - 1) << shift;
        uint64_t changed = 0;
        if (info.value_bytes == 2) {
          auto* b = reinterpret_cast<uint16_t*>(before);
          const auto* c = reinterpret_cast<const uint16_t*>(now);
          for (uint64_t i = 0; i < n; ++i) changed += ((b[i] ^ c[i]) & mask) != 0;
          if (update) std::memcpy(b, c, n * 2);
        } else {
          auto* b = reinterpret_cast<uint32_t*>(before);
          const auto* c = reinterpret_cast<const uint32_t*>(now);
          for (uint64_t i = 0; i < n; ++i) changed += ((b[i] ^ c[i]) & mask) != 0;
          if (update) std::memcpy(b, c, n * 4);
        }
        return changed;
      },
      py::arg("dtype"), py::arg("before_ptr"), py::arg("now_ptr"), py::arg("values"), py::arg("update") = true);

  // One-shot codec entry points over any buffer (bytes, numpy arrays, tensors' memory).
  m.def(
      "max_payload_bytes", [](DType d, uint64_t n, uint32_t b) { return max_payload_bytes(d, n, b); },
      py::arg("dtype"), py::arg("values"), py::arg("block_values") = 512);
  m.def(
      "encode_stateless",
      [](const CodecConfig& c, py::buffer shard) {
        py::buffer_info in = shard.request();
        const uint64_t bytes = static_cast<uint64_t>(in.size * in.itemsize);
        const uint64_t values = bytes / dtype_info(c.dtype).value_bytes;
        std::string payload(max_payload_bytes(c.dtype, values, c.block_values), '\0');
        size_t length;
        {
          py::gil_scoped_release release;
          length = encode_stateless(c, {static_cast<const std::byte*>(in.ptr), bytes},
                                    {reinterpret_cast<std::byte*>(payload.data()), payload.size()});
        }
        payload.resize(length);
        return py::bytes(payload);
      },
      py::arg("config"), py::arg("shard"));
  m.def(
      "decode_stateless",
      [](const CodecConfig& c, py::bytes payload, py::buffer out) {
        py::buffer_info o = out.request(true);
        std::string_view p = payload;
        py::gil_scoped_release release;
        decode_stateless(c, {reinterpret_cast<const std::byte*>(p.data()), p.size()},
                         {static_cast<std::byte*>(o.ptr), static_cast<size_t>(o.size * o.itemsize)});
      },
      py::arg("config"), py::arg("payload"), py::arg("out"));
}
