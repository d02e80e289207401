// Plane kernels: every compiled SIMD target against the literal reference of docs/format.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <random>
#include <vector>

#include "ciera/dtype.hpp"
#include "common/checksum.hpp"
#include "entropy/rans.hpp"
#include "format/content_checksum.hpp"
#include "format/planes.hpp"

namespace ciera::format {
namespace {

const DType kDTypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

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

TEST(Planes, EveryBf16AndFp16BitPatternRoundTrips) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<uint8_t> values(65536 * 2);
    for (uint32_t i = 0; i < 65536; ++i) {
      values[2 * i] = static_cast<uint8_t>(i);
      values[2 * i + 1] = static_cast<uint8_t>(i >> 8);
    }
    const SignMantissaLayout layout(dtype, 65536);
    for (const PlaneKernels* k : available_kernels()) {
      std::vector<uint8_t> exps(65536), sm(layout.total_bytes()), back(values.size());
      for (uint64_t first = 0; first < 65536; first += kMaxChunkValues) {
        split_values(layout, *k, values.data() + 2 * first, first, kMaxChunkValues,
                     exps.data() + first, sm.data());
      }
      for (uint64_t first = 0; first < 65536; first += kMaxChunkValues) {
        merge_values(layout, *k, exps.data() + first, sm.data(), first, kMaxChunkValues,
                     back.data() + 2 * first);
      }
      EXPECT_EQ(back, values) << dtype_name(dtype) << " on " << k->target;
    }
  }
}

// Splitting in arbitrary pieces at arbitrary offsets equals the reference on the whole shard.
TEST(Planes, KernelsMatchReferenceAtAnyOffset) {
  const size_t sizes[] = {0, 1, 7, 8, 9, 31, 33, 64, 65, 1000, 4099, 40001};
  for (DType dtype : kDTypes) {
    const uint32_t vb = dtype_info(dtype).value_bytes;
    for (size_t n : sizes) {
      const auto values = random_bytes(n * vb, n * 31 + vb);
      const SignMantissaLayout layout(dtype, n);
      std::vector<uint8_t> ref_exps(n), ref_sm(layout.total_bytes());
      reference::split(dtype, values.data(), n, ref_exps.data(), ref_sm.data());
      std::vector<uint8_t> ref_back(values.size());
      reference::merge(dtype, ref_exps.data(), ref_sm.data(), n, ref_back.data());
      ASSERT_EQ(ref_back, values) << "reference round trip, " << dtype_name(dtype) << " n=" << n;

      for (const PlaneKernels* k : available_kernels()) {
        for (size_t piece : {size_t{1}, size_t{5}, size_t{8}, size_t{333}, kMaxChunkValues}) {
          std::vector<uint8_t> exps(n, 0xAA), sm(layout.total_bytes(), 0);
          for (size_t first = 0; first < n; first += piece) {
            const size_t count = std::min(piece, n - first);
            split_values(layout, *k, values.data() + first * vb, first, count, exps.data() + first,
                         sm.data());
          }
          ASSERT_EQ(exps, ref_exps) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          ASSERT_EQ(sm, ref_sm) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          std::vector<uint8_t> back(values.size(), 0x55);
          for (size_t first = 0; first < n; first += piece) {
            const size_t count = std::min(piece, n - first);
            merge_values(layout, *k, exps.data() + first, sm.data(), first, count,
                         back.data() + first * vb);
          }
          ASSERT_EQ(back, values) << dtype_name(dtype) << " n=" << n << " piece=" << piece << " " << k->target;
          std::vector<uint8_t> only_exps(n);
          extract_exponents(dtype, *k, values.data(), n, only_exps.data());
          ASSERT_EQ(only_exps, ref_exps) << k->target;
        }
      }
    }
  }
}

TEST(Planes, SetExponentReplacesOnlyTheExponent) {
  for (DType dtype : kDTypes) {
    const DTypeInfo info = dtype_info(dtype);
    const auto values = random_bytes(64 * info.value_bytes, 7);
    for (size_t i = 0; i < 64; ++i) {
      std::vector<uint8_t> v(values.begin() + i * info.value_bytes,
                             values.begin() + (i + 1) * info.value_bytes);
      const uint8_t e = static_cast<uint8_t>((i * 37) & ((1u << info.exponent_bits) - 1));
      set_exponent(dtype, v.data(), e);
      EXPECT_EQ(exponent_of(dtype, v.data()), e);
      set_exponent(dtype, v.data(), exponent_of(dtype, values.data() + i * info.value_bytes));
      EXPECT_TRUE(std::equal(v.begin(), v.end(), values.begin() + i * info.value_bytes));
    }
  }
}

TEST(Planes, FindChangesMatchesScalarScanOnEveryTarget) {
  std::mt19937_64 rng(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{64}, size_t{100}, size_t{4096}}) {
    for (unsigned density : {0u, 1u, 50u, 100u}) {
      std::vector<uint8_t> before(n), now(n);
      for (size_t i = 0; i < n; ++i) {
        before[i] = static_cast<uint8_t>(rng());
        now[i] = (rng() % 100) < density ? static_cast<uint8_t>(before[i] + 1 + rng() % 255) : before[i];
      }
      std::vector<uint16_t> want_pos;
      std::vector<uint8_t> want_step;
      for (size_t i = 0; i < n; ++i) {
        if (now[i] != before[i]) {
          want_pos.push_back(static_cast<uint16_t>(i));
          want_step.push_back(static_cast<uint8_t>(now[i] - before[i]));
        }
      }
      for (const PlaneKernels* k : available_kernels()) {
        std::vector<uint16_t> pos(n + 1);
        std::vector<uint8_t> step(n + 1);
        const size_t m = k->find_changes(now.data(), before.data(), n, pos.data(), step.data());
        pos.resize(m);
        step.resize(m);
        EXPECT_EQ(pos, want_pos) << k->target << " n=" << n;
        EXPECT_EQ(step, want_step) << k->target << " n=" << n;
      }
    }
  }
}

TEST(Planes, FusedBf16SplitDetectMatchesSplitThenFind) {
  std::mt19937_64 rng(8);
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{64}, size_t{65},
                   size_t{127}, size_t{128}, size_t{512}, size_t{4096}}) {
    for (unsigned density : {0u, 2u, 50u, 100u}) {
      std::vector<uint8_t> values(2 * n), cache(n);
      for (auto& b : values) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> exps(n), sm(n);
      reference::split(DType::kBF16, values.data(), n, exps.data(), sm.data());
      for (size_t i = 0; i < n; ++i) {
        // Changes of -1 and +1 (the common steps) and escaped ones.
        const uint64_t kind = rng() % 4;
        const auto delta = static_cast<uint8_t>(kind == 0 ? 1 : kind == 1 ? 0xFF : 1 + rng() % 255);
        cache[i] = (rng() % 100) < density ? static_cast<uint8_t>(exps[i] - delta) : exps[i];
      }
      // Tagged positions: i | class << 13 (class 0: step +1, 1: step -1, 2: escaped).
      std::vector<uint16_t> want_pos;
      std::vector<uint8_t> want_escapes;
      for (size_t i = 0; i < n; ++i) {
        if (exps[i] != cache[i]) {
          const auto step = static_cast<uint8_t>(exps[i] - cache[i]);
          const unsigned step_class = step == 1 ? 0 : step == 0xFF ? 1 : 2;
          want_pos.push_back(static_cast<uint16_t>(i | step_class << 13));
          if (step_class == 2) want_escapes.push_back(step);
        }
      }
      // Streamed (non-temporal) or not, into a 64-byte aligned plane or one byte past it (where
      // the kernels must fall back to ordinary stores).
      const auto check = [&](const PlaneKernels& k, bool stream, size_t misalign) {
        SCOPED_TRACE(std::string(k.target) + " n " + std::to_string(n) + " stream " +
                     std::to_string(stream) + " misalign " + std::to_string(misalign));
        std::vector<uint8_t> storage(n + 128, 0xAA), got_cache = cache;
        const size_t at = (-reinterpret_cast<uintptr_t>(storage.data()) & 63) + misalign;
        uint8_t* got_sm = storage.data() + at;
        std::vector<uint16_t> pos(n + kChangeSlack);
        std::vector<uint8_t> escapes(3 + n + kChangeSlack, 0xEE);
        size_t escape_count = 3;  // appends after what is there
        const size_t m = k.split_detect_bf16(values.data(), n, got_sm, got_cache.data(), pos.data(),
                                             escapes.data(), &escape_count, stream);
        stream_fence();
        pos.resize(m);
        EXPECT_EQ(std::vector<uint8_t>(got_sm, got_sm + n), sm);
        for (size_t i = 0; i < storage.size(); ++i) {
          if (i < at || i >= at + n) {
            ASSERT_EQ(storage[i], 0xAA) << "wrote byte " << i;
          }
        }
        EXPECT_EQ(got_cache, exps) << "cache must hold the new exponents";
        EXPECT_EQ(pos, want_pos);
        ASSERT_EQ(escape_count, 3 + want_escapes.size());
        EXPECT_EQ(std::vector<uint8_t>(escapes.begin(), escapes.begin() + 3), std::vector<uint8_t>(3, 0xEE));
        EXPECT_EQ(std::vector<uint8_t>(escapes.begin() + 3, escapes.begin() + 3 + want_escapes.size()),
                  want_escapes);
      };
      for (const PlaneKernels* k : available_kernels()) {
        for (const bool stream : {false, true}) {
          check(*k, stream, 0);
          check(*k, stream, 1);
        }
      }
    }
  }
}

TEST(Planes, StreamCopyCopiesExactlyAtEveryAlignment) {
  const auto src = random_bytes(4096 + 128, 11);
  for (const PlaneKernels* k : available_kernels()) {
    for (size_t offset = 0; offset < 64; offset += 7) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4096}}) {
        std::vector<uint8_t> dst(n + 128, 0xA5);
        k->stream_copy(dst.data() + offset, src.data() + 3, n);
        stream_fence();
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= offset && i < offset + n;
          ASSERT_EQ(dst[i], inside ? src[3 + i - offset] : 0xA5)
              << k->target << " offset " << offset << " n " << n << " byte " << i;
        }
      }
    }
  }
}

// Each target's streaming content checksum equals the shared library's one-shot XXH3-64, whatever
// the sizes of the updates (xxHash buffers partial stripes between them) and the input length
// (XXH3 has separate paths up to 16, 128, 240 bytes and beyond).
TEST(Planes, ContentChecksumEqualsLibraryXxh3OnEveryTarget) {
  const auto data = random_bytes(70000, 12);
  std::mt19937_64 rng(13);
  for (const PlaneKernels* k : available_kernels()) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
                           size_t{240}, size_t{241}, size_t{1024}, size_t{4099}, data.size()}) {
      const uint64_t expected = checksum64(data.data(), n);
      ContentChecksum whole(*k);
      whole.update(data.data(), n);
      EXPECT_EQ(whole.digest(), expected) << k->target << " n " << n;
      ContentChecksum pieces(*k);
      for (size_t at = 0; at < n;) {
        const size_t piece = std::min<size_t>(n - at, rng() % 3000);
        pieces.update(data.data() + at, piece);
        at += piece;
      }
      EXPECT_EQ(pieces.digest(), expected) << k->target << " n " << n << " in pieces";
    }
  }
}

// Fine coding's change symbols against docs/format.md read literally: gap = distance to the
// previous change in the block minus one (the block's first change: its position), bucket = bit
// width of the gap, bucket - 1 extra bits (bucket >= 2) holding gap - 2^(bucket-1), LSB first;
// symbol = 3 * bucket + class (the class comes tagged on the position).
TEST(Planes, FineSymbolsFollowTheFormatOnEveryTarget) {
  std::mt19937_64 rng(21);
  {
    for (const size_t blocks : {size_t{1}, size_t{2}, size_t{7}, size_t{40}, size_t{300}}) {
      std::vector<uint16_t> positions;
      std::vector<uint8_t> classes;
      for (size_t b = 0; b < blocks; ++b) {
        // Blocks of up to 4096 values.
        const uint32_t block_values = rng() % 2 ? 4096 : 64 + static_cast<uint32_t>(rng() % 512);
        std::vector<uint16_t> chosen = random_changes(rng, block_values);
        chosen[0] |= kBlockStartFlag;
        for (uint16_t p : chosen) {
          const unsigned step_class = static_cast<unsigned>(rng() % 3);
          positions.push_back(static_cast<uint16_t>(p | step_class << kStepClassShift));
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
      for (const PlaneKernels* k : available_kernels()) {
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
TEST(Planes, FinePositionsFollowTheFormatOnEveryTarget) {
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
      for (const PlaneKernels* k : available_kernels()) {
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

// Every target's group rANS encoder leaves the words and final states that rans_put, one symbol
// at a time, leaves (the decoder and docs/format.md follow rans_put's order).
TEST(Planes, RansGroupsMatchSymbolBySymbolEncoding) {
  using entropy::kRansStates;
  std::mt19937_64 rng(34);
  for (const unsigned alphabet : {2u, 13u, 33u, 64u}) {
    entropy::Histogram hist;
    for (unsigned s = 0; s < alphabet; ++s) {
      hist.count[s] = (s % 5 == 4) ? 0 : 1 + rng() % (s < 3 ? 5000 : 40);
      hist.total += hist.count[s];
    }
    const entropy::RansModel model = entropy::RansModel::from_histogram(hist);
    entropy::RansGroupTables tables{};
    std::vector<entropy::RansEncSymbol> constants(entropy::kRansGroupSymbols);
    for (unsigned s = 0; s < alphabet; ++s) {
      if (model.freq[s] == 0) continue;
      constants[s] = entropy::rans_enc_symbol(model, s);
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
      for (uint32_t& x : start) x = entropy::kRansLowerBound + static_cast<uint32_t>(rng() % (1u << 30));
      std::vector<uint8_t> want(2 * symbols.size() + 16, 0x5A);
      uint32_t want_states[kRansStates];
      std::copy(start, start + kRansStates, want_states);
      uint8_t* want_out = want.data() + want.size();
      for (size_t g = groups; g-- > 0;) {
        for (unsigned j = kRansStates; j-- > 0;) {
          entropy::rans_put(want_states[j], constants[symbols[kRansStates * g + j]], want_out);
        }
      }
      const size_t want_bytes = static_cast<size_t>(want.data() + want.size() - want_out);
      for (const PlaneKernels* k : available_kernels()) {
        std::vector<uint8_t> got(want.size(), 0x5A);
        uint32_t states[kRansStates];
        std::copy(start, start + kRansStates, states);
        uint8_t* out = got.data() + got.size();
        k->rans_encode_groups(tables, states, symbols.data(), groups, &out);
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
TEST(Planes, RansGroupsDecodeWhatWasEncoded) {
  using entropy::kRansStates;
  std::mt19937_64 rng(35);
  for (const unsigned alphabet : {2u, 40u, 256u}) {
    entropy::Histogram hist;
    for (unsigned s = 0; s < alphabet; ++s) {
      hist.count[s] = 1 + rng() % (s < 2 ? 3000 : 30);
      hist.total += hist.count[s];
    }
    const entropy::RansModel model = entropy::RansModel::from_histogram(hist);
    std::vector<uint32_t> slots(entropy::kRansTotal);
    for (unsigned s = 0; s < alphabet; ++s) {
      for (uint32_t slot = model.start[s]; slot < model.start[s] + model.freq[s]; ++slot) {
        slots[slot] = s | (model.freq[s] - 1u) << 8 | uint32_t{model.start[s]} << 20;
      }
    }
    for (const size_t groups : {size_t{1}, size_t{5}, size_t{300}}) {
      std::vector<uint8_t> symbols(kRansStates * groups);
      for (auto& s : symbols) s = static_cast<uint8_t>(rng() % alphabet);
      std::vector<uint8_t> buffer(2 * symbols.size() + 64);
      entropy::RansEncoder encoder(model);
      encoder.begin(buffer.data() + buffer.size(), buffer.data(), symbols.size());
      ASSERT_TRUE(encoder.put_reverse(symbols.data(), symbols.size()));
      uint32_t final_states[kRansStates];
      encoder.final_states(final_states);
      const uint8_t* words = encoder.bytes_begin();
      // 32 readable bytes per group: the words plus padding the decoder may look at.
      std::vector<uint8_t> input(words, static_cast<const uint8_t*>(buffer.data() + buffer.size()));
      const size_t word_bytes = input.size();
      input.resize(word_bytes + 32 * groups, 0xC3);
      for (const PlaneKernels* k : available_kernels()) {
        uint32_t states[kRansStates];
        std::copy(final_states, final_states + kRansStates, states);
        const uint8_t* in = input.data();
        std::vector<uint8_t> got(symbols.size());
        k->rans_decode_groups(slots.data(), states, &in, got.data(), groups);
        const std::string where = std::string(k->target) + " alphabet " + std::to_string(alphabet) +
                                  " groups " + std::to_string(groups);
        EXPECT_EQ(got, symbols) << where;
        EXPECT_EQ(static_cast<size_t>(in - input.data()), word_bytes) << where;
        for (uint32_t x : states) EXPECT_EQ(x, entropy::kRansLowerBound) << where;
      }
    }
  }
}

}  // namespace
}  // namespace ciera::format
