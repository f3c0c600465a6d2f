"""Does vLLM load this export? vLLM's own load path (`qatlib.runtime.oracle.vllm_loaded`) on each
export folder, and what it made of every layer: which quantization method each of its linear and
fused-MoE modules got, so a layer vLLM keeps unquantized is named, not guessed.

    python -m qatlib.runtime.load EXPORT [EXPORT ...]     # one JSON line per export

One process loads many exports in turn (vLLM's import is the slow part); an export vLLM refuses is
a line with its error, and the next one still loads. Needs ``vllm`` (requirements/runtime-oracle.txt).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from . import oracle

# the quantization methods vLLM gives a layer it does not quantize (vllm 0.33 linear.py, fused_moe/layer.py)
UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "UnquantizedEmbeddingMethod")


def vllm_architecture(export_dir: str | Path) -> tuple[str | None, bool]:
    """(the export's ``architectures[0]``, whether the installed vLLM's model registry has it)."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or [None])[0]
    from vllm.model_executor.models import ModelRegistry

    return arch, arch in ModelRegistry.get_supported_archs()


def packed_modules(arch: str) -> dict[str, list[str]]:
    """vLLM's ``packed_modules_mapping`` of ``arch``'s model class: fused module -> the checkpoint
    modules it loads as shards (vLLM's own statement of what it fuses)."""
    from vllm.model_executor.models import ModelRegistry

    cls = ModelRegistry.models[arch].load_model_cls()
    return {k: list(v) for k, v in getattr(cls, "packed_modules_mapping", {}).items()}


def vllm_module_names(arch: str, names) -> set[str]:
    """Checkpoint module names as ``arch``'s vLLM model names its modules: vLLM's own renaming
    (the class's ``hf_to_vllm_mapper``; GPT-OSS's ``embed_tokens`` is ``embedding`` there)."""
    from vllm.model_executor.models import ModelRegistry

    mapper = getattr(ModelRegistry.models[arch].load_model_cls(), "hf_to_vllm_mapper", None)
    if mapper is None:
        return set(names)
    return {(mapper._map_name(f"{n}.weight") or f"{n}.weight").removesuffix(".weight") for n in names}


def _method(module) -> str | None:
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return None
    scheme = getattr(module, "scheme", None)
    return type(scheme).__name__ if scheme is not None else type(qm).__name__


def load_summary(export_dir: str | Path) -> dict:
    """vLLM's load of ``export_dir``: ``loaded`` (True, or the error), the architecture, and per
    quantization method the vLLM modules that got it (``unquantized``: the layers vLLM keeps in
    the model dtype, embeddings and the head included)."""
    arch, known = vllm_architecture(export_dir)
    out: dict = {"export": str(export_dir), "architecture": arch, "vllm_has_architecture": known}
    if not known:
        out["loaded"] = False
        out["error"] = f"vLLM {oracle.vllm_version()} has no {arch}"
        return out
    try:
        with oracle.vllm_loaded(export_dir) as model:
            methods: dict[str, list[str]] = {}
            for name, m in model.named_modules():
                meth = _method(m)
                if meth is not None:
                    methods.setdefault(meth, []).append(name)
            out["weights"] = weights_as_exported(model, Path(export_dir))
            out["packed_modules_mapping"] = {
                k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()
            }
    except Exception as e:  # a refusal is a result here: recorded with its text
        out["loaded"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
        return out
    out["loaded"] = True
    out["methods"] = {k: len(v) for k, v in methods.items()}
    out["unquantized"] = sorted(n for k, v in methods.items() if k in UNQUANTIZED for n in v)
    return out


def weights_as_exported(vmodel, export_dir: Path) -> dict:
    """Every fp8 weight of the export as vLLM holds it after loading (`oracle.vllm_linear`: the
    effective weight it multiplies with) against the export's own fp8 code x scale: ``equal``,
    ``differ`` (names) and ``unread`` (no vLLM module reads it under that name: a checkpoint key
    vLLM's loader skipped or renamed). vLLM loading without error is not enough: a loader can skip
    a key it does not know, leaving the layer's weights uninitialised."""
    import torch
    from safetensors.torch import load_file

    t: dict[str, torch.Tensor] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        t.update(load_file(f))
    out: dict = {"equal": 0, "differ": [], "unread": []}
    for k, w in t.items():
        if w.dtype != torch.float8_e4m3fn or not k.endswith(".weight"):
            continue
        name = k.removesuffix(".weight")
        try:
            v = oracle.vllm_linear(vmodel, name)
        except (KeyError, NotImplementedError, AttributeError):
            out["unread"].append(name)
            continue
        want = w.float() * t[f"{name}.weight_scale"].float()
        got = v.weight.float()
        if got.shape != want.shape and v.expert is None:  # a checkpoint module vLLM loads as all its shards
            got = v.layer.weight.t().float() * v.weight_scale.float()  # (Phi-3's qkv_proj): the whole layer
        if torch.equal(got, want):
            out["equal"] += 1
        else:
            out["differ"].append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m qatlib.runtime.load", description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", help="export folders (config.json + safetensors)")
    for d in ap.parse_args(argv).exports:
        try:
            out = load_summary(d)
        except Exception as e:  # e.g. no config.json: this export's line says so, the next one runs
            out = {"export": str(d), "loaded": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
