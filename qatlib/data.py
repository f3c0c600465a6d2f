"""Training data for QAT: SFT conversations, plain text, parquet and HF datasets -> token samples.

Sources (``load_training_data``):

- ``*.jsonl`` / ``*.json`` (one JSON object per line), each record one of
  - ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI),
  - ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`` (ShareGPT),
  - ``{"input": ..., "output": ...}`` (optional ``"system"`` / ``"instruction"``),
  - ``{"text": ...}`` (plain text, see below);
- ``*.parquet``: the same schemas as columns (``messages`` / ``conversations`` / ``input`` +
  ``output`` / ``text``);
- ``*.txt`` / ``*.md`` / ``*.rst`` or a directory of them: plain text;
- anything else: a HF dataset id, ``"path"`` or ``"path,subset"`` (``datasets.load_dataset``).

Conversations supervise ONLY the last assistant reply. With ``prompt`` the turns before it,
``prompt_len = len(template(prompt, add_generation_prompt=True))`` and ``ids = template(prompt +
[reply])`` (turns after the last reply are dropped); ``labels = ids`` with ``labels[:prompt_len]``
and padding set to ``-100``. The model's own causal-LM shift then makes the first supervised
prediction the reply's first token, right after ``<|im_start|>assistant\\n``. Samples truncated to
``max_seq_length`` so that no reply token is left are dropped and counted in `DataStats`.

Plain text is tokenized document by document, joined with the EOS token and cut into
``max_seq_length`` blocks in which every token is supervised; a trailing partial block is dropped
unless it is the only one. ``num_samples`` below the number of blocks keeps blocks spread evenly
over the text (`spread`), not its head.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .losses import IGNORE_INDEX

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "bot": "assistant",
    "model": "assistant",
}


class DataError(ValueError):
    """A malformed training-data record; the message names the file and line (or row)."""


@dataclass
class DataStats:
    """What happened while reading a source (logged by the trainers, kept on the dataset)."""

    source: str
    records: int = 0
    samples: int = 0
    dropped_no_supervised: int = 0
    truncated: int = 0
    prompt_mismatch: int = 0
    kind: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TokenizedDataset(Dataset):
    """A list of ``{"input_ids": [...], "labels": [...]}`` samples plus how they were made."""

    samples: list[dict[str, list[int]]]
    stats: DataStats
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.samples[i]


# --------------------------------------------------------------------------- records
def record_to_messages(rec: Any) -> list[dict[str, str]] | str:
    """One record -> chat messages, or a ``str`` for plain text. Raises ValueError when no schema fits."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if rec.get("messages") is not None:
        msgs = _as_list(rec["messages"], "messages")
        out = []
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("each entry of 'messages' needs 'role' and 'content'")
            out.append({"role": str(m["role"]), "content": _content(m["content"])})
        return out
    if rec.get("conversations") is not None:
        out = []
        for m in _as_list(rec["conversations"], "conversations"):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise ValueError("each entry of 'conversations' needs 'from' and 'value'")
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise ValueError(f"unknown ShareGPT speaker {m['from']!r} (expected human/gpt/system)")
            out.append({"role": role, "content": _content(m["value"])})
        return out
    if rec.get("output") is not None and (rec.get("input") is not None or rec.get("instruction") is not None):
        prompt = "\n\n".join(str(rec[k]) for k in ("instruction", "input") if rec.get(k))
        out = [{"role": "system", "content": str(rec["system"])}] if rec.get("system") else []
        return out + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": str(rec["output"])},
        ]
    if isinstance(rec.get("text"), str):
        return rec["text"]
    raise ValueError(f"no known schema (messages / conversations / input+output / text); keys: {sorted(rec)}")


def _as_list(v: Any, name: str) -> list:
    if hasattr(v, "tolist"):  # numpy arrays from parquet
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"'{name}' must be a list")
    return list(v)


def _content(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, (list, tuple)):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in c)
    return "" if c is None else str(c)


def _template_ids(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return list(ids)


def sft_sample(
    messages: Sequence[dict[str, str]],
    tokenizer,
    max_seq_length: int,
    stats: DataStats | None = None,
    *,
    prompt_loss: bool = False,
):
    """Tokenize a conversation supervising only its last assistant reply (with ``prompt_loss``:
    every token, upstream's ``dataset.is_sft_data: false``).

    Returns ``{"input_ids", "labels"}`` or None when truncation leaves no reply token. Raises
    ValueError when there is no assistant reply."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError("conversation has no assistant reply to supervise")
    prompt_ids = _template_ids(tokenizer, messages[:last], add_generation_prompt=True)
    ids = _template_ids(tokenizer, messages[: last + 1], add_generation_prompt=False)
    prompt_len = len(prompt_ids)
    if ids[:prompt_len] != prompt_ids:
        # The template renders the prompt differently inside the full conversation: supervise from
        # the first token where the two renderings differ (counted; should not happen with ChatML).
        prompt_len = 0
        for a, b in zip(ids, prompt_ids):
            if a != b:
                break
            prompt_len += 1
        if stats is not None:
            stats.prompt_mismatch += 1
    if len(ids) > max_seq_length:
        ids = ids[:max_seq_length]
        if stats is not None:
            stats.truncated += 1
    if prompt_len >= len(ids):
        return None
    labels = list(ids) if prompt_loss else [IGNORE_INDEX] * prompt_len + ids[prompt_len:]
    return {"input_ids": ids, "labels": labels}


def text_blocks(
    texts: Iterable[str], tokenizer, max_seq_length: int, limit: int | None = None
) -> Iterator[list[int]]:
    """Tokenize documents, join them with EOS, cut into ``max_seq_length`` blocks.

    The blocks are cut at an offset into the buffer, which is trimmed once per document: cutting
    by re-slicing the rest of the buffer after every block was quadratic in a document's length
    (a text file is ONE document: the default corpus's train.txt, 2.7M tokens, took 380 s per rank
    to tokenize and cut into 128-token blocks in a fresh-clone run, a third of its QAT stage; now
    the tokenizer's ~25-40 s)."""
    eos = tokenizer.eos_token_id
    buf: list[int] = []
    produced = 0
    for text in texts:
        if not text:
            continue
        buf.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            buf.append(eos)
        start = 0
        while len(buf) - start >= max_seq_length:
            yield buf[start : start + max_seq_length]
            start += max_seq_length
            produced += 1
            if limit is not None and produced >= limit:
                return
        del buf[:start]
    if produced == 0 and len(buf) > 1:
        yield buf


def spread(items: list, count: int | None) -> list:
    """``count`` of ``items`` spread evenly over the list (item ``i * n // count``), all of them
    when ``count`` is None or not below their number. Why not the head: text files are in source
    order (the corpus: pydoc topics, then the standard library, then packages), so the first
    blocks are all one kind of text."""
    n = len(items)
    if count is None or count >= n:
        return items
    return [items[i * n // count] for i in range(count)]


# --------------------------------------------------------------------------- readers
def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _iter_text_files(path: Path) -> Iterator[tuple[str, Any]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no text files ({', '.join(TEXT_SUFFIXES)})")
    for p in files:
        yield str(p), {"text": p.read_text(encoding="utf-8", errors="replace")}


def _iter_hf(spec: str, cache_dir: str | None, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    parts = [p.strip() for p in spec.split(",") if p.strip()]
    ds = datasets.load_dataset(*parts, split=split, cache_dir=cache_dir)
    for i, row in enumerate(ds):
        yield f"{spec} [{split}] row {i}", row


def iter_records(source: str | Path, *, hf_cache_dir: str | None = None, split: str = "train"):
    """``(where, record)`` pairs of a source (file, directory or HF dataset id). ``~`` is the
    home folder, as in a shell: a YAML path is never seen by one, and a hub id never starts so."""
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            return _iter_text_files(path)
        if path.suffix in (".jsonl", ".json"):
            return _iter_jsonl(path)
        if path.suffix == ".parquet":
            return _iter_parquet(path)
        if path.suffix in TEXT_SUFFIXES:
            return _iter_text_files(path)
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (jsonl, json, parquet, txt, md, rst)")
    if str(source).endswith((".jsonl", ".json", ".parquet", *TEXT_SUFFIXES)):
        raise DataError(f"{source}: file not found")
    return _iter_hf(str(source), hf_cache_dir, split)


def load_training_data(
    source: str | Path,
    tokenizer,
    max_seq_length: int,
    num_samples: int | None = None,
    *,
    hf_cache_dir: str | None = None,
    split: str = "train",
    prompt_loss: bool = False,
) -> TokenizedDataset:
    """Read ``source`` into at most ``num_samples`` token samples (see the module docstring);
    ``prompt_loss`` supervises conversations' prompts too (`sft_sample`)."""
    if max_seq_length <= 1:
        raise ValueError(f"max_seq_length must be > 1; got {max_seq_length}")
    stats = DataStats(str(source))
    samples: list[dict[str, list[int]]] = []
    pending_text: list[str] = []
    kinds: set[str] = set()
    for where, rec in iter_records(source, hf_cache_dir=hf_cache_dir, split=split):
        if num_samples is not None and len(samples) >= num_samples:
            break
        stats.records += 1
        try:
            parsed = record_to_messages(rec)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if isinstance(parsed, str):
            kinds.add("text")
            pending_text.append(parsed)
            continue
        kinds.add("chat")
        try:
            sample = sft_sample(parsed, tokenizer, max_seq_length, stats, prompt_loss=prompt_loss)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if sample is None:
            stats.dropped_no_supervised += 1
            continue
        samples.append(sample)
    if pending_text:
        room = None if num_samples is None else max(num_samples - len(samples), 0)
        if room != 0:
            blocks = spread(list(text_blocks(pending_text, tokenizer, max_seq_length)), room)
            samples.extend({"input_ids": b, "labels": list(b)} for b in blocks)
    stats.samples = len(samples)
    stats.kind = "+".join(sorted(kinds))
    if not samples:
        raise DataError(f"{source}: no usable training samples ({stats.as_dict()})")
    if stats.dropped_no_supervised:
        log.warning(
            "%s: dropped %d samples whose reply was truncated away (max_seq_length=%d)",
            source,
            stats.dropped_no_supervised,
            max_seq_length,
        )
    log.info("training data %s", stats.as_dict())
    return TokenizedDataset(samples, stats)


def training_data_from_config(cfg, tokenizer) -> TokenizedDataset:
    """The training set an experiment config names: ``compression.QAT.hf_dataset`` (with
    ``hf_cache_dir``) when set, else ``dataset.data_path``; ``dataset.max_seq_length`` and
    ``dataset.num_samples`` apply to both; ``dataset.is_sft_data: false`` (upstream's "not SFT
    data") supervises every token of a conversation, not only the last reply."""
    ds = cfg.dataset
    max_len = ds.max_seq_length if ds is not None else 2048
    num = ds.num_samples if ds is not None else None
    source = cfg.qat.hf_dataset or (ds.data_path if ds is not None else None)
    if not source:
        raise ValueError("no training data: set dataset.data_path or compression.QAT.hf_dataset")
    prompt_loss = ds is not None and ds.is_sft_data is False
    data = load_training_data(
        source, tokenizer, max_len, num, hf_cache_dir=cfg.qat.hf_cache_dir, prompt_loss=prompt_loss
    )
    check_samples_for_ranks(len(data), source, num)
    return data


def world_size() -> int:
    """The ranks of this run: the process group's, else torchrun's ``WORLD_SIZE`` (1 without)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_samples_for_ranks(n: int, source, num_samples: int | None, world: int | None = None) -> None:
    """DataError when there are fewer training samples than ranks: the distributed sampler would
    hand some ranks copies of other ranks' samples (a silently different run), so it is refused,
    naming the file and ``dataset.num_samples``."""
    world = world_size() if world is None else world
    if n < world:
        raise DataError(
            f"{source}: {n} training sample(s) (dataset.num_samples={num_samples}) for {world} ranks: "
            "every rank needs at least one; raise dataset.num_samples or use fewer ranks"
        )


# --------------------------------------------------------------------------- batching
@dataclass
class PadCollator:
    """Right-pad a list of samples to the longest in the batch.

    ``input_ids`` padded with ``pad_token_id``, ``labels`` with -100, plus ``attention_mask``."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer, **kw) -> PadCollator:
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token to pad with")
        return cls(int(pad), **kw)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            n = (n + m - 1) // m * m
        ids = torch.full((len(features), n), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), n), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), n), dtype=torch.long)
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            ids[i, :k] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            lab = f.get("labels", f["input_ids"])
            labels[i, :k] = torch.as_tensor(lab, dtype=torch.long)
            mask[i, :k] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
