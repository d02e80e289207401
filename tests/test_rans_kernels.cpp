// The entropy layer's group rANS kernels (entropy/rans_kernels.hpp) on every SIMD target this CPU
// runs, against the one-symbol-at-a-time coder they vectorise.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "entropy/rans.hpp"
#include "entropy/rans_kernels.hpp"
#include "test_util.hpp"

namespace ciera::entropy {
namespace {

using ciera::testing::kernels_of_every_target;

// Every target's group rANS encoder leaves the words and final states that rans_put, one symbol
// at a time, leaves (the decoder and docs/format.md follow rans_put's order).
TEST(RansKernels, GroupsMatchSymbolBySymbolEncoding) {
  std::mt19937_64 rng(34);
  for (const unsigned alphabet : {2u, 13u, 33u, 64u}) {
    Histogram hist;
    for (unsigned s = 0; s < alphabet; ++s) {
      hist.count[s] = (s % 5 == 4) ? 0 : 1 + rng() % (s < 3 ? 5000 : 40);
      hist.total += hist.count[s];
    }
    const RansModel model = RansModel::from_histogram(hist);
    RansGroupTables tables{};
    std::vector<RansEncSymbol> constants(kRansGroupSymbols);
    for (unsigned s = 0; s < alphabet; ++s) {
      if (model.freq[s] == 0) continue;
      constants[s] = rans_enc_symbol(model, s);
      tables.x_max[s] = constants[s].x_max;
      tables.rcp_freq[s] = constants[s].rcp_freq;
      tables.bias[s] = constants[s].bias;
      tables.cmpl_shift[s] = constants[s].cmpl_shift;
    }
    for (const size_t groups : {size_t{1}, size_t{3}, size_t{257}}) {
      std::vector<uint8_t> symbols(kRansStates * groups);
      for (auto& s : symbols) {
        do s = static_cast<uint8_t>(rng() % alphabet); while (model.freq[s] == 0);
      }
      uint32_t start[kRansStates];
      for (uint32_t& x : start) x = kRansLowerBound + static_cast<uint32_t>(rng() % (1u << 30));
      std::vector<uint8_t> want(2 * symbols.size() + 16, 0x5A);
      uint32_t want_states[kRansStates];
      std::copy(start, start + kRansStates, want_states);
      uint8_t* want_out = want.data() + want.size();
      for (size_t g = groups; g-- > 0;) {
        for (unsigned j = kRansStates; j-- > 0;) {
          rans_put(want_states[j], constants[symbols[kRansStates * g + j]], want_out);
        }
      }
      const size_t want_bytes = static_cast<size_t>(want.data() + want.size() - want_out);
      for (const RansKernels* k : kernels_of_every_target(rans_kernels_for)) {
        std::vector<uint8_t> got(want.size(), 0x5A);
        uint32_t states[kRansStates];
        std::copy(start, start + kRansStates, states);
        uint8_t* out = got.data() + got.size();
        k->encode_groups(tables, states, symbols.data(), groups, &out);
        const std::string where = std::string(k->target) + " alphabet " + std::to_string(alphabet) +
                                  " groups " + std::to_string(groups);
        ASSERT_EQ(static_cast<size_t>(got.data() + got.size() - out), want_bytes) << where;
        EXPECT_TRUE(std::equal(out, got.data() + got.size(), want_out)) << where;
        EXPECT_TRUE(std::equal(states, states + kRansStates, want_states)) << where;
      }
    }
  }
}

// Every target's group rANS decoder reads back what the encoder wrote: the symbols, the start
// states, and exactly the words it emitted.
TEST(RansKernels, GroupsDecodeWhatWasEncoded) {
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
    for (const size_t groups : {size_t{1}, size_t{5}, size_t{300}}) {
      std::vector<uint8_t> symbols(kRansStates * groups);
      for (auto& s : symbols) s = static_cast<uint8_t>(rng() % alphabet);
      std::vector<uint8_t> buffer(2 * symbols.size() + 64);
      RansEncoder encoder(model);
      encoder.begin(buffer.data() + buffer.size(), buffer.data(), symbols.size(), nullptr);
      ASSERT_TRUE(encoder.put_reverse(symbols.data(), symbols.size()));
      // One segment (at most 4800 symbols): its final states, then its words.
      uint32_t final_states[kRansStates];
      for (unsigned j = 0; j < kRansStates; ++j) {
        final_states[j] = load_le32(encoder.bytes_begin() + 4 * j);
      }
      const uint8_t* words = encoder.bytes_begin() + kRansStateBytes;
      // 32 readable bytes per group: the words plus padding the decoder may look at.
      std::vector<uint8_t> input(words, static_cast<const uint8_t*>(buffer.data() + buffer.size()));
      const size_t word_bytes = input.size();
      input.resize(word_bytes + 32 * groups, 0xC3);
      for (const RansKernels* k : kernels_of_every_target(rans_kernels_for)) {
        uint32_t states[kRansStates];
        std::copy(final_states, final_states + kRansStates, states);
        const uint8_t* in = input.data();
        std::vector<uint8_t> got(symbols.size());
        k->decode_groups(slots.data(), states, &in, got.data(), groups);
        const std::string where = std::string(k->target) + " alphabet " + std::to_string(alphabet) +
                                  " groups " + std::to_string(groups);
        EXPECT_EQ(got, symbols) << where;
        EXPECT_EQ(static_cast<size_t>(in - input.data()), word_bytes) << where;
        for (uint32_t x : states) EXPECT_EQ(x, kRansLowerBound) << where;
      }
    }
  }
}

}  // namespace
}  // namespace ciera::entropy
