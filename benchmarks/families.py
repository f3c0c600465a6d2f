"""Every model family users bring, through qatlib's own stages: PTQ fp8_static -> (2-rank ZeRO-3 QAT)
-> export -> reload with transformers + compressed-tensors -> vLLM's load (the oracle) -> memory plan.

    python -m benchmarks.families                      # every family, with QAT -> results/bench/families.json
    python -m benchmarks.families --only mixtral,olmoe --no-qat

`FAMILIES` is the one table of the tiny random model of each family (transformers model_type ->
config kwargs: odd widths, 2-4 layers); tests/test_families.py runs the same table (a fast subset
of stages). A family that fails is recorded with the stage it reached and the error, never a crash.
The docs' supported-families table (docs/reference/families.md) is generated from the JSON by
`qatlib.site.families`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import family_checks
from .family_checks import check_export, reload, untied_fused

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results/bench/families.json"
EXPERIMENT = REPO / "config/experiments/tiny-qwen3-moe.yaml"
VOCAB = 512
SHARD = "100KB"  # several shards per tiny model: the sharded loading paths run

# the widths every family shares: not powers of two (odd widths catch shape assumptions)
_ATTN = dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, head_dim=16)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=40)
_MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_LINEAR_ATTN = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,
)  # fmt: skip

# transformers 5.24 model_type -> the tiny model's config kwargs (plain data: tests and the
# benchmark build from it; `config_of` adds the shared vocabulary / positions)
FAMILIES: dict[str, dict] = {
    "llama": dict(**_ATTN, intermediate_size=112, num_hidden_layers=2),
    "qwen3": dict(**_ATTN, intermediate_size=112, num_hidden_layers=2),
    "gemma3_text": dict(
        **_ATTN,
        intermediate_size=112,
        num_hidden_layers=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    "phi3": dict(
        hidden_size=80,
        num_attention_heads=5,
        num_key_value_heads=5,
        intermediate_size=112,
        num_hidden_layers=2,
    ),  # fmt: skip
    "qwen2_moe": dict(
        **_ATTN,
        **_MOE,
        intermediate_size=112,
        shared_expert_intermediate_size=56,
        num_experts=4,
        num_hidden_layers=2,
    ),  # fmt: skip
    "qwen3_moe": dict(**_ATTN, **_MOE, num_experts=4, num_hidden_layers=2),
    "deepseek_v3": dict(
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=4,
        **_MLA,
        **_MOE,
        intermediate_size=112,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        topk_method="noaux_tc",  # as the hub config.json says (vLLM builds e_score_correction_bias for it)
    ),  # fmt: skip
    "glm4_moe": dict(
        **_ATTN,
        **_MOE,
        intermediate_size=112,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        use_qk_norm=True,
    ),  # fmt: skip
    "qwen3_next": dict(
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **_LINEAR_ATTN,
        **_MOE,
        intermediate_size=112,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    ),  # fmt: skip
    "qwen3_5_moe_text": dict(
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **_LINEAR_ATTN,
        **_MOE,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    ),  # fmt: skip
    "glm_moe_dsa": dict(
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=4,
        **_MLA,
        **_MOE,
        intermediate_size=112,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        topk_method="noaux_tc",
    ),  # fmt: skip
    "mixtral": dict(
        **_ATTN, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2
    ),  # fmt: skip
    "minimax_m2": dict(
        **_ATTN,
        intermediate_size=40,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        # fields of the hub config.json that vLLM reads and transformers' config does not define:
        rotary_dim=16,  # = head_dim: full rotary in both
        scoring_func="sigmoid",
        use_routing_bias=True,  # the e_score_correction_bias transformers' router has
    ),  # fmt: skip
    "olmoe": dict(**_ATTN, intermediate_size=40, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "hunyuan_v1_moe": dict(**_ATTN, intermediate_size=40, num_experts=4, moe_topk=2, num_hidden_layers=2),
    "gpt_oss": dict(
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=40,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
}

# the families whose expert layout or checkpoint-key conversion differs from Qwen3-MoE's: CI runs
# their 2-rank ZeRO-3 QAT (tests/test_families.py); the benchmark runs every family's
QAT_CI = ("mixtral", "gpt_oss", "deepseek_v3", "qwen3_next")


# families whose export vLLM 0.33 cannot load on this CPU machine, and the error that says why (the
# tests check the error is this one: a new refusal is a failure, not a known case)
ORACLE_CPU_LIMITS = {
    "glm_moe_dsa": "Sparse Attention is not supported on CPU",  # vllm/platforms/cpu.py:155
    # vLLM's registry cannot import vllm/model_executor/models/qwen3_5.py: it imports qwen3_vl ->
    # transformers' qwen2_vl image processor -> torchvision, not installed with the oracle
    "qwen3_5_moe_text": "['Qwen3_5MoeForCausalLM'] failed to be inspected",
}


# families whose export transformers 5.24's from_pretrained cannot load back, and the export
# record's note that says so (the tests check the note is there and the missing keys are these)
RELOAD_LIMITS = {"gpt_oss": "transformers 5.24 from_pretrained does NOT"}  # qatlib.export.coverage


def config_of(model_type: str):
    """The transformers config of ``model_type``'s tiny model (`FAMILIES`)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **FAMILIES[model_type],
    )  # fmt: skip


def build(model_type: str, out: Path, tokenizer, seed: int = 0) -> Path:
    """The tiny random model of ``model_type`` written to ``out`` as a user's checkpoint is: by
    ``save_pretrained``, sharded (`SHARD`), fp32, with ``tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_of(model_type), dtype=torch.float32).eval()
    model.save_pretrained(out, max_shard_size=SHARD)
    tokenizer.save_pretrained(out)
    return out


def _texts(n_docs: int = 40) -> list[str]:
    """English prose available offline (the standard library's docstrings): calibration and QAT text."""
    import collections
    import inspect
    import json as json_mod
    import re
    import textwrap

    docs = {
        inspect.getdoc(o)
        for m in (collections, json_mod, re, textwrap, inspect)
        for _, o in inspect.getmembers(m)
    }
    return sorted(d for d in docs if d and len(d) > 80)[:n_docs]


def tokenizer(out: Path):
    """A tiny BPE tokenizer trained offline (`qatlib.offline.tokenizer`) on `_texts`."""
    from qatlib.offline.tokenizer import train_tokenizer

    return train_tokenizer(_texts(200), vocab_size=VOCAB, out_dir=out)


# ----------------------------------------------------------------------------- the stages
# the scheme each family is exported in: fp8_static (per-tensor weights, static per-tensor inputs,
# what vLLM serves from compressed-tensors), except where vLLM 0.33 cannot load that format for the
# family's experts (the export refuses it by name, tests/test_gpt_oss.py): GPT-OSS's biased,
# interleaved experts load only through compressed-tensors' W8A8-INT8 MoE method (its fp8 one
# creates no expert biases), so GPT-OSS runs int8 per-channel weights with dynamic per-token inputs
FP8_STATIC = (
    "compression.quantization.name=fp8_static",
    "compression.quantization.quant_method.weight=per-tensor",
    "compression.QAT.plugin_config.quant_config.use_activation_quant=true",
)
SCHEMES = {
    "gpt_oss": (
        "compression.quantization.name=int8",
        "compression.quantization.quant_method.weight=per-channel",
        "compression.QAT.plugin_config.quant_config.use_activation_quant=true",
    ),
}


def sets(work: Path, model_type: str = "") -> list[str]:
    """The ``--set`` overrides of ``model_type``'s run on `EXPERIMENT`: its scheme (`SCHEMES`,
    else `FP8_STATIC`), a few short samples, 2 QAT steps (log-space scale updates:
    qatlib.trainers.log_scale)."""
    return [
        *SCHEMES.get(model_type, FP8_STATIC),
        f"dataset.data_path={work / 'train.txt'}",
        "dataset.num_samples=4",
        "dataset.max_seq_length=32",
        "compression.QAT.hf_args.max_steps=2",
        # log-space scale steps: fp8 per-tensor scales are ~1e-4, below an additive step of the default lr
        "compression.QAT.plugin_config.quant_config.scale_update=log",
        "compression.QAT.hf_args.learning_rate=0.001",
        "compression.QAT.hf_args.per_device_train_batch_size=1",
        "compression.QAT.hf_args.warmup_steps=0",
        "compression.QAT.hf_args.logging_steps=1",
        "compression.QAT.hf_args.disable_tqdm=true",
    ]


def _script(name: str):
    """``scripts/<name>.py`` as a module (its ``main(argv)`` is the stage as the workflow runs it)."""
    import importlib

    folder = str(REPO / "scripts")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def _call(stage: str, argv: list[str]) -> None:
    """Run a stage script's ``main``; its ``sys.exit("error: ...")`` becomes a RuntimeError with the text."""
    try:
        rc = _script(stage).main(argv)
    except SystemExit as e:
        raise RuntimeError(f"scripts/{stage}.py exited: {e.code}") from None
    if rc:
        raise RuntimeError(f"scripts/{stage}.py returned {rc}")


def _common(work: Path, model_type: str) -> list[str]:
    return ["-c", str(EXPERIMENT), "--no-progress", *(f"--set={s}" for s in sets(work, model_type))]


def run_ptq(model_type: str, base: Path, out: Path, work: Path) -> None:
    _call("ptq", [*_common(work, model_type), "--model-path", str(base), "--save-path", str(out)])


def run_export(model_type: str, model: Path, out: Path, work: Path, scales: Path | None = None) -> None:
    extra = ["--scales", str(scales)] if scales else []
    _call("export", [*_common(work, model_type), "--model-path", str(model), "--save-path", str(out), *extra])


def run_qat(model_type: str, base: Path, ptq: Path, out: Path, work: Path, timeout: float = 600) -> None:
    """scripts/qat.py on 2 gloo ranks under ZeRO-3 (the experiment's DeepSpeed JSON), as the workflow runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "scripts/qat.py"), *_common(work, model_type), "--model-path", str(base), "--from-ptq-ckpt",
           str(ptq), "--save-path", str(out), "--run-dir", str(work / "qat_run")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if p.returncode:
        errs = [ln for ln in (p.stdout + p.stderr).splitlines() if "Error" in ln or "error:" in ln]
        raise RuntimeError(
            f"scripts/qat.py (2 ranks) rc {p.returncode}: " + " | ".join(errs[-3:] or [p.stderr[-800:]])
        )


def memory_plan(model_type: str, base: Path, work: Path) -> dict:
    """``python -m qatlib.plan`` (the memory plan a user runs; its ``main``, in this process) on the
    family's experiment: the exit status (0 fits, 3 does not fit, 1 refused), the stages, the warnings."""
    import contextlib
    import io

    from qatlib.plan.__main__ import main as plan_main

    over = [*sets(work, model_type), f"model.model_path={base}"]
    out_buf, err_buf = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
        try:
            rc = plan_main([str(EXPERIMENT), "--json", *(f"--set={s}" for s in over)])
        except SystemExit as e:  # argparse / config errors
            rc = e.code if isinstance(e.code, int) else 1
    out: dict = {"rc": rc}
    try:
        data = json.loads(out_buf.getvalue())
        out["stages"] = [s.get("stage") for s in data.get("stages", [])]
        out["warnings"] = data.get("warnings", [])
    except ValueError:
        out["error"] = (err_buf.getvalue() or out_buf.getvalue()).strip()[-400:]
    return out


def oracle_loads(exports: list[Path], timeout: float = 900) -> dict[str, dict]:
    """`qatlib.runtime.load` (vLLM's own load path) on every export, in one child process (vLLM
    changes the process it runs in); export folder -> its summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "qatlib.runtime.load", *map(str, exports)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["export"]] = rec
    for d in exports:  # a crash of the child (not a refusal) is recorded for the exports it did not reach
        out.setdefault(
            str(d), {"loaded": False, "error": f"load process rc {p.returncode}: {p.stderr[-600:]}"}
        )
    return out


def not_linear_modules(model_type: str) -> set[str]:
    """`family_checks.not_linear_modules` of ``model_type``'s tiny model."""
    return family_checks.not_linear_modules(config_of(model_type))


# ----------------------------------------------------------------------------- the suite
STAGES = ("build", "ptq", "qat", "export", "reload", "oracle")


@dataclass
class FamilyResult:
    """One family's run: the last stage it completed (`STAGES`), what each check found, the error."""

    model_type: str
    folder: str = ""  # base / ptq / qat / export of this family
    architecture: str | None = None
    qat: bool = False
    stage_reached: str | None = None
    export: dict = field(default_factory=dict)  # `check_export`
    reload: dict = field(default_factory=dict)  # `reload`
    oracle: dict = field(default_factory=dict)  # `qatlib.runtime.load.load_summary`
    plan: dict = field(default_factory=dict)  # `memory_plan`
    error: str | None = None
    seconds: float = 0.0


def run_family(model_type: str, work: Path, tok, *, qat: bool) -> FamilyResult:
    """``model_type`` through build -> PTQ -> (QAT) -> export -> reload under ``work/<model_type>``
    (the oracle runs after, for every export at once: `oracle_loads`); a failure stops the family
    and is recorded with its stage."""
    d = work / model_type
    shutil.rmtree(d, ignore_errors=True)  # a run starts from nothing (the stages refuse a non-empty output)
    r = FamilyResult(model_type, folder=str(d), qat=qat)
    t0 = time.perf_counter()
    base, ptq, qat_dir, exp = d / "base", d / "ptq", d / "qat", d / "export"
    steps = [
        ("build", lambda: build(model_type, base, tok)),
        ("ptq", lambda: run_ptq(model_type, base, ptq, work)),
    ]
    if qat:
        steps += [("qat", lambda: run_qat(model_type, base, ptq, qat_dir, work))]
        steps += [("export", lambda: run_export(model_type, qat_dir, exp, work))]
    else:
        steps += [("export", lambda: run_export(model_type, base, exp, work, scales=ptq))]
    steps += [("reload", lambda: r.reload.update(reload(base, exp)))]
    for stage, fn in steps:
        try:
            fn()
        except Exception as e:
            r.error = f"{stage}: {type(e).__name__}: {e}"[:3000]
            break
        r.stage_reached = stage
        if stage == "build":
            r.architecture = json.loads((base / "config.json").read_text()).get("architectures", [None])[0]
        if stage == "export":
            try:
                r.export = check_export(config_of(model_type), base, exp)
                r.export["untied_fused"] = untied_fused(exp)
            except Exception as e:
                r.export = {"error": f"{type(e).__name__}: {e}"}
    if (base / "config.json").exists():
        r.plan = memory_plan(model_type, base, work)
    r.seconds = round(time.perf_counter() - t0, 1)
    return r


def run_suite(families, work: Path, *, qat: bool, oracle: bool = True) -> list[FamilyResult]:
    """Every family of ``families`` (`run_family`), then vLLM's load of each export that exists."""
    import torch

    torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.txt").write_text("\n\n".join(_texts(40)))
    tok = tokenizer(work / "tokenizer")
    results = [run_family(t, work, tok, qat=qat) for t in families]
    if oracle:
        done = [r for r in results if r.stage_reached in ("export", "reload")]
        loads = oracle_loads([work / r.model_type / "export" for r in done]) if done else {}
        for r in done:
            r.oracle = loads[str(work / r.model_type / "export")]
            if r.stage_reached == "reload" and r.oracle.get("loaded"):
                r.stage_reached = "oracle"
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated model_types (default: every family)")
    ap.add_argument("--no-qat", action="store_true", help="skip the 2-rank ZeRO-3 QAT (export the PTQ model)")
    ap.add_argument("--no-oracle", action="store_true", help="skip vLLM's load")
    ap.add_argument("--work", type=Path, default=REPO / "build/families", help="scratch folder")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    fams = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        ap.error(f"--only: unknown families {unknown}; known: {', '.join(FAMILIES)}")
    t0 = time.perf_counter()
    results = run_suite(fams, args.work, qat=not args.no_qat, oracle=not args.no_oracle)
    import transformers

    from qatlib.runtime.oracle import vllm_version

    from .common import machine, write_result

    doc = {
        "command": "python -m benchmarks.families" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "machine": machine(),
        "transformers": transformers.__version__,
        "vllm": vllm_version(),
        "scheme": "fp8_static (per-tensor weights, static per-tensor inputs); "
        + "; ".join(f"{t}: {', '.join(v.split('=')[1] for v in sets[:2])}" for t, sets in SCHEMES.items()),
        "qat": "2-rank ZeRO-3 (gloo), 2 steps" if not args.no_qat else "none (the PTQ model is exported)",
        "wall_s": round(time.perf_counter() - t0, 1),
        "families": [asdict(r) for r in results],
    }
    path = write_result(args.out.parent, args.out.stem, doc)
    for r in results:
        frac = r.export.get("fraction_quantized")
        print(f"{r.model_type:18s} {r.stage_reached or '-':7s} {frac if frac is None else round(frac, 4)!s:7s} "
              f"{(r.error or '')[:150]}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
