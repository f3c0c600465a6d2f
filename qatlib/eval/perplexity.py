"""Perplexity over non-overlapping windows of a tokenised text.

The text is tokenised as a whole, cut into consecutive windows of exactly ``seq_len`` tokens
(the last partial window is dropped) and each window is scored on its own: every token but the
first of a window is predicted, so ``tokens == windows * (seq_len - 1)`` and
``ppl = exp(nll)`` with ``nll`` the mean negative log-likelihood per predicted token.

The same logits also give the next-token top-1 accuracy (``top1``: how often the most likely
token is the true one) and per-window figures (``window_nll``, ``window_top1``). Why: a
multiple-choice task separates BF16 from int4 PTQ only with hundreds of items (each costs ~4
forwards of ~100 tokens: minutes per variant on 2 CPU cores), while every predicted token here
is a scored outcome at no extra cost. ``top1_stderr`` is the standard error over windows (tokens
of one window are not independent), and per-window lists allow paired comparisons of variants
that were scored on the same windows.

Sources: ``wikitext2`` (wikitext-2-raw-v1 test, joined with blank lines, as the GPTQ family of
papers does), ``c4`` (the first validation shard of allenai/c4) -- both need the hub -- and a
local text file (the offline default: the corpus test split). Works on a plain model and on a
prepared (fake-quant) model alike; it only calls ``model(input_ids)``.

``onload`` (a `qatlib.zero3.onload.Onloader`): a model larger than the device is evaluated layer by
layer instead: every window goes through decoder layer ``i`` before layer ``i + 1`` is onloaded,
then through the final norm and the head; the same logits as the whole-model forward, with one
layer's weights (plus the hidden states of all windows) on the device.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..scores import window_perplexity

HUB_SOURCES = ("wikitext2", "c4")
C4_VALIDATION_SHARD = "en/c4-validation.00000-of-00008.json.gz"


def load_eval_text(source: str | Path, *, cache_dir: str | None = None, c4_documents: int = 1100) -> str:
    """The evaluation text of ``source``: ``wikitext2``, ``c4`` or a path to a text file."""
    if str(source) == "wikitext2":
        from datasets import load_dataset

        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="test", cache_dir=cache_dir)
        return "\n\n".join(ds["text"])
    if str(source) == "c4":
        from datasets import load_dataset

        ds = load_dataset(
            "allenai/c4",
            data_files={"validation": C4_VALIDATION_SHARD},
            split="validation",
            cache_dir=cache_dir,
        )
        return "\n\n".join(ds.select(range(min(c4_documents, len(ds))))["text"])
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"perplexity source {source!r} is neither one of {HUB_SOURCES} nor a text file"
        )
    return path.read_text(encoding="utf-8")


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """All token ids of ``text`` (no special tokens added), as a 1-D LongTensor."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def ppl_label(source: str) -> str:
    """The dataset key of a perplexity figure in an eval record (``eval/<variant>.json``'s
    ``ppl``): hub sets by name, local files as ``<folder>/<stem>``; the evaluate and the
    serve_evaluate stages both key their figures by it, so the report lines them up."""
    p = Path(source)
    return source if not p.suffix else f"{p.parent.name}/{p.stem}"


def make_windows(ids: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """``[windows, seq_len]``: the non-overlapping windows, last partial one dropped; ``limit``
    keeps that many spread evenly over the whole text (window ``i * n // limit``), not its head:
    split files are in source order (the corpus: pydoc topics, then the standard library, then
    packages), so the first windows are one kind of text (SmolLM2: PPL 22.3 on the first 16
    windows of the test split, 26.2 on 16 spread ones)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2; got {seq_len}")
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens: fewer than one window of {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    if limit is not None and int(limit) < n:
        windows = windows[torch.arange(int(limit)) * n // int(limit)]
    return windows


def _device_of(model) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


@torch.no_grad()
def perplexity_of_ids(
    model,
    ids: torch.Tensor,
    *,
    seq_len: int = 256,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = True,
    desc: str = "perplexity",
    onload=None,
) -> dict:
    """Perplexity of ``model`` on the token ids ``ids`` (see the module docstring)."""
    windows = make_windows(ids.flatten(), seq_len, limit)
    device = _device_of(model) if onload is None else onload.device
    was_training = model.training
    model.eval()
    window_sums: list[float] = []
    window_tokens: list[int] = []
    window_nll: list[float] = []
    window_top1: list[float] = []
    t0 = time.perf_counter()
    from tqdm.auto import tqdm

    starts = range(0, windows.shape[0], batch_size)
    if onload is None:
        scored = (
            (batch, model(input_ids=batch, use_cache=False).logits)
            for batch in (windows[s : s + batch_size].to(device) for s in starts)
        )
    else:
        scored = layerwise_logits(model, onload, [windows[s : s + batch_size].to(device) for s in starts])
    try:
        for batch, logits in tqdm(
            scored, total=len(starts), desc=desc, disable=not progress, mininterval=1.0
        ):
            # Score row by row in fp32: bounded memory for large vocabularies.
            for r in range(batch.shape[0]):
                lg = logits[r, :-1].float()
                nll = F.cross_entropy(lg, batch[r, 1:], reduction="sum").item()
                hits = (lg.argmax(-1) == batch[r, 1:]).sum().item()
                window_sums.append(nll)
                window_tokens.append(batch.shape[1] - 1)
                window_nll.append(nll / (batch.shape[1] - 1))
                window_top1.append(hits / (batch.shape[1] - 1))
    finally:
        model.train(was_training)
    nll, ppl = window_perplexity(window_sums, window_tokens)
    top1 = sum(window_top1) / len(window_top1)  # windows hold equal token counts: the token mean
    return {
        "ppl": ppl,
        "nll": nll,
        "top1": top1,
        "top1_stderr": _stderr(window_top1),
        "window_nll": window_nll,
        "window_top1": window_top1,
        "tokens": sum(window_tokens),
        "windows": int(windows.shape[0]),
        "seq_len": seq_len,
        "seconds": time.perf_counter() - t0,
    }


def _stderr(xs: list[float]) -> float | None:
    """Standard error of the mean of ``xs`` (None below 2 values)."""
    n = len(xs)
    if n < 2:
        return None
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def layerwise_logits(model, loader, batches: list[torch.Tensor]):
    """``(input ids, logits)`` per batch of ``batches``, computed one decoder layer at a time with
    ``loader`` (`qatlib.zero3.onload`): the model's own forward up to the first layer, each layer over
    all batches, then the decoder's final ``norm`` and the output head (the Llama / Qwen / Mistral
    layout: ``logits = lm_head(norm(h))``; other heads are refused)."""
    from qatlib.surgery.modeling import decoder_layers
    from qatlib.zero3.onload import capture_layer_inputs, carry

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm, head = getattr(decoder, "norm", None), model.get_output_embeddings()
    if norm is None or head is None or getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(
            f"layer-by-layer perplexity needs logits = head(decoder.norm(h)); {type(model).__name__} differs"
        )
    with loader.outer_onloaded():
        inputs, _, _ = capture_layer_inputs(model, batches, loader.device)
    _, layers = decoder_layers(model)
    for layer in layers:
        with loader.onloaded(layer):
            outputs: list = []
            for b in inputs:
                carry(outputs, layer, b)
        inputs = outputs
    with loader.outer_onloaded(head=True):
        for ids, (args, _) in zip(batches, inputs):
            yield ids, head(norm(args[0]))


def perplexity(
    model,
    tokenizer,
    source: str | Path,
    *,
    seq_len: int = 256,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = True,
    cache_dir: str | None = None,
    onload=None,
) -> dict:
    """Perplexity on ``source`` (``wikitext2``, ``c4`` or a text file); returns
    ``{ppl, nll, tokens, windows, seq_len, seconds, source}``. ``limit`` caps the number of windows;
    ``onload``: layer by layer (see the module docstring)."""
    text = load_eval_text(source, cache_dir=cache_dir)
    out = perplexity_of_ids(
        model,
        tokenize_text(tokenizer, text),
        seq_len=seq_len,
        batch_size=batch_size,
        limit=limit,
        progress=progress,
        desc=f"perplexity {Path(str(source)).name}",
        onload=onload,
    )
    out["source"] = str(source)
    return out
