// Parameter-name classification (paper §2.4, Figure 4). Names are matched by whole dot-separated
// components, never substrings, so that `gate_proj` (an FFN matrix) is not taken for `gate` (the
// router).
#include <algorithm>
#include <array>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "ciera/analysis.hpp"

namespace ciera {
namespace {

// Components that wrappers insert and that say nothing about the parameter: FSDP1, DDP /
// DataParallel, torch.compile, activation checkpointing, Lightning.
constexpr std::array<std::string_view, 5> kWrapperComponents = {
    "_fsdp_wrapped_module", "module", "_orig_mod", "_checkpoint_wrapped_module", "_forward_module"};

std::vector<std::string_view> meaningful_components(std::string_view name) {
  std::vector<std::string_view> parts;
  while (!name.empty()) {
    const size_t dot = name.find('.');
    const std::string_view part = name.substr(0, dot);
    if (!part.empty() && std::find(kWrapperComponents.begin(), kWrapperComponents.end(), part) ==
                             kWrapperComponents.end()) {
      parts.push_back(part);
    }
    if (dot == std::string_view::npos) break;
    name.remove_prefix(dot + 1);
  }
  return parts;
}

bool is_norm_module(std::string_view c) {
  return c.ends_with("norm") || c.starts_with("ln_") || c == "ln";
}

}  // namespace

std::string_view to_string(ShardType type) {
  switch (type) {
    case ShardType::kExpertFfn:
      return "expert_ffn";
    case ShardType::kAttention:
      return "attention";
    case ShardType::kRouter:
      return "router";
    case ShardType::kNorm:
      return "norm";
    case ShardType::kEmbedding:
      return "embedding";
    case ShardType::kDenseFfn:
      return "dense_ffn";
    case ShardType::kOther:
      return "other";
  }
  return "other";
}

ShardType classify_parameter(std::string_view name) {
  const std::vector<std::string_view> parts = meaningful_components(name);
  auto has_any = [&](std::initializer_list<std::string_view> wanted) {
    return std::any_of(parts.begin(), parts.end(), [&](std::string_view c) {
      return std::find(wanted.begin(), wanted.end(), c) != wanted.end();
    });
  };
  // The order matters: norms inside attention (q_norm, kv_a_layernorm) are norms, and the router
  // lives inside the MoE block next to the experts.
  if (has_any({"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out", "word_embeddings",
               "tok_embeddings"})) {
    return ShardType::kEmbedding;
  }
  if (std::any_of(parts.begin(), parts.end(), is_norm_module)) return ShardType::kNorm;
  if (has_any({"gate", "router", "shared_expert_gate"})) return ShardType::kRouter;
  if (has_any({"experts", "shared_expert", "shared_experts"})) return ShardType::kExpertFfn;
  if (has_any({"self_attn", "attn", "attention", "self_attention", "cross_attn"}))
    return ShardType::kAttention;
  if (has_any({"mlp", "feed_forward", "ffn"})) return ShardType::kDenseFfn;
  return ShardType::kOther;
}

}  // namespace ciera
