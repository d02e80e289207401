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

#include "ciera/analysis.hpp"
#include "ciera/ciera.hpp"
#include "ciera/engine.hpp"
#include "ciera/loopback.hpp"
#include "ciera/selection.hpp"
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

  // ---- Benefit-driven selection (include/ciera/selection.hpp) ----
  py::class_<CommCurve>(m, "CommCurve")
      .def_static("fit", [](const std::vector<std::pair<double, double>>& points) {
        std::vector<CommSample> samples;
        for (const auto& [bytes, seconds] : points) samples.push_back({bytes, seconds});
        return CommCurve::fit(std::move(samples));
      }, py::arg("points"))
      .def("seconds", &CommCurve::seconds, py::arg("bytes"))
      .def_property_readonly("alpha_s", &CommCurve::alpha_s)
      .def_property_readonly("bytes_per_s", &CommCurve::bytes_per_s)
      .def_property_readonly("samples", [](const CommCurve& c) {
        std::vector<std::pair<double, double>> out;
        for (const CommSample& s : c.samples()) out.emplace_back(s.bytes, s.seconds);
        return out;
      });
  py::class_<CodecThroughput>(m, "CodecThroughput")
      .def(py::init<>())
      .def_readwrite("detect_bytes_per_s", &CodecThroughput::detect_bytes_per_s)
      .def_readwrite("encode_bytes_per_s", &CodecThroughput::encode_bytes_per_s)
      .def_readwrite("decode_bytes_per_s", &CodecThroughput::decode_bytes_per_s);
  py::class_<CostModel>(m, "CostModel")
      .def(py::init<>())
      .def_readwrite("world_size", &CostModel::world_size)
      .def_readwrite("allgather", &CostModel::allgather)
      .def("throughput", [](const CostModel& c, DType d) { return c.throughput(d); }, py::arg("dtype"))
      .def("set_throughput", [](CostModel& c, DType d, const CodecThroughput& t) { c.throughput(d) = t; },
           py::arg("dtype"), py::arg("throughput"));
  m.def(
      "measure_cost_model",
      [](std::shared_ptr<Transport> transport, uint64_t largest_bytes, std::vector<DType> dtypes,
         const CodecConfig& codec, int repeats) {
        py::gil_scoped_release release;  // collective; a Python transport re-takes the GIL per call
        return measure_cost_model(*transport, largest_bytes, dtypes, codec, repeats);
      },
      py::arg("transport"), py::arg("largest_bytes"), py::arg("dtypes"), py::arg("codec"), py::arg("repeats") = 5,
      "Comm(bytes) of this transport and the codec's speed per dtype, the same on every rank (collective).");

  m.def(
      "measure_codec",
      [](const CodecConfig& codec, uint64_t values) {
        py::gil_scoped_release release;
        return measure_codec(codec, values);
      },
      py::arg("codec"), py::arg("values") = uint64_t{1} << 20,
      "Detection, encoding and decoding throughput of this machine (bytes of raw shard per second).");

  py::class_<ShardChangeCounts>(m, "ShardChangeCounts")
      .def_readonly("observations", &ShardChangeCounts::observations)
      .def_readonly("values", &ShardChangeCounts::values)
      .def_readonly("blocks", &ShardChangeCounts::blocks)
      .def_readonly("changed_values", &ShardChangeCounts::changed_values)
      .def_readonly("changed_blocks", &ShardChangeCounts::changed_blocks)
      .def("as_list", [](const ShardChangeCounts& c) {
        return std::vector<uint64_t>{c.observations, c.values, c.blocks, c.changed_values, c.changed_blocks};
      })
      .def_static("from_list", [](const std::vector<uint64_t>& f) {
        if (f.size() != 5) throw ConfigError("ShardChangeCounts.from_list needs 5 fields");
        return ShardChangeCounts{f[0], f[1], f[2], f[3], f[4]};
      })
      .def_property_readonly("value_change_rate", &ShardChangeCounts::value_change_rate)
      .def_property_readonly("block_change_rate", &ShardChangeCounts::block_change_rate);
  py::class_<ChangeMonitor>(m, "ChangeMonitor")
      .def(py::init<DType, std::vector<uint64_t>, uint32_t>(), py::arg("dtype"), py::arg("shard_values"),
           py::arg("block_values"))
      .def(
          "observe",
          [](ChangeMonitor& monitor, uintptr_t data, uint64_t bytes) {
            py::gil_scoped_release release;
            monitor.observe(bytes_at<const std::byte>(data, bytes));
          },
          py::arg("data_ptr"), py::arg("nbytes"))
      .def_property_readonly("counts", &ChangeMonitor::counts)
      .def("clear_counts", &ChangeMonitor::clear_counts)
      .def_property_readonly("memory_bytes", &ChangeMonitor::memory_bytes);

  py::class_<ShardCandidate>(m, "ShardCandidate")
      .def(py::init<>())
      .def_readwrite("bucket", &ShardCandidate::bucket)
      .def_readwrite("param", &ShardCandidate::param)
      .def_readwrite("name", &ShardCandidate::name)
      .def_readwrite("type", &ShardCandidate::type)
      .def_readwrite("dtype", &ShardCandidate::dtype)
      .def_readwrite("shard_values", &ShardCandidate::shard_values)
      .def_readwrite("block_change_rate", &ShardCandidate::block_change_rate)
      .def_readwrite("value_change_rate", &ShardCandidate::value_change_rate);
  py::class_<SelectorOptions>(m, "SelectorOptions")
      .def(py::init<>())
      .def_readwrite("cache_budget_bytes", &SelectorOptions::cache_budget_bytes)
      .def_readwrite("overlap", &SelectorOptions::overlap)
      .def_readwrite("codec", &SelectorOptions::codec);
  m.def(
      "select_shards",
      [](const std::vector<ShardCandidate>& candidates, const CostModel& model, const SelectorOptions& options) {
        const Selection s = select_shards(candidates, model, options);
        py::list shards;
        for (const ShardChoice& c : s.shards) {
          py::dict d;
          d["bucket"] = c.shard.bucket;
          d["param"] = c.shard.param;
          d["name"] = c.shard.name;
          d["type"] = c.shard.type;
          d["block_change_rate"] = c.shard.block_change_rate;
          d["value_change_rate"] = c.shard.value_change_rate;
          d["raw_bytes"] = c.raw_bytes;
          d["expected_wire_bytes"] = c.expected_wire_bytes;
          d["comm_saved_s"] = c.comm_saved_s;
          d["encode_s"] = c.encode_s;
          d["decode_s"] = c.decode_s;
          d["gain_s"] = c.gain_s;
          d["memory_bytes"] = c.memory_bytes;
          d["score"] = c.score;
          d["chosen"] = c.chosen;
          d["reason"] = c.reason;
          shards.append(d);
        }
        py::dict out;
        out["shards"] = shards;
        out["cache_bytes"] = s.cache_bytes;
        out["budget_bytes"] = s.budget_bytes;
        out["gain_s"] = s.gain_s;
        out["round_overhead_s"] = compressed_round_overhead_s(model);
        return out;
      },
      py::arg("candidates"), py::arg("model"), py::arg("options"),
      "Benefit-driven selection (paper §3.2): a dict with per-shard gains and choices.");

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

  // ---- Exponent-change characterisation (include/ciera/analysis.hpp, docs/analysis.md) ----
  // For use inside a training loop: one counter per parameter, observe() after each optimizer
  // step. summary() has the shape of one "counts" object of `ciera analyze --json`.
  {
    auto counts_dict = [](const ChangeCounts& c, const ChangeGrid& grid) {
      auto per_cell = [&](auto value) {
        py::list rows;
        for (size_t w = 0; w < grid.worlds.size(); ++w) {
          py::list row;
          for (size_t b = 0; b < grid.block_values.size(); ++b) row.append(value(grid.cell(w, b)));
          rows.append(row);
        }
        return rows;
      };
      py::list shard_rate;
      for (size_t w = 0; w < grid.worlds.size(); ++w) shard_rate.append(c.shard_change_rate(w));
      py::dict d;
      d["transitions"] = c.transitions;
      d["values"] = c.values;
      d["changed_values"] = c.changed_values;
      d["element_change_rate"] = c.element_change_rate();
      d["blocks"] = per_cell([&](size_t i) { return c.blocks[i]; });
      d["changed_blocks"] = per_cell([&](size_t i) { return c.changed_blocks[i]; });
      d["block_change_rate"] = per_cell([&](size_t i) { return c.block_change_rate(i); });
      d["shards"] = c.shards;
      d["changed_shards"] = c.changed_shards;
      d["shard_change_rate"] = shard_rate;
      return d;
    };
    m.def(
        "classify_parameter", [](const std::string& name) { return std::string(to_string(classify_parameter(name))); },
        py::arg("name"),
        "Shard type of a parameter name: expert_ffn, attention, router, norm, embedding, dense_ffn or other.");
    py::class_<ExponentChangeCounter>(m, "ExponentChangeCounter")
        .def(py::init([](DType dtype, uint64_t values, std::vector<uint32_t> worlds, std::vector<uint32_t> blocks,
                         uint32_t warmup_steps) {
               return std::make_unique<ExponentChangeCounter>(dtype, values, ChangeGrid{std::move(worlds), std::move(blocks)},
                                                              warmup_steps);
             }),
             py::arg("dtype"), py::arg("values"), py::arg("worlds") = ChangeGrid{}.worlds,
             py::arg("blocks") = ChangeGrid{}.block_values, py::arg("warmup_steps") = 0)
        .def(
            "observe",
            [](ExponentChangeCounter& c, uintptr_t data_ptr, uint64_t nbytes) {
              py::gil_scoped_release release;
              c.observe(bytes_at<const std::byte>(data_ptr, nbytes));
            },
            py::arg("data_ptr"), py::arg("nbytes"),
            "Counts the changes since the previous snapshot (the first is the baseline); the memory at data_ptr "
            "holds `values` values of `dtype`, on the host.")
        .def(
            "observe",
            [](ExponentChangeCounter& c, py::buffer snapshot) {
              py::buffer_info in = snapshot.request();
              const std::span<const std::byte> bytes(static_cast<const std::byte*>(in.ptr),
                                                     static_cast<size_t>(in.size * in.itemsize));
              py::gil_scoped_release release;
              c.observe(bytes);
            },
            py::arg("snapshot"))
        .def_property_readonly("transitions", &ExponentChangeCounter::transitions)
        .def_property_readonly("values", &ExponentChangeCounter::num_values)
        .def("summary", [counts_dict](const ExponentChangeCounter& c) {
          const ChangeGrid& grid = c.grid();
          py::dict d;
          d["dtype"] = std::string(dtype_name(c.dtype()));
          d["values"] = c.num_values();
          d["worlds"] = grid.worlds;
          d["block_values"] = grid.block_values;
          d["warmup_steps"] = c.warmup_steps();
          d["transitions"] = c.transitions();
          d["changed_values_per_step"] =
              std::vector<uint64_t>(c.changed_values_per_step().begin(), c.changed_values_per_step().end());
          d["total"] = counts_dict(c.total(), grid);
          return d;
        }, "Counts summed over the transitions after warmup (\"total\"), and changed values per step.");
  }
}
