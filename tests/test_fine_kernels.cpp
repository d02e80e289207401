// The codec's fine-coding kernels (codec/kernels.hpp) on every SIMD target this CPU runs,
// against docs/format.md read literally.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <random>
#include <string>
#include <vector>

#include "codec/kernels.hpp"
#include "common/bits.hpp"
#include "test_util.hpp"

namespace ciera::codec {
namespace {

using ciera::testing::kernels_of_every_target;

// 1 to 70 distinct positions below `block_values`, in increasing order: the changes of one block,
// dense, sparse or far apart.
std::vector<uint16_t> random_changes(std::mt19937_64& rng, uint32_t block_values) {
  std::vector<uint16_t> chosen;
  const size_t want = 1 + rng() % std::min<size_t>(70, block_values);
  while (chosen.size() < want) {
    const auto p = static_cast<uint16_t>(rng() % block_values);
    if (std::find(chosen.begin(), chosen.end(), p) == chosen.end()) chosen.push_back(p);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// Fine coding's change symbols against docs/format.md read literally: gap = distance to the
// previous change in the block minus one (the block's first change: its position), bucket = bit
// width of the gap, bucket - 1 extra bits (bucket >= 2) holding gap - 2^(bucket-1), LSB first;
// symbol = 3 * bucket + class (the class comes tagged on the position).
TEST(CodecKernels, SymbolsFollowTheFormatOnEveryTarget) {
  std::mt19937_64 rng(21);
  {
    for (const size_t blocks : {size_t{1}, size_t{2}, size_t{7}, size_t{40}, size_t{300}}) {
      std::vector<uint16_t> positions;
      std::vector<uint8_t> classes;
      for (size_t b = 0; b < blocks; ++b) {
        // Blocks of up to 4096 values.
        const uint32_t block_values = rng() % 2 ? 4096 : 64 + static_cast<uint32_t>(rng() % 512);
        std::vector<uint16_t> chosen = random_changes(rng, block_values);
        chosen[0] |= format::kBlockStartFlag;
        for (uint16_t p : chosen) {
          const unsigned step_class = static_cast<unsigned>(rng() % 3);
          positions.push_back(static_cast<uint16_t>(p | step_class << format::kStepClassShift));
          classes.push_back(static_cast<uint8_t>(step_class));
        }
      }
      const size_t n = positions.size();
      std::vector<uint8_t> want_symbols;
      std::vector<bool> want_bits;
      int previous = -1;
      for (size_t c = 0; c < n; ++c) {
        const int position = positions[c] & 0x0FFF;
        if (positions[c] & 0x8000) previous = -1;
        const auto gap = static_cast<uint32_t>(position - previous - 1);
        previous = position;
        const auto bucket = static_cast<unsigned>(std::bit_width(gap));
        for (unsigned i = 0; bucket >= 2 && i < bucket - 1; ++i) {
          want_bits.push_back(((gap - (1u << (bucket - 1))) >> i) & 1);
        }
        want_symbols.push_back(static_cast<uint8_t>(3 * bucket + classes[c]));
      }
      for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
        std::vector<uint8_t> symbols(n), bits(11 * n / 8 + 16);
        SlackBitWriter writer(bits.data());
        writer.put(5, 3);  // the writer may start mid-byte (after the counts' extra bits)
        k->fine_symbols(positions.data(), n, symbols.data(), writer);
        ASSERT_EQ(writer.bits(), 3 + want_bits.size()) << k->target;
        bits.resize(writer.finish());
        EXPECT_EQ(symbols, want_symbols) << k->target << " n " << n;
        EXPECT_EQ(bits[0] & 7, 5) << k->target;
        for (size_t i = 0; i < want_bits.size(); ++i) {
          ASSERT_EQ((bits[(3 + i) / 8] >> ((3 + i) % 8)) & 1, want_bits[i])
              << k->target << " n " << n << " extra bit " << i;
        }
      }
    }
  }
}

// fine_positions against docs/format.md read literally: symbols 3 * bucket(gap) + class (bit 7 on
// a block's first change), bucket - 1 extra bits per gap LSB first, position = previous + gap + 1
// (the first: the gap), steps +1 / -1 / the escapes in order; output = block offset + position.
TEST(CodecKernels, PositionsFollowTheFormatOnEveryTarget) {
  std::mt19937_64 rng(22);
  const uint8_t mask = 0xFF;
  for (const size_t blocks : {size_t{1}, size_t{2}, size_t{7}, size_t{40}, size_t{300}}) {
    for (const uint32_t block_values : {64u, 512u, 4096u}) {
      std::vector<uint8_t> symbols, escapes, want_steps;
      std::vector<uint16_t> want_positions, offsets{0xEEEE};  // [0] unused
      std::vector<bool> extra_bits(5, true);  // starts mid-byte, after five other bits
      for (size_t b = 0; b < blocks; ++b) {
        offsets.push_back(static_cast<uint16_t>(rng() % 60000));
        const std::vector<uint16_t> chosen = random_changes(rng, block_values);
        int64_t previous = -1;
        for (const uint32_t p : chosen) {
          const auto gap = static_cast<uint32_t>(p - previous - 1);
          previous = p;
          const auto bucket = static_cast<unsigned>(std::bit_width(gap));
          for (unsigned i = 0; bucket >= 2 && i < bucket - 1; ++i) {
            extra_bits.push_back(((gap - (1u << (bucket - 1))) >> i) & 1);
          }
          const unsigned step_class = static_cast<unsigned>(rng() % 3);
          const bool first = p == chosen.front();
          symbols.push_back(static_cast<uint8_t>((3 * bucket + step_class) | (first ? 0x80 : 0)));
          want_positions.push_back(static_cast<uint16_t>(offsets.back() + p));
          uint8_t step = step_class == 0 ? 1 : mask;
          if (step_class == 2) {
            step = static_cast<uint8_t>(2 + rng() % 253);
            escapes.push_back(step);
          }
          want_steps.push_back(step);
        }
      }
      offsets.resize(offsets.size() + 2, 0xEEEE);
      // The kernel may read 8 bytes past the extra bits; the stretched gaps below read up to 11
      // bits more than there are.
      std::vector<uint8_t> bits((extra_bits.size() + 11 + 7) / 8 + 8, 0);
      for (size_t i = 0; i < extra_bits.size(); ++i) bits[i / 8] |= uint8_t(extra_bits[i] << (i % 8));
      const size_t n = symbols.size();
      for (const CodecKernels* k : kernels_of_every_target(codec_kernels_for)) {
        SCOPED_TRACE(std::string(k->target) + " blocks " + std::to_string(blocks) + " B " +
                     std::to_string(block_values));
        std::vector<uint16_t> positions(n);
        std::vector<uint8_t> steps(n);
        FinePositionState state;
        state.bit = 5;
        state.escape = escapes.data();
        k->fine_positions(symbols.data(), n, bits.data(), offsets.data(), block_values, mask, state,
                          positions.data(), steps.data());
        EXPECT_EQ(positions, want_positions);
        EXPECT_EQ(steps, want_steps);
        EXPECT_EQ(state.bit, extra_bits.size());
        EXPECT_EQ(state.escape, escapes.data() + escapes.size());
        EXPECT_EQ(state.block, blocks);
        EXPECT_FALSE(state.bad);
        // A gap of at least 2048 (bucket 12), anywhere, in a vector or in the scalar tail, puts
        // that change past the end of a block of 64 or 512 values: bad.
        for (const size_t at : {size_t{0}, n / 2, n - 1}) {
          if (block_values == 4096) break;
          std::vector<uint8_t> stretched = symbols;
          stretched[at] = static_cast<uint8_t>((symbols[at] & 0x80) | (3 * 12 + (symbols[at] & 0x7F) % 3));
          FinePositionState s2;
          s2.bit = 5;
          s2.escape = escapes.data();
          k->fine_positions(stretched.data(), n, bits.data(), offsets.data(), block_values, mask,
                            s2, positions.data(), steps.data());
          EXPECT_TRUE(s2.bad) << "change " << at;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ciera::codec
