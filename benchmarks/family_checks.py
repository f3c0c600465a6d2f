"""The checks of the family suite (`benchmarks.families`), each against a reference independent of
the code under test: the export's codes against the base checkpoint's weights divided by the
exported scales, the fused groups' scales, transformers' reload against the base model's logits."""

from __future__ import annotations

import json
from pathlib import Path


def ref_vocab(base: Path) -> int:
    return int(json.loads((base / "config.json").read_text())["vocab_size"])


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def not_linear_modules(config) -> set[str]:
    """Module names of the tiny model outside "linear and expert weights": embeddings, convolutions
    (the linear-attention conv1d), found by module type on a meta model, and the output head
    (``get_output_embeddings``: the experiment ignores it, `check_export` reports it apart)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    head = m.get_output_embeddings()
    return {n for n, mod in m.named_modules() if isinstance(mod, nn.Embedding | nn.Conv1d) or mod is head}


def _codes():
    """Code dtype -> the independent reference of a code from ``weight / scale``: E4M3's range and
    torch's cast (compressed-tensors' fp8 arithmetic); int8's round-half-to-even and clamp."""
    import torch

    return {
        torch.float8_e4m3fn: lambda v: v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn),
        torch.int8: lambda v: torch.round(v).clamp(-128, 127).to(torch.int8),
    }


def _split_per_expert(mod: str, v, codes: dict) -> bool:
    """A fused expert tensor ``<experts>.<proj>`` ([E, ...]) written per expert as
    ``<experts>.<e>.<proj>.weight`` codes (GPT-OSS: `qatlib.export.experts`), all E of them."""
    parent, _, leaf = mod.rpartition(".")
    per = [n for n in codes if n.startswith(parent + ".") and n.endswith(f".{leaf}.weight")]
    return len(per) == v.shape[0] and sum(codes[n].numel() for n in per) >= v.numel()


def check_export(config, base: Path, export: Path) -> dict:
    """What the export did with each linear / expert weight of the base checkpoint: ``quantized``
    (its codes under the same key), ``named`` (kept, and the export's ignore list or record names it),
    ``unnamed`` (kept and nothing says so), ``moved`` (the key is gone and codes of the same
    size sit under its module, or one of its shape beside it: a changed layout or a renamed key,
    not compared bit for bit); the fraction of weight elements quantized; and every code
    against an independent reference (`_codes`) of the base weight divided by the exported scale."""
    import torch

    from qatlib.patterns import matches_any

    CODES = _codes()
    b, e = _tensors(base), _tensors(export)
    cfg = json.loads((export / "config.json").read_text())
    ignore = list((cfg.get("quantization_config") or {}).get("ignore") or [])
    rec_file = export / "qatlib_export.json"
    record = rec_file.read_text() if rec_file.exists() else ""
    skip = not_linear_modules(config)
    # weight matrices (a fused expert tensor too), not biases: GPT-OSS's expert biases are [E, 2I]
    units = {
        k: v
        for k, v in b.items()
        if v.ndim >= 2 and k.rpartition(".")[0] not in skip and not k.endswith("bias")
    }
    fp8 = {k: v for k, v in e.items() if v.dtype in CODES}  # the quantized weights (fp8 or int8 codes)
    out = {"quantized": [], "named": [], "unnamed": [], "moved": []}
    for k, v in units.items():
        mod = k.rpartition(".")[0] if k.endswith(".weight") else k
        if k in fp8:
            out["quantized"].append(k)
        elif k not in e and (
            sum(t.numel() for n, t in fp8.items() if n.startswith(mod + ".")) >= v.numel()
            or any(n.startswith(mod.rpartition(".")[0] + ".") and t.shape == v.shape for n, t in fp8.items())
            or _split_per_expert(mod, v, fp8)
        ):  # re-laid-out (a fused tensor split) or renamed beside its siblings (w1 -> gate_proj)
            out["moved"].append(k)
        elif matches_any(mod, ignore) or f'"{mod}"' in record or f'"{k}"' in record:
            out["named"].append(k)
        else:
            out["unnamed"].append(k)
    total = sum(v.numel() for v in units.values())
    done = sum(units[k].numel() for k in out["quantized"] + out["moved"])
    exact, inexact = 0, []
    for k, q in fp8.items():
        scale = e.get(k.removesuffix("weight") + "weight_scale")
        ref = b.get(k)
        if ref is None or scale is None or ref.shape != q.shape:
            continue
        want = CODES[q.dtype](ref.float() / scale.float())
        # compared as values: compressed-tensors writes +0 where a weight underflows to -0 (same product)
        if torch.equal(want.float(), q.float()):
            exact += 1
        else:
            inexact.append(k)
    return {
        "fraction_quantized": done / total if total else None,
        "weights": {k: len(v) for k, v in out.items()},
        "exceptions_named": out["named"],
        "exceptions_unnamed": out["unnamed"],
        "layout_changed": out["moved"],
        "codes_exact": exact,
        "codes_inexact": inexact,
        "ignore": ignore,
        "head_quantized": any(k.startswith("lm_head.") for k in fp8),
    }


def untied_fused(export: Path) -> list[str]:
    """The fused groups vLLM merges (`qatlib.runtime.fusion.PACKED`: q/k/v, gate/up, MLA's
    q_a / kv_a, linear attention's qkv / z and b / a) whose exported per-tensor scales differ:
    vLLM would serve them with the max, not what was trained. Empty: every group is tied."""
    import torch

    from qatlib.runtime.fusion import PACKED

    e = _tensors(export)
    bad = []
    for members in PACKED.values():
        for k in e:
            if not k.endswith(f".{members[0]}.weight_scale"):
                continue
            parent = k.removesuffix(f"{members[0]}.weight_scale")
            for kind in ("weight_scale", "input_scale"):
                vals = [e.get(f"{parent}{m}.{kind}") for m in members]
                # per-tensor scales only: vLLM concatenates per-channel ones (nothing to tie)
                if all(v is not None and v.numel() == 1 for v in vals) and any(
                    not torch.equal(vals[0], v) for v in vals[1:]
                ):
                    bad.append(f"{parent}{'/'.join(members)} {kind}")
    return bad


def reload(base: Path, export: Path) -> dict:
    """The export loaded by transformers (+ compressed-tensors) as a user would: no missing or
    unexpected key, and its logits on a short text against the base model's (SQNR, dB)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 35).remainder(ref_vocab(base)).unsqueeze(0)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    got, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    with torch.no_grad():
        a, c = ref(ids).logits.float(), got.eval()(ids).logits.float()
    sqnr = 10 * torch.log10(a.pow(2).mean() / (a - c).pow(2).mean().clamp_min(1e-30))
    bad = {k: sorted(v)[:8] for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    return {"logits_sqnr_db": round(float(sqnr), 2), "finite": bool(torch.isfinite(c).all()), **bad}
