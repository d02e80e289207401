// The entropy layer's kernels (entropy/kernels.hpp) on every SIMD target this CPU runs: symbol
// counting against a plain count, the group rANS coders against the one-symbol-at-a-time coder
// they vectorise.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "entropy/rans.hpp"
#include "entropy/kernels.hpp"
#include "test_util.hpp"

namespace ciera::entropy {
namespace {

using ciera::testing::kernels_of_every_target;

// Every target's symbol counting adds a plain count to the tables, for any window (only its
// speed depends on it), any length around the 64-symbol vectors, and symbols in and out of the
// window.
TEST(EntropyKernels, CountSymbolsAddsAPlainCount) {
  std::mt19937_64 rng(40);
  for (const EntropyKernels* k : kernels_of_every_target(entropy_kernels_for)) {
    // Past 8160 (255 rounds of 32, where AVX2's byte counters are folded), and runs of one
    // symbol that fill those counters to their limit.
    for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000},
                           size_t{4097}, size_t{8160}, size_t{8193}, size_t{20000}}) {
      for (const unsigned window : {0u, 100u, 256u - kCountWindow}) {
        std::vector<uint8_t> v(n);
        const bool one_symbol = n % 2 == 0;
        for (auto& s : v) {
          const uint64_t mixed = rng() % 3 == 0 ? rng() % 256 : 100 + rng() % 20;
          s = static_cast<uint8_t>(one_symbol ? window + 7 : mixed);
        }
        uint32_t tables[4][256];
        std::array<uint64_t, 256> want{};
        for (unsigned t = 0; t < 4; ++t) {
          for (unsigned s = 0; s < 256; ++s) {
            tables[t][s] = static_cast<uint32_t>(rng() % 1000);  // counts already there stay
            want[s] += tables[t][s];
          }
        }
        for (uint8_t s : v) ++want[s];
        k->count_symbols(v.data(), n, window, tables);
        std::array<uint64_t, 256> got{};
        for (unsigned t = 0; t < 4; ++t) {
          for (unsigned s = 0; s < 256; ++s) got[s] += tables[t][s];
        }
        EXPECT_EQ(got, want) << k->target << " n=" << n << " window=" << window;
      }
    }
  }
}

// Every target's group rANS encoders (64-entry register tables, 256-entry gathered table) leave
// the words and final states that rans_put, one symbol at a time, leaves (the decoder and
// docs/format.md follow rans_put's order); so do their two-stream forms, for each stream.
TEST(EntropyKernels, GroupsMatchSymbolBySymbolEncoding) {
  std::mt19937_64 rng(34);
  for (const unsigned alphabet : {2u, 13u, 33u, 64u, 65u, 200u, 256u}) {
    Histogram hist;
    for (unsigned s = 0; s < alphabet; ++s) {
      hist.count[s] = (s % 5 == 4) ? 0 : 1 + rng() % (s < 3 ? 5000 : 40);
      hist.total += hist.count[s];
    }
    const RansModel model = RansModel::from_histogram(hist);
    RansGroupTables tables{};
    std::vector<RansEncSymbol> constants(256);
    for (unsigned s = 0; s < alphabet; ++s) {
      if (model.freq[s] == 0) continue;
      constants[s] = rans_enc_symbol(model, s);
      if (s >= kRansGroupSymbols) continue;
      tables.x_max[s] = constants[s].x_max;
      tables.rcp_freq[s] = constants[s].rcp_freq;
      tables.bias[s] = constants[s].bias;
      tables.cmpl_shift[s] = constants[s].cmpl_shift;
    }
    // One stream's symbols and start states, and the words and states rans_put leaves.
    struct Coded {
      std::vector<uint8_t> symbols;
      uint32_t start[kRansStates];
      std::vector<uint8_t> words;
      uint32_t states[kRansStates];
    };
    const auto code = [&](size_t groups) {
      Coded c;
      c.symbols.resize(kRansStates * groups);
      for (auto& s : c.symbols) {
        do s = static_cast<uint8_t>(rng() % alphabet);
        while (model.freq[s] == 0);
      }
      for (uint32_t& x : c.start) x = kRansLowerBound + static_cast<uint32_t>(rng() % (1u << 30));
      std::vector<uint8_t> out(2 * c.symbols.size() + 16);
      std::copy(c.start, c.start + kRansStates, c.states);
      uint8_t* at = out.data() + out.size();
      for (size_t g = groups; g-- > 0;) {
        for (unsigned j = kRansStates; j-- > 0;)
          rans_put(c.states[j], constants[c.symbols[kRansStates * g + j]], at);
      }
      c.words.assign(at, out.data() + out.size());
      return c;
    };
    for (const size_t groups : {size_t{1}, size_t{3}, size_t{257}}) {
      const Coded a = code(groups), b = code(groups);
      // One kernel pair (one stream, two at once) against rans_put.
      const auto check = [&](const std::string& where, const auto& one, const auto& two) {
        const size_t room = 2 * a.symbols.size() + 16;
        std::vector<uint8_t> got(room, 0x5A);
        uint32_t states[kRansStates];
        std::copy(a.start, a.start + kRansStates, states);
        uint8_t* out = got.data() + got.size();
        one(states, a.symbols.data(), &out);
        EXPECT_EQ(std::vector<uint8_t>(out, got.data() + got.size()), a.words) << where;
        EXPECT_TRUE(std::equal(states, states + kRansStates, a.states)) << where;
        // Two streams at once: each the words and states it leaves alone, nothing written
        // far outside them.
        std::vector<uint8_t> got_a(room, 0x5A), got_b(room, 0x5A);
        uint32_t states_a[kRansStates], states_b[kRansStates];
        std::copy(a.start, a.start + kRansStates, states_a);
        std::copy(b.start, b.start + kRansStates, states_b);
        uint8_t* out_a = got_a.data() + room;
        uint8_t* out_b = got_b.data() + room;
        two(states_a, a.symbols.data(), &out_a, states_b, b.symbols.data(), &out_b);
        EXPECT_EQ(std::vector<uint8_t>(out_a, got_a.data() + room), a.words)
            << where << " (two streams, first)";
        EXPECT_EQ(std::vector<uint8_t>(out_b, got_b.data() + room), b.words)
            << where << " (two streams, second)";
        EXPECT_TRUE(std::equal(states_a, states_a + kRansStates, a.states)) << where;
        EXPECT_TRUE(std::equal(states_b, states_b + kRansStates, b.states)) << where;
        // Below the words, only the room of 2 bytes a symbol may change (rans_put stores a word
        // before it knows whether it sheds one; the AVX2 kernels store 16 bytes at a time).
        const auto untouched_below_room = [&](const std::vector<uint8_t>& v) {
          return std::all_of(v.data(), v.data() + room - 2 * a.symbols.size(),
                             [](uint8_t b) { return b == 0x5A; });
        };
        EXPECT_TRUE(untouched_below_room(got)) << where;
        EXPECT_TRUE(untouched_below_room(got_a)) << where;
        EXPECT_TRUE(untouched_below_room(got_b)) << where;
      };
      for (const EntropyKernels* k : kernels_of_every_target(entropy_kernels_for)) {
        const std::string where = std::string(k->target) + " alphabet " + std::to_string(alphabet) +
                                  " groups " + std::to_string(groups);
        if (alphabet <= kRansGroupSymbols) {
          check(
              where + " (64-entry tables)",
              [&](uint32_t* x, const uint8_t* sym, uint8_t** out) {
                k->encode_groups(tables, x, sym, groups, out);
              },
              [&](uint32_t* xa, const uint8_t* sa, uint8_t** oa, uint32_t* xb, const uint8_t* sb,
                  uint8_t** ob) { k->encode_groups2(tables, xa, sa, oa, xb, sb, ob, groups); });
        }
        // The wide kernels, their 64- or 32-symbol window anywhere: symbols outside it (many
        // here, the symbols are drawn uniformly) take the slow path.
        for (const auto [base, width] : {std::pair{0u, kRansGroupSymbols},
                                         {37u, kRansGroupSymbols},
                                         {192u, kRansGroupSymbols},
                                         {0u, kRansNarrowSymbols},
                                         {37u, kRansNarrowSymbols},
                                         {224u, kRansNarrowSymbols}}) {
          RansWideTables wide{};
          wide.base = base;
          wide.width = width;
          wide.all = constants.data();
          for (unsigned s = 0; s < width; ++s) {
            wide.window.x_max[s] = constants[base + s].x_max;
            wide.window.rcp_freq[s] = constants[base + s].rcp_freq;
            wide.window.bias[s] = constants[base + s].bias;
            wide.window.cmpl_shift[s] = constants[base + s].cmpl_shift;
          }
          check(
              where + " (wide, " + std::to_string(width) + " at " + std::to_string(base) + ")",
              [&](uint32_t* x, const uint8_t* sym, uint8_t** out) {
                k->encode_wide_groups(wide, x, sym, groups, out);
              },
              [&](uint32_t* xa, const uint8_t* sa, uint8_t** oa, uint32_t* xb, const uint8_t* sb,
                  uint8_t** ob) { k->encode_wide_groups2(wide, xa, sa, oa, xb, sb, ob, groups); });
        }
      }
    }
  }
}

// Every target's group rANS decoder reads back what the encoder wrote: the symbols, the start
// states, and exactly the words it emitted; so does its two-stream decoder, for each stream.
TEST(EntropyKernels, GroupsDecodeWhatWasEncoded) {
  std::mt19937_64 rng(35);
  for (const unsigned alphabet : {2u, 40u, 256u}) {
    Histogram hist;
    for (unsigned s = 0; s < alphabet; ++s) {
      hist.count[s] = 1 + rng() % (s < 2 ? 3000 : 30);
      hist.total += hist.count[s];
    }
    const RansModel model = RansModel::from_histogram(hist);
    std::vector<uint32_t> slots(kRansTotal);
    for (unsigned s = 0; s < alphabet; ++s) {
      for (uint32_t slot = model.start[s]; slot < model.start[s] + model.freq[s]; ++slot) {
        slots[slot] = s | (model.freq[s] - 1u) << 8 | uint32_t{model.start[s]} << 20;
      }
    }
    // One segment of `groups` groups of random symbols: its symbols, final states, and its
    // words followed by padding (32 readable bytes per group) the decoder may look at.
    struct Encoded {
      std::vector<uint8_t> symbols;
      uint32_t final_states[kRansStates];
      std::vector<uint8_t> input;
      size_t word_bytes = 0;
    };
    const auto encode = [&](size_t groups) {
      Encoded e;
      e.symbols.resize(kRansStates * groups);
      for (auto& s : e.symbols) s = static_cast<uint8_t>(rng() % alphabet);
      std::vector<uint8_t> buffer(2 * e.symbols.size() + 64);
      RansEncoder encoder(model);
      encoder.begin(buffer.data() + buffer.size(), buffer.data(), e.symbols.size(), nullptr);
      EXPECT_TRUE(encoder.put_reverse(e.symbols.data(), e.symbols.size()));
      for (unsigned j = 0; j < kRansStates; ++j) e.final_states[j] = load_le32(encoder.bytes_begin() + 4 * j);
      const uint8_t* words = encoder.bytes_begin() + kRansStateBytes;
      e.input.assign(words, static_cast<const uint8_t*>(buffer.data() + buffer.size()));
      e.word_bytes = e.input.size();
      e.input.resize(e.word_bytes + 32 * groups, 0xC3);
      return e;
    };
    for (const size_t groups : {size_t{1}, size_t{5}, size_t{300}}) {
      // Two different segments: decode_groups reads the first, decode_groups2 both at once.
      const Encoded one = encode(groups), two = encode(groups);
      for (const EntropyKernels* k : kernels_of_every_target(entropy_kernels_for)) {
        const std::string where = std::string(k->target) + " alphabet " + std::to_string(alphabet) +
                                  " groups " + std::to_string(groups);
        uint32_t states[kRansStates];
        std::copy(one.final_states, one.final_states + kRansStates, states);
        const uint8_t* in = one.input.data();
        std::vector<uint8_t> got(one.symbols.size());
        k->decode_groups(slots.data(), states, &in, got.data(), groups);
        EXPECT_EQ(got, one.symbols) << where;
        EXPECT_EQ(static_cast<size_t>(in - one.input.data()), one.word_bytes) << where;
        for (uint32_t x : states) EXPECT_EQ(x, kRansLowerBound) << where;

        uint32_t states_a[kRansStates], states_b[kRansStates];
        std::copy(one.final_states, one.final_states + kRansStates, states_a);
        std::copy(two.final_states, two.final_states + kRansStates, states_b);
        const uint8_t* in_a = one.input.data();
        const uint8_t* in_b = two.input.data();
        std::vector<uint8_t> got_a(one.symbols.size()), got_b(two.symbols.size());
        k->decode_groups2(slots.data(), states_a, &in_a, got_a.data(), states_b, &in_b, got_b.data(), groups);
        EXPECT_EQ(got_a, one.symbols) << where << " (two streams, first)";
        EXPECT_EQ(got_b, two.symbols) << where << " (two streams, second)";
        EXPECT_EQ(static_cast<size_t>(in_a - one.input.data()), one.word_bytes) << where;
        EXPECT_EQ(static_cast<size_t>(in_b - two.input.data()), two.word_bytes) << where;
        for (unsigned j = 0; j < kRansStates; ++j) {
          EXPECT_EQ(states_a[j], kRansLowerBound) << where;
          EXPECT_EQ(states_b[j], kRansLowerBound) << where;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ciera::entropy
