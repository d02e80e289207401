// Exponent-change characterisation (include/ciera/analysis.hpp, docs/analysis.md): parameter
// types, ChangeCounts and their sums. Python renders them (JSON, plots); it never re-counts.
#include <pybind11/stl.h>

#include <algorithm>

#include <memory>
#include <string>
#include <vector>

#include "bind.hpp"
#include "ciera/analysis.hpp"
#include "ciera/error.hpp"

namespace ciera::python {
namespace {

std::vector<uint64_t> list_of(std::span<const uint64_t> values) {
  return {values.begin(), values.end()};
}

// The C++ API asserts what Python callers can get wrong (counts of one grid, indices inside it);
// from Python each is an error naming the problem, never an access past the end of a list.
void check_shape(const ChangeCounts& c) {
  if (c.blocks.size() != c.changed_blocks.size() || c.shards.size() != c.changed_shards.size()) {
    throw ConfigError("ChangeCounts: " + std::to_string(c.blocks.size()) + " block cells but " +
                      std::to_string(c.changed_blocks.size()) + " changed-block cells, " +
                      std::to_string(c.shards.size()) + " shard cells but " +
                      std::to_string(c.changed_shards.size()) + " changed-shard cells");
  }
}

void check_same_grid(const ChangeCounts& a, const ChangeCounts& b) {
  check_shape(a);
  check_shape(b);
  const bool a_empty = a.blocks.empty() && a.shards.empty();
  if (!a_empty && !(b.blocks.empty() && b.shards.empty()) &&
      (a.blocks.size() != b.blocks.size() || a.shards.size() != b.shards.size())) {
    throw ConfigError("ChangeCounts of different grids (" + std::to_string(a.blocks.size()) +
                      " and " + std::to_string(b.blocks.size()) + " cells) cannot be added");
  }
}

void check_index(size_t index, size_t size, const char* what) {
  if (index >= size) {
    throw py::index_error(std::string(what) + " " + std::to_string(index) + " is out of range (" +
                          std::to_string(size) + ")");
  }
}

ChangeCounts observe_bytes(ExponentChangeCounter& counter, std::span<const std::byte> bytes) {
  InUse only(&counter, "ExponentChangeCounter");
  py::gil_scoped_release release;
  return counter.observe(bytes);
}

// Parameter types and the grid of world and block sizes counts are kept for.
void bind_shard_types(py::module_& m) {
  auto shard_type = py::enum_<ShardType>(m, "ShardType");
  for (size_t i = 0; i < kShardTypeCount; ++i) {
    const auto type = static_cast<ShardType>(i);
    shard_type.value(std::string(to_string(type)).c_str(), type);
  }
  m.def(
      "classify_parameter",
      [](const std::string& name) { return std::string(to_string(classify_parameter(name))); },
      py::arg("name"),
      "Shard type of a parameter name: expert_ffn, attention, router, norm, embedding, dense_ffn "
      "or other.");

  py::class_<ChangeGrid>(m, "ChangeGrid",
                         "The world sizes W and block sizes B statistics are computed for.")
      .def(py::init<>())
      .def(py::init([](std::vector<uint32_t> worlds, std::vector<uint32_t> blocks) {
             return ChangeGrid{std::move(worlds), std::move(blocks)};
           }),
           py::arg("worlds"), py::arg("block_values"))
      .def_readonly("worlds", &ChangeGrid::worlds)
      .def_readonly("block_values", &ChangeGrid::block_values)
      .def("cells", &ChangeGrid::cells)
      .def(
          "cell",
          [](const ChangeGrid& g, size_t world_index, size_t block_index) {
            check_index(world_index, g.worlds.size(), "world index");
            check_index(block_index, g.block_values.size(), "block index");
            return g.cell(world_index, block_index);
          },
          py::arg("world_index"), py::arg("block_index"));
}

// Counts of changed exponents, values, blocks and shards.
void bind_change_counts(py::module_& m) {
  // Sums over transitions and tensors; per-cell lists are indexed by ChangeGrid.cell(w, b).
  // Pickled as its fields, so that ranks can exchange them (torch's all_gather_object).
  py::class_<ChangeCounts>(m, "ChangeCounts")
      .def(py::init<>())
      .def(py::init<const ChangeGrid&>(), py::arg("grid"))
      .def_readonly("transitions", &ChangeCounts::transitions)
      .def_readonly("values", &ChangeCounts::values)
      .def_readonly("changed_values", &ChangeCounts::changed_values)
      .def_readonly("blocks", &ChangeCounts::blocks)
      .def_readonly("changed_blocks", &ChangeCounts::changed_blocks)
      .def_readonly("shards", &ChangeCounts::shards)
      .def_readonly("changed_shards", &ChangeCounts::changed_shards)
      .def("element_change_rate", &ChangeCounts::element_change_rate)
      .def(
          "block_change_rate",
          [](const ChangeCounts& c, size_t cell) {
            check_index(cell, std::min(c.blocks.size(), c.changed_blocks.size()), "cell");
            return c.block_change_rate(cell);
          },
          py::arg("cell"))
      .def(
          "shard_change_rate",
          [](const ChangeCounts& c, size_t world_index) {
            check_index(world_index, std::min(c.shards.size(), c.changed_shards.size()),
                        "world index");
            return c.shard_change_rate(world_index);
          },
          py::arg("world_index"))
      .def("__iadd__",
           [](ChangeCounts& a, const ChangeCounts& b) -> ChangeCounts& {
             check_same_grid(a, b);
             return a += b;
           })
      .def("__add__",
           [](const ChangeCounts& a, const ChangeCounts& b) {
             check_same_grid(a, b);
             ChangeCounts sum = a;
             return sum += b;
           })
      .def(py::pickle(
          [](const ChangeCounts& c) {
            return py::make_tuple(c.transitions, c.values, c.changed_values, c.blocks,
                                  c.changed_blocks, c.shards, c.changed_shards);
          },
          [](const py::tuple& t) {
            if (t.size() != 7) throw ConfigError("ChangeCounts: a pickled state has 7 fields");
            ChangeCounts c;
            c.transitions = t[0].cast<uint64_t>();
            c.values = t[1].cast<uint64_t>();
            c.changed_values = t[2].cast<uint64_t>();
            c.blocks = t[3].cast<std::vector<uint64_t>>();
            c.changed_blocks = t[4].cast<std::vector<uint64_t>>();
            c.shards = t[5].cast<std::vector<uint64_t>>();
            c.changed_shards = t[6].cast<std::vector<uint64_t>>();
            check_shape(c);
            return c;
          }));
}

// Counting in a training loop, and statistics over many tensors.
void bind_change_counters(py::module_& m) {
  // One counter per parameter inside a training loop: observe() after each optimizer step.
  py::class_<ExponentChangeCounter>(m, "ExponentChangeCounter")
      .def(py::init([](DType dtype, uint64_t values, std::vector<uint32_t> worlds,
                       std::vector<uint32_t> blocks, uint32_t warmup_steps) {
             return std::make_unique<ExponentChangeCounter>(
                 dtype, values, ChangeGrid{std::move(worlds), std::move(blocks)}, warmup_steps);
           }),
           py::arg("dtype"), py::arg("values"), py::arg("worlds") = ChangeGrid{}.worlds,
           py::arg("blocks") = ChangeGrid{}.block_values, py::arg("warmup_steps") = 0)
      .def(
          "observe",
          [](ExponentChangeCounter& c, uintptr_t data_ptr, uint64_t nbytes) {
            return observe_bytes(c, bytes_at<const std::byte>(data_ptr, nbytes, "data_ptr"));
          },
          py::arg("data_ptr"), py::arg("nbytes"),
          "Counts the changes since the previous snapshot (the first is the baseline) and returns "
          "them; the memory at data_ptr holds `values` values of `dtype`, on the host.")
      .def(
          "observe",
          [](ExponentChangeCounter& c, py::handle snapshot) {
            HostBuffer in(snapshot, false, "snapshot");
            return observe_bytes(c, in.bytes());
          },
          py::arg("snapshot"), "The same, for a buffer or a CPU tensor.")
      .def_property_readonly("dtype", &ExponentChangeCounter::dtype)
      .def_property_readonly("values", &ExponentChangeCounter::num_values)
      .def_property_readonly("grid", &ExponentChangeCounter::grid)
      .def_property_readonly("warmup_steps", &ExponentChangeCounter::warmup_steps)
      .def_property_readonly("transitions",
                             [](const ExponentChangeCounter& c) {
                               InUse only(&c, "ExponentChangeCounter");
                               return c.transitions();
                             })
      .def_property_readonly(
          "total",
          [](const ExponentChangeCounter& c) {
            InUse only(&c, "ExponentChangeCounter");
            return c.total();
          },
          "Counts summed over the transitions after warmup.")
      .def_property_readonly(
          "changed_values_per_step",
          [](const ExponentChangeCounter& c) {
            InUse only(&c, "ExponentChangeCounter");
            return list_of(c.changed_values_per_step());
          },
          "Changed values of every transition, warmup included.");

  // Sums of ChangeCounts over tensors and steps: per step, per step and type, and after warmup.
  py::class_<ChangeStatistics>(m, "ChangeStatistics")
      .def(py::init<ChangeGrid, uint32_t>(), py::arg("grid"), py::arg("warmup_steps"))
      .def(
          "add",
          [](ChangeStatistics& s, uint32_t step, ShardType type, const ChangeCounts& counts) {
            if (step < 1) throw py::value_error("ChangeStatistics.add: steps count from 1");
            check_same_grid(ChangeCounts(s.grid()), counts);
            s.add(step, type, counts);
          },
          py::arg("step"), py::arg("type"), py::arg("counts"),
          "Adds one tensor's counts of transition `step` (>= 1).")
      .def_property_readonly("grid", &ChangeStatistics::grid)
      .def_property_readonly("warmup_steps", &ChangeStatistics::warmup_steps)
      .def_property_readonly("steps", &ChangeStatistics::steps)
      .def("step", py::overload_cast<uint32_t>(&ChangeStatistics::step, py::const_),
           py::arg("step"))
      .def("step", py::overload_cast<uint32_t, ShardType>(&ChangeStatistics::step, py::const_),
           py::arg("step"), py::arg("type"))
      .def("total", py::overload_cast<>(&ChangeStatistics::total, py::const_))
      .def("total", py::overload_cast<ShardType>(&ChangeStatistics::total, py::const_),
           py::arg("type"));
}

}  // namespace

void bind_analysis(py::module_& m) {
  bind_shard_types(m);
  bind_change_counts(m);
  bind_change_counters(m);
}

}  // namespace ciera::python
