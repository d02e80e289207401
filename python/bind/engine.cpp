// The compressed allgather engine (include/ciera/engine.hpp). Buffers cross as data pointers and
// byte counts (FSDP's flat tensors); the engine keeps its transport alive as long as it lives.
#include <pybind11/stl.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bind.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "ciera/transport.hpp"
#if defined(CIERA_WITH_CUDA)
#include "ciera/cuda.hpp"
#endif

namespace ciera::python {
namespace {

// The codec backend for `device`: -1 the host, d >= 0 CUDA device d.
std::shared_ptr<const CodecBackend> backend_for(int device) {
  if (device < 0) return host_codec_backend();
#if defined(CIERA_WITH_CUDA)
  return cuda::codec_backend(device);
#else
  throw ConfigError("device " + std::to_string(device) +
                    ": this build of CIERA has no CUDA backend (build it with nvcc: "
                    "CIERA_CUDA=ON pip install .)");
#endif
}

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// What start(keep=...) keeps alive: each ticket's object until its wait() returns, and which
// tickets in flight were started without one. Read and written with the GIL held only.
struct Kept {
  std::map<CompressedAllgather::Ticket, py::object> objects;
  std::set<CompressedAllgather::Ticket> unkept;
  std::set<CompressedAllgather::Ticket> waiting;  // a wait() of this ticket is in the engine
};

// An engine that close() can end before Python drops the object: every later call is a
// ValueError, as for a closed file. Each call holds its own reference to the engine, so a
// close() from another thread, or the garbage collector, never destroys an engine a call is
// still inside; the engine goes when the last of them lets go. It is always destroyed with the
// GIL released: joining its communication thread may need the GIL (a PythonTransport). Its
// transport and the objects start(keep=) holds go after it (they outlive every gather the
// destruction finishes), with the GIL taken back for them.
class PyEngine {
 public:
  using Engine = std::shared_ptr<CompressedAllgather>;

  PyEngine(std::shared_ptr<Transport> transport, EngineConfig config,
           std::vector<BucketLayout> buckets, int device)
      : kept_(std::make_shared<Kept>()) {
    auto backend = backend_for(device);
    py::gil_scoped_release release;  // the agreement is collective
    Transport& t = *transport;
    engine_ = Engine(
        new CompressedAllgather(t, std::move(config), std::move(buckets), std::move(backend)),
        [transport = std::move(transport), kept = kept_](CompressedAllgather* e) mutable {
          delete e;
          if (PyGILState_GetThisThreadState() == nullptr && python_finalizing()) {
            // An engine ended by a thread of its own as the interpreter shuts down (one
            // collected on its communication thread): Python objects can no longer be touched
            // from there. Left.
            new std::shared_ptr<Transport>(std::move(transport));
            new auto(std::move(kept->objects));
            return;
          }
          py::gil_scoped_acquire gil;
          transport.reset();
          // Out of the map before they go: a __del__ that runs then may call wait(), which
          // erases from it.
          auto objects = std::move(kept->objects);
          kept->objects.clear();
        });
  }
  ~PyEngine() {
    if (engine_ && engine_->on_communication_thread()) {
      // The garbage collector dropped the engine inside one of its own transport's calls, so a
      // gather is in flight. The engine cannot be destroyed here: its destructor joins this
      // thread. Where every gather in flight keeps its buffers (start(keep=)), another thread
      // ends it once this call has returned and those gathers are finished.
      if (kept_->unkept.empty()) {
        std::thread([engine = std::move(engine_)]() mutable { engine.reset(); }).detach();
        return;
      }
      // Otherwise that gather's buffers went with the same collection as often as not, and
      // kept alive the engine would finish it into memory that may be freed: stop, saying why,
      // rather than corrupt the heap silently.
      std::fprintf(stderr,
                   "ciera: an Engine was garbage-collected inside one of its own transport's "
                   "calls, with a gather in flight whose buffers may be freed by now; aborting "
                   "rather than writing into them (pass the buffers as start(keep=...), keep the "
                   "engine until its gathers are waited for, or close() it)\n");
      std::abort();
    }
    release(engine_);
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  Engine live() const {
    Engine engine = engine_;
    if (!engine)
      throw py::value_error("the CIERA engine is closed (Engine.close(), or Handle.disable())");
    refuse_own_thread(*engine);
    return engine;
  }

  bool closed() const { return !engine_; }

  // `call(engine)` with the GIL released, for calls that block or code.
  template <typename Call>
  auto unlocked(Call&& call) const {
    Engine engine = live();
    py::gil_scoped_release unlocked;
    Releaser last_reference{engine};
    return call(*engine);
  }

  // start() or run(): `input`/`output` are data pointers with their sizes in bytes
  // (Tensor.data_ptr(): host memory, or device memory on a CUDA engine); `stream` a CUDA
  // stream as an integer (torch.cuda.Stream.cuda_stream) or 0; `slot_stride` as in
  // CompressedAllgather::start. A null pointer fails the gather on every rank.
  template <auto Method>
  auto gather(size_t bucket, uintptr_t input, uint64_t input_bytes, uintptr_t output,
              uint64_t output_bytes, uintptr_t stream, uint64_t slot_stride) {
    std::span<const std::byte> in;
    std::span<std::byte> out;
    check_on_every_rank(
        [&] {
          in = bytes_at<const std::byte>(input, input_bytes, "input");
          out = bytes_at<std::byte>(output, output_bytes, "output");
        },
        [&](const std::string& reason) {
          unlocked([&](CompressedAllgather& engine) { engine.refuse(bucket, reason); });
        });
    return unlocked([&](CompressedAllgather& engine) {
      return (engine.*Method)(bucket, in, out, stream, slot_stride);
    });
  }

  // start(): `keep` (None: nothing) is held until the ticket's wait() returns, or the engine
  // has finished the gather as it closes. While start() runs, the call itself holds this
  // engine, so no collection can end it before the ticket is recorded.
  CompressedAllgather::Ticket start(size_t bucket, uintptr_t input, uint64_t input_bytes,
                                    uintptr_t output, uint64_t output_bytes, uintptr_t stream,
                                    uint64_t slot_stride, py::object keep) {
    // This call's own reference until `keep` is recorded: an engine closed meanwhile by another
    // thread then ends (finishing the gather) only after it, and lets `keep` go after that.
    struct Held {
      Engine engine;
      ~Held() { release(engine); }
    } held{live()};
    const CompressedAllgather::Ticket ticket = gather<&CompressedAllgather::start>(
        bucket, input, input_bytes, output, output_bytes, stream, slot_stride);
    if (keep.is_none()) {
      kept_->unkept.insert(ticket);
    } else {
      kept_->objects.emplace(ticket, std::move(keep));
    }
    return ticket;
  }

  // wait(): once the engine has been asked for the ticket, its gather is over however the call
  // ends (or the ticket was never one of this engine's gathers in flight), and its kept object
  // is let go. One call per ticket at a time reaches the engine, so a second one, refused here,
  // never lets go of the buffers of the gather the first waits for; so does a call refused
  // before it reaches the engine (closed, or from the communication thread).
  GatherStats wait(CompressedAllgather::Ticket ticket) {
    if (engine_) refuse_own_thread(*engine_);  // said as such, before any other refusal
    if (!kept_->waiting.insert(ticket).second) {
      throw py::value_error("wait: ticket " + std::to_string(ticket) +
                            " is being waited for by another call");
    }
    struct Done {
      Kept& kept;
      CompressedAllgather::Ticket ticket;
      ~Done() { kept.waiting.erase(ticket); }
    } done{*kept_, ticket};
    GatherStats stats;
    try {
      stats = unlocked([&](CompressedAllgather& engine) { return engine.wait(ticket); });
    } catch (const py::value_error&) {
      throw;  // from live(): the engine never saw the ticket
    } catch (...) {
      forget(ticket);
      throw;
    }
    forget(ticket);
    return stats;
  }

  void close() {
    if (engine_) refuse_own_thread(*engine_);
    release(engine_);
  }

 private:
  // A transport callable (which runs on the engine's communication thread) calling the engine:
  // wait() would wait for itself for ever, close() would join its own thread.
  static void refuse_own_thread(const CompressedAllgather& engine) {
    if (engine.on_communication_thread()) {
      throw py::value_error(
          "the CIERA engine was called from inside one of its own transport's calls (its "
          "communication thread); call it from another thread");
    }
  }
  void forget(CompressedAllgather::Ticket ticket) {
    kept_->unkept.erase(ticket);
    // Out of the map before it goes: its __del__ may call wait(), which erases from it.
    auto node = kept_->objects.extract(ticket);
  }

  // Drops `engine` while the GIL is released by the caller's scope.
  struct Releaser {
    Engine& engine;
    ~Releaser() { engine.reset(); }
  };
  // `engine` is emptied while the GIL is still held (another thread's live() copies it under
  // the GIL: emptied unlocked, the two raced on the pointer), and its engine dropped unlocked.
  static void release(Engine& engine) {
    Engine last = std::move(engine);
    if (!last) return;
    py::gil_scoped_release unlocked;
    last.reset();
  }

  std::shared_ptr<Kept> kept_;
  Engine engine_;
};

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<BucketLayout>(m, "BucketLayout")
      .def(py::init<>())
      .def_readwrite("name", &BucketLayout::name)
      .def_readwrite("dtype", &BucketLayout::dtype)
      .def_readwrite("shard_values", &BucketLayout::shard_values)
      .def_readwrite("policy", &BucketLayout::policy)
      .def_static("fsdp_split", &BucketLayout::fsdp_split, py::arg("name"), py::arg("dtype"),
                  py::arg("param_values"), py::arg("ranks"),
                  py::arg("policy") = ShardPolicy::kCiera)
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
      .def_readonly("control_bytes", &GatherStats::control_bytes)
      .def_readonly("encode_s", &GatherStats::encode_s)
      .def_readonly("exchange_s", &GatherStats::exchange_s)
      .def_readonly("decode_s", &GatherStats::decode_s)
      .def_readonly("total_s", &GatherStats::total_s);

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<std::shared_ptr<Transport>, EngineConfig, std::vector<BucketLayout>, int>(),
           py::arg("transport").none(false), py::arg("config"), py::arg("buckets"),
           py::arg("device") = -1,
           "device: -1 for host memory, d >= 0 for CUDA device d (payloads in its memory, coded "
           "there; the transport must move device memory)")
      .def("start", &PyEngine::start, py::arg("bucket"), py::arg("input_ptr"),
           py::arg("input_bytes"), py::arg("output_ptr"), py::arg("output_bytes"),
           py::arg("stream") = 0, py::arg("slot_stride") = 0, py::arg("keep") = py::none(),
           "Starts gathering `bucket` and returns a ticket for wait(). The pointers are raw "
           "addresses (Tensor.data_ptr(), ndarray.ctypes.data): the memory must stay valid, "
           "unresized, until wait() returns (freed earlier, the engine writes into freed "
           "memory). `keep` (e.g. the two tensors) is held by the engine until then, or until "
           "the engine has finished the gather as it closes; an engine whose gathers in flight "
           "all keep their buffers may even be garbage-collected inside its own transport's "
           "call, which otherwise ends the process. The input may overlap the output only as "
           "this rank's own slot of it (an in-place gather). Wrong sizes and null pointers fail "
           "the gather on every rank (ConfigError from wait()).")
      .def("wait", &PyEngine::wait, py::arg("ticket"),
           "Blocks until the gather of `ticket` (from this engine's start()) is done and returns "
           "its GatherStats; CommError / ConfigError, on every rank, if it failed. Blocks with "
           "the GIL released and does not see Ctrl-C until the gather ends (at most the "
           "configured timeout).")
      .def("run", &PyEngine::gather<&CompressedAllgather::run>, py::arg("bucket"),
           py::arg("input_ptr"), py::arg("input_bytes"), py::arg("output_ptr"),
           py::arg("output_bytes"), py::arg("stream") = 0, py::arg("slot_stride") = 0,
           "start() then wait(), with their rules for the buffers.")
      .def(
          "refuse",
          [](PyEngine& e, size_t bucket, const std::string& reason) {
            e.unlocked([&](CompressedAllgather& engine) { engine.refuse(bucket, reason); });
          },
          py::arg("bucket"), py::arg("reason"),
          "Takes part in the bucket's next gather only to refuse it: raises ConfigError, the "
          "same on every rank, naming this rank and `reason`.")
      .def("reset_caches",
           [](PyEngine& e) {
             e.unlocked([](CompressedAllgather& engine) { engine.reset_caches(); });
           })
      .def(
          "set_policy",
          [](PyEngine& e, size_t bucket, size_t param, ShardPolicy p) {
            e.unlocked([&](CompressedAllgather& engine) { engine.set_policy(bucket, param, p); });
          },
          py::arg("bucket"), py::arg("param"), py::arg("policy"))
      .def(
          "bucket",
          [](PyEngine& e, size_t b) {
            return e.unlocked([&](CompressedAllgather& engine) { return engine.bucket(b); });
          },
          py::arg("index"))
      .def_property_readonly("bucket_count",
                             [](PyEngine& e) {
                               return e.unlocked([](CompressedAllgather& engine) {
                                 return engine.bucket_count();
                               });
                             })
      .def_property_readonly("cache_bytes",
                             [](PyEngine& e) {
                               return e.unlocked([](CompressedAllgather& engine) {
                                 return engine.cache_bytes();
                               });
                             })
      .def_property_readonly(
          "rank",
          [](PyEngine& e) {
            return e.unlocked([](CompressedAllgather& engine) { return engine.rank(); });
          })
      .def_property_readonly(
          "world_size",
          [](PyEngine& e) {
            return e.unlocked([](CompressedAllgather& engine) { return engine.world_size(); });
          })
      .def_property_readonly("backend",
                             [](PyEngine& e) {
                               return e.unlocked([](CompressedAllgather& engine) {
                                 return std::string(engine.backend().name());
                               });
                             })
      .def_property_readonly("closed", &PyEngine::closed)
      .def("close", &PyEngine::close,
           "Ends the engine (joins its threads); closing twice is harmless. A gather in flight "
           "is finished first (up to the configured timeout), so its buffers may be freed once "
           "close() returns; its wait() then raises ValueError (closed).");
}

}  // namespace ciera::python
