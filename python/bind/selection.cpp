// Benefit-driven selective compression (include/ciera/selection.hpp, paper §3.2): the cost model,
// warmup change statistics and the selector. Results are classes with read-only properties.
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "bind.hpp"
#include "ciera/selection.hpp"

namespace ciera::python {

namespace {

// The cost model: collective and codec times measured on the transport.
void bind_cost_model(py::module_& m) {
  py::class_<CommCurve>(m, "CommCurve")
      .def_static(
          "fit",
          [](const std::vector<std::pair<double, double>>& points) {
            std::vector<CommSample> samples;
            for (const auto& [bytes, seconds] : points) samples.push_back({bytes, seconds});
            return CommCurve::fit(std::move(samples));
          },
          py::arg("points"), "Comm(bytes) through (bytes, seconds) points.")
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
      .def(
          "throughput", [](const CostModel& c, DType d) { return c.throughput(d); },
          py::arg("dtype"))
      .def(
          "set_throughput",
          [](CostModel& c, DType d, const CodecThroughput& t) { c.throughput(d) = t; },
          py::arg("dtype"), py::arg("throughput"))
      .def(
          "delta_throughput", [](const CostModel& c, DType d) { return c.delta_throughput(d); },
          py::arg("dtype"), "The value-delta codec's speed (the delta policy); zero: not measured.")
      .def(
          "set_delta_throughput",
          [](CostModel& c, DType d, const CodecThroughput& t) { c.delta_throughput(d) = t; },
          py::arg("dtype"), py::arg("throughput"));
  m.def(
      "measure_cost_model",
      [](std::shared_ptr<Transport> transport, uint64_t largest_bytes, std::vector<DType> dtypes,
         const CodecConfig& codec, int repeats) {
        py::gil_scoped_release release;  // collective; a Python transport re-takes the GIL per call
        return measure_cost_model(*transport, largest_bytes, dtypes, codec, repeats);
      },
      py::arg("transport").none(false), py::arg("largest_bytes"), py::arg("dtypes"), py::arg("codec"),
      py::arg("repeats") = 5,
      "Comm(bytes) of this transport and the codec's speed per dtype, the same on every rank "
      "(collective).");
  m.def(
      "measure_codec",
      [](const CodecConfig& codec, uint64_t values) {
        py::gil_scoped_release release;
        return measure_codec(codec, values);
      },
      py::arg("codec"), py::arg("values") = uint64_t{1} << 20,
      "Detection, encoding and decoding throughput of this machine (bytes of raw shard per "
      "second), for the codec's stream_kind.");
  m.def("expected_delta_payload_bytes", &expected_delta_payload_bytes, py::arg("values"),
        py::arg("section_bits_per_value"),
        "Expected value-delta frame of a shard: the payload header plus the measured section.");
  m.def("compressed_round_overhead_s", &compressed_round_overhead_s, py::arg("model"),
        "Extra latency a bucket pays once any of its shards is compressed.");
}

// Warmup change statistics per shard (q_i, measured).
void bind_change_monitor(py::module_& m) {
  // Pickled as its seven counts, so that ranks can exchange them (torch's all_gather_object); the
  // five of an older pickle (before value tracking) are accepted, the others then zero.
  py::class_<ShardChangeCounts>(m, "ShardChangeCounts")
      .def(py::init<>())
      .def_readonly("observations", &ShardChangeCounts::observations)
      .def_readonly("values", &ShardChangeCounts::values)
      .def_readonly("blocks", &ShardChangeCounts::blocks)
      .def_readonly("changed_values", &ShardChangeCounts::changed_values)
      .def_readonly("changed_blocks", &ShardChangeCounts::changed_blocks)
      .def_readonly("changed_patterns", &ShardChangeCounts::changed_patterns)
      .def_readonly("value_delta_bits", &ShardChangeCounts::value_delta_bits)
      .def_property_readonly("value_change_rate", &ShardChangeCounts::value_change_rate)
      .def_property_readonly("block_change_rate", &ShardChangeCounts::block_change_rate)
      .def_property_readonly("pattern_change_rate", &ShardChangeCounts::pattern_change_rate)
      .def_property_readonly("delta_bits_per_value", &ShardChangeCounts::delta_bits_per_value)
      .def("merge", &ShardChangeCounts::merge, py::arg("other"),
           "Adds another rank's counts of the same shard (the observation count is shared).")
      .def(py::pickle(
          [](const ShardChangeCounts& c) {
            return py::make_tuple(c.observations, c.values, c.blocks, c.changed_values,
                                  c.changed_blocks, c.changed_patterns, c.value_delta_bits);
          },
          [](const py::tuple& t) {
            if (t.size() != 5 && t.size() != 7) {
              throw ConfigError("ShardChangeCounts: a pickled state has 7 counts (or 5), got " +
                                std::to_string(t.size()));
            }
            auto at = [&](size_t i) { return i < t.size() ? t[i].cast<uint64_t>() : uint64_t{0}; };
            return ShardChangeCounts{at(0), at(1), at(2), at(3), at(4), at(5), at(6)};
          }));
  py::class_<ChangeMonitor>(m, "ChangeMonitor")
      .def(py::init<DType, std::vector<uint64_t>, uint32_t, bool>(), py::arg("dtype"),
           py::arg("shard_values"), py::arg("block_values"), py::arg("track_values") = false,
           "track_values: also keep the previous values (value_bytes per value) and count what "
           "the delta policy needs (changed_patterns, value_delta_bits).")
      .def(
          "observe",
          [](ChangeMonitor& monitor, uintptr_t data, uint64_t bytes) {
            const auto snapshot = bytes_at<const std::byte>(data, bytes, "data_ptr");
            InUse only(&monitor, "ChangeMonitor");
            py::gil_scoped_release release;
            monitor.observe(snapshot);
          },
          py::arg("data_ptr"), py::arg("nbytes"),
          "One thread at a time: a call while another thread's observe() is in flight is a "
          "RuntimeError, as are counts, memory_bytes and clear_counts() then.")
      .def_property_readonly("counts",
                             [](const ChangeMonitor& monitor) {
                               InUse only(&monitor, "ChangeMonitor");
                               return monitor.counts();
                             })
      .def_property_readonly("tracks_values", &ChangeMonitor::tracks_values)
      .def("clear_counts",
           [](ChangeMonitor& monitor) {
             InUse only(&monitor, "ChangeMonitor");
             monitor.clear_counts();
           })
      .def_property_readonly("memory_bytes", [](const ChangeMonitor& monitor) {
        InUse only(&monitor, "ChangeMonitor");
        return monitor.memory_bytes();
      });
}

// The budgeted selector and its result.
void bind_selector(py::module_& m) {
  py::class_<ShardCandidate>(m, "ShardCandidate")
      .def(py::init<>())
      .def_readwrite("group", &ShardCandidate::group)
      .def_readwrite("bucket", &ShardCandidate::bucket)
      .def_readwrite("param", &ShardCandidate::param)
      .def_readwrite("name", &ShardCandidate::name)
      .def_readwrite("type", &ShardCandidate::type)
      .def_readwrite("dtype", &ShardCandidate::dtype)
      .def_readwrite("shard_values", &ShardCandidate::shard_values)
      .def_readwrite("block_change_rate", &ShardCandidate::block_change_rate)
      .def_readwrite("value_change_rate", &ShardCandidate::value_change_rate)
      .def_readwrite("delta_bits_per_value", &ShardCandidate::delta_bits_per_value)
      .def_readwrite("regathers", &ShardCandidate::regathers);
  py::class_<SelectorOptions>(m, "SelectorOptions")
      .def(py::init<>())
      .def_readwrite("cache_budget_bytes", &SelectorOptions::cache_budget_bytes)
      .def_readwrite("overlap", &SelectorOptions::overlap)
      .def_readwrite("codec", &SelectorOptions::codec)
      .def_readwrite("allow_delta", &SelectorOptions::allow_delta);
  py::class_<PolicyEstimate>(m, "PolicyEstimate")
      .def_readonly("expected_wire_bytes", &PolicyEstimate::expected_wire_bytes)
      .def_readonly("comm_saved_s", &PolicyEstimate::comm_saved_s)
      .def_readonly("encode_s", &PolicyEstimate::encode_s)
      .def_readonly("decode_s", &PolicyEstimate::decode_s)
      .def_readonly("gain_s", &PolicyEstimate::gain_s)
      .def_readonly("memory_bytes", &PolicyEstimate::memory_bytes)
      .def_readonly("score", &PolicyEstimate::score)
      .def_readonly("unavailable", &PolicyEstimate::unavailable);

  // A choice also answers for its candidate's fields (bucket, param, name, type, rates).
  py::class_<ShardChoice>(m, "ShardChoice")
      .def_readonly("shard", &ShardChoice::shard)
      .def_property_readonly("group", [](const ShardChoice& c) { return c.shard.group; })
      .def_property_readonly("bucket", [](const ShardChoice& c) { return c.shard.bucket; })
      .def_property_readonly("param", [](const ShardChoice& c) { return c.shard.param; })
      .def_property_readonly("name", [](const ShardChoice& c) { return c.shard.name; })
      .def_property_readonly("type", [](const ShardChoice& c) { return c.shard.type; })
      .def_property_readonly("regathers", [](const ShardChoice& c) { return c.shard.regathers; })
      .def_property_readonly("block_change_rate",
                             [](const ShardChoice& c) { return c.shard.block_change_rate; })
      .def_property_readonly("value_change_rate",
                             [](const ShardChoice& c) { return c.shard.value_change_rate; })
      .def_readonly("raw_bytes", &ShardChoice::raw_bytes)
      .def_readonly("expected_wire_bytes", &ShardChoice::expected_wire_bytes)
      .def_readonly("comm_saved_s", &ShardChoice::comm_saved_s)
      .def_readonly("encode_s", &ShardChoice::encode_s)
      .def_readonly("decode_s", &ShardChoice::decode_s)
      .def_readonly("gain_s", &ShardChoice::gain_s)
      .def_readonly("memory_bytes", &ShardChoice::memory_bytes)
      .def_readonly("score", &ShardChoice::score)
      .def_readonly("delta", &ShardChoice::delta)
      .def_readonly("policy", &ShardChoice::policy)
      .def_readonly("chosen", &ShardChoice::chosen)
      .def_readonly("chosen_memory_bytes", &ShardChoice::chosen_memory_bytes)
      .def_readonly("chosen_gain_s", &ShardChoice::chosen_gain_s)
      .def_readonly("reason", &ShardChoice::reason);
  py::class_<Selection>(m, "Selection")
      .def_readonly("shards", &Selection::shards)
      .def_readonly("cache_bytes", &Selection::cache_bytes)
      .def_readonly("budget_bytes", &Selection::budget_bytes)
      .def_readonly("gain_s", &Selection::gain_s)
      .def("chosen_count", &Selection::chosen_count)
      .def("policy", py::overload_cast<size_t, size_t>(&Selection::policy, py::const_),
           py::arg("bucket"), py::arg("param"))
      .def("policy", py::overload_cast<size_t, size_t, size_t>(&Selection::policy, py::const_),
           py::arg("group"), py::arg("bucket"), py::arg("param"))
      .def("count", &Selection::count, py::arg("policy"));
  m.def(
      "select_shards",
      [](const std::vector<ShardCandidate>& candidates, const CostModel& model,
         const SelectorOptions& options) { return select_shards(candidates, model, options); },
      py::arg("candidates"), py::arg("model"), py::arg("options"),
      "Benefit-driven selection (paper §3.2): per-shard gains and choices.");
  m.def(
      "select_shards",
      [](const std::vector<ShardCandidate>& candidates, const std::vector<CostModel>& models,
         const SelectorOptions& options) { return select_shards(candidates, models, options); },
      py::arg("candidates"), py::arg("models"), py::arg("options"),
      "The same over the shards of several groups (candidate.group indexes `models`), one budget "
      "for all.");
}

}  // namespace

void bind_selection(py::module_& m) {
  bind_cost_model(m);
  bind_change_monitor(m);
  bind_selector(m);
}

}  // namespace ciera::python
