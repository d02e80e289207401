#include "entropy/rans.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <string>

#include "ciera/error.hpp"
#include "entropy/model_math.hpp"
#include "entropy/kernels.hpp"

namespace ciera::entropy {

RansModel RansModel::from_histogram(const Histogram& hist) {
  assert(hist.total > 0);
  RansModel m;
  normalise_frequencies(hist.count.data(), hist.total, m.freq.data(),
                        &m.first, &m.last);
  uint32_t cumulative = 0;
  for (unsigned s = 0; s < 256; ++s) {
    m.start[s] = static_cast<uint16_t>(cumulative);
    cumulative += m.freq[s];
  }
  return m;
}

uint64_t RansModel::cost_q16(const Histogram& hist) const {
  uint64_t cost = 0;
  for (unsigned s = 0; s < 256; ++s) {
    if (hist.count[s] != 0) cost += rans_cost_q16(hist.count[s], freq[s]);
  }
  return cost;
}

RansModel RansModel::read_table(ByteReader& in, unsigned max_symbol, const char* what) {
  RansModel m;
  m.first = in.u8();
  m.last = in.u8();
  if (m.first > m.last || m.last > max_symbol) {
    throw FormatError(std::string(what) + ": rANS table symbol range [" + std::to_string(m.first) +
                      ", " + std::to_string(m.last) + "] is invalid (largest allowed symbol " +
                      std::to_string(max_symbol) + ")");
  }
  uint32_t sum = 0;
  for (unsigned s = m.first; s <= m.last; ++s) {
    const uint64_t f = in.varint(13);
    if (f > kRansTotal || sum + f > kRansTotal) {
      throw FormatError(std::string(what) + ": rANS frequencies exceed " +
                        std::to_string(kRansTotal));
    }
    m.freq[s] = static_cast<uint16_t>(f);
    sum += static_cast<uint32_t>(f);
  }
  if (sum != kRansTotal) {
    throw FormatError(std::string(what) + ": rANS frequencies sum to " + std::to_string(sum) +
                      ", not " + std::to_string(kRansTotal));
  }
  // Canonical form: the table spans exactly the symbols that occur, and at least two of them
  // (one symbol is a constant stream).
  if (m.first == m.last || m.freq[m.first] == 0 || m.freq[m.last] == 0) {
    throw FormatError(std::string(what) + ": rANS table [" + std::to_string(m.first) + ", " +
                      std::to_string(m.last) + "] is not canonical (" +
                      (m.first == m.last ? "one symbol: a constant stream"
                                         : "a symbol at its ends has frequency 0") +
                      ")");
  }
  uint32_t cumulative = 0;
  for (unsigned s = 0; s < 256; ++s) {
    m.start[s] = static_cast<uint16_t>(cumulative);
    cumulative += m.freq[s];
  }
  return m;
}

double RansModel::cost_bits(const Histogram& hist) const {
  double bits = 0;
  for (unsigned s = 0; s < 256; ++s) {
    if (hist.count[s] == 0) continue;
    bits += static_cast<double>(hist.count[s]) *
            (kRansScaleBits - std::log2(static_cast<double>(freq[s])));
  }
  return bits;
}

size_t RansModel::table_bytes() const {
  size_t bytes = 2;
  for (unsigned s = first; s <= last; ++s) bytes += freq[s] >= 128 ? 2 : 1;
  return bytes;
}

uint8_t* RansModel::write_table(uint8_t* out) const {
  *out++ = first;
  *out++ = last;
  for (unsigned s = first; s <= last; ++s) out = put_varint(out, freq[s]);
  return out;
}

RansEncSymbol rans_enc_symbol(const RansModel& model, unsigned s) {
  assert(model.freq[s] != 0);
  return rans_enc_symbol_of(model.freq[s], model.start[s]);
}

RansEncoder::RansEncoder(const RansModel& model) {
  for (unsigned s = 0; s < 256; ++s) {
    if (model.freq[s] != 0) symbols_[s] = rans_enc_symbol(model, s);
  }
  group_kernel_ = model.last < kRansGroupSymbols;
  // The wide kernels' window: the consecutive symbols of the largest total frequency (the first
  // such), so that few symbols take their slow path. 32 of them where the symbols outside those
  // are about as rare as outside the best 64 (an exponent plane's usually are): half the
  // permutes per symbol. When every symbol is below 64 the window is symbols 0..63, the group
  // kernels' tables. Only the speed depends on the window, never a word of the stream.
  constexpr uint64_t kNarrowSlack = 16;  // of kRansTotal slots, more outside a narrow window
  uint64_t wide_mass = 0, narrow_mass = 0;
  const unsigned wide_base = densest_window(model.freq.data(), kRansGroupSymbols, &wide_mass);
  const unsigned narrow_base = densest_window(model.freq.data(), kRansNarrowSymbols, &narrow_mass);
  if (!group_kernel_ && wide_mass - narrow_mass <= kNarrowSlack) {
    wide_.base = narrow_base;
    wide_.width = kRansNarrowSymbols;
  } else {
    wide_.base = wide_base;
    wide_.width = kRansGroupSymbols;
  }
  assert(!group_kernel_ || wide_.base == 0);
  wide_.all = symbols_.data();
  for (unsigned s = 0; s < wide_.width; ++s) {
    const RansEncSymbol& e = symbols_[wide_.base + s];
    wide_.window.x_max[s] = e.x_max;
    wide_.window.rcp_freq[s] = e.rcp_freq;
    wide_.window.bias[s] = e.bias;
    wide_.window.cmpl_shift[s] = e.cmpl_shift;
  }
}

void RansEncoder::begin(uint8_t* out_end, uint8_t* out_limit, uint64_t total_symbols,
                        uint8_t* lengths) {
  for (uint32_t& x : state_) x = kRansLowerBound;
  next_index_ = total_symbols;
  out_ = out_end;
  limit_ = out_limit;
  segment_end_ = out_end;
  lengths_ = lengths;
  segments_ = rans_segment_count(total_symbols);
}

bool RansEncoder::put_reverse(const uint8_t* symbols, size_t n) {
  assert(n <= next_index_);
  // One symbol emits at most one 16-bit word, so checking the room once per batch keeps the
  // inner loop free of bounds checks. A batch stays within one segment and leaves room for the
  // segment's states, stored below its words once its first symbol is coded.
  constexpr size_t kBatch = 256;
  for (size_t end = n; end > 0;) {
    // Two whole segments of this chunk, the first of them not started: coded together.
    if (next_index_ % kRansSegmentSymbols == 0 && end >= 2 * kRansSegmentSymbols &&
        static_cast<size_t>(out_ - limit_) >= 2 * kSegmentRoom) {
      encode_pair(symbols + end - 2 * kRansSegmentSymbols);
      end -= 2 * kRansSegmentSymbols;
      continue;
    }
    const uint64_t segment_first = (next_index_ - 1) / kRansSegmentSymbols * kRansSegmentSymbols;
    const size_t in_segment = static_cast<size_t>(next_index_ - segment_first);
    const size_t batch = std::min({kBatch, end, in_segment});
    const size_t begin = end - batch;
    if (static_cast<size_t>(out_ - limit_) >= 2 * batch + kRansStateBytes) {
      encode_batch(symbols + begin, batch);
    } else if (!encode_checked(symbols + begin, batch)) {
      return false;
    }
    if (next_index_ == segment_first) {
      if (static_cast<size_t>(out_ - limit_) < kRansStateBytes) return false;
      close_segment();
    }
    end = begin;
  }
  return true;
}

// Near the limit, one symbol at a time with an exact check, so that a stream is refused only when
// it really does not fit: whether a stream is coded with rANS must not depend on how its symbols
// were batched (docs/architecture.md, "Deterministic encoding").
bool RansEncoder::encode_checked(const uint8_t* symbols, size_t n) {
  for (size_t k = n; k-- > 0;) {
    --next_index_;
    uint32_t& x = state_[next_index_ & (kRansStates - 1)];
    const RansEncSymbol& e = symbols_[symbols[k]];
    if (x >= e.x_max) {
      if (out_ - limit_ < 2) return false;
      out_ -= 2;
      store_le16(out_, static_cast<uint16_t>(x));
      x >>= 16;
    }
    const uint32_t q = static_cast<uint32_t>((uint64_t{x} * e.rcp_freq) >> 32) >> (e.cmpl_shift >> 16);
    x = x + e.bias + q * (e.cmpl_shift & 0xFFFF);
  }
  return true;
}

// Segments a (the later one, next below the words written so far) and b (the one before it),
// whose states are fresh: b's words are coded below a's room and moved up under a's states once
// a is closed, so both come out exactly as coded one after the other.
void RansEncoder::encode_pair(const uint8_t* symbols) {
  uint32_t b_state[kRansStates];
  std::fill(b_state, b_state + kRansStates, kRansLowerBound);
  uint8_t* a_out = out_;
  uint8_t* const b_end = out_ - kSegmentRoom;
  uint8_t* b_out = b_end;
  const uint8_t* a_symbols = symbols + kRansSegmentSymbols;
  constexpr size_t kGroups = kRansSegmentSymbols / kRansStates;
  if (group_kernel_) {
    entropy_kernels().encode_groups2(wide_.window, state_, a_symbols, &a_out, b_state, symbols, &b_out,
                                  kGroups);
  } else {
    entropy_kernels().encode_wide_groups2(wide_, state_, a_symbols, &a_out, b_state, symbols, &b_out,
                                       kGroups);
  }
  out_ = a_out;
  next_index_ -= kRansSegmentSymbols;
  close_segment();
  const auto b_words = static_cast<size_t>(b_end - b_out);
  out_ -= b_words;
  std::memmove(out_, b_out, b_words);
  std::copy(b_state, b_state + kRansStates, state_);
  next_index_ -= kRansSegmentSymbols;
  close_segment();
}

void RansEncoder::close_segment() {
  out_ -= kRansStateBytes;
  for (unsigned j = 0; j < kRansStates; ++j) {
    store_le32(out_ + 4 * j, state_[j]);
    state_[j] = kRansLowerBound;
  }
  const uint64_t segment = next_index_ / kRansSegmentSymbols;
  if (segment + 1 < segments_) {
    store_le32(lengths_ + 4 * segment, static_cast<uint32_t>(segment_end_ - out_));
  }
  segment_end_ = out_;
}

void RansEncoder::encode_batch(const uint8_t* symbols, size_t n) {
  uint8_t* out = out_;
  uint64_t index = next_index_;
  size_t k = n;
  // Symbols are encoded last to first; symbol i uses state i % kRansStates. Up to the first
  // whole group of sixteen, one at a time.
  constexpr uint64_t kLast = kRansStates - 1;
  while (k > 0 && (index & kLast) != 0) {
    --k;
    --index;
    rans_put(state_[index & kLast], symbols_[symbols[k]], out);
  }
  const size_t groups = k / kRansStates;
  if (groups > 0) {
    k -= groups * kRansStates;
    index -= groups * kRansStates;
    if (group_kernel_) {
      entropy_kernels().encode_groups(wide_.window, state_, symbols + k, groups, &out);
    } else {
      entropy_kernels().encode_wide_groups(wide_, state_, symbols + k, groups, &out);
    }
  }
  while (k > 0) {
    --k;
    --index;
    rans_put(state_[index & kLast], symbols_[symbols[k]], out);
  }
  out_ = out;
  next_index_ = index;
}

void RansDecoder::begin(const RansModel& model, const uint8_t* body, uint64_t size,
                        uint64_t symbols, const char* what) {
  what_ = what;
  for (unsigned s = 0; s < 256; ++s) {
    const uint32_t f = model.freq[s];
    if (f == 0) continue;
    const uint32_t entry = rans_slot_entry(s, f, model.start[s]);
    for (uint32_t slot = model.start[s]; slot < model.start[s] + f; ++slot) slots_[slot] = entry;
  }
  // Segment lengths: every segment holds at least its states, and they fit the body.
  segments_ = rans_segment_count(symbols);
  const uint64_t length_bytes = 4 * (segments_ - 1);
  if (segments_ == 0 || size < length_bytes) {
    throw FormatError(std::string(what) + ": rANS body too short for its segment lengths");
  }
  lengths_ = body;
  uint64_t left = size - length_bytes;
  for (uint64_t j = 0; j + 1 < segments_; ++j) {
    const uint32_t length = load_le32(body + 4 * j);
    if (length < kRansStateBytes || length > left - kRansStateBytes || left < kRansStateBytes) {
      throw FormatError(std::string(what) + ": rANS segment " + std::to_string(j) + " of " +
                        std::to_string(segments_) + " has an invalid length");
    }
    left -= length;
  }
  if (left < kRansStateBytes) {
    throw FormatError(std::string(what) + ": rANS body too short for its last segment's states");
  }
  symbols_ = symbols;
  segment_ = 0;
  in_ = body + length_bytes;
  stream_end_ = body + size;
  open_segment();
}

uint64_t RansDecoder::segment_symbols_of(uint64_t segment) const {
  return std::min<uint64_t>(kRansSegmentSymbols, symbols_ - segment * kRansSegmentSymbols);
}

const uint8_t* RansDecoder::segment_end(uint64_t segment, const uint8_t* begin) const {
  return segment + 1 < segments_ ? begin + load_le32(lengths_ + 4 * segment) : stream_end_;
}

void RansDecoder::load_states(uint64_t segment, const uint8_t* at, uint32_t* states) const {
  for (unsigned j = 0; j < kRansStates; ++j) {
    const uint32_t x = load_le32(at + 4 * j);
    if (x < kRansLowerBound || x >= (uint32_t{1} << 31)) {
      throw FormatError(std::string(what_) + ": rANS state " + std::to_string(j) +
                        " of segment " + std::to_string(segment) + " is out of range");
    }
    states[j] = x;
  }
}

void RansDecoder::open_segment() {
  end_ = segment_end(segment_, in_);
  load_states(segment_, in_, state_);
  in_ += kRansStateBytes;
  index_ = 0;
  segment_symbols_ = segment_symbols_of(segment_);
}

// Segment s (just opened) and s + 1, whose symbols are the next ones wanted: as many groups of
// both as their bytes allow without checks through the two-stream kernel, then the rest of
// each the usual way. Leaves the decoder at the end of s + 1, s checked as finish_segment does.
size_t RansDecoder::get_two_segments(uint8_t* out) {
  const uint64_t next = segment_ + 1;
  // begin() checked every length: segment s + 1 starts at s's end and holds its states.
  const uint8_t* next_in = end_;
  const uint8_t* next_end = segment_end(next, next_in);
  uint32_t next_state[kRansStates];
  load_states(next, next_in, next_state);
  next_in += kRansStateBytes;
  const uint64_t next_symbols = segment_symbols_of(next);
  uint8_t* next_out = out + segment_symbols_;
  // A symbol reads at most one 16-bit word, and a group's look-ahead stays within 32 bytes of
  // words it may take: groups are safe while 2 bytes per symbol of them remain (as in
  // get_in_segment, whose rounds shrink the same way as the bytes left do).
  uint64_t next_index = 0;
  for (;;) {
    const uint64_t room = std::min({segment_symbols_ - index_, static_cast<uint64_t>(end_ - in_) / 2,
                                    next_symbols - next_index, static_cast<uint64_t>(next_end - next_in) / 2});
    const size_t groups = static_cast<size_t>(room / kRansStates);
    if (groups == 0) break;
    entropy_kernels().decode_groups2(slots_.data(), state_, &in_, out + index_, next_state, &next_in,
                                  next_out + next_index, groups);
    index_ += kRansStates * groups;
    next_index += kRansStates * groups;
  }
  get_in_segment(out + index_, static_cast<size_t>(segment_symbols_ - index_));
  finish_segment();
  const size_t first_symbols = static_cast<size_t>(segment_symbols_);
  segment_ = next;
  std::copy(next_state, next_state + kRansStates, state_);
  in_ = next_in;
  end_ = next_end;
  segment_symbols_ = next_symbols;
  index_ = next_index;
  get_in_segment(next_out + index_, static_cast<size_t>(segment_symbols_ - index_));
  return first_symbols + static_cast<size_t>(next_symbols);
}

void RansDecoder::get(uint8_t* out, size_t n) {
  size_t k = 0;
  while (k < n) {
    if (index_ == segment_symbols_) {
      finish_segment();
      ++segment_;
      open_segment();
    }
    // This segment from its start and the next one, both wanted whole: decoded together.
    if (index_ == 0 && segment_ + 1 < segments_ &&
        n - k >= segment_symbols_ + segment_symbols_of(segment_ + 1)) {
      k += get_two_segments(out + k);
      continue;
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n - k, segment_symbols_ - index_));
    get_in_segment(out + k, take);
    k += take;
  }
}

void RansDecoder::get_in_segment(uint8_t* out, size_t n) {
  size_t k = 0;
  // One symbol reads at most one 16-bit word (freq >= 1 leaves state >= 2^3 and one word lifts
  // it to 2^19 >= L), so while twice the symbols left in a batch fit in the input, the inner loop
  // needs no bounds check; the last few symbols of a stream take the checked path.
  while (k < n) {
    const size_t room = static_cast<size_t>(end_ - in_) / 2;
    const size_t batch = std::min(n - k, room) & ~size_t{kRansStates - 1};
    if (batch < kRansStates || (index_ & (kRansStates - 1)) != 0) {
      out[k++] = take_checked();
      continue;
    }
    get_unchecked(out + k, batch);
    k += batch;
  }
}

void RansDecoder::get_unchecked(uint8_t* out, size_t n) {
  entropy_kernels().decode_groups(slots_.data(), state_, &in_, out, n / kRansStates);
  index_ += n;
}

uint8_t RansDecoder::take_checked() {
  uint32_t& state = state_[index_++ & (kRansStates - 1)];
  const uint8_t symbol = rans_take(state, slots_.data());
  if (state < kRansLowerBound) {
    if (end_ - in_ < 2) throw FormatError(std::string(what_) + ": rANS stream ends early");
    state = (state << 16) | load_le16(in_);
    in_ += 2;
  }
  return symbol;
}

void RansDecoder::finish_segment() const {
  if (in_ != end_) {
    throw FormatError(std::string(what_) + ": rANS segment " + std::to_string(segment_) +
                      " has " + std::to_string(end_ - in_) + " unread bytes");
  }
  for (uint32_t x : state_) {
    if (x != kRansLowerBound) {
      throw FormatError(std::string(what_) + ": rANS segment " + std::to_string(segment_) +
                        " is corrupt (final state mismatch)");
    }
  }
}

void RansDecoder::finish() const {
  if (segment_ + 1 != segments_ || index_ != segment_symbols_) {
    throw FormatError(std::string(what_) + ": rANS stream finished before its last symbol");
  }
  finish_segment();
}

}  // namespace ciera::entropy
