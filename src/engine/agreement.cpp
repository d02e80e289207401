// The description is "key=value" text in a fixed order, not a struct, so that the first
// differing fact can be reported by name and value, including a fact one rank's build does not
// know (it shows as <absent>); format_version and protocol_version are facts like the others.
// It lists every rank's shard sizes, so all of them together are W^2 x parameters bytes: only a
// digest of each travels unless the ranks differ (docs/format.md, "Engine protocol").
#include "engine/agreement.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string_view>
#include <tuple>
#include <utility>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "common/checksum.hpp"
#include "common/text.hpp"
#include "engine/protocol.hpp"

namespace ciera {
namespace {

using Facts = std::vector<std::pair<std::string, std::string>>;

// One fact per line, in a fixed order, for everything every rank must agree on.
Facts describe(const EngineConfig& c, const std::vector<BucketLayout>& buckets, int world) {
  Facts facts;
  facts.emplace_back("format_version", std::to_string(kFormatVersion));
  facts.emplace_back("protocol_version", std::to_string(kEngineProtocolVersion));
  facts.emplace_back("world_size", std::to_string(world));
  facts.emplace_back("block_values", std::to_string(c.codec.block_values));
  facts.emplace_back("change_detection", std::string(change_detection_name(c.codec.detection)));
  facts.emplace_back("exponent_coding", std::string(exponent_coding_name(c.codec.coding)));
  facts.emplace_back("content_checksum", c.codec.content_checksum ? "on" : "off");
  facts.emplace_back("warmup_steps", std::to_string(c.warmup_steps));
  facts.emplace_back("warmup_mode", c.warmup == WarmupMode::kRaw ? "raw" : "key_frames");
  facts.emplace_back("adaptive", c.adaptive ? "on" : "off");
  facts.emplace_back("buckets", std::to_string(buckets.size()));
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketLayout& l = buckets[b];
    const std::string p = "bucket[" + std::to_string(b) + "].";
    facts.emplace_back(p + "name", l.name);
    facts.emplace_back(p + "dtype", std::string(dtype_name(l.dtype)));
    facts.emplace_back(p + "ranks", std::to_string(l.ranks()));
    facts.emplace_back(p + "params", std::to_string(l.params()));
    // Each parameter's policy by name, so that ranks whose policies differ disagree on this fact
    // and the message shows where, in the names the user chose them by (single letters until
    // stop 70 read "'cc' on rank 1; 'rr' on rank 0").
    std::string policy;
    for (ShardPolicy s : l.policy) {
      if (!policy.empty()) policy += ',';
      policy += shard_policy_name(s);
    }
    facts.emplace_back(p + "policy", policy);
    for (int r = 0; r < l.ranks(); ++r) {
      std::string sizes;
      for (uint64_t v : l.shard_values[r]) {
        if (!sizes.empty()) sizes += ',';
        sizes += std::to_string(v);
      }
      facts.emplace_back(p + "shard_values[rank " + std::to_string(r) + "]", sizes);
    }
  }
  return facts;
}

std::string serialise(const Facts& facts) {
  std::string s;
  for (const auto& [k, v] : facts) s += k + "=" + v + "\n";
  return s;
}

std::map<std::string, std::string> parse_facts(const std::string& text) {
  std::map<std::string, std::string> facts;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) facts[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return facts;
}

// At most 80 bytes of `value` that show where it departs from the other ranks' (after the first
// `common` bytes they all share): a long name that differs only near its end is shown there.
std::string excerpt(const std::string& value, size_t common) {
  if (value.size() <= 80) return value;
  const size_t from = utf8_boundary(value, common > 40 ? common - 20 : 0);
  return (from > 0 ? "..." : "") +
         shortened(std::string_view(value).substr(from), from > 0 ? 77 : 80);
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) {
    if (!s.empty()) s += ',';
    s += std::to_string(r);
  }
  return s;
}

// " (bucket 'NAME')" for a fact "bucket[i].x" other than the name itself, NAME being rank 0's
// (the names are compared first, so the ranks share it); "" otherwise.
std::string bucket_named(const std::string& key, const std::map<std::string, std::string>& facts) {
  const size_t close = key.find("].");
  if (key.rfind("bucket[", 0) != 0 || close == std::string::npos) return "";
  const std::string name_key = key.substr(0, close + 2) + "name";
  const auto it = facts.find(name_key);
  if (key == name_key || it == facts.end()) return "";
  return " (bucket '" + shortened(it->second, 60) + "')";
}

using FactMap = std::map<std::string, std::string>;

// Throws on the first fact (in rank 0's order, then facts rank 0 lacks) whose value differs.
// `facts` holds each rank's (ranks with the same description share one).
void throw_first_difference(const std::string& rank0_text,
                            const std::vector<const FactMap*>& facts) {
  const int world = static_cast<int>(facts.size());
  std::istringstream order(rank0_text);
  std::string line;
  std::vector<std::string> keys;
  while (std::getline(order, line)) keys.push_back(line.substr(0, line.find('=')));
  for (int r = 1; r < world; ++r) {
    for (const auto& [k, v] : *facts[r]) {
      if (!facts[0]->count(k)) keys.push_back(k);
    }
  }
  for (const std::string& key : keys) {
    std::map<std::string, std::vector<int>> holders;
    for (int r = 0; r < world; ++r) {
      auto it = facts[r]->find(key);
      holders[it == facts[r]->end() ? "<absent>" : it->second].push_back(r);
    }
    if (holders.size() > 1) {
      const std::string& some = holders.begin()->first;
      size_t common = some.size();
      for (const auto& [value, ranks] : holders) {
        common = std::min<size_t>(
            common, std::mismatch(some.begin(), some.begin() + std::min(some.size(), value.size()),
                                  value.begin())
                            .first -
                        some.begin());
      }
      std::string text =
          "configuration mismatch across ranks: " + key + bucket_named(key, *facts[0]) + " is";
      bool first = true;
      for (const auto& [value, ranks] : holders) {
        text += std::string(first ? " " : "; ") + "'" + excerpt(value, common) + "' on rank" +
                (ranks.size() > 1 ? "s " : " ") + join_ranks(ranks);
        first = false;
      }
      throw ConfigError(text);
    }
  }
}

constexpr uint64_t kMaxDescriptionBytes = uint64_t{1} << 30;

// Gathers the texts of `senders` (rank order; the others' `lengths` are 0: they send nothing and
// come back empty), each bounded as below and all of them together too.
std::vector<std::string> gather_texts(Transport& t, const std::string& mine,
                                      const std::vector<uint64_t>& lengths,
                                      const std::vector<int>& senders) {
  const int world = t.size();
  std::vector<uint64_t> displs(static_cast<size_t>(world));
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    // A description is a few KiB per bucket; a length past this is a broken or foreign peer,
    // refused before anything is sized from it (and before the sum could wrap).
    if (lengths[r] > kMaxDescriptionBytes) {
      throw ConfigError("configuration agreement: rank " + std::to_string(r) + " announced a " +
                        std::to_string(lengths[r]) + "-byte description (at most " +
                        std::to_string(kMaxDescriptionBytes) + ")");
    }
    displs[r] = total;
    total += lengths[r];
  }
  // All of them together within the same bound (the sum of at most 2^31 lengths of at most
  // 2^30 cannot wrap): world x 1 GiB would otherwise be an allocation here that fails
  // (std::bad_alloc) or takes the host's memory, where a ConfigError names what was announced.
  if (total > kMaxDescriptionBytes) {
    std::string announced;
    for (size_t i = 0; i < senders.size(); ++i) {
      if (i == 8 && senders.size() > 9) {
        announced += ", ... (" + std::to_string(senders.size()) + " ranks)";
        break;
      }
      announced += (i == 0 ? "rank " : ", rank ") + std::to_string(senders[i]) + " " +
                   std::to_string(lengths[senders[i]]);
    }
    throw ConfigError("configuration agreement: the ranks announced descriptions of " +
                      std::to_string(total) + " bytes in all (" + announced + "; at most " +
                      std::to_string(kMaxDescriptionBytes) + " together)");
  }
  std::string all(total, '\0');
  t.allgatherv(mine.data(), all.data(), lengths, displs);
  std::vector<std::string> texts;
  for (int r = 0; r < world; ++r) texts.push_back(all.substr(displs[r], lengths[r]));
  return texts;
}

// Every rank's text, as sent: lengths first, then the texts.
std::vector<std::string> exchange_descriptions(Transport& t, const std::string& mine) {
  uint64_t my_length = mine.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(t.size()));
  t.allgather(&my_length, sizeof my_length, lengths.data());
  std::vector<int> everyone(lengths.size());
  for (size_t r = 0; r < everyone.size(); ++r) everyone[r] = static_cast<int>(r);
  return gather_texts(t, mine, lengths, everyone);
}

// The first word every rank sends in the agreement (docs/format.md, "Engine protocol"):
// "CIERAGR" and the engine protocol's version. Builds of protocol 2 and earlier sent their
// description's length in this place; as a length it is past kMaxDescriptionBytes, so such a
// peer refuses it by name after this one collective, as this build refuses theirs, instead of
// the two sides pairing different collectives until the timeout.
constexpr uint64_t kMarkerMagic = 0x4349'4552'4147'5200;  // "CIERAGR" above the version byte
constexpr uint64_t kMarker = kMarkerMagic | kEngineProtocolVersion;
constexpr uint64_t kLastLengthFirstProtocol = 2;

// Throws the protocol_version mismatch, as the description's fact would read, if any rank sent
// another marker (or a length: an older build).
void check_markers(Transport& t) {
  std::vector<uint64_t> markers(static_cast<size_t>(t.size()));
  t.allgather(&kMarker, sizeof kMarker, markers.data());
  if (std::all_of(markers.begin(), markers.end(), [](uint64_t m) { return m == kMarker; })) return;
  std::vector<FactMap> versions;
  for (const uint64_t m : markers) {
    char hex[19];
    std::snprintf(hex, sizeof hex, "0x%016llx", static_cast<unsigned long long>(m));
    const std::string version = (m & ~uint64_t{0xff}) == kMarkerMagic ? std::to_string(m & 0xff)
                                : m <= kMaxDescriptionBytes
                                    ? std::to_string(kLastLengthFirstProtocol) + " or older"
                                    : "unknown (sent " + std::string(hex) + ")";
    versions.push_back({{"protocol_version", version}});
  }
  std::vector<const FactMap*> facts;
  for (const FactMap& v : versions) facts.push_back(&v);
  throw_first_difference("protocol_version\n", facts);
}

// What a rank sends in the agreement's first phase instead of its description: a match of all
// of these on every rank is the agreement, in O(world) bytes rather than O(world^2 x params).
struct DescriptionDigest {
  uint64_t bytes = 0;
  uint64_t low = 0, high = 0;  // XXH3-128 of the description
  uint64_t has_error = 0;      // 1 where the rank names a local error: its text must be read
};
static_assert(sizeof(DescriptionDigest) == 32);

// The descriptions that differ, each once, and which of them is each rank's.
struct Descriptions {
  std::vector<std::string> texts;
  std::vector<size_t> of_rank;
};

// The ranks' descriptions; none where every rank sent the same one (and no error). Ranks whose
// digests match send their text once, by the lowest of them, and it is held once: a mismatch
// costs each rank one description per distinct configuration, not world of them.
Descriptions exchange_where_different(Transport& t, const std::string& mine, bool has_error) {
  const int world = t.size();
  const XXH128_hash_t hash = XXH3_128bits(mine.data(), mine.size());
  const DescriptionDigest my_digest{mine.size(), hash.low64, hash.high64, has_error ? 1u : 0u};
  std::vector<DescriptionDigest> digests(static_cast<size_t>(world));
  t.allgather(&my_digest, sizeof my_digest, digests.data());
  const bool agreed = std::all_of(digests.begin(), digests.end(), [&](const DescriptionDigest& d) {
    return d.bytes == digests[0].bytes && d.low == digests[0].low && d.high == digests[0].high &&
           d.has_error == 0;
  });
  if (agreed) return {};
  std::map<std::tuple<uint64_t, uint64_t, uint64_t>, int> first_holder;
  std::vector<int> sender(static_cast<size_t>(world)), senders;
  std::vector<uint64_t> lengths(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    const DescriptionDigest& d = digests[r];
    sender[r] = first_holder.try_emplace({d.bytes, d.low, d.high}, r).first->second;
    if (sender[r] == r) {
      lengths[r] = d.bytes;
      senders.push_back(r);
    }
  }
  std::vector<std::string> texts = gather_texts(t, mine, lengths, senders);
  Descriptions d;
  std::vector<size_t> index_of_sender(static_cast<size_t>(world));
  for (const int s : senders) {
    index_of_sender[s] = d.texts.size();
    d.texts.push_back(std::move(texts[s]));
  }
  for (int r = 0; r < world; ++r) d.of_rank.push_back(index_of_sender[sender[r]]);
  return d;
}

}  // namespace

void agree_on_configuration(Transport& transport, const EngineConfig& config,
                            const std::vector<BucketLayout>& buckets,
                            const std::string& local_error) {
  Facts mine = describe(config, buckets, transport.size());
  if (!local_error.empty()) mine.insert(mine.begin(), {"error", local_error});
  check_markers(transport);
  const Descriptions d = exchange_where_different(transport, serialise(mine), !local_error.empty());
  if (d.texts.empty()) return;
  std::vector<FactMap> distinct;
  for (const std::string& text : d.texts) distinct.push_back(parse_facts(text));
  std::vector<const FactMap*> facts;
  for (const size_t i : d.of_rank) facts.push_back(&distinct[i]);
  for (size_t r = 0; r < facts.size(); ++r) {
    if (auto it = facts[r]->find("error"); it != facts[r]->end()) {
      throw ConfigError("configuration rejected on rank " + std::to_string(r) + ": " + it->second);
    }
  }
  throw_first_difference(d.texts[d.of_rank[0]], facts);
}

void agree_on_set_up(Transport& transport, const std::string& local_error) {
  const uint32_t failed = local_error.empty() ? 0 : 1;
  std::vector<uint32_t> everyone(static_cast<size_t>(transport.size()));
  transport.allgather(&failed, sizeof failed, everyone.data());
  if (std::all_of(everyone.begin(), everyone.end(), [](uint32_t f) { return f == 0; })) return;
  const std::vector<std::string> texts = exchange_descriptions(transport, local_error);
  for (size_t r = 0; r < texts.size(); ++r) {
    if (!texts[r].empty())
      throw ConfigError("engine set-up failed on rank " + std::to_string(r) + ": " + texts[r]);
  }
}

std::vector<uint32_t> exchange_stream_epochs(Transport& transport, uint32_t mine) {
  std::vector<uint32_t> epochs(static_cast<size_t>(transport.size()));
  transport.allgather(&mine, sizeof mine, epochs.data());
  return epochs;
}

}  // namespace ciera
