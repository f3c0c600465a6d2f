"""A local multiple-choice continuation task for lm-eval, built from held-out text.

The upstream zero-shot suite (piqa, arc, hellaswag, winogrande) needs the hub. Offline, the
same harness code path runs on a task of the same shape built from the corpus test split: each
item is a context of ``context_words`` words, the true continuation (the next
``continuation_words`` words) and ``num_choices - 1`` distractors, spans of the same length from
other paragraphs of the same text. Scored like hellaswag: log-likelihood of each continuation,
``acc`` and ``acc_norm`` (length-normalised). Chance level is ``1 / num_choices``.

lm-eval resolves ``data_files`` against the working directory, so the YAML holds absolute paths.
The json loader writes an Arrow cache: into ``cache_dir`` when one is baked into the YAML, else
into the HF datasets cache (`qatlib.eval.harness.evaluate_tasks` points it at ``hf_home``), so the
task folder itself is never written after it is built.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import yaml

from ..checkpoint.layout import write_text

TASK_VERSION = 1


def _atomic_write(path: Path, text: str) -> None:
    """`qatlib.checkpoint.layout.write_text`: lm-eval never reads a half-written task file."""
    write_text(path, text)


def _paragraph_words(text: str) -> list[list[str]]:
    return [p.split() for p in text.split("\n\n") if p.strip()]


def make_mc_items(
    text: str,
    *,
    n: int = 200,
    context_words: int = 48,
    continuation_words: int = 12,
    num_choices: int = 4,
    seed: int = 0,
    neighborhood: int | None = None,
) -> list[dict]:
    """``n`` items ``{"id", "context", "choices", "label"}`` from ``text`` (deterministic in ``seed``).

    Contexts come from distinct (paragraph, offset) places that hold ``context_words +
    continuation_words`` words; the answer position is drawn uniformly per item. Distractors are
    spans of other paragraphs: any paragraph, or with ``neighborhood=k`` only the k paragraphs on
    either side (same document, same topic: a harder task that rewards local coherence).
    Raises ValueError when the text cannot supply ``n`` distinct items.
    """
    if num_choices < 2:
        raise ValueError(f"num_choices must be >= 2; got {num_choices}")
    paras = _paragraph_words(text)
    need = context_words + continuation_words
    long_paras = [i for i, p in enumerate(paras) if len(p) >= need]
    span_paras = [i for i, p in enumerate(paras) if len(p) >= continuation_words]
    if not long_paras or len(span_paras) < num_choices:
        raise ValueError(f"text too short for a {need}-word context+continuation and {num_choices} choices")
    span_set = set(span_paras)
    rng = random.Random(seed)
    items: list[dict] = []
    used: set[tuple[int, int]] = set()
    attempts = 0
    while len(items) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could only build {len(items)} of {n} distinct items from this text")
        pi = rng.choice(long_paras)
        words = paras[pi]
        start = rng.randrange(0, len(words) - need + 1)
        if (pi, start) in used:
            continue
        context = " ".join(words[start : start + context_words])
        true = " ".join(words[start + context_words : start + need])
        pool = span_paras
        if neighborhood:
            near = [q for q in range(pi - neighborhood, pi + neighborhood + 1) if q in span_set and q != pi]
            if len(near) >= num_choices - 1:
                pool = near
        distractors: list[str] = []
        tries = 0
        while len(distractors) < num_choices - 1:
            tries += 1
            if tries > 200:
                pool = span_paras
            qi = rng.choice(pool)
            if qi == pi:
                continue
            other = paras[qi]
            s = rng.randrange(0, len(other) - continuation_words + 1)
            d = " ".join(other[s : s + continuation_words])
            if d != true and d not in distractors:
                distractors.append(d)
        used.add((pi, start))
        label = rng.randrange(num_choices)
        choices = distractors[:label] + [true] + distractors[label:]
        items.append({"id": len(items), "context": context, "choices": choices, "label": label})
    return items


def task_yaml(task: str, data_file: str | Path, *, cache_dir: str | Path | None = None) -> dict:
    """The lm-eval task config (multiple_choice, acc + acc_norm) reading the jsonl ``data_file``."""
    kwargs: dict = {"data_files": {"test": str(Path(data_file).resolve())}}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(Path(cache_dir).resolve())
    return {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": kwargs,
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": TASK_VERSION},
    }


def _read_text_or_file(src: str | Path) -> str:
    if isinstance(src, Path):
        return src.read_text(encoding="utf-8")
    if "\n" not in src and len(src) < 4096:
        try:
            if Path(src).is_file():
                return Path(src).read_text(encoding="utf-8")
        except OSError:
            pass
    return src


def build_local_mc_task(
    test_text_or_file: str | Path,
    out_dir: str | Path,
    *,
    n: int = 200,
    seed: int = 0,
    task: str = "qat_local_mc",
    context_words: int = 48,
    continuation_words: int = 12,
    num_choices: int = 4,
    neighborhood: int | None = None,
    cache_dir: str | Path | None = None,
) -> dict:
    """Write ``<out_dir>/<task>.jsonl`` and ``<out_dir>/<task>.yaml`` (absolute paths inside).

    ``test_text_or_file``: a path to a text file, or the text itself. Pass ``out_dir`` as
    ``include_path`` to `qatlib.eval.harness.evaluate_tasks` and ``task`` as the task name.
    Returns ``{task, include_path, data_file, yaml_file, items, sha256, label_counts}``.
    """
    text = _read_text_or_file(test_text_or_file)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    items = make_mc_items(
        text,
        n=n,
        context_words=context_words,
        continuation_words=continuation_words,
        num_choices=num_choices,
        seed=seed,
        neighborhood=neighborhood,
    )
    data = "".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n" for it in items)
    data_file = out / f"{task}.jsonl"
    yaml_file = out / f"{task}.yaml"
    _atomic_write(data_file, data)
    cfg = task_yaml(task, data_file, cache_dir=cache_dir)
    _atomic_write(yaml_file, yaml.safe_dump(cfg, sort_keys=False))
    counts = [0] * num_choices
    for it in items:
        counts[it["label"]] += 1
    return {
        "task": task,
        "include_path": str(out),
        "data_file": str(data_file),
        "yaml_file": str(yaml_file),
        "items": len(items),
        "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest(),
        "label_counts": counts,
        "chance": 1.0 / num_choices,
    }
