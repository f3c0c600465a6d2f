"""How each model family names its sizes in ``config.json``: the ONE table the memory plan reads.

Why a table: every family spells the same few terms its own way (OLMoE's expert width is
``intermediate_size``, Hunyuan's top-k is ``moe_topk``, DeepSeek's expert count
``n_routed_experts``), and lays out its decoder layer a little differently (MLA ranks, a
linear-attention block, shared experts, biases). `qatlib.plan.shape.ModelShape.from_config` reads
every family through this dict and nothing else; a new family is one entry here.

Plain data, torch-free (the plan runs without importing torch, so transformers' config classes,
which import it, are not read here). tests/test_plan_families.py holds every entry to
transformers 5's config class of that ``model_type``: each key named here is one the class writes
(or an alias in its own ``attribute_map``), each default equals the class's, and the plan's
parameter count equals the model's built on the meta device.

A term names one key or several: the first is the attribute the config class writes, the others
the aliases its ``attribute_map`` accepts (a config.json may be written with either).

Entry fields (all optional; `GENERIC` fills what an entry leaves out):

``experts`` / ``top_k`` / ``expert_width``  config keys of the routed-expert count, the experts per
    token and one expert's MLP width; ``experts: None``: a dense family (MoE keys ignored, as
    transformers does).
``shared``  the shared expert: ``("width", key)`` its MLP width, ``("count", key)`` that many
    expert widths side by side (DeepSeek's ``n_shared_experts``); ``shared_gate``: a
    ``Linear(hidden, 1)`` scales it (Qwen2-MoE, Qwen3-Next).
``sparse``  which layers route: ``"step"`` (not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0``), ``"first_k"`` (``i >= first_k_dense_replace``), ``"types"``
    (``mlp_layer_types[i] == "sparse"``), ``"all"``.
``attention``  ``"gqa"`` (q/k/v/o), ``"mla"`` (DeepSeek's low-rank q and kv), ``"mla_dsa"`` (MLA
    + GLM's DSA indexer). ``gated_q``: q_proj is twice as wide (an output gate). ``sinks``: one
    learned sink per head.
``linear_attention``  the linear-attention (gated DeltaNet) layers' projections, where
    ``layer_types`` (or ``full_attention_interval``) says ``linear_attention``:
    ``"qkvz_ba"`` (Qwen3-Next: in_proj_qkvz, in_proj_ba) or ``"qkv_z_b_a"`` (Qwen3.5: four).
``qk_norm``  per-layer q/k RMSNorms: ``"head"`` (head_dim each), ``"proj"`` (the whole q / k
    projection width: MiniMax-M2), ``"olmoe"`` (hidden, hidden / heads x kv heads);
    ``qk_norm_flag``: the config key that switches them on (GLM-4-MoE ``use_qk_norm``).
``fused``  q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (Phi-3): the same
    weights as separate linears, one scale where they would have three / two.
``attn_bias``  ``(config key, which of "qkvo")``; ``mlp_bias``: the key of the dense MLP's bias.
``expert_bias`` / ``router_bias``  biases on the fused experts / the router (GPT-OSS).
``norms``  RMSNorms per decoder layer (Gemma 3: four).
``defaults``  values of the config class where ``config.json`` may leave a key out and the
    class's default matters (a key present but null stays null: DeepSeek's ``q_lora_rank``).
"""

from __future__ import annotations

from typing import Any

# Every term's keys where a family names none: transformers' standard attribute first, then the
# aliases config.json files are written with (the hub's Qwen3-MoE says num_experts, transformers 5
# writes num_local_experts).
GENERIC: dict[str, Any] = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk"),
    "expert_width": ("moe_intermediate_size",),
    "tied": "tie_word_embeddings",
    "layer_types": "layer_types",
    # which layers route (``sparse`` below says which of these a family reads)
    "sparse_step": "decoder_sparse_step",
    "dense_list": "mlp_only_layers",
    "first_dense": "first_k_dense_replace",
    "mlp_types": "mlp_layer_types",
    "full_attention_interval": "full_attention_interval",
    # groups of terms, one key each: MLA's ranks and head widths (q_lora_rank null: no low-rank q),
    # DSA's indexer heads and width, linear attention's heads and widths
    "mla": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "indexer": ("index_n_heads", "index_head_dim"),
    "linear": (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ),
    "linear_conv": "linear_conv_kernel_dim",
    "sparse": "all",
    "attention": "gqa",
    "norms": 2,
}

_QWEN_MOE = {"experts": "num_experts", "expert_width": "moe_intermediate_size", "sparse": "step"}
_DEEPSEEK = {
    "experts": ("n_routed_experts", "num_local_experts"),
    "expert_width": "moe_intermediate_size",
    "shared": ("count", "n_shared_experts"),
    "sparse": "first_k",
}
_NEXT = {
    **_QWEN_MOE,
    "shared": ("width", "shared_expert_intermediate_size"),
    "shared_gate": True,
    "gated_q": True,
    "qk_norm": "head",
    "defaults": {
        "head_dim": 256,
        "full_attention_interval": 4,  # read by the config class only where layer_types is absent
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
}

FAMILIES: dict[str, dict[str, Any]] = {
    # dense
    "llama": {"experts": None, "attn_bias": ("attention_bias", "qkvo"), "mlp_bias": "mlp_bias"},
    "qwen3": {
        "experts": None,
        "attn_bias": ("attention_bias", "qkvo"),
        "qk_norm": "head",
        "defaults": {"head_dim": 128},
    },
    "gemma3_text": {
        "experts": None,
        "attn_bias": ("attention_bias", "qkvo"),
        "qk_norm": "head",
        "norms": 4,
        "defaults": {"tie_word_embeddings": True, "head_dim": 256},
    },
    "phi3": {"experts": None, "fused": True},
    # MoE
    "qwen2_moe": {
        **_QWEN_MOE,
        "shared": ("width", "shared_expert_intermediate_size"),
        "shared_gate": True,
        "attn_bias": ("qkv_bias", "qkv"),
        "defaults": {"qkv_bias": True, "decoder_sparse_step": 1},
    },
    "qwen3_moe": {
        **_QWEN_MOE,
        "experts": ("num_local_experts", "num_experts"),
        "attn_bias": ("attention_bias", "qkvo"),
        "qk_norm": "head",
        "defaults": {"decoder_sparse_step": 1},
    },
    "deepseek_v3": {
        **_DEEPSEEK,
        "attention": "mla",
        "attn_bias": ("attention_bias", "qkvo"),  # MLA: on q_a_proj, kv_a_proj_with_mqa, o_proj
        "defaults": {
            "first_k_dense_replace": 3,
            "n_shared_experts": 1,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
        },
    },
    "glm4_moe": {
        **_DEEPSEEK,
        "attn_bias": ("attention_bias", "qkv"),
        "qk_norm": "head",
        "qk_norm_flag": "use_qk_norm",
        "defaults": {"first_k_dense_replace": 1, "n_shared_experts": 1},
    },
    "glm_moe_dsa": {
        **_DEEPSEEK,
        "attention": "mla_dsa",
        "attn_bias": ("attention_bias", "qkvo"),
        "sparse": "types",
        "defaults": {
            "first_k_dense_replace": 3,
            "n_shared_experts": 1,
            "q_lora_rank": 2048,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64,
            "v_head_dim": 256,
            "index_n_heads": 32,
            "index_head_dim": 128,
        },
    },
    "qwen3_next": {
        **_NEXT,
        "linear_attention": "qkvz_ba",
        "defaults": {**_NEXT["defaults"], "decoder_sparse_step": 1},
    },
    "qwen3_5_moe_text": {**_NEXT, "sparse": "all", "linear_attention": "qkv_z_b_a"},
    "mixtral": {"experts": ("num_local_experts", "num_experts"), "expert_width": "intermediate_size"},
    "minimax_m2": {
        "experts": ("num_local_experts", "num_experts"),
        "expert_width": "intermediate_size",
        "qk_norm": "proj",
        "defaults": {"head_dim": 128},
    },
    "olmoe": {
        "experts": ("num_experts", "num_local_experts"),
        "expert_width": "intermediate_size",
        "attn_bias": ("attention_bias", "qkvo"),
        "qk_norm": "olmoe",
    },
    "hunyuan_v1_moe": {
        "experts": ("num_experts", "num_local_experts"),  # an int, or one per layer
        "top_k": ("moe_topk", "num_experts_per_tok"),  # an int, or one per layer
        "expert_width": "intermediate_size",
        "shared": ("width", "intermediate_size"),
        "attn_bias": ("attention_bias", "qkvo"),
        "qk_norm": "head",
    },
    "gpt_oss": {
        "experts": ("num_local_experts", "num_experts"),
        "expert_width": "intermediate_size",
        "attn_bias": ("attention_bias", "qkvo"),
        "sinks": True,
        "expert_bias": True,
        "router_bias": True,
        "defaults": {"attention_bias": True, "head_dim": 64},
    },
}


def family(model_type: str) -> dict[str, Any] | None:
    """The table's entry for ``model_type`` over `GENERIC` (None: a family the table does not know)."""
    entry = FAMILIES.get(model_type)
    return None if entry is None else {**GENERIC, **entry}


def keys(value: Any) -> tuple[str, ...]:
    """A term's config keys as a tuple (an entry names one key or several)."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def lookup(cfg: dict[str, Any], fam: dict[str, Any], term_keys: Any) -> tuple[Any, str | None]:
    """The first of ``term_keys`` that ``cfg`` has (a key present, even null, wins over the
    family's default) and which key it was; (None, None) where none is present or defaulted."""
    names = keys(term_keys)
    for k in names:
        if k in cfg:
            return cfg[k], k
    defaults = fam.get("defaults") or {}
    for k in names:
        if k in defaults:
            return defaults[k], k
    return None, None
