"""Memory plan: the peak memory each stage of an experiment will need, before anything is launched.

    python -m qatlib.plan config/experiments/qwen3-30b.yaml --gpus 8 [--nodes 2] [--json]

Arithmetic on the model's ``config.json`` and the experiment (no weights read, no torch imported,
so the Snakefile calls it to size every job). Per stage it lists, term by term, the peak DEVICE
memory of one rank and the HOST RAM of one node; on a CPU run (``--gpus 0``) a rank's working set
lives in host RAM, so it is added there. Why arithmetic: a 30B MoE run that does not fit fails
after an hour of loading (or is killed by the OOM killer on a shared node); the plan says so in a
second, and names the term that is too large.

What each stage's terms model (the code as it is after #16's streaming and QAT-memory work);
``streamed(raw, stage)`` decides which stages run streamed, and the stage scripts stream by
default exactly there (``--whole-model`` opts out), so the plan sizes what a user runs:

``ptq_calibrate``  ``qatlib/ptq/__init__.py`` + ``quant/calibration.py``, streamed layer by layer
                   (``scripts/ptq.py``, its default): the input embeddings while the first
                   layer's inputs are captured, then ONE decoder layer at a time (never both),
                   its experts read per expert from the shards into the linearised skeleton
                   (no fused tensor), calibration activations carried from layer to layer. Not
                   streamed where ``streamed`` says so (GPTQ; a static input scale on the head):
                   the model loaded whole, plus GPTQ's carried activations or one batch's logits.
``zero3_qat``      ``zero3_load.py`` / ``trainers/end2end.py`` under DeepSpeed ZeRO-3: each rank
                   holds model/world, the persistent (replicated) small parameters (DeepSpeed's
                   persistence thresholds), one gathered unit (one expert or linear: qatlib's
                   default leaf module, `qatlib.zero3.ds_config`; a decoder layer where the JSON lists a
                   whole-layer class, e.g. ``Qwen3MoeSparseMoeBlock``) plus the prefetch bucket, the
                   trainable scales with their fp32 master, gradient and Adam moments (all
                   partitioned), the activations of a micro-batch (layer inputs only with
                   gradient checkpointing, plus one layer recomputed), fake-quantized weights
                   NOT kept for backward (``quant/functional.py``'s custom autograd recomputes
                   them; one linear's temporaries), and the logits terms of ``losses.py``
                   (student logits, the KD teacher's logits, the gradient buffer and one chunk's
                   fp32 working set, ``CHUNK_ELEMENTS``). The teacher is the model itself with
                   quantization disabled (``end2end.py``): no second copy of the weights, unless
                   weights (``quant_config.weight_lr``, + their optimizer state) or norms train:
                   then the original model, a second partitioned copy (``base_model_teacher``).
                   Rank 0's host also holds ``zero3_save.save_consolidated``'s buffer (one shard +
                   one gathered unit + every scale).
``convert_export`` ``export_stream.py`` (``scripts/export.py``, always; host only): one
                   output tensor (each is spilled to disk as it comes and the shards assembled
                   64 MiB at a time), one onloaded decoder layer, one linear's compression
                   temporaries, every scale.
``evaluate``       ``scripts/evaluate.py``: the whole model on the device when it fits, else
                   layer-sequential offload (one layer + embeddings on the device, the model in
                   host RAM); the export variant's compressed copy while it decompresses, one
                   layer's forward and the logits of a batch.

Constants that mirror other modules (``CHUNK_ELEMENTS``, ``SAVE_SHARD_BYTES``, ``PARTITION_BYTES``,
``COPY_BYTES``) are checked against
them in tests/test_plan.py. ``benchmarks/plan_rehearsal.py`` measures the rehearsal's peak RSS per
stage beside these predictions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qatlib.yamlio import load_yaml

from .ds_settings import zero3_setting_warnings
from .model import (
    ModelShape,
    PlanError,
    PlanInputs,
    StagePlan,
    Term,
    WeightFormat,
    from_experiment,
    not_streamed,
    section,
    streamed,
)
from .stages import (
    CHUNK_ELEMENTS,
    COPY_BYTES,
    GIB,
    PARTITION_BYTES,
    SAVE_SHARD_BYTES,
    STAGES,
    Run,
    act_per_token,
    plan,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "COPY_BYTES",
    "GIB",
    "SAVE_SHARD_BYTES",
    "PARTITION_BYTES",
    "STAGES",
    "ModelShape",
    "PlanError",
    "PlanInputs",
    "Run",
    "StagePlan",
    "Term",
    "WeightFormat",
    "act_per_token",
    "find_model_config",
    "from_experiment",
    "plan",
    "not_computed_warnings",
    "not_streamed",
    "run_warnings",
    "section",
    "streamed",
    "zero3_setting_warnings",
]

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIGS = "config/models"  # <org>--<name>/config.json of hub models
BASE_MODELS = "config/base_models.yaml"


def find_model_config(model_path: str, repo: Path = REPO, base_models: str = BASE_MODELS) -> dict[str, Any]:
    """The config.json (as a dict) of ``model.model_path``, without reading weights: a local model
    folder's; a workflow base model (``results/base/<name>``: its config/base_models.yaml entry,
    trained-from-scratch ``model`` sizes or a ``random`` rehearsal model's config.json with fewer
    layers); a hub id's copy under config/models/. PlanError names what was looked for."""
    p = Path(str(model_path)).expanduser()
    local = p if p.is_absolute() else repo / p
    for folder in (p, local):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    models = load_yaml(repo / base_models) or {}
    if p.parent.name == "base" and p.name in models:
        spec = models[p.name]
        if "random" in spec:
            r = spec["random"]
            cfg = json.loads((repo / r["config"]).read_text(encoding="utf-8"))
            return {**cfg, "num_hidden_layers": r.get("num_hidden_layers", cfg["num_hidden_layers"])}
        if "model" not in spec:  # e.g. a GGUF conversion: its config.json exists only once built
            raise PlanError(
                f"model.model_path: {model_path!r} is built by the workflow ({base_models}: "
                f"{', '.join(spec)}) and not built yet; pass --model-config FILE"
            )
        from_spec = dict(spec.get("model") or {})
        from_spec["model_type"] = from_spec.pop("arch", "qwen3_moe")
        return from_spec
    hub = repo / MODEL_CONFIGS / str(model_path).replace("/", "--") / "config.json"
    if hub.is_file():
        return json.loads(hub.read_text(encoding="utf-8"))
    raise PlanError(
        f"model.model_path: no config.json for {model_path!r} (looked for a local folder, an entry of "
        f"{base_models} under results/base/, and {hub.relative_to(repo)}); pass --model-config FILE"
    )


def not_computed_warnings(shape: ModelShape) -> list[str]:
    """One line per model term the plan could not compute (`ModelShape.not_computed`): the run
    still starts; the plan's figures leave that term out (top-k: count every expert)."""
    return [f"memory plan: not computed: {t}" for t in shape.not_computed]


def run_warnings(raw: dict[str, Any], ds: dict[str, Any] | None, model_path: str, world: int) -> list[str]:
    """What the plan could not compute of the model (`ModelShape.not_computed`), then
    `zero3_setting_warnings`, for a run of ``world`` ranks of the experiment ``raw`` on the model
    at ``model_path`` (its config.json, `find_model_config`): what the QAT stage prints."""
    mcfg = find_model_config(model_path)
    try:
        shape = ModelShape.from_config(mcfg, f"{model_path}: config.json")
    except PlanError as e:  # the plan sizes jobs; it never stops a run it cannot size
        return [f"memory plan: not computed: the whole model ({e})"]
    run = Run(gpus=0, cpu_ranks=max(1, world))
    dtype = mcfg.get("torch_dtype") or mcfg.get("dtype")
    return not_computed_warnings(shape) + zero3_setting_warnings(shape, raw, ds, run, dtype)
