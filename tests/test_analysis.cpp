// Exponent-change characterisation (docs/analysis.md): counting against hand-worked cases and a
// literal per-block reference, parameter classification on real transformers names, and the
// safetensors reader on good and broken files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "analysis/checkpoints.hpp"
#include "analysis/json_text.hpp"
#include "analysis/safetensors.hpp"
#include "ciera/analysis.hpp"
#include "ciera/error.hpp"

namespace ciera {
namespace {

namespace fs = std::filesystem;

const DType kDTypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};

// --- value helpers ---------------------------------------------------------------------------

uint32_t one_bits(DType dtype) {  // 1.0
  switch (dtype) {
    case DType::kBF16:
      return 0x3F80;
    case DType::kFP16:
      return 0x3C00;
    case DType::kFP32:
      return 0x3F800000u;
  }
  return 0;
}
uint32_t two_bits(DType dtype) {  // 2.0: the exponent of 1.0 plus one
  switch (dtype) {
    case DType::kBF16:
      return 0x4000;
    case DType::kFP16:
      return 0x4000;
    case DType::kFP32:
      return 0x40000000u;
  }
  return 0;
}

std::vector<std::byte> pack(DType dtype, const std::vector<uint32_t>& bits) {
  const uint32_t size = dtype_info(dtype).value_bytes;
  std::vector<std::byte> out(bits.size() * size);
  for (size_t i = 0; i < bits.size(); ++i) {
    for (uint32_t b = 0; b < size; ++b)
      out[i * size + b] = static_cast<std::byte>(bits[i] >> (8 * b));
  }
  return out;
}

// n copies of 1.0, and the same with 2.0 at `changed`.
std::pair<std::vector<std::byte>, std::vector<std::byte>> snapshots(
    DType dtype, uint64_t n, const std::vector<uint64_t>& changed) {
  std::vector<uint32_t> before(n, one_bits(dtype)), after(n, one_bits(dtype));
  for (uint64_t p : changed) after[p] = two_bits(dtype);
  return {pack(dtype, before), pack(dtype, after)};
}

// The literal definition: walk every shard of every W and every block of every B.
ChangeCounts reference_counts(uint64_t n, const std::set<uint64_t>& changed,
                              const ChangeGrid& grid) {
  ChangeCounts c(grid);
  c.transitions = 1;
  c.values = n;
  c.changed_values = changed.size();
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    const uint64_t shard = (n + grid.worlds[w] - 1) / grid.worlds[w];
    for (uint32_t rank = 0; rank < grid.worlds[w]; ++rank) {
      const uint64_t begin = std::min<uint64_t>(n, rank * shard);
      const uint64_t end = std::min<uint64_t>(n, begin + shard);
      if (begin == end) continue;  // an empty shard carries nothing
      ++c.shards[w];
      bool shard_changed = false;
      for (uint64_t p = begin; p < end; ++p) shard_changed |= changed.count(p) > 0;
      c.changed_shards[w] += shard_changed;
      for (size_t b = 0; b < grid.block_values.size(); ++b) {
        for (uint64_t block = begin; block < end; block += grid.block_values[b]) {
          ++c.blocks[grid.cell(w, b)];
          bool block_changed = false;
          for (uint64_t p = block; p < std::min(end, block + grid.block_values[b]); ++p) {
            block_changed |= changed.count(p) > 0;
          }
          c.changed_blocks[grid.cell(w, b)] += block_changed;
        }
      }
    }
  }
  return c;
}

void expect_equal(const ChangeCounts& got, const ChangeCounts& want, const std::string& what) {
  EXPECT_EQ(got.transitions, want.transitions) << what;
  EXPECT_EQ(got.values, want.values) << what;
  EXPECT_EQ(got.changed_values, want.changed_values) << what;
  EXPECT_EQ(got.blocks, want.blocks) << what;
  EXPECT_EQ(got.changed_blocks, want.changed_blocks) << what;
  EXPECT_EQ(got.shards, want.shards) << what;
  EXPECT_EQ(got.changed_shards, want.changed_shards) << what;
}

// --- counting --------------------------------------------------------------------------------

// n = 10 over W = 4: shards of 3 values [0,3) [3,6) [6,9) [9,10); over W = 8: shards of 2 values,
// five of them non-empty; over W = 16: ten shards of one value. Changes at 1, 2 and 9.
TEST(ExponentChanges, HandWorkedUnevenShardsAndPartialBlocks) {
  const ChangeGrid grid{{4, 8, 16}, {2, 4}};
  for (DType dtype : kDTypes) {
    auto [before, after] = snapshots(dtype, 10, {1, 2, 9});
    const ChangeCounts c = count_exponent_changes(dtype, before, after, grid);
    EXPECT_EQ(c.values, 10u);
    EXPECT_EQ(c.changed_values, 3u);
    EXPECT_EQ(c.shards, (std::vector<uint64_t>{4, 5, 10}));
    EXPECT_EQ(c.changed_shards, (std::vector<uint64_t>{2, 3, 3}));
    // Per W: B = 2, B = 4.  W=4: blocks {[0,2) [2,3)} x3 + {[9,10)} = 7; B=4: one per shard = 4.
    EXPECT_EQ(c.blocks, (std::vector<uint64_t>{7, 4, 5, 5, 10, 10}));
    // W=4: [0,2) [2,3) [9,10) changed; B=4: shards 0 and 3.  W=8: [0,2) [2,4) [8,10).
    EXPECT_EQ(c.changed_blocks, (std::vector<uint64_t>{3, 2, 3, 3, 3, 3}));
    EXPECT_DOUBLE_EQ(c.element_change_rate(), 0.3);
    EXPECT_DOUBLE_EQ(c.shard_change_rate(0), 0.5);
    EXPECT_DOUBLE_EQ(c.block_change_rate(grid.cell(0, 0)), 3.0 / 7.0);
  }
}

TEST(ExponentChanges, MatchesTheLiteralDefinitionOnSizesAndPatterns) {
  const ChangeGrid grid;  // W in {4, 8, 16, 32}, B in {64 .. 1024}
  std::mt19937_64 rng(7);
  // 0, 1, odd, below and above a block, not a multiple of anything, past a 16384-value chunk.
  for (uint64_t n : {0ull, 1ull, 3ull, 63ull, 64ull, 1000ull, 4097ull, 16385ull, 70001ull}) {
    for (double density : {0.0, 0.003, 0.05, 1.0}) {
      std::set<uint64_t> changed;
      for (uint64_t p = 0; p < n; ++p) {
        if (std::uniform_real_distribution<double>(0, 1)(rng) < density) changed.insert(p);
      }
      const std::vector<uint64_t> positions(changed.begin(), changed.end());
      for (DType dtype : kDTypes) {
        auto [before, after] = snapshots(dtype, n, positions);
        expect_equal(count_exponent_changes(dtype, before, after, grid),
                     reference_counts(n, changed, grid),
                     std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                         " density=" + std::to_string(density));
      }
    }
  }
}

TEST(ExponentChanges, OnlyExponentBitsCount) {
  // Pairs (before, after) per dtype; the first group keeps its exponent, the second changes it.
  struct Case {
    DType dtype;
    std::vector<std::pair<uint32_t, uint32_t>> same, different;
  };
  const Case cases[] = {
      {DType::kBF16,
       {{0x7FC0, 0x7FC1},
        {0x7F80, 0x7FC0},
        {0x0000, 0x8000},
        {0x3F80, 0xBF80},
        {0x0001, 0x0000},
        {0x3F80, 0x3FFF}},
       {{0x3F80, 0x4000}, {0x7F7F, 0x7F80}, {0x0000, 0x0080}, {0x8000, 0xFFC0}}},
      {DType::kFP16,
       {{0x7E00, 0x7E01},
        {0x7C00, 0x7E00},
        {0x0000, 0x8000},
        {0x3C00, 0xBC00},
        {0x0001, 0x0000},
        {0x3C00, 0x3FFF}},
       {{0x3C00, 0x4000}, {0x7BFF, 0x7C00}, {0x0000, 0x0400}, {0x8000, 0xFE00}}},
      {DType::kFP32,
       {{0x7FC00000u, 0x7FC00001u},
        {0x7F800000u, 0x7FC00000u},
        {0x00000000u, 0x80000000u},
        {0x3F800000u, 0xBF800000u},
        {0x00000001u, 0x00000000u},
        {0x3F800000u, 0x3FFFFFFFu}},
       {{0x3F800000u, 0x40000000u},
        {0x7F7FFFFFu, 0x7F800000u},
        {0x00000000u, 0x00800000u},
        {0x80000000u, 0xFFC00000u}}},
  };
  const ChangeGrid grid{{1}, {1}};
  for (const Case& c : cases) {
    std::vector<uint32_t> before, after;
    for (auto [b, a] : c.same) before.push_back(b), after.push_back(a);
    for (auto [b, a] : c.different) before.push_back(b), after.push_back(a);
    const ChangeCounts counts =
        count_exponent_changes(c.dtype, pack(c.dtype, before), pack(c.dtype, after), grid);
    EXPECT_EQ(counts.changed_values, c.different.size()) << dtype_name(c.dtype);
    EXPECT_EQ(counts.changed_blocks[0], c.different.size()) << dtype_name(c.dtype);
  }
}

TEST(ExponentChanges, EmptyGridCountsElementsOnly) {
  auto [before, after] = snapshots(DType::kBF16, 100, {5, 50});
  const ChangeCounts c = count_exponent_changes(DType::kBF16, before, after, ChangeGrid{{}, {}});
  EXPECT_EQ(c.changed_values, 2u);
  EXPECT_TRUE(c.blocks.empty());
  EXPECT_TRUE(c.shards.empty());
}

TEST(ExponentChanges, RejectsMisshapenInput) {
  std::vector<std::byte> a(10), b(12), odd(3);
  EXPECT_THROW(count_exponent_changes(DType::kBF16, a, b, ChangeGrid{}), ConfigError);
  EXPECT_THROW(count_exponent_changes(DType::kBF16, odd, odd, ChangeGrid{}), ConfigError);
  EXPECT_THROW(count_exponent_changes(DType::kBF16, a, a, ChangeGrid{{0}, {64}}), ConfigError);
  EXPECT_THROW(count_exponent_changes(DType::kBF16, a, a, ChangeGrid{{4}, {0}}), ConfigError);
}

TEST(ExponentChangeCounter, FollowsSnapshotsAndLeavesWarmupOutOfTheTotal) {
  const ChangeGrid grid{{4, 8}, {64, 512}};
  for (DType dtype : kDTypes) {
    const uint64_t n = 5000;
    ExponentChangeCounter counter(dtype, n, grid, /*warmup_steps=*/1);
    std::mt19937_64 rng(3);
    std::vector<uint32_t> bits(n, one_bits(dtype));
    std::vector<std::byte> previous = pack(dtype, bits);
    EXPECT_EQ(counter.observe(previous).values, 0u);  // the baseline
    ChangeCounts want_total(grid);
    for (int step = 1; step <= 4; ++step) {
      for (int k = 0; k < 40; ++k) {
        const uint64_t p = rng() % n;
        bits[p] = bits[p] == one_bits(dtype) ? two_bits(dtype) : one_bits(dtype);
      }
      const std::vector<std::byte> now = pack(dtype, bits);
      const ChangeCounts want = count_exponent_changes(dtype, previous, now, grid);
      expect_equal(counter.observe(now), want, "step " + std::to_string(step));
      if (step > 1) want_total += want;
      previous = now;
    }
    EXPECT_EQ(counter.transitions(), 4u);
    ASSERT_EQ(counter.changed_values_per_step().size(), 4u);
    expect_equal(counter.total(), want_total, std::string(dtype_name(dtype)) + " total");
    EXPECT_EQ(counter.total().transitions, 3u);
  }
}

TEST(ExponentChangeCounter, RejectsASnapshotOfTheWrongSize) {
  ExponentChangeCounter counter(DType::kFP32, 10);
  std::vector<std::byte> wrong(36);
  try {
    counter.observe(wrong);
    FAIL() << "accepted 36 bytes for 10 FP32 values";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("40 bytes"), std::string::npos) << e.what();
  }
}

// --- pieces: ChunkedChangeCounter --------------------------------------------------------------

// `before` and `after` fed to a ChunkedChangeCounter in pieces of the given sizes, in values,
// repeated until the tensor ends (a size of 0 is an empty piece).
ChangeCounts counts_in_pieces(DType dtype, const std::vector<std::byte>& before,
                              const std::vector<std::byte>& after, const ChangeGrid& grid,
                              const std::vector<uint64_t>& piece_values) {
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  const uint64_t n = before.size() / value_bytes;
  ChunkedChangeCounter counter(dtype, n, grid);
  const std::span<const std::byte> whole_before(before), whole_after(after);
  for (size_t piece = 0; counter.values_added() < n; ++piece) {
    const uint64_t first = counter.values_added();
    const uint64_t count = std::min(piece_values[piece % piece_values.size()], n - first);
    counter.add(whole_before.subspan(first * value_bytes, count * value_bytes),
                whole_after.subspan(first * value_bytes, count * value_bytes));
  }
  return counter.counts();
}

// Cuts inside a block, a shard, at a find_changes chunk of 16384 values and one value either
// side of it, single values and empty pieces: every cut counts as the whole tensor does.
TEST(ChunkedChangeCounter, AnyCutCountsAsTheWholeSnapshots) {
  const ChangeGrid grid{{1, 3, 8, 32}, {5, 64, 100, 1024}};
  std::mt19937_64 rng(11);
  const std::vector<std::vector<uint64_t>> cuts = {
      {1}, {7}, {63, 0, 65}, {100}, {1023, 2}, {16383}, {16384}, {16385}, {40000, 1}};
  for (uint64_t n : {0ull, 1ull, 5ull, 999ull, 70001ull}) {
    for (double density : {0.0, 0.01, 1.0}) {
      std::set<uint64_t> changed;
      for (uint64_t p = 0; p < n; ++p) {
        if (std::uniform_real_distribution<double>(0, 1)(rng) < density) changed.insert(p);
      }
      const ChangeCounts want = reference_counts(n, changed, grid);
      const std::vector<uint64_t> positions(changed.begin(), changed.end());
      for (DType dtype : kDTypes) {
        auto [before, after] = snapshots(dtype, n, positions);
        std::vector<std::vector<uint64_t>> all_cuts = cuts;
        std::vector<uint64_t> random_cut;  // cut at random points, a piece at most 3000 values
        for (int i = 0; i < 50; ++i) random_cut.push_back(rng() % 3000);
        random_cut.push_back(1);  // so that the pattern moves on even if all drew 0
        all_cuts.push_back(random_cut);
        for (const std::vector<uint64_t>& cut : all_cuts) {
          expect_equal(counts_in_pieces(dtype, before, after, grid, cut), want,
                       std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + " density=" +
                           std::to_string(density) + " first piece " + std::to_string(cut.front()));
        }
      }
    }
  }
}

// Two changes in one block of B = 4, cut between them: the block is counted once. W = 2 over 10
// values: shards [0, 5) and [5, 10); a cut at 7 splits the second shard, changed at 6 and 8.
TEST(ChunkedChangeCounter, ABlockOrShardSplitByACutIsCountedOnce) {
  const ChangeGrid grid{{2}, {4}};
  auto [before, after] = snapshots(DType::kBF16, 10, {2, 3, 6, 8});
  for (uint64_t cut : {3ull, 7ull}) {
    const ChangeCounts c = counts_in_pieces(DType::kBF16, before, after, grid, {cut, 10});
    EXPECT_EQ(c.changed_values, 4u) << "cut at " << cut;
    EXPECT_EQ(c.changed_shards, (std::vector<uint64_t>{2})) << "cut at " << cut;
    // Blocks [0,4) [4,5) [5,9) [9,10): [0,4) and [5,9) changed.
    EXPECT_EQ(c.blocks, (std::vector<uint64_t>{4})) << "cut at " << cut;
    EXPECT_EQ(c.changed_blocks, (std::vector<uint64_t>{2})) << "cut at " << cut;
  }
}

TEST(ChunkedChangeCounter, RejectsPiecesThatDoNotFitAndIncompleteCounts) {
  ChunkedChangeCounter counter(DType::kBF16, 5, ChangeGrid{{4}, {64}});
  const std::vector<std::byte> four(4), six(6), three(3), eight(8);
  const auto message = [&](std::span<const std::byte> a, std::span<const std::byte> b) {
    try {
      counter.add(a, b);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(four, six).find("pieces of 4 and 6 bytes differ in size"), std::string::npos);
  EXPECT_NE(message(three, three).find("a piece holds 3 bytes, not a whole number of bf16 values"),
            std::string::npos);
  counter.add(four, four);  // values [0, 2)
  EXPECT_NE(message(eight, eight).find("values [2, 6) reach past the 5 values"), std::string::npos);
  EXPECT_EQ(counter.values_added(), 2u);  // the refused pieces added nothing
  try {
    (void)counter.counts();
    FAIL() << "counts of 2 of 5 values were given out";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("2 of 5 values added"), std::string::npos) << e.what();
  }
  counter.add(six, six);
  EXPECT_EQ(counter.counts().values, 5u);
  EXPECT_THROW(ChunkedChangeCounter(DType::kBF16, 5, ChangeGrid{{4}, {0}}), ConfigError);
}

TEST(ChangeStatistics, SumsCountsBySteptypeAndLeavesWarmupOut) {
  const ChangeGrid grid{{4}, {64}};
  ChangeStatistics stats(grid, /*warmup_steps=*/1);
  auto [before, after] = snapshots(DType::kBF16, 256, {0, 100});
  const ChangeCounts c = count_exponent_changes(DType::kBF16, before, after, grid);
  stats.add(1, ShardType::kNorm, c);
  stats.add(2, ShardType::kNorm, c);
  stats.add(2, ShardType::kAttention, c);
  EXPECT_EQ(stats.steps(), 2u);
  EXPECT_EQ(stats.step(1).changed_values, 2u);
  EXPECT_EQ(stats.step(2).changed_values, 4u);
  EXPECT_EQ(stats.step(2, ShardType::kAttention).changed_values, 2u);
  EXPECT_EQ(stats.total().changed_values, 4u);  // step 1 is warmup
  EXPECT_EQ(stats.total().values, 512u);
  EXPECT_EQ(stats.total(ShardType::kNorm).changed_values, 2u);
  EXPECT_EQ(stats.total(ShardType::kNorm).changed_blocks[0], 2u);
  EXPECT_EQ(stats.total(ShardType::kExpertFfn).values, 0u);
  EXPECT_EQ(stats.step(3).values, 0u);
}

// --- classification --------------------------------------------------------------------------

// Names as transformers 5.24 builds them (python/ciera/models.py configs; DeepSeek with dense first
// layers and without q_lora), and the older per-expert checkpoint layouts.
const std::vector<std::pair<std::string, ShardType>> kNames = {
    // OLMoE
    {"model.embed_tokens.weight", ShardType::kEmbedding},
    {"lm_head.weight", ShardType::kEmbedding},
    {"model.norm.weight", ShardType::kNorm},
    {"model.layers.0.self_attn.q_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.k_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.v_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.o_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.q_norm.weight", ShardType::kNorm},
    {"model.layers.0.self_attn.k_norm.weight", ShardType::kNorm},
    {"model.layers.0.mlp.gate.weight", ShardType::kRouter},
    {"model.layers.0.mlp.experts.gate_up_proj", ShardType::kExpertFfn},
    {"model.layers.0.mlp.experts.down_proj", ShardType::kExpertFfn},
    {"model.layers.0.input_layernorm.weight", ShardType::kNorm},
    {"model.layers.0.post_attention_layernorm.weight", ShardType::kNorm},
    {"model.layers.3.mlp.experts.17.gate_proj.weight", ShardType::kExpertFfn},  // older layout
    {"model.layers.3.mlp.experts.17.down_proj.weight", ShardType::kExpertFfn},
    // Mixtral (5.x uses mlp.*, checkpoints on the Hub block_sparse_moe.*)
    {"model.layers.1.mlp.gate.weight", ShardType::kRouter},
    {"model.layers.1.block_sparse_moe.gate.weight", ShardType::kRouter},
    {"model.layers.1.block_sparse_moe.experts.7.w1.weight", ShardType::kExpertFfn},
    {"model.layers.1.block_sparse_moe.experts.7.w2.weight", ShardType::kExpertFfn},
    {"model.layers.1.block_sparse_moe.experts.7.w3.weight", ShardType::kExpertFfn},
    // Qwen2-MoE
    {"model.layers.0.self_attn.q_proj.bias", ShardType::kAttention},
    {"model.layers.0.mlp.shared_expert.gate_proj.weight", ShardType::kExpertFfn},
    {"model.layers.0.mlp.shared_expert.up_proj.weight", ShardType::kExpertFfn},
    {"model.layers.0.mlp.shared_expert.down_proj.weight", ShardType::kExpertFfn},
    {"model.layers.0.mlp.shared_expert_gate.weight", ShardType::kRouter},
    // DeepSeek V2 / V3
    {"model.layers.0.self_attn.q_a_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.q_a_layernorm.weight", ShardType::kNorm},
    {"model.layers.0.self_attn.q_b_proj.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", ShardType::kAttention},
    {"model.layers.0.self_attn.kv_a_layernorm.weight", ShardType::kNorm},
    {"model.layers.0.self_attn.kv_b_proj.weight", ShardType::kAttention},
    {"model.layers.0.mlp.gate_proj.weight", ShardType::kDenseFfn},  // first_k_dense_replace layers
    {"model.layers.0.mlp.up_proj.weight", ShardType::kDenseFfn},
    {"model.layers.0.mlp.down_proj.weight", ShardType::kDenseFfn},
    {"model.layers.1.mlp.shared_experts.gate_proj.weight", ShardType::kExpertFfn},
    {"model.layers.1.mlp.shared_experts.down_proj.weight", ShardType::kExpertFfn},
    {"model.layers.1.mlp.gate.e_score_correction_bias", ShardType::kRouter},
    // Llama 4
    {"language_model.model.layers.0.feed_forward.router.weight", ShardType::kRouter},
    {"language_model.model.layers.0.feed_forward.experts.gate_up_proj", ShardType::kExpertFfn},
    {"language_model.model.layers.0.feed_forward.shared_expert.down_proj.weight",
     ShardType::kExpertFfn},
    // Not a parameter type we know
    {"model.rotary_emb.inv_freq", ShardType::kOther},
    {"", ShardType::kOther},
};

TEST(ClassifyParameter, RealNamesOfEveryFamily) {
  for (const auto& [name, type] : kNames) {
    EXPECT_EQ(to_string(classify_parameter(name)), to_string(type)) << name;
  }
}

TEST(ClassifyParameter, WrapperPrefixesClassifyTheSame) {
  for (const auto& [name, type] : kNames) {
    for (const std::string& wrapped :
         {"_fsdp_wrapped_module." + name, "module." + name, "_orig_mod." + name,
          "module._orig_mod." + name, "_fsdp_wrapped_module._checkpoint_wrapped_module." + name}) {
      EXPECT_EQ(to_string(classify_parameter(wrapped)), to_string(type)) << wrapped;
    }
  }
  // FSDP1 also wraps inside the model.
  EXPECT_EQ(classify_parameter("model.layers.0._fsdp_wrapped_module.mlp.experts.down_proj"),
            ShardType::kExpertFfn);
  EXPECT_EQ(classify_parameter("model.layers.0._fsdp_wrapped_module.mlp.gate.weight"),
            ShardType::kRouter);
}

TEST(ClassifyParameter, NamesOfTypes) {
  EXPECT_EQ(to_string(ShardType::kExpertFfn), "expert_ffn");
  EXPECT_EQ(to_string(ShardType::kAttention), "attention");
  EXPECT_EQ(to_string(ShardType::kRouter), "router");
  EXPECT_EQ(to_string(ShardType::kNorm), "norm");
  EXPECT_EQ(to_string(ShardType::kEmbedding), "embedding");
  EXPECT_EQ(to_string(ShardType::kDenseFfn), "dense_ffn");
  EXPECT_EQ(to_string(ShardType::kOther), "other");
}

// --- safetensors -------------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("ciera_analysis_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
             "_" + std::to_string(reinterpret_cast<uintptr_t>(this)) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_raw(const fs::path& path, const std::string& header, const std::vector<std::byte>& data,
               std::optional<uint64_t> claimed_header_bytes = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = claimed_header_bytes.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

struct Tensor {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::vector<std::byte> bytes;
};

// A well-formed file: tensors laid out in the order given.
void write_safetensors(const fs::path& path, const std::vector<Tensor>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::vector<std::byte> data;
  for (const Tensor& t : tensors) {
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i > 0) shape += ',';
      shape += std::to_string(t.shape[i]);
    }
    header += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape +
              "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + t.bytes.size()) + "]}";
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
  }
  header += "}";
  header.resize((header.size() + 7) / 8 * 8, ' ');  // padded as the reference writer does
  write_raw(path, header, data);
}

std::vector<std::byte> bytes_of(size_t n, uint8_t seed = 1) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(seed + i * 7);
  return v;
}

// The FormatError's message, or "" when none was thrown.
template <typename F>
std::string format_error(F&& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

void expect_rejected(const fs::path& path, const std::string& expected) {
  const std::string message = format_error([&] { SafetensorsFile file(path); });
  EXPECT_NE(message.find(expected), std::string::npos)
      << "message: " << message << "\nexpected: " << expected;
  EXPECT_NE(message.find(path.string()), std::string::npos)
      << "message does not name the file: " << message;
}

TEST(Safetensors, ReadsAWellFormedFile) {
  TempDir dir;
  const fs::path path = dir.path() / "a.safetensors";
  write_safetensors(path, {{"b.weight", "BF16", {2, 3}, bytes_of(12, 1)},
                           {"a.weight", "F32", {4}, bytes_of(16, 2)},
                           {"c.half", "F16", {1}, bytes_of(2, 3)},
                           {"steps", "I64", {}, bytes_of(8, 4)},
                           {"empty", "F32", {0, 5}, {}}});
  const SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.tensors()[0].name, "a.weight");  // sorted by name
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const SafetensorsTensor* b = file.find("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, "BF16");
  EXPECT_EQ(b->ciera_dtype, DType::kBF16);
  EXPECT_EQ(b->shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(b->num_values, 6u);
  EXPECT_EQ(std::vector<std::byte>(b->bytes.begin(), b->bytes.end()), bytes_of(12, 1));
  EXPECT_EQ(file.find("a.weight")->ciera_dtype, DType::kFP32);
  EXPECT_EQ(file.find("c.half")->ciera_dtype, DType::kFP16);
  EXPECT_FALSE(file.find("steps")->ciera_dtype.has_value());
  EXPECT_EQ(file.find("steps")->num_values, 1u);  // a scalar
  EXPECT_EQ(file.find("empty")->num_values, 0u);
  EXPECT_EQ(file.find("missing"), nullptr);
}

TEST(Safetensors, RejectsBrokenFilesNamingTheProblem) {
  TempDir dir;
  const fs::path good = dir.path() / "good.safetensors";
  write_safetensors(good, {{"w", "BF16", {4}, bytes_of(8)}, {"v", "F32", {2}, bytes_of(8)}});
  std::ifstream in(good, std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  const fs::path p = dir.path() / "bad.safetensors";
  auto write_text = [&](const std::string& content) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << content;
  };
  auto entry = [](const std::string& body) { return std::string("{\"w\":") + body + "}"; };

  write_text("abc");
  expect_rejected(p, "shorter than the 8-byte header length");
  write_text(whole.substr(0, whole.size() - 3));
  expect_rejected(p, "tensor 'v': data_offsets [8, 16] reach past the 13 bytes of data");
  write_raw(p, "{}", {}, 1000);
  expect_rejected(p, "header length 1000 exceeds the 2 bytes after it");
  write_raw(p, "{\"w\": [1, 2", {});
  expect_rejected(p, "header is not valid JSON");
  write_raw(p, "[1,2]", {});
  expect_rejected(p, "not a JSON object");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[4]})"), bytes_of(8));
  expect_rejected(p, "tensor 'w': entry has no \"data_offsets\"");
  write_raw(p, entry(R"({"dtype":"Q4","shape":[4],"data_offsets":[0,8]})"), bytes_of(8));
  expect_rejected(p, "tensor 'w': unknown dtype \"Q4\"");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]})"), bytes_of(8));
  expect_rejected(p,
                  "tensor 'w': shape [2,3] of BF16 needs 12 bytes but data_offsets [0, 8] hold 8");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[-4],"data_offsets":[0,8]})"), bytes_of(8));
  expect_rejected(p, "not a non-negative integer");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[4],"data_offsets":[8,0]})"), bytes_of(8));
  expect_rejected(p, "end before they begin");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[4],"data_offsets":[0]})"), bytes_of(8));
  expect_rejected(p, "is not a pair of non-negative integers");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
            bytes_of(8));
  expect_rejected(p, "overflows");
  write_raw(p,
            R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},)"
            R"("v":{"dtype":"BF16","shape":[4],"data_offsets":[4,12]}})",
            bytes_of(12));
  expect_rejected(p, "overlaps tensor 'w'");
  write_raw(p,
            R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},)"
            R"("v":{"dtype":"BF16","shape":[2],"data_offsets":[10,14]}})",
            bytes_of(14));
  expect_rejected(p, "tensor 'v': data starts at 10 but the tensors before it end at 8");
  write_raw(p, entry(R"({"dtype":"BF16","shape":[4],"data_offsets":[0,8]})"), bytes_of(10));
  expect_rejected(p, "2 bytes after the last tensor's data belong to no tensor");
  write_raw(p, R"({"__metadata__":{"a":1}})", {});
  expect_rejected(p, "__metadata__ \"a\" is 1, not a string");
  expect_rejected(dir.path() / "absent.safetensors", "cannot open");
  // Values nested 200,000 deep, in an entry and in the metadata: the message quotes the start
  // (json::dump() recursed once a level and overflowed the stack writing it; found by fuzzing).
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  write_raw(p, entry(deep), {});
  expect_rejected(p, "tensor 'w': entry is [[[[");
  write_raw(p, "{\"__metadata__\":{\"a\":" + deep + "}}", {});
  expect_rejected(p, "__metadata__ \"a\" is [[[[");
}

TEST(JsonExcerpt, CompactTextCutAtAnyDepthWithoutRecursion) {
  const auto parsed = [](const std::string& text) { return nlohmann::json::parse(text); };
  for (const char* text :
       {R"({"a":[1,2,{"b":null}],"c":"x"})", "[]", "{}", "3.5", R"("s")", "[[],{}]"}) {
    EXPECT_EQ(json_excerpt(parsed(text), 100), parsed(text).dump()) << text;
  }
  EXPECT_EQ(json_excerpt(parsed(R"([1234567890,1234567890])"), 12), "[12345678...");
  const nlohmann::json deep = parsed(std::string(300000, '[') + std::string(300000, ']'));
  EXPECT_EQ(json_excerpt(deep, 8), "[[[[[...");
  EXPECT_EQ(json_excerpt(parsed(R"({"k\u00e9":"\u00e9\u00e9\u00e9\u00e9"})"), 12),
            "{\"k\u00e9\":\"...");  // not half an é
}

// --- checkpoint series -------------------------------------------------------------------------

TEST(Checkpoints, DirectoriesAreOrderedByStepNumber) {
  TempDir dir;
  for (const char* name : {"step_10.safetensors", "step_9.safetensors", "step_100.safetensors"}) {
    write_safetensors(dir.path() / name, {{"w", "BF16", {4}, bytes_of(8)}});
  }
  std::ofstream(dir.path() / "notes.txt") << "not a checkpoint";
  const std::vector<fs::path> files = list_checkpoints({dir.path().string()});
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0].filename(), "step_9.safetensors");
  EXPECT_EQ(files[1].filename(), "step_10.safetensors");
  EXPECT_EQ(files[2].filename(), "step_100.safetensors");
  EXPECT_EQ(checkpoint_step_number("run3-ckpt-000120.safetensors"), 120u);
  EXPECT_FALSE(checkpoint_step_number("final.safetensors").has_value());

  write_safetensors(dir.path() / "final.safetensors", {{"w", "BF16", {4}, bytes_of(8)}});
  try {
    list_checkpoints({dir.path().string()});
    FAIL() << "ordered a file without a step number";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("final.safetensors: its name holds no step number"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(list_checkpoints({(dir.path() / "step_9.safetensors").string()}),
               ConfigError);  // only one
}

TEST(Checkpoints, AFolderOfResumeCheckpointsSaysWhatToAnalyseInstead) {
  TempDir dir;
  std::ofstream(dir.path() / "notes.txt") << "not a checkpoint";
  auto error_of = [&] {
    try {
      list_checkpoints({dir.path().string()});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of(), dir.path().string() + ": no *.safetensors files");
  // What `ciera train --checkpoint-every` leaves: <run>/checkpoints/step-NNNNNN/.metadata. Given
  // the run folder, its checkpoints/ or one step's folder, the error names that step's folder.
  const fs::path step = dir.path() / "checkpoints" / "step-000002";
  fs::create_directories(step);
  std::ofstream(step / ".metadata") << "torch.distributed.checkpoint";
  for (const fs::path& given : {dir.path(), dir.path() / "checkpoints", step}) {
    std::string error;
    try {
      list_checkpoints({given.string()});
    } catch (const ConfigError& e) {
      error = e.what();
    }
    EXPECT_NE(error.find(step.string() + " is a torch.distributed.checkpoint folder"),
              std::string::npos)
        << given << ": " << error;
    EXPECT_NE(error.find("ciera train --save-checkpoints DIR"), std::string::npos) << error;
  }
}

TEST(Checkpoints, OneCheckpointGivenTwiceIsRefused) {
  TempDir dir;
  for (const char* name : {"step_1.safetensors", "step_2.safetensors"}) {
    write_safetensors(dir.path() / name, {{"w", "BF16", {4}, bytes_of(8)}});
  }
  const std::string d = dir.path().string(), first = (dir.path() / "step_1.safetensors").string();
  const std::string other_spelling = (dir.path() / "." / "step_1.safetensors").string();
  for (const std::vector<std::string>& arguments :
       std::vector<std::vector<std::string>>{{d, d}, {d, first}, {first, other_spelling}}) {
    try {
      list_checkpoints(arguments);
      FAIL() << "took " << arguments[0] << " and " << arguments[1];
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("step_1.safetensors is given twice"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Checkpoints, SeriesMustAgreeOnTensors) {
  TempDir dir;
  const fs::path a = dir.path() / "a.safetensors", b = dir.path() / "b.safetensors";
  write_safetensors(a, {{"w", "BF16", {4}, bytes_of(8)}, {"v", "F32", {2}, bytes_of(8)}});
  auto message = [&](const std::vector<Tensor>& second) {
    write_safetensors(b, second);
    return format_error([&] { open_checkpoint_series({a, b}); });
  };
  EXPECT_EQ(message({{"w", "BF16", {4}, bytes_of(8, 9)}, {"v", "F32", {2}, bytes_of(8)}}), "");
  EXPECT_NE(message({{"w", "BF16", {4}, bytes_of(8)}})
                .find(b.string() + ": tensor 'v' is missing (it is in " + a.string()),
            std::string::npos);
  EXPECT_NE(message({{"w", "BF16", {4}, bytes_of(8)}, {"v", "BF16", {4}, bytes_of(8)}})
                .find("tensor 'v' is BF16 but F32 in"),
            std::string::npos);
  EXPECT_NE(message({{"w", "BF16", {2, 2}, bytes_of(8)}, {"v", "F32", {2}, bytes_of(8)}})
                .find("tensor 'w' has shape [2, 2] but [4] in"),
            std::string::npos);
  EXPECT_NE(message({{"w", "BF16", {4}, bytes_of(8)},
                     {"v", "F32", {2}, bytes_of(8)},
                     {"x", "F32", {1}, bytes_of(4)}})
                .find("tensor 'x' is not in " + a.string()),
            std::string::npos);
}

// The step numbers in the names are the checkpoints' training steps (`ciera analyze` then refuses
// uneven spacing); before, they were read only to sort a folder, and step_10, step_20, step_90
// were analysed as three consecutive steps.
TEST(Checkpoints, StepNumbersComeFromTheNamesInTheOrderGiven) {
  using Steps = std::optional<std::vector<uint64_t>>;
  EXPECT_EQ(
      checkpoint_steps({"a/step_10.safetensors", "a/step_20.safetensors", "a/step_90.safetensors"}),
      Steps(std::vector<uint64_t>{10, 20, 90}));
  // Names that do not number the steps: taken as consecutive, not guessed.
  EXPECT_EQ(checkpoint_steps({"before.safetensors", "after_1.safetensors"}), std::nullopt);
  EXPECT_EQ(checkpoint_steps({"llama_7b.safetensors", "tuned_7b.safetensors"}), std::nullopt);
  // Distinct numbers out of order, as `ls step_*` sorts unpadded names: refused.
  try {
    checkpoint_steps({"step_10.safetensors", "step_100.safetensors", "step_20.safetensors"});
    FAIL() << "took step 100 before step 20";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("out of step order: step_100.safetensors (step 100) is "
                                         "given before step_20.safetensors (step 20)"),
              std::string::npos)
        << e.what();
  }
}

// Tensors of a dtype CIERA does not carry (left out by --skip-unsupported) were still required
// in every checkpoint: an optimizer's I64 step counter in some checkpoints only was fatal.
TEST(Checkpoints, SeriesOfCieraDtypesOnlyIgnoresOtherTensors) {
  TempDir dir;
  const fs::path a = dir.path() / "a.safetensors", b = dir.path() / "b.safetensors";
  write_safetensors(a, {{"w", "BF16", {4}, bytes_of(8)}, {"step", "I64", {1}, bytes_of(8)}});
  auto message = [&](const std::vector<Tensor>& second, bool only_ciera_dtypes) {
    write_safetensors(b, second);
    return format_error([&] { open_checkpoint_series({a, b}, only_ciera_dtypes); });
  };
  const Tensor w{"w", "BF16", {4}, bytes_of(8, 5)};
  EXPECT_NE(message({w}, false).find("tensor 'step' is missing"), std::string::npos);
  EXPECT_EQ(message({w}, true), "");
  EXPECT_EQ(message({w, {"step", "I64", {2}, bytes_of(16)}, {"m", "F64", {1}, bytes_of(8)}}, true),
            "");
  // The tensors compared must still agree, in both directions.
  EXPECT_NE(message({{"step", "I64", {1}, bytes_of(8)}}, true).find("tensor 'w' is missing"),
            std::string::npos);
  EXPECT_NE(message({w, {"v", "F32", {1}, bytes_of(4)}}, true).find("tensor 'v' is not in"),
            std::string::npos);
  EXPECT_NE(message({w, {"step", "F32", {2}, bytes_of(8)}}, true)
                .find("tensor 'step' is F32 but I64 in " + a.string()),
            std::string::npos);
}

// --- reading in windows -----------------------------------------------------------------------

TEST(Safetensors, ReleasedBytesReadTheSameAgain) {
  TempDir dir;
  const fs::path path = dir.path() / "a.safetensors";
  const std::vector<std::byte> big = bytes_of(3 * 4096 + 124, 5), small = bytes_of(10, 9);
  write_safetensors(path, {{"big", "BF16", {big.size() / 2}, big},
                           {"small", "F16", {5}, small},
                           {"empty", "F32", {0}, {}}});
  const SafetensorsFile file(path);
  const std::span<const std::byte> bytes = file.find("big")->bytes;
  // A range starting and ending inside pages, then a whole tensor, an empty one, everything.
  file.release(bytes.subspan(4001, 5000));
  EXPECT_EQ(std::vector<std::byte>(bytes.begin(), bytes.end()), big);
  file.release(bytes);
  file.release(file.find("empty")->bytes);
  file.release(file.find("small")->bytes);
  EXPECT_EQ(std::vector<std::byte>(bytes.begin(), bytes.end()), big);
  const std::span<const std::byte> small_bytes = file.find("small")->bytes;
  EXPECT_EQ(std::vector<std::byte>(small_bytes.begin(), small_bytes.end()), small);
}

// Three checkpoints of a BF16 tensor past one find_changes chunk, an F32 one and an empty one,
// values changed at random from each to the next.
std::vector<SafetensorsFile> random_series(const fs::path& dir, uint64_t big_values) {
  std::mt19937_64 rng(5);
  std::vector<uint32_t> big(big_values), small(1001);
  for (uint32_t& v : big) v = static_cast<uint32_t>(rng()) & 0xFFFF;
  for (uint32_t& v : small) v = static_cast<uint32_t>(rng());
  std::vector<fs::path> paths;
  for (int step = 0; step < 3; ++step) {
    for (uint32_t& v : big) {
      if (rng() % 50 == 0) v = static_cast<uint32_t>(rng()) & 0xFFFF;
    }
    for (uint32_t& v : small) {
      if (rng() % 20 == 0) v = static_cast<uint32_t>(rng());
    }
    paths.push_back(dir / ("step_" + std::to_string(step) + ".safetensors"));
    write_safetensors(paths.back(), {{"big", "BF16", {big_values}, pack(DType::kBF16, big)},
                                     {"small", "F32", {7, 143}, pack(DType::kFP32, small)},
                                     {"empty", "F16", {0}, {}}});
  }
  return open_checkpoint_series(paths);
}

TEST(Checkpoints, ComparingInWindowsCountsAsWholeTensors) {
  TempDir dir;
  const std::vector<SafetensorsFile> files = random_series(dir.path(), 70001);
  const ChangeGrid grid{{1, 3, 32}, {5, 64, 512}};
  const ChangeGrid elements_only{{}, {}};
  for (const char* name : {"big", "small", "empty"}) {
    const SafetensorsTensor& t = *files[0].find(name);
    const DType dtype = *t.ciera_dtype;
    // Windows cutting blocks and shards at odd points, a find_changes chunk and one value past
    // it, the whole tensor and more; one value per window for the small tensors only (a madvise
    // call per value is slow).
    const uint64_t whole = std::max<uint64_t>(t.num_values, 1);  // a window of 0 is refused
    std::vector<uint64_t> windows = {3, 64, 1000, 4097, 16385, whole, whole + 1, uint64_t{1} << 40};
    if (t.num_values < 2000) windows.push_back(1);
    for (uint64_t window : windows) {
      std::vector<TensorComparison> comparisons;
      comparisons.push_back({0, 1, ChunkedChangeCounter(dtype, t.num_values, grid)});
      comparisons.push_back({1, 2, ChunkedChangeCounter(dtype, t.num_values, grid)});
      comparisons.push_back({0, 2, ChunkedChangeCounter(dtype, t.num_values, elements_only)});
      std::vector<uint64_t> progress;
      compare_in_windows(files, name, comparisons, window,
                         [&](uint64_t values_done) { progress.push_back(values_done); });
      const std::string what = std::string(name) + " window=" + std::to_string(window);
      ASSERT_EQ(progress.size(), (t.num_values + window - 1) / window) << what;
      for (size_t i = 0; i < progress.size(); ++i) {
        EXPECT_EQ(progress[i], std::min(t.num_values, (i + 1) * window)) << what;
      }
      // The released pages read back as the file's bytes: the whole tensors, counted at once.
      for (const TensorComparison& c : comparisons) {
        const ChangeGrid& g = c.after - c.before == 1 ? grid : elements_only;
        expect_equal(c.counter.counts(),
                     count_exponent_changes(dtype, files[c.before].find(name)->bytes,
                                            files[c.after].find(name)->bytes, g),
                     what + " " + std::to_string(c.before) + "->" + std::to_string(c.after));
      }
    }
  }
}

TEST(Checkpoints, ComparingInWindowsRefusesWhatDoesNotMatch) {
  TempDir dir;
  const std::vector<SafetensorsFile> files = random_series(dir.path(), 100);
  const auto error_of = [&](std::string_view name, size_t after, DType dtype, uint64_t values,
                            uint64_t window) {
    std::vector<TensorComparison> comparisons;
    comparisons.push_back({0, after, ChunkedChangeCounter(dtype, values, ChangeGrid{})});
    try {
      compare_in_windows(files, name, comparisons, window);
    } catch (const ConfigError& e) {
      EXPECT_EQ(comparisons.front().counter.values_added(), 0u) << e.what();
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of("big", 1, DType::kBF16, 100, 0).find("a window must hold at least one value"),
            std::string::npos);
  EXPECT_NE(error_of("big", 3, DType::kBF16, 100, 8).find("checkpoint 3 of a series of 3"),
            std::string::npos);
  EXPECT_NE(error_of("absent", 1, DType::kBF16, 100, 8).find("tensor 'absent' is missing"),
            std::string::npos);
  const std::string wrong = error_of("big", 1, DType::kFP16, 100, 8);
  EXPECT_NE(
      wrong.find(files[0].path().string() +
                 ": tensor 'big' holds 100 BF16 values, but its comparison was made for 100 fp16"),
      std::string::npos)
      << wrong;
  EXPECT_NE(error_of("big", 1, DType::kBF16, 99, 8).find("was made for 99 bf16 values"),
            std::string::npos);
}

// Counts of another grid were added past the end of these (a heap overflow in release builds,
// where the check was only an assert); a step 0 read before the per-step counts.
TEST(ChangeStatistics, CountsOfAnotherGridAndStepZeroAreRefused) {
  ChangeCounts four(ChangeGrid{{4}, {64}});
  const ChangeCounts two(ChangeGrid{{2}, {64, 512}});
  EXPECT_THROW(four += two, ConfigError);
  ChangeStatistics stats(ChangeGrid{{4}, {64}}, /*warmup_steps=*/0);
  try {
    stats.add(1, ShardType::kOther, two);
    FAIL() << "counts of another grid were added";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot add counts of another grid"), std::string::npos)
        << e.what();
  }
  const ChangeCounts same(ChangeGrid{{4}, {64}});
  try {
    stats.add(0, ShardType::kOther, same);
    FAIL() << "step 0 was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("steps count from 1, got 0"), std::string::npos)
        << e.what();
  }
  stats.add(1, ShardType::kOther, same);  // still usable
  // A type outside the enumeration reads nothing past the per-type counts (it did, out of bounds).
  const auto unknown = static_cast<ShardType>(99);
  EXPECT_THROW(stats.add(1, unknown, same), ConfigError);
  EXPECT_THROW((void)stats.total(unknown), ConfigError);
  EXPECT_THROW((void)stats.step(1, unknown), ConfigError);
}

}  // namespace
}  // namespace ciera
