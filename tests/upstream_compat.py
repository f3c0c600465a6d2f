"""The upstream AngelSlim configs (tests/data/upstream, commit 67394ce) and what qatlib does with each.

`REFUSED` and the lists below are the claims per file; the tests check them from the same data:
`tests/test_upstream.py` (each file loads or is refused with its message; the files in `RUNS` run
their first stage, ``scripts/ptq.py``, on a tiny local model of their architecture) and
`tests/test_upstream_dag.py` (every file in `QAT` is an experiment of the workflow: a Snakemake
dry run of its report builds the full DAG; the files in `DAG_RUNS` run it for real).
``python3 tests/upstream_compat.py`` writes the table `render()` makes to docs/upstream-compat.md
and the README carries `totals()`; a test checks both are fresh.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "tests" / "data" / "upstream"
TABLE = REPO / "docs" / "upstream-compat.md"
COMMIT = "67394ce55f6b6cfae702575fbc3c7a05c13fdd74"

AWQ = ("compression.quantization.name", "upstream AngelSlim feature AWQ")
SPIN = ("transform", "upstream AngelSlim feature transform (SpinQuant")
LEPTO = ("compression.quantization.name", "upstream AngelSlim feature LeptoQuant (fp8_lepto)")
HY3_DS = (
    "compression.QAT.hf_args.deepspeed",
    "configs/hunyuan/qat/fp8_static/learn_scale/ds_config_zero3.json",
)

# Refused files -> (dotted key, message fragment). Everything else loads.
REFUSED: dict[str, tuple[str, str]] = {
    "configs/Hy3/qat/fp8_static/learn_scale/Hy3_a20b_fp8_static_end2end_learn_scale_zero3.yaml": HY3_DS,
    "configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static_analyse.yaml": (
        "compression.quant_analyse",
        "upstream AngelSlim feature quant_analyse",
    ),
    "configs/qwen3/ptq/int4_gptaq/qwen3-4b_int4_gptaq.yaml": (
        "compression.quantization.name",
        "upstream AngelSlim feature GPTAQ",
    ),
    "configs/qwen3/ptq/spinquant/qwen3-8b_spinquant_int4_awq.yaml": SPIN,
    "configs/qwen3/ptq/spinquant/qwen3-a3b_spinquant_fp8_static.yaml": SPIN,
    "configs/qwen3/ptq/spinquant/qwen3_spinquant_fp8_static.yaml": SPIN,
}
for _m in ("0_6b", "4b", "8b"):
    REFUSED[f"configs/qwen3/ptq/fp8_static/qwen3-{_m}_lepto_fp8_static.yaml"] = LEPTO
for _m in ("0_6b", "14b", "1_7b", "1_7b_int4_awq_low_memory", "32b", "4b", "8b", "a22b", "a3b"):
    name = f"qwen3-{_m}.yaml" if _m.endswith("low_memory") else f"qwen3-{_m}_int4_awq.yaml"
    REFUSED[f"configs/qwen3/ptq/int4_awq/{name}"] = AWQ

# Upstream FOCUS (configs/qwen3/fp4): NVFP4 / MXFP4 W4A4 QAT with learned sub-group scales and (MXFP4)
# ceil-rounded E8M0 scales; tests/test_focus.py runs each one's PTQ, a few QAT steps and its export on
# a tiny Qwen3 (one process), tests/test_upstream_dag.py dry-runs their DAG (ZeRO-3 on the ranks).
_FOCUS = "configs/qwen3/fp4/qwen3-4b_focus_"
FOCUS_RUNS = tuple(f"{_FOCUS}{f}_w4a4{v}_zero3.yaml" for f in ("nvfp4", "mxfp4") for v in ("", "_real"))

# Files whose first stage (scripts/ptq.py) the tests run: every QAT config, and one PTQ config
# per algorithm and architecture. Hy3 runs with hf_args.deepspeed pointed at its copied JSON.
_QAT = "configs/qwen3/qat"
RUNS: list[str] = [
    f"{_QAT}/fp8_static/learn_scale/qwen3-30b-a3b_fp8_static_end2end_learn_scale_zero3.yaml",
    f"{_QAT}/fp8_static/learn_scale/qwen3-4b_fp8_static_end2end_learn_scale_zero3.yaml",
    f"{_QAT}/int4_weight_only/learn_scale/qwen3-4b_int4_weight_only_blockwise_learn_scale.yaml",
    f"{_QAT}/int4_weight_only/learn_scale/qwen3-4b_int4_weight_only_end2end_learn_scale.yaml",
    f"{_QAT}/w4a8_fp8/learn_scale/qwen3-4b_w4a8_fp8_end2end_learn_scale.yaml",
    f"{_QAT}/w4a8_fp8/learn_scale/qwen3-4b_w4a8_fp8_end2end_learn_scale_lwc.yaml",
    f"{_QAT}/w4a8_fp8/learn_scale/qwen3-4b_w4a8_fp8_end2end_learn_scale_lwc_qkv_fp8attn.yaml",
    f"{_QAT}/w4a8_fp8/learn_scale/qwen3-4b_w4a8_fp8_end2end_learn_scale_qkv_fp8attn.yaml",
    "configs/Hy3/qat/fp8_static/learn_scale/Hy3_a20b_fp8_static_end2end_learn_scale_zero3.yaml",
    "configs/qwen3/ptq/fp8_static/qwen3-0_6b_fp8_static.yaml",
    "configs/qwen3/ptq/fp8_static/qwen3-a3b_fp8_static.yaml",
    "configs/qwen3/ptq/fp8_dynamic/qwen3_coder-a35b_fp8_dynamic_low_memory.yaml",
    "configs/qwen3/ptq/int8_dynamic/qwen3-0_6b_int8_dynamic.yaml",
    "configs/qwen3/ptq/int4_gptq/qwen3-0_6b_int4_gptq.yaml",
    "configs/qwen3/ptq/int4_gptq/qwen3-a3b_int4_gptq.yaml",
    # quant_helpers: [smooth] (SmoothQuant before the PTQ, `qatlib.quant.smoothing`)
    "configs/qwen3/ptq/smooth_int8/qwen3-0_6b_int8_dynamic_smooth.yaml",
    # upstream's low_memory (qatlib's streamed calibration) and save_name: fp8 (vLLM's / SGLang's fp8 format)
    "configs/qwen3/ptq/fp8_static/qwen3-a22b_fp8_static_low_memroy.yaml",
    "configs/qwen3/ptq/fp8_dynamic/qwen3-a3b_fp8_dynamic.yaml",
]

# Files whose export the default deploy target (vLLM 0.33) cannot load on their MoE model: refused under
# `deploy.target: vllm` once the local model is known to be MoE, so they run with `deploy.target: none`.
VLLM_CANNOT_LOAD: dict[str, str] = {
    "configs/qwen3/ptq/fp8_dynamic/qwen3_coder-a35b_fp8_dynamic_low_memory.yaml": (
        "per-tensor dynamic fp8 activations on an MoE model: no vLLM 0.33 MoE kernel"
    ),
}


HY3 = "configs/Hy3/qat/fp8_static/learn_scale/Hy3_a20b_fp8_static_end2end_learn_scale_zero3.yaml"
HEADLINE = f"{_QAT}/fp8_static/learn_scale/qwen3-30b-a3b_fp8_static_end2end_learn_scale_zero3.yaml"
BLOCKWISE = f"{_QAT}/int4_weight_only/learn_scale/qwen3-4b_int4_weight_only_blockwise_learn_scale.yaml"
# the files whose whole DAG (ptq -> ZeRO-3 / blockwise QAT -> export -> evaluate -> report) the
# slow tests run for real on a tiny local model
DAG_RUNS = (HEADLINE, BLOCKWISE)


def yaml_files() -> list[str]:
    return sorted(str(p.relative_to(UPSTREAM)) for p in UPSTREAM.glob("configs/**/*.yaml"))


def qat_files() -> list[str]:
    """The upstream QAT configs (``configs/*/qat``, and FOCUS's ``configs/qwen3/fp4``): the
    workflow's experiments (the PTQ ones are first stages)."""
    return [f for f in yaml_files() if "/qat/" in f or "/fp4/" in f]


def architecture(rel: str) -> str:
    """The transformers model type of the upstream model a config names."""
    name = Path(rel).name
    if name.startswith("Hy3"):
        return "hy_v3"
    return "qwen3_moe" if any(t in name for t in ("a3b", "a22b", "a35b")) else "qwen3"


def local_overrides(rel: str, model_dir: str, data_path: str, ptq_ckpt: str) -> dict[str, object]:
    """The only keys pointed at local files: model_path, the data (``hf_dataset`` wins over
    ``data_path`` upstream, so it is cleared where set) and ``from_ptq_ckpt`` where the file has the
    key (FOCUS's write ``null``: upstream starts its FP4 ZeRO-3 QAT from constant scales; qatlib's
    ZeRO-3 QAT starts from a PTQ checkpoint, which the workflow makes and puts there)."""
    from qatlib.yamlio import load_yaml

    raw = load_yaml(UPSTREAM / rel)
    qat = (raw.get("compression") or {}).get("QAT") or {}
    out: dict[str, object] = {"model.model_path": model_dir, "dataset.data_path": data_path}
    if qat.get("hf_dataset"):
        out["compression.QAT.hf_dataset"] = None
    if "from_ptq_ckpt" in qat:
        out["compression.QAT.from_ptq_ckpt"] = ptq_ckpt
    return out


def load(rel: str, **extra: object):
    """`load_config` of the copied file with local overrides (paths need not exist to load)."""
    from qatlib.config import load_config

    return load_config(
        UPSTREAM / rel, {**local_overrides(rel, "/local/model", "/local/data.jsonl", "/local/ptq"), **extra}
    )


def outcome(rel: str) -> tuple[str, str]:
    """(result, detail) measured now. QAT files: ``DAG runs`` (the whole DAG, for real, in the
    tests) or ``DAG builds`` (its dry run builds the full DAG; its first stage runs); the PTQ
    files: ``PTQ runs`` (``scripts/ptq.py`` runs), ``loads`` or ``refused``."""
    from qatlib.config import ConfigError

    fix = {}
    if rel == HY3:  # upstream's path does not exist; the JSON beside the file
        fix = {"compression.QAT.hf_args.deepspeed": str(UPSTREAM / Path(rel).parent / "ds_config_zero3.json")}
    try:
        cfg = load(rel, **fix)
    except ConfigError as e:
        path, msg = e.issues[0]
        return "refused", f"`{path}`: {msg}".replace(f"{REPO}/", "").replace(str(Path.cwd()), ".")
    scheme = cfg.quant_scheme()
    if rel in qat_files():
        mode = cfg.qat.training_mode
        launch = "ZeRO-3, torchrun on the ranks" if cfg.zero3_enabled else "one process"
        detail = f"{scheme.name} ({mode}), {launch}"
        if rel == HY3:
            detail += (
                "; with `hf_args.deepspeed` pointed at the JSON beside it (as shipped: refused, see above)"
            )
        if rel in FOCUS_RUNS:
            w, a = scheme.weight, scheme.input
            detail += (
                f"; weight {w.describe()}, input {a.describe()}, save_format {cfg.qat.save_format}; its PTQ, 2 QAT "
                "steps (one process) and export run in tests/test_focus.py"
            )
        return ("DAG runs" if rel in DAG_RUNS else "DAG builds"), detail
    detail = f"{scheme.name} ({cfg.ptq_algorithm})"
    if cfg.quantization.low_memory:
        detail += "; low_memory: the streamed (layer-by-layer) calibration"
    if scheme.checkpoint_format.value != "compressed-tensors":
        detail += f"; exported as quant_method {scheme.checkpoint_format.value} (vLLM's / SGLang's Fp8Config)"
    if rel in VLLM_CANNOT_LOAD:
        detail += f"; refused under `deploy.target: vllm` ({VLLM_CANNOT_LOAD[rel]}), runs with `deploy.target: none`"
    return ("PTQ runs" if rel in RUNS else "loads"), detail


KINDS = ("DAG runs", "DAG builds", "PTQ runs", "loads", "refused")


def counts() -> dict[str, int]:
    outcomes = [outcome(r)[0] for r in yaml_files()]
    return {k: outcomes.count(k) for k in KINDS}


def totals() -> str:
    """The one-line summary the table ends with and the README quotes (a test checks both)."""
    c = counts()
    qat = c["DAG runs"] + c["DAG builds"]
    n_ptq = len(yaml_files()) - len(qat_files())
    refused_qat = sum(outcome(f)[0] == "refused" for f in qat_files())
    return (
        f"{qat} of {len(qat_files())} QAT configs build the full DAG ({c['DAG runs']} run it end to end "
        f"in the tests, the {len(FOCUS_RUNS)} FOCUS FP4 ones PTQ, QAT a few steps and export); of {n_ptq} "
        f"Qwen3 PTQ configs {c['PTQ runs']} run, {c['loads']} load, {c['refused'] - refused_qat} are refused, "
        f"each for a feature qatlib lacks ({', '.join(refused_features())})."
    )


def refused_features() -> list[str]:
    """The upstream features the refused files ask for, by file count (most first)."""
    import re
    from collections import Counter

    names = Counter()
    for rel in yaml_files():
        kind, detail = outcome(rel)
        if kind == "refused" and rel != HY3:
            m = re.search(r"upstream AngelSlim feature (\S+)", detail)
            names[m.group(1) if m else detail] += 1
    return [f"{n} {k}" for k, n in names.most_common()]


def render() -> str:
    lines = [
        "# Upstream AngelSlim configs in qatlib",
        "",
        f"Generated by `python3 tests/upstream_compat.py` from the copies in `tests/data/upstream/` (AngelSlim commit "
        f"`{COMMIT[:7]}`, Apache-2.0) and checked by `tests/test_upstream.py` and `tests/test_upstream_dag.py`. "
        "Each file is used unchanged with only `model.model_path`, `dataset.data_path` (clearing "
        "`compression.QAT.hf_dataset` where set) and `compression.QAT.from_ptq_ckpt` pointed at local files.",
        "",
        "A QAT file is an experiment of the workflow as it is: `experiments_dir` its folder, `experiment` its "
        "name, the local paths (and, for a quick run, fewer steps / shorter sequences / a local `evaluation` "
        "text) in params.yaml's `overrides`; the workflow finds the DeepSpeed JSON its repository-relative "
        "`hf_args.deepspeed` names (above the YAML) and replaces `from_ptq_ckpt` by its own PTQ output. "
        "**DAG runs**: `ptq_calibrate -> zero3_qat -> convert_export -> evaluate -> sqnr -> report` runs for real "
        "in the tests on a tiny local model of its architecture and the export reloads; **DAG builds**: a "
        "Snakemake dry run of its report builds that DAG (9 jobs, QAT under `torchrun` on the ranks for ZeRO-3, "
        "one process otherwise) and its first stage runs on a tiny local model. PTQ files: **PTQ runs**: "
        "`scripts/ptq.py` runs on a tiny local model; **loads**: it validates (same format and algorithm as a "
        "file that runs); **refused**: the error qatlib gives.",
        "",
        "Hy3 (`hy_v3`, in transformers 5.24): upstream's `hf_args.deepspeed` names "
        "`configs/hunyuan/qat/fp8_static/learn_scale/ds_config_zero3.json`, a path upstream's own repository does "
        "not have (the JSON sits in `configs/Hy3/...`), so the file as shipped is refused (by `load_config`, and "
        "by the workflow at DAG time); with `hf_args.deepspeed` pointed at the JSON beside it, it builds the DAG "
        "and its first stage runs on a tiny `HYV3ForCausalLM`.",
        "",
        "FOCUS FP4 (`configs/qwen3/fp4`, NVFP4 / MXFP4 W4A4, ZeRO-3): upstream's newest QAT recipes run as written. "
        "`use_subgroup_scale` / `num_sub` are FOCUS's learned sub-group scales (`QuantSpec.subgroups`: per "
        "group_size / num_sub weights a factor sigmoid(logit) divides the weight before rounding, not the codes "
        "after; the logits train with `learnable.weight_scale` at `quant_max_scale_lr`); `qtype: mxfp4_rceil` is "
        "MXFP4 with E8M0 scales 2**ceil(log2(amax / 6)) (`ScaleRule.CEIL`; qatlib's `qtype: mxfp4` keeps "
        "compressed-tensors' rule); `mantissa_rounding: even / nearest` are both qatlib's E2M1 rounding (to "
        "nearest, ties to even). Upstream learns FP4 scales as multipliers of the group max, so an additive "
        "learning rate there is a relative one: without `scale_update` these files step qatlib's FP4 scales in "
        "log space (MXFP4's E8M0 scales at qatlib's own multiple of it, `quant_config.e8m0_scale_lr` overrides). "
        "The export folds the sub-group factors into the E2M1 codes (as upstream's own export does): "
        "what vLLM computes, codes x group scale, is the trained weight; MXFP4 activations are quantized by the "
        "runtime with its own scale rule, recorded in `qatlib_export.json` (`changes`). Their `from_ptq_ckpt: "
        "null` (upstream starts FP4 ZeRO-3 QAT from constant scales) is the workflow's PTQ output, as for every "
        "QAT file; their `save_format: fake` is the export stage's format, after ZeRO-3 QAT too.",
        "",
        "PTQ keys: `low_memory: true` asks for layer-by-layer calibration, qatlib's default wherever "
        "`qatlib.plan.streamed` says the streamed calibration writes the same scales; where it cannot (GPTQ, a "
        "static input scale on an unignored `lm_head`) `scripts/ptq.py` refuses before any work, naming why. "
        "`save_name: fp8` exports vLLM's / SGLang's own fp8 format (`quant_method: fp8`, their `Fp8Config`): the "
        "tensors compressed-tensors writes for fp8 per-tensor under that header. Why not compressed-tensors with "
        "a warning: the served arithmetic differs. vLLM 0.33 runs compressed-tensors' dynamic per-tensor fp8 "
        "on no MoE kernel (refused), while its `Fp8MoEMethod` quantizes the experts' input per tensor, as "
        "trained; dense layers are quantized per token where CUTLASS fp8 runs in both formats; SGLang keeps "
        "each shard's weight scale there (`docs/runtime-oracle.md`, the `*_FP8_FORMAT` facts, checked against "
        "vLLM's own load path). The format needs a bfloat16 / float16 model, and transformers cannot reload it "
        "(the evaluation's `export` variant is skipped, `deployed` emulates it).",
        "",
        "| file | architecture | result | detail |",
        "|---|---|---|---|",
    ]
    for rel in yaml_files():
        kind, detail = outcome(rel)
        short = rel.removeprefix("configs/")
        lines.append(f"| `{short}` | {architecture(rel)} | {kind} | {detail.replace('|', '/')} |")
    lines += ["", f"Totals: {totals()}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(render())
    print(f"wrote {TABLE}")
