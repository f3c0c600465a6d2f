"""Sparse upcycling: a Qwen3-MoE made from a pretrained dense model's own weights.

The MoE experiment needs a real model's quantization gap, and no MoE can be downloaded: this
builds one from the default experiment's dense base model (SmolLM2-135M, Llama, the
``gguf_model`` rule's ``results/base/smollm2-135m``), offline and deterministically.

What is kept exactly: embeddings, the (tied) head, every norm, the attention and the dense MLPs of
``dense_layers`` (Qwen3-MoE's ``mlp_only_layers``). Qwen3-MoE's attention differs from Llama's by
an RMSNorm of each query / key head (``q_norm`` / ``k_norm``) before RoPE; a normalisation changes
the function (weights of ones: test perplexity 17.8 -> 285 on SmolLM2; least-squares weights: 133).
Here it runs in its linear regime instead: the input norm's weight (``input_layernorm``, which
feeds q / k / v only) is scaled by ``a`` so small that ``a^2 * mean(q^2)`` is below
``qk_norm_error * eps`` for every input of ``q_proj`` and ``k_proj`` (a bound from the projections'
spectral norms and the input norm's largest weight, no data), so that
``RMSNorm(a q) = a q / sqrt(a^2 mean(q^2) + eps)`` is ``a q / sqrt(eps)`` to a relative
``qk_norm_error / 2``, and the q / k norms' weight ``sqrt(eps) / a`` gives back ``q``; ``v`` comes
out ``a`` times smaller and ``o_proj`` is divided by ``a``. Why the norm and not the projections:
the q / k / v WEIGHTS stay SmolLM2's, so every format quantizes them as it would the dense model.
Scaling the projections instead (``a ~ 1e-5``) left weights of ~1e-7 that a runtime cannot hold:
vLLM fuses q / k / v under ONE per-tensor fp8 scale (the largest: a v_proj 1e5 x larger rounded
q / k to zero, PPL 26 -> 3400) and re-quantizes the shards through fp16 at load (subnormal below
6e-5: deployed 29.6 where the trained model read 27.7). Every quantizer of qatlib is
scale-invariant in the scaled inputs (RTN, GPTQ and LWC by construction; log-space scale steps;
static input scales are fp32); the q / k states are quantized after the norm, where the scale is
the original. The small activations need fp32 or bf16 (fp16 would flush them to subnormals).

Experts (``experts``):

- ``split`` (MoEfication): the dense MLP's intermediate neurons are partitioned into
  ``num_experts`` experts of equal width (``cluster``: balanced k-means of the neurons'
  co-activation over calibration tokens, so that neurons firing together share an expert). Same
  parameter count as the dense model. Routed to ``top-k`` of them (weights renormalised, as
  Qwen3-30B-A3B's ``norm_topk_prob``), each expert's ``down_proj`` scaled by ``k * alpha``: with
  ``k = num_experts`` and a zero router the MoE is the dense model exactly; with fewer experts per
  token it is an approximation, whose quality the router decides.
- ``copy`` (sparse upcycling): every expert is a copy of the whole MLP (``perturb``: relative
  Gaussian noise, seeded); with renormalised weights the MoE equals the dense model for any router
  when ``perturb`` is 0.

Router: initialised by ridge regression of each expert's output norm (log) on the MLP input
over ``init_windows`` calibration windows, times ``init_scale`` (a small scale keeps the weights
of the selected experts near ``1 / k``), with ``alpha`` the least-squares scale of the routed output
onto the dense one (each token's error relative to its own norm); then trained on the corpus by distillation (forward KL to the dense model's
logits) with everything else frozen, for a fixed token budget (reproducible whatever the machine),
plus Qwen3-MoE's load-balancing loss. The saved folder carries ``upcycle_stats.json``: the dense
and upcycled test perplexity on the same windows, before and after router training, expert loads.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.layout import UPCYCLE_STATS_FILE
from .base_model import deterministic_training, lr_at, read_documents, tokenize_pieces
from .publish import save_model_folder

STATS_FILE = UPCYCLE_STATS_FILE
EXPERT_MODES = ("split", "copy")


@dataclass(frozen=True)
class RouterTraining:
    """The router's distillation run: ``steps = token_budget // (batch_size * seq_len)``."""

    token_budget: int = 204_800
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1e-3
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    aux_loss_coef: float = 1e-3  # Qwen3-MoE's load-balancing loss (its router_aux_loss_coef)
    seed: int = 0

    @property
    def steps(self) -> int:
        return max(1, self.token_budget // (self.batch_size * self.seq_len))


@dataclass(frozen=True)
class UpcycleSpec:
    """One ``upcycle`` entry of config/base_models.yaml."""

    source: str  # the dense base model's name (results/base/<source>)
    num_experts: int = 8
    num_experts_per_tok: int = 6
    experts: str = "split"
    cluster: bool = True  # split: balanced k-means of co-activation (False: contiguous slices)
    dense_layers: tuple[int, ...] = ()  # kept dense (mlp_only_layers); negative: from the end
    num_hidden_layers: int | None = None  # keep the first N layers (a CI-sized model)
    perturb: float = 0.0  # copy: relative noise
    qk_norm_error: float = 1e-4
    init_windows: int = 16
    init_scale: float = 0.1
    eval_windows: int = 32
    seed: int = 0
    router: RouterTraining = field(default_factory=RouterTraining)

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "upcycle") -> UpcycleSpec:
        d = dict(d)
        for klass, sub, name in (
            (cls, d, where),
            (RouterTraining, dict(d.get("router") or {}), f"{where}.router"),
        ):
            names = {f.name for f in fields(klass)}
            unknown = sorted(set(sub) - names)
            if unknown:
                raise ValueError(f"{name}: unknown keys {unknown} (keys: {', '.join(sorted(names))})")
        if "source" not in d:
            raise ValueError(f"{where}: missing key 'source' (the dense base model's name)")
        d["router"] = RouterTraining(**(d.get("router") or {}))
        d["dense_layers"] = tuple(int(i) for i in d.get("dense_layers") or ())
        spec = cls(**d)
        if spec.experts not in EXPERT_MODES:
            raise ValueError(
                f"{where}.experts must be one of {', '.join(EXPERT_MODES)}; got {spec.experts!r}"
            )
        if not 1 <= spec.num_experts_per_tok <= spec.num_experts:
            raise ValueError(f"{where}: num_experts_per_tok must be in [1, num_experts={spec.num_experts}]")
        return spec


# --------------------------------------------------------------------------- the dense model
def load_dense(path: str | Path, num_hidden_layers: int | None = None):
    """The dense model (fp32, eval), cut to its first ``num_hidden_layers`` layers if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if model.config.model_type not in ("llama", "qwen3"):
        raise ValueError(f"{path}: upcycling reads a Llama or Qwen3 model, not {model.config.model_type!r}")
    c = model.config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or c.hidden_act != "silu":
        raise ValueError(f"{path}: biases or a {c.hidden_act!r} MLP have no Qwen3-MoE counterpart")
    if num_hidden_layers is not None and num_hidden_layers < c.num_hidden_layers:
        del model.model.layers[num_hidden_layers:]
        c.num_hidden_layers = num_hidden_layers
        if getattr(c, "layer_types", None):
            c.layer_types = c.layer_types[:num_hidden_layers]
    model.eval()
    return model


def dense_layer_ids(spec: UpcycleSpec, layers: int) -> list[int]:
    out = sorted({i % layers for i in spec.dense_layers if -layers <= i < layers})
    return out


def moe_config(dense_cfg, spec: UpcycleSpec):
    """The Qwen3-MoE config of the upcycled model (everything but the MLPs from ``dense_cfg``)."""
    from transformers import Qwen3MoeConfig

    c = dense_cfg
    inter = c.intermediate_size
    if spec.experts == "split" and inter % spec.num_experts:
        raise ValueError(f"split: {spec.num_experts} experts do not divide intermediate_size {inter}")
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_theta})
    return Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=inter,  # the dense layers' MLP
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=bool(c.tie_word_embeddings),
        attention_bias=False,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=inter // spec.num_experts if spec.experts == "split" else inter,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=dense_layer_ids(spec, c.num_hidden_layers),
        router_aux_loss_coef=spec.router.aux_loss_coef,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        use_cache=False,
    )


# --------------------------------------------------------------------------- weights
def qk_scale(
    weight: torch.Tensor, norm_weight: torch.Tensor, head_dim: int, eps: float, error: float
) -> float:
    """``a`` with ``a^2 * mean(q_h^2) <= error * eps`` for every input of a projection ``weight``
    ``[heads * head_dim, hidden]`` fed by an RMSNorm of weight ``norm_weight``: its output has
    ``|x|^2 <= hidden * max(norm_weight^2)`` (unit mean square before the weight), so
    ``mean(q_h^2) <= sigma_max(W_h)^2 * hidden * max(norm_weight^2) / head_dim``."""
    hidden = weight.shape[1]
    sigma = torch.linalg.matrix_norm(weight.double().view(-1, head_dim, hidden), ord=2).max()
    bound = sigma**2 * hidden * norm_weight.double().pow(2).max() / head_dim
    return float(torch.sqrt(error * eps / bound))


def balanced_clusters(features: torch.Tensor, k: int, *, iters: int = 15, seed: int = 0) -> torch.Tensor:
    """Cluster of each row of ``features`` ``[n, d]`` into ``k`` clusters of exactly ``n / k`` rows
    (k-means; each assignment round gives the rows with the clearest preference their nearest
    cluster with room left)."""
    n = features.shape[0]
    cap = n // k
    gen = torch.Generator().manual_seed(seed)
    centres = features[torch.randperm(n, generator=gen)[:k]].clone()
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        dist = torch.cdist(features, centres)
        pref = torch.argsort(dist, dim=1)
        best2 = dist.gather(1, pref[:, :2])
        order = torch.argsort(best2[:, 0] - best2[:, 1])  # clearest preference first
        room = [cap] * k
        for j in order.tolist():
            for c in pref[j].tolist():
                if room[c]:
                    room[c] -= 1
                    assign[j] = c
                    break
        centres = torch.stack([features[assign == c].mean(0) for c in range(k)])
    return assign


class _MlpInputs:
    """Each MLP's input and intermediate activations over the calibration tokens (one forward)."""

    def __init__(self, model) -> None:
        self.x: dict[int, torch.Tensor] = {}
        self.h: dict[int, torch.Tensor] = {}
        self.handles = [
            layer.mlp.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, i):
        def hook(mod, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            self.x[i] = x
            self.h[i] = mod.act_fn(mod.gate_proj(x)) * mod.up_proj(x)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _router_init(x, outs, k: int, init_scale: float) -> tuple[torch.Tensor, float]:
    """Router ``[E, H]`` from the expert outputs ``outs`` ``[T, E, H]`` at inputs ``x`` ``[T, H]``:
    ridge regression of the centred log output norms, times ``init_scale``; and ``alpha``, the
    least-squares scale of ``k * sum_selected(w_e * out_e)`` onto ``sum_e out_e``."""
    t = torch.log(outs.norm(dim=-1) + 1e-6).double()
    xd = x.double()
    ridge = 1e-2 * xd.pow(2).mean() * xd.shape[0]
    a = xd.T @ xd + ridge * torch.eye(xd.shape[1], dtype=torch.double)
    w = torch.linalg.solve(a, xd.T @ (t - t.mean(0))).T.float() * init_scale
    probs = torch.softmax(x @ w.T, dim=-1)
    top, idx = probs.topk(k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    routed = k * (outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, outs.shape[-1])) * top.unsqueeze(-1)).sum(1)
    full = outs.sum(1)
    # each token's error relative to its own output: the next norm divides it by its norm, and
    # SmolLM2's first position carries an output ~100x the others' (an absolute fit is that token's)
    inv = 1.0 / full.pow(2).sum(-1).clamp_min(1e-30)
    alpha = float(
        ((routed * full).sum(-1) * inv).sum() / (routed.pow(2).sum(-1) * inv).sum().clamp_min(1e-30)
    )
    return w, alpha


def upcycle_weights(dense, spec: UpcycleSpec, calib: torch.Tensor | None = None):
    """The Qwen3-MoE (fp32, eval, untrained router for ``copy``) built from ``dense``; ``calib``
    ``[windows, seq]`` token ids (split mode: clustering, router and alpha initialisation)."""
    from transformers import Qwen3MoeForCausalLM

    cfg = moe_config(dense.config, spec)
    torch.manual_seed(spec.seed)
    moe = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    src, keys = dense.state_dict(), set(moe.state_dict())
    new = {k: v for k, v in src.items() if ".mlp." not in k and k in keys}
    e, k = spec.num_experts, spec.num_experts_per_tok
    eps, head_dim = float(cfg.rms_norm_eps), cfg.head_dim
    acts = None
    if spec.experts == "split" and calib is not None:
        acts = _MlpInputs(dense)
        with torch.no_grad():
            dense.model(calib)  # the decoder only: no logits needed
        acts.close()
    gen = torch.Generator().manual_seed(spec.seed)
    dense_ids = set(cfg.mlp_only_layers)
    info = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if dense.config.model_type == "llama":  # q_norm / k_norm in their linear regime
            norm = src[f"{p}input_layernorm.weight"]
            a = min(
                qk_scale(src[f"{p}self_attn.{qk}_proj.weight"], norm, head_dim, eps, spec.qk_norm_error)
                for qk in "qk"
            )
            new[f"{p}input_layernorm.weight"] = norm * a
            for qk in "qk":
                new[f"{p}self_attn.{qk}_norm.weight"] = torch.full((head_dim,), math.sqrt(eps) / a)
            new[f"{p}self_attn.o_proj.weight"] = src[f"{p}self_attn.o_proj.weight"] / a
        if i in dense_ids:
            for n in ("gate_proj", "up_proj", "down_proj"):
                new[f"{p}mlp.{n}.weight"] = src[f"{p}mlp.{n}.weight"]
            continue
        g, u, dn = (src[f"{p}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        rec: dict = {"layer": i}
        if spec.experts == "copy":

            def noisy(t):
                return (
                    t + spec.perturb * t.abs().mean() * torch.randn(t.shape, generator=gen)
                    if spec.perturb
                    else t
                )

            gate_up = torch.stack([torch.cat([noisy(g), noisy(u)]) for _ in range(e)])
            down = torch.stack([noisy(dn) for _ in range(e)])
            router = 0.02 * torch.randn(e, cfg.hidden_size, generator=gen)
        else:
            width = g.shape[0] // e
            if acts is not None and spec.cluster:
                h = acts.h[i].abs()
                assign = balanced_clusters((h / h.norm(dim=0).clamp_min(1e-12)).T, e, seed=spec.seed)
                perm = torch.cat([torch.nonzero(assign == c).flatten() for c in range(e)])
            else:
                perm = torch.arange(g.shape[0])
            g, u, dn = g[perm], u[perm], dn[:, perm]
            sl = [slice(c * width, (c + 1) * width) for c in range(e)]
            router, alpha = torch.zeros(e, cfg.hidden_size), 1.0
            if acts is not None:
                h = acts.h[i][:, perm]
                outs = torch.stack([h[:, s] @ dn[:, s].T for s in sl], 1)
                router, alpha = _router_init(acts.x[i], outs, k, spec.init_scale)
            rec["alpha"] = round(alpha, 5)
            gate_up = torch.stack([torch.cat([g[s], u[s]]) for s in sl])
            down = torch.stack([dn[:, s] * (k * alpha) for s in sl])
        new[f"{p}mlp.experts.gate_up_proj"] = gate_up
        new[f"{p}mlp.experts.down_proj"] = down
        new[f"{p}mlp.gate.weight"] = router
        info.append(rec)
    missing, unexpected = moe.load_state_dict(new, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"upcycling left keys unset {missing[:5]} or unused {unexpected[:5]}")
    moe.tie_weights()
    return moe.requires_grad_(False), info


# --------------------------------------------------------------------------- router training
def routers(model) -> list[torch.nn.Parameter]:
    return [layer.mlp.gate.weight for layer in model.model.layers if hasattr(layer.mlp, "gate")]


@deterministic_training()
def train_router(moe, teacher, ids: torch.Tensor, cfg: RouterTraining, *, progress: bool = False) -> dict:
    """Distil ``teacher``'s logits into ``moe`` by training its routers only (forward KL per token +
    ``aux_loss_coef`` x the load-balancing loss), on seeded random windows of the stream ``ids``."""
    from tqdm.auto import tqdm

    n_win = ids.numel() // cfg.seq_len
    if n_win < cfg.batch_size:
        raise ValueError(
            f"{ids.numel()} training tokens: fewer than one batch of {cfg.batch_size}x{cfg.seq_len}"
        )
    windows = ids[: n_win * cfg.seq_len].view(n_win, cfg.seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    order, pos = torch.randperm(n_win, generator=gen), 0
    moe.requires_grad_(False)
    params = routers(moe)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    history, t0 = [], time.perf_counter()
    moe.train()
    for step in tqdm(range(cfg.steps), desc="router", disable=not progress, mininterval=1.0):
        if pos + cfg.batch_size > n_win:
            order, pos = torch.randperm(n_win, generator=gen), 0
        batch = windows[order[pos : pos + cfg.batch_size]]
        pos += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg)
        with torch.no_grad():
            t = F.log_softmax(teacher(input_ids=batch).logits.float(), -1)
        out = moe(input_ids=batch, output_router_logits=cfg.aux_loss_coef > 0, use_cache=False)
        s = F.log_softmax(out.logits.float(), -1)
        kd = F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
        loss = kd + (cfg.aux_loss_coef * out.aux_loss if cfg.aux_loss_coef > 0 else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, cfg.steps // 20) == 0 or step == cfg.steps - 1:
            history.append(
                {"step": step, "kd": round(kd.item(), 5), "seconds": round(time.perf_counter() - t0, 1)}
            )
    moe.eval()
    moe.requires_grad_(False)
    return {
        "steps": cfg.steps,
        "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "seconds": round(time.perf_counter() - t0, 1),
        "history": history,
    }


@torch.no_grad()
def expert_load(moe, windows: torch.Tensor) -> dict:
    """Share of routed tokens per expert over ``windows``: min / max over layers and experts."""
    loads = []
    hooks = []
    for layer in moe.model.layers:
        if not hasattr(layer.mlp, "gate"):
            continue

        def hook(mod, _inp, out):
            idx = out[2].flatten()
            loads.append(torch.bincount(idx, minlength=mod.num_experts).float() / idx.numel())

        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    moe(windows)
    for h in hooks:
        h.remove()
    if not loads:
        return {}
    allv = torch.stack(loads)
    return {
        "min": round(allv.min().item(), 4),
        "max": round(allv.max().item(), 4),
        "uniform": round(1 / allv.shape[1], 4),
    }


# --------------------------------------------------------------------------- orchestration
def upcycle(
    source_dir: str | Path,
    out_dir: str | Path,
    spec: UpcycleSpec | dict,
    corpus_dir: str | Path,
    *,
    progress: bool = False,
) -> dict:
    """Upcycle the dense model of ``source_dir`` into ``out_dir`` (a hub folder with its tokenizer
    and ``upcycle_stats.json``, written complete or not at all); returns the stats."""
    from transformers import AutoTokenizer

    from ..eval.perplexity import make_windows, perplexity_of_ids, tokenize_text

    if isinstance(spec, dict):
        spec = UpcycleSpec.from_dict(spec)
    t_start = time.perf_counter()
    corpus = Path(corpus_dir)
    tok = AutoTokenizer.from_pretrained(str(source_dir))
    dense = load_dense(source_dir, spec.num_hidden_layers)
    calib = make_windows(
        tokenize_text(tok, (corpus / "calib.txt").read_text(encoding="utf-8")),
        spec.router.seq_len,
        spec.init_windows,
    )
    moe, layers = upcycle_weights(dense, spec, calib)
    test_ids = tokenize_text(tok, (corpus / "test.txt").read_text(encoding="utf-8"))

    def ppl(m) -> dict:
        r = perplexity_of_ids(m, test_ids, seq_len=256, limit=spec.eval_windows, progress=False)
        return {k: r[k] for k in ("ppl", "nll", "windows", "tokens")} | {"window_nll": r["window_nll"]}

    t_built = time.perf_counter()
    stats: dict = {"spec": asdict(spec), "source": str(source_dir), "dense": ppl(dense), "initial": ppl(moe)}
    train_ids = tokenize_pieces(tok, read_documents(corpus / "train.txt"))
    stats["router_training"] = train_router(moe, dense, train_ids, spec.router, progress=progress)
    stats["upcycled"] = ppl(moe)
    stats["ppl_ratio"] = round(stats["upcycled"]["ppl"] / stats["dense"]["ppl"], 5)
    stats["expert_load"] = expert_load(moe, calib[:4])
    stats["layers"] = layers
    stats["params"] = {
        "dense": sum(p.numel() for p in dense.parameters()),
        "moe": sum(p.numel() for p in moe.parameters()),
    }
    stats["build_seconds"] = round(t_built - t_start, 1)
    moe.config.use_cache = True

    def record(_folder: Path) -> dict:
        stats["total_seconds"] = round(time.perf_counter() - t_start, 1)
        return stats

    return save_model_folder(out_dir, moe, tok, STATS_FILE, record)
