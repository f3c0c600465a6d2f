"""The config reference (docs/reference/config.md): every key of the experiment schema, one row each.

The keys, types, defaults and allowed values come from `qatlib.config.config_json_schema` (the
schema Snakemake validates against); the origin is `QATLIB_KEYS`, and the one line of meaning is
the field's own ``description`` in the schema (pydantic ``Field(description=...)``) where it has
one, else `MEANING` here. A schema key without a meaning is an error (`rows`), and a meaning for a
key the schema lacks is one too: the table cannot drift from the schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Keys qatlib adds to the upstream AngelSlim layout; every other key is upstream's (read by
# upstream's config parser, or a feature key `qatlib.config.upstream` refuses unless it is off).
QATLIB_KEYS = frozenset(
    {
        "compression.quantization.strict_ignore_layers",
        "compression.QAT.block_wise_config.loss",
        "compression.QAT.plugin_config.quant_config.compile_fake_quant",
        "compression.QAT.plugin_config.quant_config.scale_update",
        "compression.QAT.plugin_config.quant_config.e8m0_scale_lr",
        "compression.QAT.plugin_config.quant_config.weight_lr",
        "compression.QAT.plugin_config.quant_config.weight_update",
        "compression.QAT.plugin_config.quant_config.frozen_codes",
        "global.collective_timeout_s",
        "deploy.int8_gemm",
        "evaluation",
        "evaluation.ppl",
        "evaluation.tasks",
        "evaluation.max_seq_length",
        "evaluation.batch_size",
        "evaluation.num_fewshot",
        "evaluation.limit",
        "deploy",
        "deploy.target",
        "deploy.capability",
    }
)

_QC = "compression.QAT.plugin_config.quant_config"
_TENSOR = {  # quant_config.weight / activation: per-field overrides of the preset
    "qtype": "the element format (int2..int8, fp8, nvfp4, mxfp4); absent: the preset's",
    "granularity": "one scale per tensor / channel / group / token / head; absent: the preset's",
    "group_size": "elements per scale for per-group; `-1`: no groups",
    "is_sym": "symmetric (no zero point); upstream's spelling of `QuantSpec.symmetric`",
    "dynamic": "scales computed at run time from each input instead of trained",
    "mantissa_rounding": "FOCUS FP4 rounding: `even` / `nearest` honoured (ties to even), `floor` refused",
    "use_subgroup_scale": "FOCUS FP4 learned sub-group scales: refused when true (no such scale in qatlib)",
    "num_sub": "FOCUS FP4 sub-groups per group; read only with `use_subgroup_scale`",
}
_OUTPUT = {  # quant_config.q / k / v: quantization of a projection's output (inside attention)
    "qtype": "the element format; required (there is no preset to override)",
    "granularity": "one scale per tensor / head / ...",
    "group_size": "elements per scale for per-group; `-1`: no groups",
    "is_sym": "symmetric (no zero point)",
    "dynamic": "scales computed at run time instead of trained",
}

MEANING: dict[str, str] = {
    # ------------------------------------------------------------------ model
    "model": "what to load and how (arguments of `from_pretrained`)",
    "model.name": "a label; not read",
    "model.model_path": "local folder or hub id of the base model",
    "model.trust_remote_code": "allow the model's own Python code (hub models with custom classes)",
    "model.torch_dtype": "the dtype the model is loaded in (`auto`: the checkpoint's)",
    "model.device_map": "`from_pretrained`'s placement; `None` under ZeRO-3 (DeepSpeed places the shards)",
    "model.low_cpu_mem_usage": "`from_pretrained`'s low-memory load",
    "model.use_cache": "the KV cache during training forwards (off for QAT)",
    "model.attn_implementation": "attention kernel (`eager`, `sdpa`, ...); `fp8_attn` needs `eager`",
    "model.cache_dir": "hub download cache for `from_pretrained`",
    # ------------------------------------------------------------------ compression
    "compression": "the pipeline (`name`), the format (`quantization`) and the training (`QAT`)",
    "compression.name": "`QAT` or `PTQ`; one YAML drives both stages either way",
    "compression.quant_analyse": "upstream's quantization-analysis report: refused when true",
    "compression.quantization": "the named format and which layers it leaves alone",
    "compression.quantization.name": "the format preset, or an upstream algorithm name (`int4_gptq` = "
    "int4_weight_only by GPTQ, `int8_dynamic` = `int8`)",
    "compression.quantization.bits": "integer bits when no `name` is given; ignored with a `name`",
    "compression.quantization.quant_method": "granularities applied on top of the preset",
    "compression.quantization.quant_method.weight": "weight granularity (`per-block`: only the FP4 formats')",
    "compression.quantization.quant_method.activation": "activation granularity",
    "compression.quantization.quant_method.group_size": "elements per weight scale (where upstream's configs "
    "put it)",
    "compression.quantization.quant_method.zero_point": "true: asymmetric weights with a zero point; absent: "
    "the preset's symmetry",
    "compression.quantization.quant_method.mse_range": "AWQ's MSE clipping-range search: refused when true",
    "compression.quantization.group_size": "elements per weight scale (per-group weights only)",
    "compression.quantization.ignore_layers": "layers left unquantized: dotted suffixes or `re:` patterns "
    "(`gate` never matches `gate_proj`)",
    "compression.quantization.strict_ignore_layers": "an `ignore_layers` entry matching no module is an "
    "error instead of a warning",
    "compression.quantization.save_name": "the export's checkpoint format; only `compressed-tensors`",
    "compression.quantization.low_memory": "layer-by-layer PTQ (GPTQ is; refused for static RTN)",
    "compression.quantization.quant_helpers": "`[smooth]`: SmoothQuant before PTQ (each norm's per-channel "
    "activation range moved into the linears that read it; the smoothed weights saved with the PTQ checkpoint, "
    "`qatlib.quant.smoothing`); upstream's only helper",
    "compression.quantization.smooth_alpha": "SmoothQuant's migration strength in [0, 1]: "
    "each channel's factor is (activation max)^alpha / (weight column max)^(1 - alpha) (with `quant_helpers: [smooth]`)",
    "compression.quantization.cpu_convert": "conversion on the CPU: refused when true",
    "compression.quantization.modules_to_quantize": "quantizing by module type: refused unless `[]`",
    "compression.quantization.quant_analyse": "the quantization-analysis report: refused when true",
    "compression.quantization.quant_vit": "vision-tower quantization: refused when true",
    "compression.quantization.quant_talker": "Qwen3-Omni talker quantization: refused when true",
    # ------------------------------------------------------------------ compression.QAT
    "compression.QAT": "training mode, losses, data, Trainer arguments, the learnable-scale plugin",
    "compression.QAT.training_mode": "`end2end` (HF Trainer, ZeRO-3 capable), `blockwise` (one process) or "
    "`two_phase` (blockwise, then end2end from its result, one process; with `frozen_codes` the "
    "scales train on its codes: EfficientQAT's recipe)",
    "compression.QAT.dist_mode": "the distributed backend; only `hf` (HF Trainer + DeepSpeed)",
    "compression.QAT.do_train": "false: no training steps (prepare, load and save only)",
    "compression.QAT.save_format": "what the QAT save writes: `fake`, `real`, `save_kvcache_only`, "
    "`real_and_kvcache`",
    "compression.QAT.resume_ckpt_dir": "a Trainer checkpoint to resume from (same number of ranks)",
    "compression.QAT.from_ptq_ckpt": "the PTQ checkpoint whose scales start QAT; required under ZeRO-3",
    "compression.QAT.hf_dataset": "a hub dataset id; overrides `dataset.data_path`",
    "compression.QAT.hf_cache_dir": "cache folder for `hf_dataset`",
    "compression.QAT.loss_type": "the objective: `origin` = next-token loss only, the others add a "
    "distillation term to the unquantized model",
    "compression.QAT.loss_topk": "K of the top-k losses when not written inline",
    "compression.QAT.kd_temperature": "softmax temperature of `kd`",
    "compression.QAT.kd_alpha": "mix of `kd`'s distillation and hard-label terms",
    "compression.QAT.lm_loss_weight": "weight of the next-token cross-entropy",
    "compression.QAT.kd_loss_weight": "weight of the distillation term (> 0 with a KD `loss_type`)",
    "compression.QAT.hf_args": "`Seq2SeqTrainingArguments` keys; `deepspeed` names the ZeRO-3 JSON; "
    "`warmup_ratio` becomes the ratio form of `warmup_steps`",
    "compression.QAT.block_wise_config": "per-decoder-block training (one process)",
    "compression.QAT.block_wise_config.epochs": "passes over the block's samples",
    "compression.QAT.block_wise_config.batch_size": "samples per block step",
    "compression.QAT.block_wise_config.train_size": "calibration samples each block trains on",
    "compression.QAT.block_wise_config.val_size": "held-out samples per block",
    "compression.QAT.block_wise_config.training_seqlen": "tokens per sample",
    "compression.QAT.block_wise_config.quant_lr": "learning rate of the scales",
    "compression.QAT.block_wise_config.weight_lr": "learning rate of the block's weights",
    "compression.QAT.block_wise_config.min_lr_factor": "the cosine schedule ends at lr / this",
    "compression.QAT.block_wise_config.wd": "weight decay",
    "compression.QAT.block_wise_config.loss": "the block loss: `mse` (upstream's) or `token_relative` "
    "(each token's squared error over its squared norm)",
    "compression.QAT.plugin_config": "the learnable-scale plugin",
    "compression.QAT.plugin_config.enable_scale": "the learnable-scale plugin on",
    "compression.QAT.plugin_config.enable_rotation": "the learnable-rotation plugin: refused when true",
    f"{_QC}": "which quantizers exist, which parameters train, and how",
    f"{_QC}.use_weight_quant": "quantize the weights",
    f"{_QC}.use_activation_quant": "quantize the linear inputs",
    f"{_QC}.use_qkv_quant": "false: q / k / v quantizers off; absent: on where `q` / `k` / `v` are set",
    f"{_QC}.lazy_init_samples": "batches that initialise scales the PTQ checkpoint does not hold",
    f"{_QC}.weight_scale_init_value": "a weight scale's start where no PTQ scale exists",
    f"{_QC}.activation_scale_init_value": "an input scale's start where no PTQ scale exists",
    f"{_QC}.learnable": "which parameter groups train (the model's weights never do, unless `weight_lr`)",
    f"{_QC}.learnable.act_scale": "train the static input scales",
    f"{_QC}.learnable.weight_scale": "train the weight scales (and zero points)",
    f"{_QC}.learnable.kv_scale": "train the k / v (KV cache) scales",
    f"{_QC}.learnable.norm": "train the RMSNorm weights (the KD teacher is then a second, original copy)",
    f"{_QC}.learnable.lwc": "train the LWC clip factors (needs `lwc.enable_lwc`)",
    f"{_QC}.learnable.quant_max_scale_lr": "FOCUS's sub-group-scale lr; accepted and unused (no sub-group "
    "scales)",
    f"{_QC}.lwc": "learnable weight clipping",
    f"{_QC}.lwc.enable_lwc": "create the clip factors",
    f"{_QC}.lwc.lwc_init_value": "the clip factors' start (pre-sigmoid)",
    f"{_QC}.lwc.lwc_lr": "learning rate of the clip factors",
    f"{_QC}.weight": "per-field overrides of the preset's weight format",
    f"{_QC}.activation": "per-field overrides of the preset's input format",
    **{f"{_QC}.{role}.{k}": v for role in ("weight", "activation") for k, v in _TENSOR.items()},
    f"{_QC}.fp8_attn": "fp8 attention (needs `model.attn_implementation: eager`)",
    f"{_QC}.compile_fake_quant": "`torch.compile` the fake-quant ops (FP8 formats gain on CPU; needs a C++ "
    "compiler)",
    f"{_QC}.scale_update": "`additive` (AdamW on the scale, upstream's) or `log` (AdamW on log(scale): "
    "a relative step, no scale reaches 0); absent: `additive`, `log` for FP4 weights",
    f"{_QC}.e8m0_scale_lr": "lr of MXFP4's power-of-two scales; absent: 5 x `learning_rate` under `log`",
    f"{_QC}.weight_lr": "the quantized linears' weights train too, at this lr (teacher: a second copy)",
    f"{_QC}.weight_update": "`weight_lr` as an absolute step, or `relative`: in units of each weight tensor's size",
    f"{_QC}.frozen_codes": "train the scales on the start's codes (integer, FP8, FP4) held fixed (EfficientQAT's E2E-QP)",
    f"{_QC}.q": "quantize the queries inside attention (after `q_norm` and RoPE)",
    f"{_QC}.k": "quantize the keys as the KV cache holds them (after `k_norm` and RoPE)",
    f"{_QC}.v": "quantize the values as the KV cache holds them",
    **{f"{_QC}.{role}.{k}": v for role in ("q", "k", "v") for k, v in _OUTPUT.items()},
    # ------------------------------------------------------------------ the rest
    "dataset": "training and calibration data",
    "dataset.name": "a label of the dataset kind; not read",
    "dataset.data_path": "JSONL (messages / conversations / input-output), parquet or text file",
    "dataset.max_seq_length": "tokens per training sample",
    "dataset.num_samples": "training samples read (at least one per rank)",
    "dataset.batch_size": "samples per batch of the data loader",
    "dataset.is_sft_data": "false: supervise every token; true or absent: the last assistant reply only",
    "global": "where results go and the seed",
    "global.save_path": "the QAT output folder (the workflow sets its own)",
    "global.seed": "the seed of the whole run",
    "global.collective_timeout_s": "every collective waits at most this long; a dead or hung rank ends the job",
    "evaluation": "what the report measures after training",
    "evaluation.ppl": "perplexity sets: `wikitext2`, `c4` or local text files",
    "evaluation.tasks": "lm-eval task names or local task folders",
    "evaluation.max_seq_length": "tokens per evaluation window",
    "evaluation.batch_size": "windows per forward",
    "evaluation.num_fewshot": "lm-eval few-shot examples",
    "evaluation.limit": "at most this many items per task (absent: all)",
    "deploy": "the runtime the export is for",
    "deploy.target": "`vllm`, `sglang` or `none`: a format the runtime cannot load is a config error, and "
    "the scales it merges train tied",
    "deploy.capability": "the GPU compute capability it will run on (`9.0`); absent: not checked",
    "transform": "SpinQuant / Hadamard rotations: refused unless empty",
}


@dataclass(frozen=True)
class Row:
    """One key of the reference table."""

    key: str
    type: str
    default: str
    allowed: str
    origin: str
    meaning: str


def _code(v: Any) -> str:
    return f"`{json.dumps(v)}`"


def _branches(prop: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(prop.get("anyOf", [prop]))


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if ref else node


def _code_allowed() -> dict[str, str]:
    """Allowed values the schema leaves as a plain string, read from the code that checks them."""
    from qatlib.config.upstream import ALGORITHMS
    from qatlib.losses import PLAIN_LOSSES, TOPK_LOSSES
    from qatlib.quant.spec import PRESETS

    return {
        "compression.quantization.name": ", ".join(f"`{n}`" for n in [*PRESETS, *ALGORITHMS]),
        "compression.QAT.loss_type": ", ".join(
            [*(f"`{n}`" for n in PLAIN_LOSSES), *(f"`{n}[_K]`" for n in TOPK_LOSSES)]
        ),
    }


def _type(prop: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    names = []
    for b in _branches(prop):
        b = _resolve(b, defs)
        t = b.get("type")
        if "properties" in b:
            names.append("section")
        elif t == "array":
            names.append(f"list[{b.get('items', {}).get('type', 'any')}]")
        elif t == "object":
            names.append("mapping")
        elif t:
            names.append(t)
    return " or ".join(names) or "any"


def _allowed(prop: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    out = []
    for b in map(lambda b: _resolve(b, defs), _branches(prop)):
        if "enum" in b:
            out.append(", ".join(f"`{v}`" for v in b["enum"]))
        if "const" in b:
            out.append(f"`{b['const']}`")
        bounds = [
            f"{op} {b[k]}"
            for k, op in (
                ("minimum", "≥"),
                ("exclusiveMinimum", ">"),
                ("maximum", "≤"),
                ("exclusiveMaximum", "<"),
            )
            if k in b
        ]
        if bounds:
            out.append(", ".join(bounds))
        if "pattern" in b:  # an alternation would split a markdown table (`_code_allowed` lists those)
            out.append("a pattern" if "|" in b["pattern"] else f"matches `{b['pattern']}`")
        if b.get("items", {}).get("minLength"):
            out.append("non-empty strings")
        names = b.get("propertyNames", {}).get("enum")
        if names:
            out.append(f"{len(names)} Trainer argument names (below)")
    return "; ".join(out)


def _default(prop: Mapping[str, Any], required: bool, type_: str) -> str:
    if "default" in prop:
        return _code(prop["default"])
    if required:
        return "required"
    if "list[" in type_:
        return "`[]`"
    if "mapping" in type_:
        return "`{}`"
    return "(its keys')"


def walk(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any], bool]]:
    """``(dotted key, property schema, required)`` for every key of ``schema``, depth first in
    schema order (a section before its keys)."""
    defs = schema.get("$defs", {})

    def rec(node: Mapping[str, Any], prefix: str):
        required = set(node.get("required", ()))
        for name, prop in node.get("properties", {}).items():
            key = f"{prefix}{name}"
            yield key, prop, name in required
            for b in _branches(prop):
                b = _resolve(b, defs)
                if "properties" in b:
                    yield from rec(b, f"{key}.")

    yield from rec(schema, "")


def schema_keys(schema: Mapping[str, Any]) -> list[str]:
    return [k for k, _, _ in walk(schema)]


def rows(schema: Mapping[str, Any]) -> list[Row]:
    """The table rows; raises KeyError naming every schema key without a `MEANING` and every
    meaning whose key the schema lacks."""
    described = {k: prop["description"] for k, prop, _ in walk(schema) if prop.get("description")}
    keys = schema_keys(schema)
    missing = [k for k in keys if k not in MEANING and k not in described]
    stale = sorted(set(MEANING) - set(keys))
    if missing or stale:
        raise KeyError(
            "qatlib/site/config_reference.py MEANING is out of step with the schema: "
            + (f"no meaning for {', '.join(missing)}" if missing else "")
            + ("; " if missing and stale else "")
            + (f"keys the schema lacks: {', '.join(stale)}" if stale else "")
        )
    defs = schema.get("$defs", {})
    from_code = _code_allowed()
    out = []
    for key, prop, required in walk(schema):
        t = _type(prop, defs)
        origin = "qatlib" if key in QATLIB_KEYS else "upstream"
        allowed = from_code.get(key) or _allowed(prop, defs)
        meaning = " ".join(described[key].split()) if key in described else MEANING[key]
        out.append(Row(key, t, _default(prop, required, t), allowed, origin, meaning))
    return out


def trainer_argument_names(schema: Mapping[str, Any]) -> list[str]:
    hf = schema["$defs"]["QATConfig"]["properties"]["hf_args"]
    for b in _branches(hf):
        names = b.get("propertyNames", {}).get("enum")
        if names:
            return list(names)
    return []


def _cell(text: str) -> str:
    if "|" in text:
        raise ValueError(f"a table cell cannot hold '|': {text!r}")
    return text or " "


def render(schema: Mapping[str, Any]) -> str:
    """The generated block of docs/reference/config.md: one table per top-level section."""
    table = rows(schema)
    sections: dict[str, list[Row]] = {}
    for r in table:
        sections.setdefault(r.key.split(".", 1)[0], []).append(r)
    lines = []
    for top, rs in sections.items():
        lines += [
            f"### `{top}`",
            "",
            "| key | type | default | allowed | origin | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for r in rs:
            cells = [f"`{r.key}`", r.type, r.default, r.allowed, r.origin, r.meaning]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    names = trainer_argument_names(schema)
    lines += [
        f'??? note "The {len(names)} names `compression.QAT.hf_args` accepts"',
        "",
        "    " + ", ".join(f"`{n}`" for n in names),
        "",
    ]
    return "\n".join(lines).rstrip("\n")


def page_keys(text: str) -> list[str]:
    """The keys a rendered page names in its tables' first column."""
    out = []
    for line in text.splitlines():
        if line.startswith("| `"):
            out.append(line[3:].split("`", 1)[0])
    return out
