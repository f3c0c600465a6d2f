"""A decoder's sizes, from its config.json read through `qatlib.plan.families` (torch-free).

Why it never refuses a family it cannot fully describe: the plan sizes jobs, it does not decide
whether a model may be trained. A term it cannot compute (a key the table looks for is missing,
or the ``model_type`` is not in the table) becomes a sentence in ``not_computed`` naming the term
and the key looked for; the plan counts it as zero (or, for top-k, as every expert: an upper
bound) and says so in every stage's output. Only the core sizes without which nothing can be
counted (vocab, hidden, layers, heads) raise `PlanError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from qatlib.yamlio import ConfigError

from .families import FAMILIES, GENERIC, family, keys, lookup


class PlanError(ConfigError):
    """A model config or an experiment value the plan cannot use (the message names it)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model (every family of `qatlib.plan.families.FAMILIES`)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (dense layers of a MoE model too)
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0  # one routed expert's width
    tied: bool = False
    dense_layers: int = 0  # MoE models: layers with a dense MLP instead
    model_type: str = ""
    # per decoder layer, (linear attention, routed MLP); empty: full attention, the last
    # ``layers - dense_layers`` layers routed
    kinds: tuple[tuple[bool, bool], ...] = ()
    shared_width: int = 0  # shared experts' MLP width, all of them side by side
    shared_gate: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    mlp_bias: bool = False
    attn_bias: str = ""  # which of q, k, v, o carry a bias (MLA: "q" q_a, "k" kv_a, "o")
    qk_norm: str = ""  # "" | head | proj | olmoe (`qatlib.plan.families`)
    gated_q: bool = False
    fused: bool = False  # q/k/v and gate/up in one linear each (the same weights, fewer scales)
    sinks: bool = False
    norms: int = 2
    mla: tuple[int, int, int, int, int] | None = None  # q_lora (0: none), kv_lora, qk_nope, qk_rope, v_head
    indexer: tuple[int, int] | None = None  # DSA: heads, head_dim
    linear: tuple[int, int, int, int, int] | None = None  # key heads, value heads, key dim, value dim, conv
    linear_split: str = ""
    not_computed: tuple[str, ...] = field(default=())

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelShape:
        """The shape of ``cfg`` (a config.json as a dict) read through its family's entry of
        `qatlib.plan.families.FAMILIES` (an unknown ``model_type``: `GENERIC`'s keys, a
        llama-like layer). What it cannot compute goes to ``not_computed`` naming the term and
        the key looked for in ``source``; `PlanError` only without vocab / hidden / layers / heads."""
        mt = str(cfg.get("model_type") or "")
        text = cfg.get("text_config")
        if family(mt) is None and isinstance(text, dict) and family(str(text.get("model_type") or "")):
            # a multimodal config.json (Qwen3.5-MoE, Gemma 3): its language model is planned
            shape = cls.from_config(text, f"{source}: text_config")
            note = f"model_type {mt!r} outside text_config (e.g. a vision tower): not counted"
            return replace(shape, not_computed=(note, *shape.not_computed))
        fam, missing = family(mt), []
        if fam is None:
            fam = dict(GENERIC)
            missing.append(
                f"layout of model_type {mt!r}: not in qatlib/plan/families.py; counted as a llama-like "
                "decoder (q/k/v/o, gate/up/down, 2 norms per layer; no q/k norms, biases or sinks)"
            )

        def get(term_keys: Any) -> Any:
            return lookup(cfg, fam, term_keys)[0]

        def need(term: str) -> int:
            v = get(fam[term])
            if not isinstance(v, int) or isinstance(v, bool):
                raise PlanError(
                    f"{source}: {fam[term]}: missing or not an integer (needed by the memory plan)"
                )
            return v

        def size(term: str, what: str, term_keys: Any) -> int:
            v = get(term_keys)
            if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                if len(set(v)) > 1:
                    missing.append(
                        f"{term}: {'/'.join(keys(term_keys))} differs per layer; the largest is used"
                    )
                v = max(v)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            missing.append(f"{term} ({what}): {source} has no integer {'/'.join(keys(term_keys))}")
            return 0

        vocab, hidden, layers, heads = need("vocab"), need("hidden"), need("layers"), need("heads")
        kv_heads = get(fam["kv_heads"]) or heads
        head_dim = get(fam["head_dim"]) or hidden // heads
        flag = lambda k, default=False: bool(get(k)) if lookup(cfg, fam, k)[1] else default  # noqa: E731

        # routed experts: the family's key, or (a family the table does not know) any generic one
        experts = 0
        if fam.get("experts") is not None:
            known = mt in FAMILIES
            n = get(fam["experts"])
            if known or n:
                experts = size("experts", "routed experts per MoE layer", fam["experts"])
        top_k = width = shared = 0
        if experts:
            width = size("expert width", "one expert's MLP width", fam["expert_width"])
            if not width and mt not in FAMILIES and get(fam["intermediate"]):
                # an unknown family: the dense width, as Mixtral / OLMoE name it (said, not silent)
                width = int(get(fam["intermediate"]))
                missing[-1] += f"; {fam['intermediate']} ({width}) assumed"
            top_k = size("top_k", "experts per token; every expert is assumed", fam["top_k"]) or experts
            kind, key = fam.get("shared") or (None, None)
            if kind == "width":
                shared = size("shared expert width", "shared expert MLP", key)
            elif kind == "count":
                shared = size("shared experts", "shared experts x expert width", key) * width

        # which layers route, and which attend linearly
        def routed(i: int) -> bool:
            rule = fam.get("sparse")
            if not experts:
                return False
            if rule == "step":
                step = get(fam["sparse_step"]) or 1
                return i not in (get(fam["dense_list"]) or []) and (i + 1) % step == 0
            if rule in ("first_k", "types"):
                types = get(fam["mlp_types"]) if rule == "types" else None
                if isinstance(types, list) and len(types) == layers:
                    return types[i] == "sparse"
                return i >= (get(fam["first_dense"]) or 0)
            return True

        lin = None
        if fam.get("linear_attention"):
            lin = tuple(size(k, "linear attention", k) for k in keys(fam["linear"]))
            lin += (size("linear_conv_kernel_dim", "linear attention conv", fam["linear_conv"]),)
        types = get(fam["layer_types"])
        interval = get(fam["full_attention_interval"]) or 4

        def linear_at(i: int) -> bool:
            if lin is None:
                return False
            if isinstance(types, list) and len(types) == layers:
                return types[i] == "linear_attention"
            return (i + 1) % interval != 0

        kinds = tuple((linear_at(i), routed(i)) for i in range(layers))
        mla = indexer = None
        if fam["attention"] in ("mla", "mla_dsa"):
            names = keys(fam["mla"])
            q_lora = get(names[0]) or 0
            mla = (q_lora, *(size(k, "MLA rank / head width", k) for k in names[1:]))
        if fam["attention"] == "mla_dsa":
            indexer = tuple(size(k, "DSA indexer", k) for k in keys(fam["indexer"]))
        bias_key, bias_on = fam.get("attn_bias") or (None, "")
        qk_norm = fam.get("qk_norm") or ""
        if fam.get("qk_norm_flag") and not get(fam["qk_norm_flag"]):
            qk_norm = ""
        return cls(
            vocab=vocab,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate=int(get(fam["intermediate"]) or 0),
            experts=experts,
            top_k=top_k,
            moe_intermediate=width,
            tied=flag(fam["tied"]),
            dense_layers=sum(1 for _, moe in kinds if not moe) if experts else 0,
            model_type=mt,
            kinds=kinds,
            shared_width=shared,
            shared_gate=bool(fam.get("shared_gate")) and bool(shared),
            expert_bias=bool(fam.get("expert_bias")),
            router_bias=bool(fam.get("router_bias")),
            mlp_bias=bool(fam.get("mlp_bias")) and flag(fam["mlp_bias"]),
            attn_bias=bias_on if bias_key and flag(bias_key) else "",
            qk_norm=qk_norm,
            gated_q=bool(fam.get("gated_q")),
            fused=bool(fam.get("fused")),
            sinks=bool(fam.get("sinks")),
            norms=int(fam["norms"]),
            mla=mla,
            indexer=indexer,
            linear=lin,
            linear_split=str(fam.get("linear_attention") or ""),
            not_computed=tuple(missing),
        )

    # ------------------------------------------------------------------ per layer
    def layer_kinds(self) -> tuple[tuple[bool, bool], ...]:
        """(linear attention, routed MLP) of every decoder layer."""
        if self.kinds:
            return self.kinds
        dense = self.layers - self.moe_layers
        return tuple((False, i >= dense) for i in range(self.layers))

    def attn_linears(self, linear: bool = False) -> list[tuple[int, int]]:
        """A layer's attention linears as (out, in)."""
        h = self.hidden
        if linear and self.linear:
            kh, vh, kd, vd, _ = self.linear
            k, v = kh * kd, vh * vd
            if self.linear_split == "qkvz_ba":
                return [(2 * k + 2 * v, h), (2 * vh, h), (h, v)]
            return [(2 * k + v, h), (v, h), (vh, h), (vh, h), (h, v)]
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            n, qk = self.heads, nope + rope
            q = [(q_lora, h), (n * qk, q_lora)] if q_lora else [(n * qk, h)]
            out = [*q, (kv_lora + rope, h), (n * (nope + v), kv_lora), (h, n * v)]
            if self.indexer:
                ih, idim = self.indexer
                out += [(ih * idim, q_lora), (idim, h), (ih, h)]
            return out
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.fused:  # Phi-3: one qkv_proj
            return [(q + 2 * kv, h), (h, q)]
        return [(q * (2 if self.gated_q else 1), h), (kv, h), (kv, h), (h, q)]

    def attn_small(self, linear: bool = False) -> list[int]:
        """A layer's attention parameters outside its linears' weights, one entry per tensor (in
        the model's order, for DeepSpeed's persistence rule): q/k norms, biases, sinks, MLA's
        latent norms and DSA's indexer norm, linear attention's conv, decay and norm."""
        if linear and self.linear:
            kh, vh, kd, vd, conv = self.linear
            return [vh, vh, (2 * kh * kd + vh * vd) * conv, vd]  # dt_bias, A_log, conv1d, norm
        b = self.attn_bias
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            out = [q_lora] if q_lora else []  # q_a_layernorm, kv_a_layernorm
            out += [
                kv_lora,
                ("q" in b and q_lora) or 0,
                ("k" in b) * (kv_lora + rope),
                ("o" in b) * self.hidden,
            ]
            out += [self.indexer[1]] * 2 if self.indexer else []  # the indexer's k_norm (LayerNorm)
            return [n for n in out if n]
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norm = {
            "head": [self.head_dim, self.head_dim],
            "proj": [q, kv],
            "olmoe": [self.hidden, self.hidden // self.heads * self.kv_heads],
        }.get(self.qk_norm, [])
        bias = [
            ("q" in b) * q * (2 if self.gated_q else 1),
            ("k" in b) * kv,
            ("v" in b) * kv,
            ("o" in b) * self.hidden,
        ]
        return [n for n in [self.sinks * self.heads, *bias, *norm] if n]

    def mlp_linears(self, moe: bool) -> list[tuple[int, int]]:
        """A layer's MLP linears as (out, in): a routed layer's experts (each expert's gate, up,
        down), its shared experts and their gate; the router is not quantized."""
        h = self.hidden
        i = self.moe_intermediate if moe else self.intermediate
        if self.fused and not moe:  # Phi-3: one gate_up_proj
            return [(2 * i, h), (h, i)]
        out = [(i, h), (i, h), (h, i)] * (self.experts if moe else 1)
        if moe and self.shared_width:
            s = self.shared_width
            out += [(s, h), (s, h), (h, s)] + ([(1, h)] if self.shared_gate else [])
        return out

    def mlp_small(self, moe: bool) -> list[int]:
        """A routed layer's router (+ its bias) and expert biases; a dense MLP's biases."""
        if not moe:
            return [self.intermediate, self.intermediate, self.hidden] if self.mlp_bias else []
        out = [self.experts * self.hidden] + ([self.experts] if self.router_bias else [])
        if self.expert_bias:
            out += [self.experts * 2 * self.moe_intermediate, self.experts * self.hidden]
        return out

    def layer_linears(self, moe: bool, linear: bool = False) -> list[tuple[int, int]]:
        return self.attn_linears(linear) + self.mlp_linears(moe)

    def layer_params(self, moe: bool, linear: bool = False) -> int:
        norms = self.norms * self.hidden
        other = sum(self.attn_small(linear)) + sum(self.mlp_small(moe))
        return sum(o * i for o, i in self.layer_linears(moe, linear)) + norms + other

    @property
    def moe_layers(self) -> int:
        if self.kinds:
            return sum(1 for _, moe in self.kinds if moe) if self.experts else 0
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def largest_layer(self) -> int:
        return max(self.layer_params(moe, lin) for lin, moe in set(self.layer_kinds()))

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden  # + final norm

    @property
    def total_params(self) -> int:
        return self.embed_params + sum(self.layer_params(moe, lin) for lin, moe in self.layer_kinds())

    @property
    def quantized_params(self) -> int:
        """Weights of every quantized linear (the decoder layers' linears and fused experts)."""
        return sum(o * i for lin, moe in self.layer_kinds() for o, i in self.layer_linears(moe, lin))

    @property
    def per_expert(self) -> int:
        return 3 * self.hidden * self.moe_intermediate + self.expert_bias * (
            2 * self.moe_intermediate + self.hidden
        )

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (top-k experts, the lm_head)."""
        idle = (self.experts - self.top_k) * self.per_expert
        layers = sum(self.layer_params(moe, lin) - moe * idle for lin, moe in self.layer_kinds())
        return self.vocab * self.hidden + layers

    @property
    def largest_fused(self) -> int:
        """The largest fused expert tensor (``gate_up_proj [E, 2I, H]``): linearisation's transient."""
        return self.experts * 2 * self.moe_intermediate * self.hidden if self.moe_layers else 0

    @property
    def largest_linear(self) -> int:
        return max(o * i for lin, moe in set(self.layer_kinds()) for o, i in self.layer_linears(moe, lin))

    @property
    def q_width(self) -> int:
        """Query (= key) width of a full-attention layer, for the activation terms."""
        if self.mla:
            return self.heads * (self.mla[2] + self.mla[3])
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        if self.mla:
            return self.heads * max(self.mla[2] + self.mla[3], self.mla[4])
        return self.kv_heads * self.head_dim
