#include <pybind11/stl.h>

#include <cmath>
#include <string>

#include "bind.hpp"
#include "ciera/config.hpp"
#include "ciera/dtype.hpp"
#include "ciera/engine.hpp"

namespace ciera::python {

void bind_config(py::module_& m) {
  py::enum_<DType>(m, "DType")
      .value("bf16", DType::kBF16)
      .value("fp16", DType::kFP16)
      .value("fp32", DType::kFP32);
  py::enum_<ChangeDetection>(m, "ChangeDetection")
      .value("exact", ChangeDetection::kExact)
      .value("hash", ChangeDetection::kHash);
  py::enum_<ExponentCoding>(m, "ExponentCoding")
      .value("auto", ExponentCoding::kAuto)
      .value("block", ExponentCoding::kBlock)
      .value("fine", ExponentCoding::kFine);
  py::enum_<ShardPolicy>(m, "ShardPolicy")
      .value("raw", ShardPolicy::kRaw)
      .value("ciera", ShardPolicy::kCiera)
      .value("delta", ShardPolicy::kDelta)
      .value("zeropp_int8", ShardPolicy::kZeroppInt8)
      .value("sdp4bit", ShardPolicy::kSdp4bit)
      .value("stateless", ShardPolicy::kStateless);
  m.def("parse_shard_policy", [](std::string_view name) { return parse_shard_policy(name); },
        "The policy of one name: raw, ciera, delta, zeropp-int8, sdp4bit or stateless (`ciera train --codec` "
        "names schemes, not policies: it also takes auto and zipnn, and has no raw).");
  m.def("shard_policy_name", [](ShardPolicy p) { return std::string(shard_policy_name(p)); });
  m.def("lossy_policy", &lossy_policy, "Whether gathers of this policy may differ from the input.");
  py::enum_<StreamKind>(m, "StreamKind")
      .value("exponent_reuse", StreamKind::kExponentReuse)
      .value("value_delta", StreamKind::kValueDelta)
      .value("zeropp_int8", StreamKind::kZeroppInt8)
      .value("sdp4bit", StreamKind::kSdp4bit)
      .value("stateless", StreamKind::kStateless);
  py::enum_<WarmupMode>(m, "WarmupMode")
      .value("raw", WarmupMode::kRaw)
      .value("key_frames", WarmupMode::kKeyFrames);

  py::class_<CodecConfig>(m, "CodecConfig")
      .def(py::init<>())
      .def_readonly_static("MIN_BLOCK_VALUES", &CodecConfig::kMinBlockValues)
      .def_readonly_static("MAX_BLOCK_VALUES", &CodecConfig::kMaxBlockValues)
      .def_readwrite("dtype", &CodecConfig::dtype)
      .def_readwrite("stream_kind", &CodecConfig::stream_kind)
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
          [](EngineConfig& c, double s) {
            // Checked before the conversion, which a NaN or a huge value would make undefined;
            // below 1e9 s as the transports' own timeouts (milliseconds_of), and rounded up to a
            // whole millisecond as they are: truncated, 0.0004 s was a timeout of 0.
            if (!(std::isfinite(s) && s > 0 && s < 1e9)) {
              throw py::value_error(
                  "EngineConfig.timeout_s must be a finite number of seconds > 0 and below 1e9, got " +
                  py::str(py::float_(s)).cast<std::string>());
            }
            c.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000)));
          });
}

}  // namespace ciera::python
