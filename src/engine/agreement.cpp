// The description is "key=value" text in a fixed order, not a struct, so that the first
// differing fact can be reported by name and value, including a fact one rank's build does not
// know (it shows as <absent>); format_version and protocol_version are facts like the others.
#include "engine/agreement.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <string_view>
#include <utility>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/version.hpp"
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

constexpr uint64_t kMaxDescriptionBytes = uint64_t{1} << 30;

// Every rank's description, as sent.
std::vector<std::string> exchange_descriptions(Transport& t, const std::string& mine) {
  const int world = t.size();
  uint64_t my_length = mine.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(world));
  t.allgather(&my_length, sizeof my_length, lengths.data());
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
    for (int r = 0; r < world; ++r) {
      if (r == 8 && world > 9) {
        announced += ", ... (" + std::to_string(world) + " ranks)";
        break;
      }
      announced +=
          (r == 0 ? "rank " : ", rank ") + std::to_string(r) + " " + std::to_string(lengths[r]);
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

// Throws on the first fact (in rank 0's order, then facts rank 0 lacks) whose value differs.
void throw_first_difference(const std::string& rank0_text,
                            const std::vector<std::map<std::string, std::string>>& facts) {
  const int world = static_cast<int>(facts.size());
  std::istringstream order(rank0_text);
  std::string line;
  std::vector<std::string> keys;
  while (std::getline(order, line)) keys.push_back(line.substr(0, line.find('=')));
  for (int r = 1; r < world; ++r) {
    for (const auto& [k, v] : facts[r]) {
      if (!facts[0].count(k)) keys.push_back(k);
    }
  }
  for (const std::string& key : keys) {
    std::map<std::string, std::vector<int>> holders;
    for (int r = 0; r < world; ++r) {
      auto it = facts[r].find(key);
      holders[it == facts[r].end() ? "<absent>" : it->second].push_back(r);
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
          "configuration mismatch across ranks: " + key + bucket_named(key, facts[0]) + " is";
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

}  // namespace

void agree_on_configuration(Transport& transport, const EngineConfig& config,
                            const std::vector<BucketLayout>& buckets,
                            const std::string& local_error) {
  Facts mine = describe(config, buckets, transport.size());
  if (!local_error.empty()) mine.insert(mine.begin(), {"error", local_error});
  const std::vector<std::string> texts = exchange_descriptions(transport, serialise(mine));
  std::vector<std::map<std::string, std::string>> facts;
  for (const std::string& text : texts) facts.push_back(parse_facts(text));
  for (size_t r = 0; r < facts.size(); ++r) {
    if (auto it = facts[r].find("error"); it != facts[r].end()) {
      throw ConfigError("configuration rejected on rank " + std::to_string(r) + ": " + it->second);
    }
  }
  throw_first_difference(texts[0], facts);
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
