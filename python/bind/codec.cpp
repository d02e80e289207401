// The stateful codec for Python users (include/ciera/codec.hpp): one ShardEncoder per shard sent,
// one ShardDecoder per shard received, over NumPy arrays, bytes-like objects or CPU tensors.
#include <pybind11/stl.h>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "bind.hpp"
#include "ciera/codec.hpp"
#include "ciera/dtype.hpp"

namespace ciera::python {
namespace {

// A codec object is driven by one thread at a time; the GIL is released while it codes, so a
// second thread that codes, requests a key frame or resets is refused instead of racing on the
// codec's state (property reads are not guarded: read them from the thread that codes).
class Exclusive {
 public:
  Exclusive(std::atomic<bool>& busy, const char* what) : busy_(busy) {
    if (busy_.exchange(true))
      throw std::runtime_error(std::string(what) + " is in use by another thread");
  }
  ~Exclusive() { busy_ = false; }

 private:
  std::atomic<bool>& busy_;
};

// ValueError unless `buffer` holds `values` values of the codec's dtype; ConfigError if its own
// element type is another float type or size (an FP32 array given to a BF16 codec: the bytes
// would code, but as values of the wrong type, and a decode into it would read as garbage).
void check_shard(const HostBuffer& buffer, const CodecConfig& config, uint64_t values,
                 const char* what) {
  buffer.check_elements(config.dtype, what);
  const uint64_t want = values * dtype_info(config.dtype).value_bytes;
  if (buffer.size() != want) {
    throw py::value_error(std::string(what) + " holds " + std::to_string(buffer.size()) +
                          " bytes, but the codec is for " + std::to_string(values) + " " +
                          std::string(dtype_name(config.dtype)) + " values (" +
                          std::to_string(want) + " bytes)");
  }
}

// Refuses `a` and `b` sharing memory: the codec reads one while it writes the other, so an
// overlap would code or decode values that it has already overwritten.
void check_apart(std::span<const std::byte> a, std::span<const std::byte> b, const char* what) {
  const auto a_begin = reinterpret_cast<uintptr_t>(a.data()),
             b_begin = reinterpret_cast<uintptr_t>(b.data());
  if (!a.empty() && !b.empty() && a_begin < b_begin + b.size() && b_begin < a_begin + a.size())
    throw py::value_error(std::string(what) + " overlap: they must be separate memory");
}

// The encoder and a payload buffer of max_payload_bytes(), allocated once.
class PyShardEncoder {
 public:
  PyShardEncoder(const CodecConfig& config, uint64_t values, uint32_t stream, uint32_t epoch)
      : encoder_(config, values, {.stream = stream, .epoch = epoch}),
        payload_(encoder_.max_payload_bytes()) {}

  std::pair<py::bytes, FrameStats> encode(py::handle shard) {
    const FrameStats stats = encode_into(shard, payload_);
    return {py::bytes(reinterpret_cast<const char*>(payload_.data()), stats.payload_bytes), stats};
  }

  FrameStats encode_into_buffer(py::handle shard, py::handle payload) {
    HostBuffer out(payload, true, "payload");
    if (out.size() < encoder_.max_payload_bytes()) {
      throw py::value_error("payload buffer holds " + std::to_string(out.size()) +
                            " bytes; max_payload_bytes is " +
                            std::to_string(encoder_.max_payload_bytes()));
    }
    return encode_into(shard, out.writable_bytes());
  }

  ShardEncoder& encoder() { return encoder_; }
  // Starts a new epoch; refused while another thread encodes.
  void request_key_frame() {
    Exclusive only(busy_, "ShardEncoder");
    encoder_.request_key_frame();
  }

 private:
  FrameStats encode_into(py::handle shard, std::span<std::byte> payload) {
    HostBuffer in(shard, false, "shard");
    check_shard(in, encoder_.config(), encoder_.num_values(), "shard");
    check_apart(in.bytes(), payload, "shard and payload");
    Exclusive only(busy_, "ShardEncoder");
    py::gil_scoped_release release;
    return encoder_.encode(in.bytes(), payload);
  }

  ShardEncoder encoder_;
  std::vector<std::byte> payload_;
  std::atomic<bool> busy_{false};
};

class PyShardDecoder {
 public:
  PyShardDecoder(const CodecConfig& config, uint64_t values, uint32_t stream, uint32_t epoch)
      : decoder_(config, values, {.stream = stream, .epoch = epoch}) {}

  FrameStats decode(py::handle payload, py::handle out) {
    HostBuffer in(payload, false, "payload");
    HostBuffer shard(out, true, "out");
    check_shard(shard, decoder_.config(), decoder_.num_values(), "out");
    check_apart(in.bytes(), shard.bytes(), "payload and out");
    Exclusive only(busy_, "ShardDecoder");
    py::gil_scoped_release release;
    return decoder_.decode(in.bytes(), shard.writable_bytes());
  }

  ShardDecoder& decoder() { return decoder_; }
  // Forgets the cache; refused while another thread decodes.
  void reset() {
    Exclusive only(busy_, "ShardDecoder");
    decoder_.reset();
  }
  void request_resync() {
    Exclusive only(busy_, "ShardDecoder");
    decoder_.request_resync();
  }

 private:
  ShardDecoder decoder_;
  std::atomic<bool> busy_{false};
};

}  // namespace

void bind_codec(py::module_& m) {
  py::enum_<FrameKind>(m, "FrameKind")
      .value("key", FrameKind::kKey)
      .value("delta", FrameKind::kDelta)
      .value("value_delta", FrameKind::kValueDelta);
  py::enum_<ExponentSection>(m, "ExponentSection")
      .value("full", ExponentSection::kFull)
      .value("unchanged", ExponentSection::kUnchanged)
      .value("block", ExponentSection::kBlock)
      .value("fine", ExponentSection::kFine)
      .value("differences", ExponentSection::kDifferences);

  py::class_<FrameStats>(m, "FrameStats",
                         "What one frame contained; sizes in bytes unless named otherwise.")
      .def_readonly("kind", &FrameStats::kind)
      .def_readonly("section", &FrameStats::section)
      .def_readonly("stream", &FrameStats::stream)
      .def_readonly("epoch", &FrameStats::epoch)
      .def_readonly("sequence", &FrameStats::sequence)
      .def_readonly("payload_bytes", &FrameStats::payload_bytes)
      .def_readonly("bitmap_bytes", &FrameStats::bitmap_bytes)
      .def_readonly("sign_mantissa_bytes", &FrameStats::sign_mantissa_bytes)
      .def_readonly("exponent_bytes", &FrameStats::exponent_bytes)
      .def_readonly("blocks", &FrameStats::blocks)
      .def_readonly("changed_blocks", &FrameStats::changed_blocks)
      .def_readonly("changed_values", &FrameStats::changed_values)
      .def_readonly("changed_values_known", &FrameStats::changed_values_known)
      .def_readonly("entropy_symbols", &FrameStats::entropy_symbols)
      .def_readonly("entropy_coded_bytes", &FrameStats::entropy_coded_bytes)
      .def_readonly("entropy_bound_bytes", &FrameStats::entropy_bound_bytes)
      .def_readonly("coded_symbols", &FrameStats::coded_symbols)
      .def_readonly("coded_symbols_entropy_bits", &FrameStats::coded_symbols_entropy_bits)
      .def("__repr__", [](const FrameStats& s) {
        return "FrameStats(kind=" + std::string(frame_kind_name(s.kind)) +
               ", section=" + std::string(exponent_section_name(s.section)) +
               ", stream=" + std::to_string(s.stream) + ", epoch=" + std::to_string(s.epoch) +
               ", sequence=" + std::to_string(s.sequence) +
               ", payload_bytes=" + std::to_string(s.payload_bytes) + ")";
      });

  py::class_<PyShardEncoder>(
      m, "ShardEncoder",
      "Sender side of one shard (paper §3.1): encode() each step's values into a payload. Every "
      "payload names its stream: `stream` (distinct per sender and shard) and `epoch` (draw a "
      "fresh one with new_stream_epoch() each time the sender starts).")
      .def(py::init<const CodecConfig&, uint64_t, uint32_t, uint32_t>(), py::arg("config"),
           py::arg("values"), py::kw_only(), py::arg("stream") = 0, py::arg("epoch") = 1)
      .def("encode", &PyShardEncoder::encode, py::arg("shard"),
           "(payload: bytes, FrameStats) for `shard`, `values` values of config.dtype (a buffer or "
           "a CPU tensor).")
      .def("encode_into", &PyShardEncoder::encode_into_buffer, py::arg("shard"), py::arg("payload"),
           "Encodes into a writable buffer of at least max_payload_bytes; the payload is its first "
           "FrameStats.payload_bytes bytes.")
      .def(
          "request_key_frame", &PyShardEncoder::request_key_frame,
          "Makes the next frame a key frame of a new epoch (resynchronises a receiver).")
      .def_property_readonly("values", [](PyShardEncoder& e) { return e.encoder().num_values(); })
      .def_property_readonly("max_payload_bytes",
                             [](PyShardEncoder& e) { return e.encoder().max_payload_bytes(); })
      .def_property_readonly("config", [](PyShardEncoder& e) { return e.encoder().config(); })
      .def_property_readonly("stream", [](PyShardEncoder& e) { return e.encoder().stream(); })
      .def_property_readonly("epoch", [](PyShardEncoder& e) { return e.encoder().epoch(); })
      .def_property_readonly("next_sequence",
                             [](PyShardEncoder& e) { return e.encoder().next_sequence(); })
      .def_property_readonly(
          "cache_bytes", [](PyShardEncoder& e) { return e.encoder().cache_bytes(); },
          "Bytes of persistent sender state.");

  py::class_<PyShardDecoder>(m, "ShardDecoder",
                             "Receiver side of one peer shard; owns its exponent cache. Accepts "
                             "only the stream (`stream`, `epoch`) it was made for, in sequence.")
      .def(py::init<const CodecConfig&, uint64_t, uint32_t, uint32_t>(), py::arg("config"),
           py::arg("values"), py::kw_only(), py::arg("stream") = 0, py::arg("epoch") = 1)
      .def("decode", &PyShardDecoder::decode, py::arg("payload"), py::arg("out"),
           "Reconstructs the shard bit for bit into `out`, or raises FormatError naming the "
           "problem; after an error the decoder is unchanged and usable, and `out` holds "
           "unspecified values (it may be partly written). Bit for bit is checked by the "
           "payload's content checksum: with config.content_checksum off on both sides, a "
           "damaged payload or a frame on another base decodes to wrong values without an error.")
      .def(
          "reset", &PyShardDecoder::reset,
          "Forgets the cache and asks for a resynchronisation: the next frame must be a key frame.")
      .def("request_resync", &PyShardDecoder::request_resync,
           "This receiver asked the sender for a key frame (ShardEncoder.request_key_frame): the "
           "next key frame may come from a later epoch of the stream.")
      .def_property_readonly("values", [](PyShardDecoder& d) { return d.decoder().num_values(); })
      .def_property_readonly("config", [](PyShardDecoder& d) { return d.decoder().config(); })
      .def_property_readonly("has_cache", [](PyShardDecoder& d) { return d.decoder().has_cache(); })
      .def_property_readonly("stream", [](PyShardDecoder& d) { return d.decoder().stream(); })
      .def_property_readonly("epoch", [](PyShardDecoder& d) { return d.decoder().epoch(); })
      .def_property_readonly("last_sequence",
                             [](PyShardDecoder& d) { return d.decoder().last_sequence(); })
      .def_property_readonly(
          "cache_bytes", [](PyShardDecoder& d) { return d.decoder().cache_bytes(); },
          "Bytes of the cache: the exponents (exponent reuse) or the previous values (value-delta "
          "streams).");

  // One-shot key frames over any buffer (bytes, NumPy arrays, CPU tensors).
  m.def("new_stream_epoch", &new_stream_epoch,
        "A fresh random epoch for a sender that starts (or restarts) a stream.");
  m.def(
      "max_payload_bytes",
      [](DType d, uint64_t n, uint32_t b) { return max_payload_bytes(d, n, b); }, py::arg("dtype"),
      py::arg("values"), py::arg("block_values") = 512);
  m.def(
      "encode_stateless",
      [](const CodecConfig& c, py::handle shard) {
        HostBuffer in(shard, false, "shard");
        in.check_elements(c.dtype, "shard");
        const uint64_t values = in.size() / dtype_info(c.dtype).value_bytes;
        std::string payload(max_payload_bytes(c.dtype, values, c.block_values), '\0');
        size_t length;
        {
          py::gil_scoped_release release;
          length = encode_stateless(c, in.bytes(),
                                    {reinterpret_cast<std::byte*>(payload.data()), payload.size()});
        }
        return py::bytes(payload.data(), length);
      },
      py::arg("config"), py::arg("shard"));
  m.def(
      "decode_stateless",
      [](const CodecConfig& c, py::handle payload, py::handle out) {
        HostBuffer in(payload, false, "payload");
        HostBuffer shard(out, true, "out");
        shard.check_elements(c.dtype, "out");
        check_apart(in.bytes(), shard.bytes(), "payload and out");
        py::gil_scoped_release release;
        decode_stateless(c, in.bytes(), shard.writable_bytes());
      },
      py::arg("config"), py::arg("payload"), py::arg("out"));
}

}  // namespace ciera::python
