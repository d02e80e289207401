// The model zoo: published shapes of the paper's six MoE models, their parameters per gather unit
// and shard type, FLOPs per token, and the paper's per-type change rates.
#include <cmath>

#include "sim/json_fields.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

std::vector<ModelShape> make_zoo() {
  std::vector<ModelShape> zoo;
  {
    // https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json; q/k norms over the
    // full projection width (OlmoeAttention). Published: 6.9B total, 1.3B active.
    ModelShape m;
    m.name = "olmoe-1b-7b", m.display = "OLMoE-1B-7B";
    m.source = "huggingface.co/allenai/OLMoE-1B-7B-0924 config.json";
    m.layers = 16, m.hidden = 2048, m.heads = 16, m.kv_heads = 16, m.head_dim = 128;
    m.routed_experts = 64, m.experts_per_token = 8, m.expert_intermediate = 1024;
    m.vocab = 50304, m.qk_norm_weights = true;
    m.published_params = 6.92e9;
    zoo.push_back(m);
  }
  {
    // https://huggingface.co/deepseek-ai/deepseek-moe-16b-base config.json: first_k_dense_replace
    // 1, 2 shared experts of 1408 each, dense FFN 10944. Published: 16.4B total.
    ModelShape m;
    m.name = "deepseek-moe-16b", m.display = "DeepSeek-MoE-16B";
    m.source = "huggingface.co/deepseek-ai/deepseek-moe-16b-base config.json";
    m.layers = 28, m.dense_layers = 1, m.hidden = 2048, m.heads = 16, m.kv_heads = 16,
    m.head_dim = 128;
    m.routed_experts = 64, m.experts_per_token = 6, m.expert_intermediate = 1408;
    m.shared_intermediate = 2 * 1408, m.dense_intermediate = 10944, m.vocab = 102400;
    m.published_params = 16.4e9;
    zoo.push_back(m);
  }
  {
    // MiniCPM-MoE-8x2B is MiniCPM-2B upcycled to 8 experts, top-2 (model card at
    // huggingface.co/openbmb/MiniCPM-MoE-8x2B): MiniCPM-2B config.json has hidden 2304, 40 layers,
    // 36 heads, FFN 5760, vocab 122753, tied embeddings. Published: 13.6B non-embedding parameters.
    ModelShape m;
    m.name = "minicpm-moe-8x2b", m.display = "MiniCPM-8x2B";
    m.source = "huggingface.co/openbmb/MiniCPM-MoE-8x2B model card + MiniCPM-2B config.json";
    m.layers = 40, m.hidden = 2304, m.heads = 36, m.kv_heads = 36, m.head_dim = 64;
    m.routed_experts = 8, m.experts_per_token = 2, m.expert_intermediate = 5760;
    m.vocab = 122753, m.tied_embeddings = true;
    m.published_params = 13.6e9, m.published_without_embeddings = true;
    zoo.push_back(m);
  }
  {
    // https://huggingface.co/Qwen/Qwen2-57B-A14B config.json: moe_intermediate_size 2560,
    // shared_expert_intermediate_size 20480, QKV bias, shared-expert gate. Published: 57.4B total.
    ModelShape m;
    m.name = "qwen2-57b-a14b", m.display = "Qwen2-57B-A14B";
    m.source = "huggingface.co/Qwen/Qwen2-57B-A14B config.json";
    m.layers = 28, m.hidden = 3584, m.heads = 28, m.kv_heads = 4, m.head_dim = 128;
    m.routed_experts = 64, m.experts_per_token = 8, m.expert_intermediate = 2560;
    m.shared_intermediate = 20480, m.vocab = 151936, m.qkv_bias = true, m.shared_expert_gate = true;
    m.published_params = 57.4e9;
    zoo.push_back(m);
  }
  {
    // https://huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json. Published: 46.7B total.
    ModelShape m;
    m.name = "mixtral-8x7b", m.display = "Mixtral-8x7B";
    m.source = "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json";
    m.layers = 32, m.hidden = 4096, m.heads = 32, m.kv_heads = 8, m.head_dim = 128;
    m.routed_experts = 8, m.experts_per_token = 2, m.expert_intermediate = 14336, m.vocab = 32000;
    m.published_params = 46.7e9;
    zoo.push_back(m);
  }
  {
    // https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E config.json, text_config: every
    // layer MoE (interleave_moe_layer_step 1), 16 experts top-1 plus one shared expert of 8192,
    // qk norm without weights. Published: 109B total including the vision encoder, which the
    // text-only model here leaves out.
    ModelShape m;
    m.name = "llama4-scout-17b-16e", m.display = "Llama-4-Scout-17B";
    m.source = "huggingface.co/meta-llama/Llama-4-Scout-17B-16E config.json (text_config)";
    m.layers = 48, m.hidden = 5120, m.heads = 40, m.kv_heads = 8, m.head_dim = 128;
    m.routed_experts = 16, m.experts_per_token = 1, m.expert_intermediate = 8192;
    m.shared_intermediate = 8192, m.vocab = 202048;
    m.published_params = 109e9;
    zoo.push_back(m);
  }
  return zoo;
}

uint64_t attention_weights(const ModelShape& m) {
  const uint64_t q = static_cast<uint64_t>(m.heads) * m.head_dim;
  const uint64_t kv = static_cast<uint64_t>(m.kv_heads) * m.head_dim;
  return m.hidden * (q + 2 * kv) + q * m.hidden;
}

uint64_t qkv_bias_values(const ModelShape& m) {
  return m.qkv_bias ? static_cast<uint64_t>(m.heads + 2 * m.kv_heads) * m.head_dim : 0;
}

// Two RMSNorms per layer, plus q/k norms where they have weights (classified as norms, as
// classify_parameter does).
uint64_t layer_norm_values(const ModelShape& m) {
  const uint64_t qk =
      m.qk_norm_weights ? static_cast<uint64_t>(m.heads + m.kv_heads) * m.head_dim : 0;
  return 2 * m.hidden + qk;
}

GatherUnit layer_unit(const ModelShape& m, int index, int seq_len) {
  const bool dense = index < m.dense_layers;
  GatherUnit unit;
  unit.name = "layers." + std::to_string(index);
  const uint64_t attention = attention_weights(m);
  const uint64_t ffn_per_expert = 3 * m.hidden * m.expert_intermediate;  // gate, up, down
  const uint64_t shared = 3 * m.hidden * m.shared_intermediate;
  uint64_t ffn = 0, active_ffn = 0, router = 0;
  if (dense) {
    ffn = active_ffn = 3 * m.hidden * m.dense_intermediate;
  } else {
    ffn = m.routed_experts * ffn_per_expert + shared;
    active_ffn = m.experts_per_token * ffn_per_expert + shared;
    router = m.hidden * m.routed_experts + (m.shared_expert_gate ? m.hidden : 0);
  }
  unit.shards.push_back({ShardType::kAttention, attention + qkv_bias_values(m)});
  if (router) unit.shards.push_back({ShardType::kRouter, router});
  unit.shards.push_back({dense ? ShardType::kDenseFfn : ShardType::kExpertFfn, ffn});
  unit.shards.push_back({ShardType::kNorm, layer_norm_values(m)});
  unit.grad_values = unit.gathered_values();
  // 2 FLOPs per multiply-add for every weight a token meets, plus QK^T and AV over the sequence.
  const double q_width = static_cast<double>(m.heads) * m.head_dim;
  unit.forward_flops_per_token =
      2.0 * static_cast<double>(attention + router + active_ffn) + 4.0 * seq_len * q_width;
  return unit;
}

}  // namespace

ShardType parse_shard_type(std::string_view name) {
  std::string known;
  for (ShardType type : kAllShardTypes) {
    if (to_string(type) == name) return type;
    known += (known.empty() ? "" : ", ") + std::string(to_string(type));
  }
  throw ConfigError("unknown shard type \"" + std::string(name) + "\" (expected one of " + known +
                    ")");
}

const std::vector<ModelShape>& model_zoo() {
  static const std::vector<ModelShape> zoo = make_zoo();
  return zoo;
}

const ModelShape& find_model(std::string_view name) {
  std::string known;
  for (const ModelShape& m : model_zoo()) {
    if (m.name == name) return m;
    known += (known.empty() ? "" : ", ") + m.name;
  }
  throw ConfigError("unknown model \"" + std::string(name) + "\" (known: " + known + ", all)");
}

uint64_t GatherUnit::gathered_values() const {
  uint64_t total = 0;
  for (const ShardGroup& s : shards) total += s.values;
  return total;
}

void check_layers(const ModelShape& m, int layers) {
  if (layers < 0 || layers > m.layers) {
    throw ConfigError("--layers " + std::to_string(layers) + " is outside 1.." +
                      std::to_string(m.layers) + " for " + m.display);
  }
}

std::vector<GatherUnit> model_units(const ModelShape& m, int layers, int seq_len) {
  check_layers(m, layers);
  const int count = layers == 0 ? m.layers : layers;
  const uint64_t table = static_cast<uint64_t>(m.vocab) * m.hidden;
  std::vector<GatherUnit> units;
  GatherUnit embed;
  embed.name = "embed";
  embed.shards.push_back({ShardType::kEmbedding, table});
  embed.grad_values = table;
  units.push_back(embed);
  for (int i = 0; i < count; ++i) units.push_back(layer_unit(m, i, seq_len));
  // A tied head gathers the embedding table again; its gradient is reduced with the embedding's.
  GatherUnit head;
  head.name = "head";
  head.shards.push_back({ShardType::kNorm, static_cast<uint64_t>(m.hidden)});
  head.shards.push_back({ShardType::kEmbedding, table});
  head.grad_values = m.hidden + (m.tied_embeddings ? 0 : table);
  head.forward_flops_per_token = 2.0 * static_cast<double>(table);
  units.push_back(head);
  return units;
}

uint64_t parameter_count(const ModelShape& m, bool with_embeddings) {
  uint64_t total = 0;
  for (const GatherUnit& unit : model_units(m, 0, 1)) {
    if (with_embeddings) {
      total += unit.grad_values;
    } else {
      for (const ShardGroup& s : unit.shards)
        total += s.type == ShardType::kEmbedding ? 0 : s.values;
    }
  }
  return total;
}

double ChangeRates::block_rate(ShardType type) const {
  const TypeRate& r = of(type);
  if (r.block >= 0) return r.block;
  if (r.element >= 0) return 1.0 - std::pow(1.0 - r.element, static_cast<double>(block_values));
  return 1.0;  // unknown: assume every block changes, so selection never compresses it
}

namespace {

// How the paper's rates say where their element rate came from (paper_rates), and a rates file's
// block rates over them (apply_rates_json).
constexpr char kPaperElementNote[] = "element 0.51% assumed (paper §2.2: 0.30-0.51%)";

}  // namespace

ChangeRates paper_rates(const ModelShape& model) {
  // Median block change rates at B = 512 from the paper's Fig. 4 (§2.4). The text fixes OLMoE's
  // values and, for DeepSeek and MiniCPM, layer norm plus the 0.66-0.84 range of the other three;
  // which of the figure's values belongs to expert FFN, attention or router there is our reading.
  // The paper gives no per-type rates for Qwen2, Mixtral or Scout: Qwen2 takes DeepSeek's
  // (fine-grained experts; similar ablation behaviour, Table 3), Mixtral and Scout high rates
  // ("its block change rate is high", §4.4; "high per-shard change rates", §4.2).
  // The paper's "high" says nothing of Mixtral's and Scout's norm and embedding: those take
  // MiniCPM's norm and OLMoE's embedding, and say so.
  struct Row {
    const char* model;
    double expert_ffn, attention, router, norm, embedding;
    const char* source;
    const char* norm_embedding_source = nullptr;  // where it differs from `source`
  };
  static const Row rows[] = {
      {"olmoe-1b-7b", 0.22, 0.96, 0.94, 0.64, 0.65, "paper Fig. 4"},
      {"deepseek-moe-16b", 0.75, 0.84, 0.66, 0.00, 0.48, "paper Fig. 4"},
      {"minicpm-moe-8x2b", 0.80, 0.81, 0.66, 0.13, 0.88, "paper Fig. 4"},
      {"qwen2-57b-a14b", 0.75, 0.84, 0.66, 0.00, 0.48, "assumed (DeepSeek's)"},
      {"mixtral-8x7b", 0.95, 0.97, 0.95, 0.13, 0.65, "assumed (paper: high)",
       "assumed (norm as MiniCPM's, embedding as OLMoE's)"},
      {"llama4-scout-17b-16e", 0.95, 0.97, 0.95, 0.13, 0.65, "assumed (paper: high)",
       "assumed (norm as MiniCPM's, embedding as OLMoE's)"},
  };
  // Element rates (for the encoder's fine mode, which sends per changed value): the paper gives
  // only the range for real MoE training, 0.30-0.51% of values per step (§2.2), not per type; we
  // take its top for every type.
  constexpr double kPaperElementRate = 0.0051;
  ChangeRates rates;
  for (const Row& row : rows) {
    if (model.name != row.model) continue;
    const auto set = [&](ShardType type, double block, const std::string& source) {
      rates.of(type).block = block;
      rates.of(type).block_at = 512;
      rates.of(type).element = kPaperElementRate;
      rates.of(type).source = source + "; " + kPaperElementNote;
    };
    set(ShardType::kExpertFfn, row.expert_ffn, row.source);
    set(ShardType::kAttention, row.attention, row.source);
    set(ShardType::kRouter, row.router, row.source);
    const char* small = row.norm_embedding_source ? row.norm_embedding_source : row.source;
    set(ShardType::kNorm, row.norm, small);
    set(ShardType::kEmbedding, row.embedding, small);
    set(ShardType::kDenseFfn, row.expert_ffn, "assumed (as expert FFN)");
    rates.of(ShardType::kOther).block = 1.0;  // unknown: every block, every value changes
    rates.of(ShardType::kOther).source = "assumed";
  }
  return rates;
}

namespace {

ShardType shard_type_in(const std::string& origin, const std::string& key) {
  const std::string name = key.substr(key.find('.') == std::string::npos ? 0 : key.find('.') + 1);
  try {
    return parse_shard_type(name);
  } catch (const ConfigError& e) {
    throw ConfigError(origin + ": field \"" + key + "\": " + e.what());
  }
}

}  // namespace

void apply_rates_json(ChangeRates& rates, const std::string& json_text, const std::string& origin) {
  using detail::Fields;
  const detail::Json json = detail::parse_json(json_text, origin);
  const Fields top(json, "", origin);
  const uint32_t measured_at =
      top.has("block_values") ? top.block_values("block_values") : rates.block_values;
  // A file that gives no rate changed nothing, without a word (every rate stayed the paper's).
  bool gives_a_rate = false;
  for (const auto& [key, value] : json.items()) {
    if (key == "block" || key == "block_values" || key == "format" || key == "version" ||
        key == "source")
      continue;
    gives_a_rate = true;
    const ShardType type = shard_type_in(origin, key);
    rates.of(type).element = top.fraction(key.c_str());
    rates.of(type).block = -1;
    rates.of(type).block_at = 0;
    rates.of(type).source = origin;
  }
  if (top.has("block")) {
    const Fields block = top.object("block");
    for (const auto& [key, value] : block.json().items()) {
      gives_a_rate = true;
      const ShardType type = shard_type_in(origin, "block." + key);
      const double rate = block.fraction(key.c_str());
      if (measured_at != rates.block_values) {
        // At another B than the projection's: the file's element rate for the type stands in
        // (set above, its block rate derived), as a trace's do.
        if (rates.of(type).source == origin && rates.of(type).element >= 0) continue;
        throw ConfigError(origin + ": \"block\" rates are at B = " + std::to_string(measured_at) +
                          " (\"block_values\"), the projection's B is " +
                          std::to_string(rates.block_values) + " (--block): give --block " +
                          std::to_string(measured_at) + ", or an element rate for \"" + key +
                          "\" to derive its block rate from");
      }
      // A block changes when any of its values does: never less often than its values do.
      if (rates.of(type).source == origin && rates.of(type).element > rate) {
        throw ConfigError(origin + ": field \"block." + key +
                          "\": a block changes whenever one of its "
                          "values does, so its rate (" +
                          std::to_string(rate) + ") cannot be below the element rate (" +
                          std::to_string(rates.of(type).element) + ")");
      }
      TypeRate& r = rates.of(type);
      // A block rate alone keeps the element rate the type had (fine mode's): the label says
      // where that came from, not the file (the paper's was labelled "rates FILE" as measured).
      std::string element_from;
      if (r.source != origin && r.element >= 0) {
        element_from =
            "; " + (r.source.ends_with(kPaperElementNote) ? std::string(kPaperElementNote)
                                                          : "element from " + r.source);
      }
      r.block = rate;
      r.block_at = 0;
      r.source = origin + element_from;
    }
  }
  if (!gives_a_rate) {
    throw ConfigError(
        origin +
        ": gives no change rate: expected element rates by shard type "
        "({\"expert_ffn\": 0.004, ...}) and/or \"block\" rates "
        "({\"block\": {\"expert_ffn\": 0.21, ...}}); docs/simulator.md, \"Change rates\"");
  }
}

}  // namespace ciera::sim
