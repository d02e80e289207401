"""Small configurations of real MoE architectures from Hugging Face transformers, built from
config (no download): OLMoE, Mixtral, Qwen2-MoE and DeepSeek (V3-style MLA + shared experts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "deepseek")


@dataclass
class ModelSpec:
    family: str = "olmoe"
    hidden: int = 128
    layers: int = 2
    experts: int = 8
    experts_per_token: int = 2
    expert_intermediate: int = 256
    heads: int = 4
    vocab: int = 256
    max_positions: int = 1024

    def describe(self) -> dict:
        return asdict(self)


def build(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """The model with deterministic initialisation (FP32 master weights)."""
    import torch  # here, so that `ciera train` checks its options (ModelSpec) without loading torch
    import transformers as tf

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                  max_position_embeddings=spec.max_positions, intermediate_size=spec.expert_intermediate,
                  num_experts_per_tok=spec.experts_per_token, eos_token_id=None, pad_token_id=None,
                  bos_token_id=None, tie_word_embeddings=False)
    if spec.family == "olmoe":
        cfg, cls = tf.OlmoeConfig(**common, num_experts=spec.experts), tf.OlmoeForCausalLM
    elif spec.family == "mixtral":
        cfg, cls = tf.MixtralConfig(**common, num_local_experts=spec.experts), tf.MixtralForCausalLM
    elif spec.family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, num_experts=spec.experts, moe_intermediate_size=spec.expert_intermediate,
                                shared_expert_intermediate_size=spec.expert_intermediate)
        cls = tf.Qwen2MoeForCausalLM
    elif spec.family == "deepseek":
        head = spec.hidden // spec.heads
        rope = max(2, (head // 2) & ~1)  # rotary dimensions come in pairs
        cfg = tf.DeepseekV3Config(**common, n_routed_experts=spec.experts, moe_intermediate_size=spec.expert_intermediate,
                                  n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=spec.hidden // 2,
                                  q_lora_rank=spec.hidden // 2, qk_rope_head_dim=rope,
                                  qk_nope_head_dim=head - rope, v_head_dim=head, n_group=1, topk_group=1)
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown model family {spec.family!r} (expected one of {', '.join(FAMILIES)})")
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = cls(cfg)
    return model.float()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's sparse MoE block (its input is what an expert-parallel layer would
    send to the experts' ranks)."""
    return [layer.mlp for layer in decoder_layers(model)]
