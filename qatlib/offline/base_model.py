"""Pre-train the default experiment's tiny base model from scratch, offline.

No model can be downloaded on the CPU machines, so the default experiment trains its own small
Qwen3-MoE (or dense Qwen3) on the offline corpus (`qatlib.offline.corpus`): a byte-level BPE
tokenizer (`qatlib.offline.tokenizer`) is trained on ``train.txt``, the model is built from a
config dict and trained with AdamW (warm-up + cosine) for a fixed TOKEN budget (not a wall-time
budget, so runs are reproducible), then saved with ``save_pretrained`` (safetensors) together with its tokenizer, exactly like an
upstream checkpoint folder that `qatlib.models.load_model` reads.

Expert implementation: transformers runs fused MoE experts through
``config._experts_implementation``; on the CPU ``grouped_mm`` is ~15x faster than ``eager``, so
it is set explicitly and checked. Its backward is not reproducible by default, so every offline
training loop runs under `deterministic_training` (its docstring says why).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..checkpoint.layout import PRETRAIN_STATS_FILE
from .publish import save_model_folder

# Tiny Qwen3-MoE: ~2.8M parameters with a 4096 vocabulary (1.05M of them in the two embeddings).
DEFAULT_MODEL: dict = {
    "arch": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "intermediate_size": 384,  # dense Qwen3 MLP (and Qwen3-MoE dense layers, if any)
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ARCHS = ("qwen3_moe", "qwen3")
_MOE_ONLY = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
)


@dataclass
class TrainConfig:
    """Optimisation settings. ``token_budget`` fixes the number of steps:
    ``steps = token_budget // (batch_size * seq_len)``.

    The default, 900 steps of 8x256 tokens (1.84M tokens, 0.62 epoch of the default corpus), takes
    about 3 minutes at the ~10k tokens/s measured on 2 idle cores (2 threads). On a shared machine
    set ``num_threads=1``: two spinning OpenMP threads per process were up to 5x slower per step
    than one thread there (measured: 4.1 s vs 0.79 s per step)."""

    token_budget: int = 1_843_200
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    clip_grad_norm: float = 1.0
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    router_aux_loss: bool = True  # Qwen3-MoE load-balancing loss (coef from the model config)
    seed: int = 0
    num_threads: int | None = None
    eval_windows: int | None = 200  # test windows scored at the end (None: all)
    log_every: int = 10
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def steps(self) -> int:
        return max(1, self.token_budget // self.tokens_per_step)

    @classmethod
    def from_dict(cls, d: dict | None) -> TrainConfig:
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown pretraining options: {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


# --------------------------------------------------------------------------- model
def model_config(spec: dict | None = None):
    """A transformers config from ``DEFAULT_MODEL`` updated with ``spec`` (``arch``: qwen3_moe | qwen3)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    d = dict(DEFAULT_MODEL)
    d.update(spec or {})
    arch = d.pop("arch")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if arch == "qwen3":
        for k in _MOE_ONLY:
            d.pop(k, None)
        return Qwen3Config(**d)
    return Qwen3MoeConfig(**d)


def is_moe(config) -> bool:
    return getattr(config, "num_experts", 0) and config.model_type == "qwen3_moe"


def ensure_grouped_mm(model) -> None:
    """Run fused experts with ``grouped_mm`` (the fast CPU path) and check it took effect."""
    if not is_moe(model.config):
        return
    if model.config._experts_implementation != "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    impl = model.config._experts_implementation
    if impl != "grouped_mm":
        raise RuntimeError(f"experts implementation is {impl!r}, expected 'grouped_mm'")


@contextlib.contextmanager
def deterministic_training() -> Iterator[None]:
    """Run the enclosed training with torch's deterministic algorithms (and restore the setting).

    Why: ``grouped_mm`` gathers each token once per routed expert (``hidden_states[perm // k]``);
    the backward of that gather accumulates duplicate indices, and on a multi-threaded CPU torch
    does it in a parallel kernel whose order changes from run to run unless deterministic
    algorithms are on. Measured at SmolLM2's width (hidden 576, top-7 of 8 experts, 2 threads):
    three backward passes of one batch gave three different router gradients; the upcycled MoE's
    router training then diverged from step 5 (test perplexity 26.54 vs 26.91 for the same command).
    With the flag the same passes are bit-equal, at no measured cost (~0.6 s a step either way);
    smaller models (the tiny Qwen3-MoE, top-2) already took the serial path and keep their bits.
    ``warn_only``: an op without a deterministic kernel (on a GPU) warns instead of failing a run.
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def build_model(spec: dict | None = None, *, seed: int = 0):
    """A freshly initialised causal LM (fp32, ``use_cache`` off) from a config dict."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(spec)
    cfg.use_cache = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ensure_grouped_mm(model)
    return model


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n)
    return {"total": total, "embeddings": emb, "non_embedding": total - emb}


# --------------------------------------------------------------------------- data
def read_documents(path: str | Path) -> list[str]:
    """Paragraph-level pieces of a corpus text file (blank-line separated), non-empty."""
    text = Path(path).read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def tokenize_pieces(tokenizer, pieces: Sequence[str], *, batch: int = 2048) -> torch.Tensor:
    """Token ids of the pieces, each followed by a blank line, concatenated (batched encoding:
    the fast tokenizer uses all cores)."""
    out: list[int] = []
    for i in range(0, len(pieces), batch):
        enc = tokenizer(
            [p + "\n\n" for p in pieces[i : i + batch]], add_special_tokens=False, return_attention_mask=False
        )["input_ids"]
        for ids in enc:
            out.extend(ids)
    return torch.tensor(out, dtype=torch.long)


def lr_at(step: int, steps: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr`` (``step`` counts from 0)."""
    warm = max(1, int(round(cfg.warmup_fraction * steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, steps - warm)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
    )


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@deterministic_training()
def train_model(model, ids: torch.Tensor, cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train ``model`` in place on the token stream ``ids``; returns the training statistics.

    The stream is cut into non-overlapping windows of ``seq_len``; windows are drawn in a seeded
    random order, epoch after epoch, until ``cfg.steps`` steps are done.
    """
    from tqdm.auto import tqdm

    n_win = ids.numel() // cfg.seq_len
    if n_win < cfg.batch_size:
        raise ValueError(
            f"{ids.numel()} training tokens: fewer than one batch of {cfg.batch_size}x{cfg.seq_len}"
        )
    windows = ids[: n_win * cfg.seq_len].view(n_win, cfg.seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(n_win, generator=gen)
    pos = 0
    epoch = 0
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=1e-8)
    moe = bool(is_moe(model.config))
    aux_coef = (
        float(getattr(model.config, "router_aux_loss_coef", 0.0)) if moe and cfg.router_aux_loss else 0.0
    )
    model.train()
    history = []
    t0 = time.perf_counter()
    ema = None
    bar = tqdm(range(cfg.steps), desc="pretrain", disable=not progress, mininterval=1.0)
    lm_loss = float("nan")
    for step in bar:
        if pos + cfg.batch_size > n_win:
            order = torch.randperm(n_win, generator=gen)
            pos = 0
            epoch += 1
        batch = windows[order[pos : pos + cfg.batch_size]]
        pos += cfg.batch_size
        lr = lr_at(step, cfg.steps, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        kwargs = {"output_router_logits": True} if aux_coef > 0 else {}
        out = model(input_ids=batch, labels=batch, use_cache=False, **kwargs)
        loss = out.loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = loss.item() - (aux_coef * out.aux_loss.item() if aux_coef > 0 else 0.0)
        ema = lm_loss if ema is None else 0.95 * ema + 0.05 * lm_loss
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            history.append(
                {
                    "step": step,
                    "loss": round(lm_loss, 5),
                    "lr": lr,
                    "grad_norm": round(gnorm, 4),
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}")
    bar.close()
    model.eval()
    wall = time.perf_counter() - t0
    tail = [h["loss"] for h in history[-5:]]
    return {
        "steps": cfg.steps,
        "tokens": cfg.steps * cfg.tokens_per_step,
        "epochs": epoch + pos / n_win,
        "train_windows": n_win,
        "final_loss": lm_loss,
        "final_loss_smoothed": ema,
        "final_loss_mean_last_logs": sum(tail) / len(tail),
        "first_loss": history[0]["loss"],
        "wall_seconds": wall,
        "tokens_per_second": cfg.steps * cfg.tokens_per_step / wall,
        "history": history,
    }


# --------------------------------------------------------------------------- orchestration
def pretrain(
    corpus_dir: str | Path,
    out_dir: str | Path,
    *,
    model: dict | None = None,
    train: dict | TrainConfig | None = None,
    tokenizer_dir: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Tokenizer + model trained on ``corpus_dir/train.txt``, saved into ``out_dir``.

    ``model``: overrides of `DEFAULT_MODEL` (``vocab_size`` is also the tokenizer's size).
    ``train``: overrides of `TrainConfig`. ``tokenizer_dir``: reuse a trained tokenizer instead.
    ``out_dir`` receives ``config.json``, ``model.safetensors``, the tokenizer files and
    ``pretrain_stats.json`` (also returned); it is written to a temporary folder and renamed.
    If ``corpus_dir/test.txt`` exists, the final model's perplexity on it is recorded.
    """
    from ..eval.perplexity import perplexity_of_ids, tokenize_text
    from .tokenizer import train_tokenizer

    cfg = train if isinstance(train, TrainConfig) else TrainConfig.from_dict(train)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    spec = dict(DEFAULT_MODEL)
    spec.update(model or {})
    corpus = Path(corpus_dir)
    t_start = time.perf_counter()
    pieces = read_documents(corpus / "train.txt")
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:
        tok = train_tokenizer(pieces, vocab_size=int(spec["vocab_size"]))
    if len(tok) > spec["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tok)} tokens > vocab_size {spec['vocab_size']}")
    t_tok = time.perf_counter()
    ids = tokenize_pieces(tok, pieces)
    t_ids = time.perf_counter()

    net = build_model(spec, seed=cfg.seed)
    net.config.eos_token_id = tok.eos_token_id
    net.config.pad_token_id = tok.pad_token_id
    net.config.bos_token_id = None
    stats = {
        "model": spec,
        "train": asdict(cfg),
        "params": count_params(net),
        "experts_implementation": getattr(net.config, "_experts_implementation", None),
        "train_tokens_available": int(ids.numel()),
        "tokenizer_seconds": t_tok - t_start,
        "tokenize_seconds": t_ids - t_tok,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    torch.manual_seed(cfg.seed)
    stats.update(train_model(net, ids, cfg, progress=progress))

    test = corpus / "test.txt"
    if test.is_file():
        ev = perplexity_of_ids(
            net,
            tokenize_text(tok, test.read_text(encoding="utf-8")),
            seq_len=cfg.seq_len,
            limit=cfg.eval_windows,
            progress=progress,
            desc="pretrain eval",
        )
        stats["test"] = ev
    net.config.use_cache = True

    def record(_folder: Path) -> dict:
        stats["total_seconds"] = time.perf_counter() - t_start
        return stats

    return save_model_folder(out_dir, net, tok, PRETRAIN_STATS_FILE, record)
