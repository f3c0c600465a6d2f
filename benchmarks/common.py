"""What every benchmark shares: the machine record, paired timing, the default model, JSON output.

Timings on a shared CPU drift by 2x within a minute, so no benchmark reports an absolute time as
its result. Every figure is a RATIO of two things measured in the same process, interleaved round
by round (`interleaved`): the reported ratio is the median over rounds of the per-round ratio,
which cancels slow drifts of the machine's load; absolute medians are recorded beside it for
orientation only.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("results/bench")
DEFAULT_BASE_MODEL = "tiny-qwen3-moe"
PACKAGES = ("torch", "transformers", "deepspeed", "compressed-tensors", "accelerate", "lm-eval", "qatlib")
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- machine
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(cwd: str | os.PathLike = REPO, exclude: Iterable[str | os.PathLike] = ()) -> dict[str, Any]:
    """``{"commit", "dirty", "changed_files"}`` of the repository (None when git is absent); dirty
    counts modified, staged and untracked (not ignored) files, except the paths in ``exclude`` (a
    benchmark's own output, which it rewrites after each row: the run did not use it)."""

    def run(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.rstrip("\n") if r.returncode == 0 else None  # porcelain lines start with a space

    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain")  # untracked files count: the run used them too
    top = run("rev-parse", "--show-toplevel")
    skip = set()
    for p in exclude:
        with contextlib.suppress(ValueError):
            skip.add(Path(p).resolve().relative_to(Path(top or cwd).resolve()).as_posix())
    changed = (
        None
        if status is None
        else [f for line in status.splitlines() if line.strip() and (f := line[3:]) not in skip]
    )
    return {
        "commit": commit,
        "dirty": None if changed is None else bool(changed),
        "changed_files": None if changed is None else len(changed),
    }


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def machine() -> dict[str, Any]:
    """Cores, torch threads, memory, load, package versions, git commit and date of this run; what
    decides CPU arithmetic (`qatlib.report.inputs.cpu_arithmetic`: torch's ATen level and the env
    vars that cap it, e.g. ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` runs a newer CPU as
    an AVX2-only one) and whether bf16 / fp16 matmuls have native kernels: CPU step times differ
    by 2-250x with these (`qatlib.surgery.frozen_linear`)."""
    import torch

    from qatlib.report.inputs import cpu_arithmetic
    from qatlib.surgery.frozen_linear import half_gemm_is_native

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    mem = _meminfo()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.is_available(),
        "cpu_arithmetic": cpu_arithmetic(),
        "native_half_gemm": {
            str(d).removeprefix("torch."): half_gemm_is_native(d) for d in (torch.bfloat16, torch.float16)
        },
        "load_avg_1m": load_avg(),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "versions": {p: _version(p) for p in PACKAGES},
        "git": git_state(),
        "argv": " ".join(sys.argv),
    }


def load_avg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


# --------------------------------------------------------------------------- resident set
def rss_now() -> int:
    """This process's resident set now (bytes, ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak of this process's resident set (`rss_now`) while the block runs, sampled by a thread
    every ``interval`` seconds (torch ops release the GIL): ``with RssSampler() as rs: ...; rs.peak``."""

    def __init__(self, interval: float = 0.0005) -> None:
        import threading

        self.interval = interval
        self.peak = rss_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_now())


# --------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    fns: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each function, measured round-robin: every round runs each function
    once (the order rotates from round to round), so all of them see the same load."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(timed(fns[n]))
    return times


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Median (and quartiles) over rounds of ``num[r] / den[r]``, plus the ratio of medians."""
    ratios = sorted(a / b for a, b in zip(num, den))
    q = _quartiles(ratios)
    return {
        "ratio": rounded(statistics.median(ratios)),
        "ratio_q1": rounded(q[0]),
        "ratio_q3": rounded(q[1]),
        "ratio_of_medians": rounded(statistics.median(num) / statistics.median(den)),
        "rounds": len(ratios),
    }


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def median_ms(ts: Sequence[float]) -> float:
    return round(1000.0 * statistics.median(ts), 3)


# --------------------------------------------------------------------------- formats
# Layers left in high precision, as in the default experiment (config/experiments/tiny-qwen3-moe.yaml).
IGNORE = ("lm_head", "embed_tokens", "gate")

FORMATS: dict[str, str] = {
    "fp8_static": "FP8 E4M3 weights and static per-tensor activations",
    "fp8_dynamic": "FP8 E4M3 weights and dynamic activations (vLLM's fp8 without calibration)",
    # vLLM concatenates channel scales of fused shards (no max-merge of weight scales); its fused
    # MoE refuses this pair (channel weights need token-dynamic inputs): dense models only
    "fp8_static_ch": "FP8 E4M3 per-channel weights and static per-tensor activations",
    "int4_g32": "int4 sym weight-only, groups of 32",
    "int4_g64": "int4 sym weight-only, groups of 64 (the default experiment's format)",
    "int4_ch": "int4 sym weight-only, per-channel",
    "w4a8_fp8_g32": "int4 g32 weights (FP8 recast) + static FP8 activations",
    "w4a8_fp8_g64": "int4 g64 weights (FP8 recast) + static FP8 activations",
    # `benchmarks.gpu_check`'s (groups of 128 on the real width, 16 on its tiny model)
    "int4_g128": "int4 sym weight-only, groups of 128",
    "w4a8_fp8_g128": "int4 g128 weights (FP8 recast) + static FP8 activations",
    "w4a8_fp8_g16": "int4 g16 weights (FP8 recast) + static FP8 activations",
    "int8_w8a8": "int8 per-channel weights + int8 per-token dynamic activations",
    "int3_g32": "int3 sym weight-only, groups of 32",
    "int3_g64": "int3 sym weight-only, groups of 64",
    "int2_g32": "int2 sym weight-only, groups of 32",
    "int2_g64": "int2 sym weight-only, groups of 64",
    # the 4-bit floats (#14) and int4 at equal storage: int4 g32 = NVFP4 = 4.5 bits per weight
    # (16-bit scale per 32 vs E4M3 per 16), int4 g16 = 5, MXFP4 = 4.25 (E8M0 per 32)
    "int4_g16": "int4 sym weight-only, groups of 16",
    "nvfp4": "NVFP4 W4A4: E2M1 weights and dynamic activations, E4M3 scale per 16, FP32 global scales",
    "nvfp4_w4a16": "NVFP4 weight-only (W4A16: vLLM's Marlin path on pre-Blackwell GPUs)",
    "mxfp4": "MXFP4 W4A4: E2M1 weights and dynamic activations, E8M0 scale per 32",
    "mxfp4_w4a16": "MXFP4 weight-only",
    # upstream AngelSlim's FOCUS recipes (configs/qwen3/fp4): the FP4 W4A4 rows above plus learned
    # sub-group scales folded into the codes (and MXFP4's E8M0 scales rounded up, mxfp4_rceil)
    "nvfp4_focus": "NVFP4 W4A4 + FOCUS's learned sub-group scales (2 per group of 16)",
    "mxfp4_focus": "MXFP4 W4A4 + FOCUS's sub-group scales (4 per group of 32) and ceil-rounded E8M0 scales",
}
# FOCUS: the sub-group factors per group and the logits' learning rate, upstream's (num_sub and
# learnable.quant_max_scale_lr of configs/qwen3/fp4/qwen3-4b_focus_{nvfp4,mxfp4}_w4a4*_zero3.yaml)
FOCUS = {"nvfp4_focus": (2, 1e-3), "mxfp4_focus": (4, 5e-2)}


# the formats that are a qatlib preset as it is (renamed where the names differ)
_PRESET_OF = {
    "fp8_static": "fp8_static",
    "fp8_dynamic": "fp8_dynamic",
    "int8_w8a8": "int8",
    "nvfp4": "nvfp4",
    "nvfp4_w4a16": "nvfp4_weight_only",
    "mxfp4": "mxfp4",
    "mxfp4_w4a16": "mxfp4_weight_only",
}


def format_scheme(name: str):
    """The `QuantScheme` of a benchmark format name (`FORMATS`): a qatlib preset, per channel
    (``_ch``) or in groups of N (``_gN``: the int weight-only presets, ``w4a8_fp8``)."""
    from qatlib.quant import PRESETS
    from qatlib.quant.spec import Granularity, ScaleRule

    if name not in FORMATS:
        raise KeyError(f"unknown benchmark format {name!r}; choose from {', '.join(FORMATS)}")
    if name in FOCUS:  # FOCUS's sub-group scales (and for MXFP4 upstream's mxfp4_rceil scale rule)
        s = PRESETS[name.removesuffix("_focus")]
        rule = ScaleRule.CEIL if s.weight.qtype == "mxfp4" else ScaleRule.COMPRESSED_TENSORS
        w = s.weight.replace(subgroups=FOCUS[name][0], scale_rule=rule)
        return s.replace(name=name, weight=w, input=s.input.replace(scale_rule=rule))
    if name in _PRESET_OF:
        s = PRESETS[_PRESET_OF[name]]
        return s if s.name == name else s.replace(name=name)
    kind, _, tail = name.rpartition("_")  # int4_g32 -> int4, g32; fp8_static_ch -> fp8_static, ch
    s = PRESETS[kind if kind in PRESETS else f"{kind}_weight_only"]
    if tail == "ch":
        w = s.weight.replace(granularity=Granularity.CHANNEL, group_size=None)
    else:
        w = s.weight.replace(group_size=int(tail.removeprefix("g")))
    return s.replace(name=name, weight=w)


def format_names(
    ap, flag: str, names: str | Sequence[str], shown: Sequence[str] = FORMATS
) -> tuple[str, ...]:
    """The format names of a command line's ``flag`` (comma-separated, or already a sequence); an
    argparse error (``ap.error``) naming ``flag`` for any that `FORMATS` lacks, offering ``shown``."""
    out = tuple(f.strip() for f in names.split(",")) if isinstance(names, str) else tuple(names)
    if unknown := [f for f in out if f not in FORMATS]:
        ap.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(shown)}")
    return out


# --------------------------------------------------------------------------- models
# Qwen3-30B-A3B's width (its config.json), without the expert and layer counts: the real-width
# benchmarks (`benchmarks.qat_width`, `benchmarks.gpu_check`) cut it to a few layers and experts.
QWEN3_30B_A3B_WIDTH: dict[str, int] = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    vocab_size=151936,
)


def tensor_bytes(model_dir: str | os.PathLike) -> dict[str, int]:
    """``{key: bytes}`` of every tensor of a model folder's weight files, from their headers
    (`qatlib.checkpoint.layout.weight_files`, `qatlib.checkpoint.safetensors.read_header`)."""
    from qatlib.checkpoint import safetensors as st
    from qatlib.checkpoint.layout import weight_files

    return {i.key: i.end - i.start for f in weight_files(model_dir) for i in st.read_header(f)}


def base_models_spec(name: str = DEFAULT_BASE_MODEL) -> dict[str, Any]:
    """``config/base_models.yaml[name]`` (``model`` / ``train`` overrides of `qatlib.offline.base_model`)."""
    import yaml

    with open(REPO / "config" / "base_models.yaml", encoding="utf-8") as f:
        models = yaml.safe_load(f)
    if name not in models:
        raise KeyError(f"no base model {name!r} in config/base_models.yaml (have {', '.join(models)})")
    return models[name]


def find_base_model(results: str | os.PathLike = "results", name: str = DEFAULT_BASE_MODEL) -> Path | None:
    """The pipeline's pre-trained base model folder, or None."""
    for d in (Path(results) / "base" / name, Path(results) / "bench" / "cache" / "base" / name):
        if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
            return d
    return None


def load_base(path: str | os.PathLike):
    """A pre-trained model folder as the benchmarks run it: fp32, ``use_cache`` off, eval mode
    (`qatlib.models.load_model`), experts on ``grouped_mm`` (`qatlib.offline.base_model`)."""
    import torch

    from qatlib.models import load_model
    from qatlib.offline.base_model import ensure_grouped_mm

    model = load_model(path, torch_dtype=torch.float32)
    ensure_grouped_mm(model)
    return model


def default_model(results: str | os.PathLike = "results", name: str = DEFAULT_BASE_MODEL, *, seed: int = 0):
    """``(model, source)``: the pre-trained default model if the pipeline (or the quality
    benchmark) produced it, else the same architecture freshly initialised from its config (speed
    and memory do not depend on the weights' values). fp32, ``use_cache`` off, experts on
    ``grouped_mm``."""
    from qatlib.offline.base_model import build_model

    path = find_base_model(results, name)
    if path is not None:
        return load_base(path), str(path)
    model = build_model(base_models_spec(name).get("model"), seed=seed)
    return model, f"built from config/base_models.yaml[{name}] (random init)"


# --------------------------------------------------------------------------- output
def write_result(out_dir: str | os.PathLike, name: str, payload: Mapping[str, Any]) -> Path:
    """``<out_dir>/<name>.json`` with the schema version first, atomically
    (`qatlib.checkpoint.layout.write_text`)."""
    from qatlib.checkpoint.layout import write_text

    path = Path(out_dir) / f"{name}.json"
    doc = {"benchmark": name, "schema_version": SCHEMA_VERSION, **payload}
    mach = doc.get("machine")
    if isinstance(mach, Mapping) and isinstance(mach.get("git"), Mapping):
        # the tree as this run used it: the record itself (rewritten after each row of a multi-row
        # benchmark) is not a change the run ran with
        doc["machine"] = {**mach, "git": git_state(exclude=[path])}
    return write_text(path, json.dumps(doc, indent=2, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    return o.item() if hasattr(o, "item") else str(o)  # tensors and numpy scalars; paths, the rest


class Rounded(float):
    """A figure rounded for the record that remembers the value it was rounded from: as a float it
    is the rounded value (what the JSON writes, what ``==`` and the reports see), ``exact`` is the
    unrounded one, which `target` compares. ``round()`` keeps ``exact``; arithmetic gives a plain
    float of the rounded values, so a value computed from rows must be computed from their `exact`."""

    exact: float

    def __new__(cls, value: float, exact: float) -> Rounded:
        self = super().__new__(cls, value)
        self.exact = float(exact)
        return self

    def __round__(self, ndigits: int | None = None):  # type: ignore[override]
        return round(float(self)) if ndigits is None else rounded(self, ndigits)

    def __reduce__(self):
        return Rounded, (float(self), self.exact)


def rounded(x: float | None, ndigits: int = 4) -> Rounded | None:
    """``round(x, ndigits)`` for a record, as a `Rounded` that keeps x's exact value; None stays None."""
    return None if x is None else Rounded(round(float(x), ndigits), exact(x))


def exact(x: Any) -> Any:
    """The unrounded value of a `Rounded`; anything else as it is."""
    return x.exact if isinstance(x, Rounded) else x


def target(
    name: str,
    value: float | None,
    threshold: float,
    *,
    higher_is_better: bool,
    unit: str = "",
    note: str = "",
) -> dict[str, Any]:
    """One target row: ``met`` is None when the value could not be measured. A `Rounded` value is
    compared, and recorded, unrounded (`exact`): 0.84999 recorded as 0.85 does not meet 0.85."""
    value = exact(value)
    met = None if value is None else (value >= threshold if higher_is_better else value <= threshold)
    op = ">=" if higher_is_better else "<="
    return {"target": f"{name} {op} {threshold}{unit}", "value": value, "met": met, "note": note}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warmup_qwen3_config():
    """A 1-layer Qwen3 config (~30k parameters) for the warm-up a memory benchmark runs before its
    baseline: the code loaded on first use (transformers' model classes, ~0.13-0.17 GiB) is then
    not counted as the measured model's."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
