"""The experiment as the workflow reads it while Snakemake builds the DAG (no torch, no pydantic).

- the effective experiment: the YAML read by `qatlib.yamlio` (the reader `qatlib.config` uses),
  params.yaml's `overrides` applied as the scripts apply `--set`, checked against the exported
  JSON schema (keys and types; the cross-field rules run in every script, via `load_config`);
- which config sections each stage reads (`STAGE_SECTIONS`): a rule's `params.config` is the
  JSON of those sections, so an edit re-runs exactly the stages that read it (Snakemake's params
  trigger) and, through their new outputs, what follows; the experiment YAML itself is not an
  input (its mtime would re-run every stage on any edit);
- where the workflow finds a path the YAML names: a product (`results/...`, rewritten to the
  configured results folder), a local file, or a hub id;
- the `--set` arguments a stage's script gets: its overrides and the paths resolved here;
- each job's resources (`Experiments.resources`: mem_mb, runtime) from the memory plan
  (`qatlib.plan`, arithmetic on the model's config.json: no torch, no weights);
- whether a stage runs streamed, one decoder layer at a time (`Experiments.streamed`: what
  `qatlib.plan.streamed` says, which the scripts of ptq_calibrate and convert_export decide by
  themselves, with no flag; the stage the plan models).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from qatlib.yamlio import (
    ConfigError,
    apply_overrides,
    config_file_candidates,
    format_issues,
    join_path,
    load_yaml,
    section,
    yaml_value,
)

__all__ = [
    "HUB_PPL_SETS",
    "PLAN_MARGIN",
    "STAGE_EXCLUDE",
    "STAGE_SECTIONS",
    "TRAINING_ONLY",
    "ConfigError",
    "Experiments",
    "override_items",
    "reads",
    "schema_issues",
    "section",
    "stage_config",
    "zero3_enabled",
]

# What each stage reads from the experiment config: its `params.config`, hence what re-runs it
# ("" = everything).
STAGE_SECTIONS = {
    "ptq_calibrate": [
        "model",
        "compression.quantization",
        "compression.QAT.plugin_config",
        "dataset",
        "global.seed",
    ],
    "zero3_qat": ["model", "compression", "dataset", "global.seed"],
    "convert_export": [
        "model",
        "compression.quantization",
        "compression.QAT.plugin_config",
        "compression.QAT.save_format",
    ],
    "evaluate": ["model", "evaluation", "global.seed"],
    "evaluate_quant": [
        "model",
        "evaluation",
        "global.seed",
        "compression.quantization",
        "compression.QAT.plugin_config",
    ],
    "evaluate_deployed": ["model", "evaluation", "global.seed", "deploy"],
    "sqnr": ["compression.quantization", "compression.QAT.plugin_config"],
    "report": [""],
}
# Keys inside those sections that only training reads (a sweep over them re-runs QAT, not PTQ).
TRAINING_ONLY = [
    "compression.QAT.plugin_config.quant_config.learnable",
    "compression.QAT.plugin_config.quant_config.lazy_init_samples",
    "compression.QAT.plugin_config.quant_config.lwc.lwc_lr",
    "compression.QAT.plugin_config.quant_config.scale_update",
    "compression.QAT.plugin_config.quant_config.e8m0_scale_lr",
    "compression.QAT.plugin_config.quant_config.weight_lr",
]
STAGE_EXCLUDE = {
    stage: TRAINING_ONLY for stage in ("ptq_calibrate", "convert_export", "evaluate_quant", "sqnr")
}

# `results/x` in a YAML names a workflow product; these suffixes mark a local data file.
PRODUCT_PREFIX = "results/"
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".md", ".rst")
HUB_PPL_SETS = ("wikitext2", "c4")
DEEPSPEED_KEY = "compression.QAT.hf_args.deepspeed"
PTQ_CKPT_KEY = "compression.QAT.from_ptq_ckpt"
# Rules sized by the memory plan (rule -> plan stage), and the head-room on its host RAM figure.
PLANNED = {
    "ptq_calibrate": "ptq_calibrate",
    "zero3_qat": "zero3_qat",
    "convert_export": "convert_export",
    "evaluate": "evaluate",
}
PLAN_MARGIN = 1.25
MIN_MEM_MB = 2000  # no torch job runs in less (interpreter, torch, transformers, lm-eval imports)


def override_items(tree: Mapping[str, Any] | None, prefix: str = "") -> list[tuple[str, Any]]:
    """params.yaml's nested `overrides` as the scripts' ``--set`` pairs (dotted key, value); string
    leaves are read as YAML values, like ``--set`` does (``snakemake --config 'overrides={...}'``
    hands every nested value over as a string). Applied in order, they deep-merge the tree."""

    def leaf(v: Any) -> Any:
        if isinstance(v, list):
            return [leaf(x) for x in v]
        return yaml_value(v) if isinstance(v, str) else v

    out = []
    for k, v in (tree or {}).items():
        if isinstance(v, Mapping):  # an empty one merges nothing
            out += override_items(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", leaf(v)))
    return out


def schema_issues(raw: Any, schema: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(dotted path, message) of every schema violation of ``raw``, sorted by path."""
    import jsonschema
    from jsonschema.exceptions import best_match

    # best_match: inside an `anyOf` (an optional section) the branch that says what is wrong
    errors = [best_match([e]) for e in jsonschema.Draft202012Validator(schema).iter_errors(raw)]
    return sorted((join_path(e.absolute_path), e.message) for e in errors)


def reads(stage: str, key: str) -> bool:
    """Whether `stage` reads the dotted config `key` (its sections, minus exclusions)."""
    inside = any(not s or key == s or key.startswith(f"{s}.") for s in STAGE_SECTIONS[stage])
    excluded = any(key == e or key.startswith(f"{e}.") for e in STAGE_EXCLUDE.get(stage, ()))
    return inside and not excluded


def _without(tree: Any, prefix: str, exclude: list[str]) -> Any:
    """`tree` (the config value at dotted `prefix`) minus the dotted `exclude` paths in it."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else k
        if path not in exclude:
            out[k] = _without(v, path, exclude)
    return out


def stage_config(raw: dict[str, Any], stage: str, **extra: Any) -> str:
    """JSON of the config sections `stage` reads (plus `extra`): the rule's `params.config`."""
    exclude = STAGE_EXCLUDE.get(stage, [])
    picked = {
        key or "all": _without(raw if not key else section(raw, key), key, exclude)
        for key in STAGE_SECTIONS[stage]
    }
    picked.update(extra)
    return json.dumps(picked, sort_keys=True, default=str)


def zero3_enabled(ds_config: Any) -> bool:
    """ZeRO-3 is on iff the DeepSpeed config has ``zero_optimization.stage == 3`` (the rule of
    `qatlib.config.ExperimentConfig.zero3_enabled`)."""
    stage = section(ds_config, "zero_optimization.stage")
    return isinstance(stage, int) and not isinstance(stage, bool) and stage == 3


class Experiments:
    """The experiments of one workflow run: YAMLs under ``experiments_dir`` (relative to ``repo``,
    the repository root as seen from the working directory), products under ``results``, and
    params.yaml's ``overrides``, which apply to the ``active`` experiment only. A config problem
    raises ``error(message)`` (Snakemake's WorkflowError in the workflow; ConfigError here)."""

    def __init__(
        self,
        repo: Path,
        results: str,
        experiments_dir: str,
        active: str,
        overrides: Mapping[str, Any] | None,
        schema: str | os.PathLike[str],
        error: type[Exception] = ConfigError,
    ) -> None:
        self.repo, self.results, self.active, self.error = Path(repo), results, active, error
        self.experiments_dir = self.repo_path(experiments_dir)
        self.overrides = override_items(overrides)
        self.schema = json.loads(Path(schema).read_text(encoding="utf-8"))

    # ------------------------------------------------------------------ paths
    def repo_path(self, p: str | os.PathLike[str]) -> Path:
        """A path from a config file: absolute, or relative to the repository root."""
        q = Path(os.path.expanduser(str(p)))
        return q if q.is_absolute() else self.repo / q

    def product(self, p: Any) -> str | None:
        """`results/x` -> `<results>/x` (a workflow product), else None."""
        if isinstance(p, str) and p.startswith(PRODUCT_PREFIX):
            return f"{self.results}/{p[len(PRODUCT_PREFIX) :]}".rstrip("/")
        return None

    def local_file(self, p: Any) -> str | None:
        """A repository-relative (or absolute) local path, if `p` names an existing path or a data
        file; None for what looks like a hub id (`Qwen/Qwen3-4B`, `wikitext2`)."""
        if not isinstance(p, str) or not p:
            return None
        q = self.repo_path(p)
        if q.exists() or p.endswith(TEXT_SUFFIXES) or os.path.isabs(p) or p.startswith((".", "~")):
            return str(q)
        return None

    def resolve(self, p: Any) -> Any:
        """Where the workflow finds `p`: a product path, a local path, or `p` itself (a hub id)."""
        return self.product(p) or self.local_file(p) or p

    def as_input(self, p: Any) -> str | None:
        """`p` as a Snakemake input (products and local paths), or None (hub ids)."""
        return self.product(p) or self.local_file(p)

    # ------------------------------------------------------------------ the experiment
    def yaml_path(self, exp: str) -> Path:
        return self.experiments_dir / f"{exp}.yaml"

    def get(self, exp: str) -> dict[str, Any]:
        """The effective experiment config (raw dict): the YAML, with params.yaml's overrides when
        `exp` is the active experiment, validated against the schema."""
        try:
            return self._load(exp)
        except ConfigError as e:
            if self.error is ConfigError:
                raise
            raise self.error(str(e)) from None

    @cache  # noqa: B019 (one instance per workflow run)
    def _load(self, exp: str) -> dict[str, Any]:
        path = self.yaml_path(exp)
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in self.experiments_dir.glob("*.yaml")))
            raise ConfigError(f"experiment {exp!r}: {path} does not exist (experiments: {known})")
        raw = load_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        source = str(path)
        items = self.overrides if exp == self.active else []
        if items:
            source += " (with params.yaml overrides " + ", ".join(f"{k}={v!r}" for k, v in items) + ")"
            apply_overrides(raw, items, source)
        issues = schema_issues(raw, self.schema)
        if issues:
            raise ConfigError(format_issues(issues, source), issues)
        return raw

    def stage_config(self, exp: str, stage: str, **extra: Any) -> str:
        """The rule's `params.config` (`stage_config`) of `exp`."""
        return stage_config(self.get(exp), stage, **extra)

    def value(self, exp: str, dotted: str) -> Any:
        return section(self.get(exp), dotted)

    def model_path(self, exp: str) -> Any:
        return self.resolve(self.value(exp, "model.model_path"))

    def base_weights(self, exp: str) -> str | None:
        """The base model's folder where the workflow has it (a product or a local path; None for
        a hub id): what the SQNR of both variants is measured against."""
        return self.as_input(self.value(exp, "model.model_path"))

    def data_path(self, exp: str) -> Any:
        return self.value(exp, "compression.QAT.hf_dataset") or self.value(exp, "dataset.data_path")

    def eval_sources(self, exp: str) -> tuple[list[Any], list[Any]]:
        """(ppl sources, tasks) of `evaluation`, with local / product paths resolved."""
        ev = self.value(exp, "evaluation") or {}
        ppl = [p if p in HUB_PPL_SETS else self.resolve(p) for p in ev.get("ppl") or []]
        return ppl, [self.resolve(t) for t in ev.get("tasks") or []]

    def eval_inputs(self, exp: str) -> list[str]:
        """The local / product files of `evaluation` (ppl texts and task folders). An experiment
        with nothing to evaluate (upstream's YAMLs have no `evaluation`) is an error here, at DAG
        time, rather than in the evaluate jobs after PTQ and QAT have run."""
        ev = self.value(exp, "evaluation") or {}
        if not (ev.get("ppl") or ev.get("tasks")):
            raise self.error(
                f"{self.yaml_path(exp)}: evaluation: no ppl / tasks to evaluate (the report compares "
                "them across bf16 / ptq / qat / export / deployed); set evaluation.ppl or evaluation.tasks, e.g. "
                "through params.yaml's overrides"
            )
        srcs = [p for p in ev.get("ppl") or [] if p not in HUB_PPL_SETS] + list(ev.get("tasks") or [])
        return [x for x in map(self.as_input, srcs) if x]

    def products(self, exp: str) -> list[str]:
        """The workflow products (resolved paths) the experiment reads: data, model, evaluation."""
        ev = self.value(exp, "evaluation") or {}
        paths = [self.data_path(exp), self.value(exp, "model.model_path")]
        paths += list(ev.get("ppl") or []) + list(ev.get("tasks") or [])
        return [q for q in map(self.product, paths) if q]

    def deepspeed_file(self, exp: str) -> Path | None:
        """The DeepSpeed JSON `hf_args.deepspeed` names, found as `qatlib.config` finds it
        (`config_file_candidates`: the repository root standing in for the scripts' CWD, then the
        YAML's folder and those above it, where upstream's repository-relative paths land); None
        for an inline mapping or no DeepSpeed. A file found nowhere is an error at DAG time."""
        ds = self.value(exp, DEEPSPEED_KEY)
        if not isinstance(ds, str):
            return None
        tried = config_file_candidates(ds, self.repo, self.yaml_path(exp).parent)
        found = next((p for p in tried if p.is_file()), None)
        if found is None:
            raise self.error(
                f"{self.yaml_path(exp)}: {DEEPSPEED_KEY}: DeepSpeed config file {ds!r} not found "
                f"(looked in: {', '.join(map(str, tried))})"
            )
        return found

    def deepspeed(self, exp: str) -> Any:
        """The DeepSpeed config's content (a file's JSON), or the YAML's value as it is."""
        path = self.deepspeed_file(exp)
        return json.loads(path.read_text(encoding="utf-8")) if path else self.value(exp, DEEPSPEED_KEY)

    def distributed(self, exp: str) -> bool:
        """Whether QAT runs on several processes (torchrun): end-to-end under ZeRO-3; blockwise or
        two-phase training, or training without ZeRO-3, is one process."""
        mode = self.value(exp, "compression.QAT.training_mode") or "end2end"
        return mode == "end2end" and zero3_enabled(self.deepspeed(exp))

    # ------------------------------------------------------------------ script arguments
    def stage_overrides(self, exp: str, stage: str) -> dict[str, Any]:
        """params.yaml's overrides (active experiment only) under the sections `stage` reads: a
        stage never sees (nor re-runs for) an override it does not read."""
        if exp != self.active:
            return {}
        return {k: v for k, v in self.overrides if reads(stage, k)}

    def ptq_output(self, exp: str) -> str:
        """The ptq_calibrate rule's output: the DAG's PTQ checkpoint, which QAT warm-starts from."""
        return f"{self.results}/{exp}/ptq"

    @cache  # noqa: B019 (one instance per workflow run)
    def committed(self, exp: str) -> dict[str, Any]:
        """The experiment YAML as it is on disk (no overrides): what a script reads with `-c`."""
        raw = load_yaml(self.yaml_path(exp))
        return raw if isinstance(raw, dict) else {}

    def cli_sets(self, exp: str, stage: str, *keys: str) -> str:
        """`--set key=value` arguments of a stage's script: its params.yaml overrides, and where the
        workflow's value differs from the YAML on disk: the DeepSpeed JSON as found here,
        `from_ptq_ckpt` (always the DAG's own PTQ output: the YAML's may name a folder of another
        machine, or none) and `keys` (dotted paths: the effective value, products and local paths
        resolved; an override to null is passed as null, e.g. upstream's `hf_dataset` cleared)."""
        sets = self.stage_overrides(exp, stage)
        on_disk = self.committed(exp)
        # every script validates the whole config, so each gets the DeepSpeed JSON's path
        ds = self.deepspeed_file(exp)
        if ds is not None and str(ds) != section(on_disk, DEEPSPEED_KEY):
            sets[DEEPSPEED_KEY] = str(ds)
        # the QAT rule always warm-starts from the DAG's PTQ output (--from-ptq-ckpt); every script
        # sees that, also where the YAML has none (ZeRO-3 requires one at parse time)
        ptq = self.ptq_output(exp)
        if section(on_disk, PTQ_CKPT_KEY) != ptq:
            sets[PTQ_CKPT_KEY] = ptq
        for key in keys:
            v = self.value(exp, key)
            if key in ("evaluation.ppl", "evaluation.tasks"):
                ppl, tasks = self.eval_sources(exp)
                new = ppl if key == "evaluation.ppl" else tasks
            else:
                new = self.resolve(v) if isinstance(v, str) else v
            old = section(on_disk, key)
            if new != old and (new or old):  # an absent list stays absent
                sets[key] = new
        return " ".join(shlex.quote(f"--set={k}={json.dumps(v)}") for k, v in sorted(sets.items()))

    def streamed(self, exp: str, stage: str) -> bool:
        """Whether `stage` of `exp` runs streamed, one decoder layer at a time:
        `qatlib.plan.streamed` (its docstring says where and why not), the one owner the plan's
        terms follow too."""
        from qatlib.plan import streamed

        return streamed(self.get(exp), stage)

    # ------------------------------------------------------------------ resources (the memory plan)
    @cache  # noqa: B019 (one instance per workflow run)
    def plan(self, exp: str, gpus: int, nodes: int, cpu_ranks: int, threads: int, base_models: str) -> dict:
        """`qatlib.plan`'s stages of `exp` by name, for ``gpus`` GPUs per node (0: CPU ranks); {}
        when the model's config.json is not known at DAG time (a hub id without a copy under
        config/models/): then the rules keep config.yaml's ``mem_mb``."""
        from qatlib import plan as qp

        raw = self.get(exp)
        try:
            mcfg = qp.find_model_config(str(self.model_path(exp)), self.repo, base_models)
        except qp.PlanError:
            return {}
        try:
            shape = qp.ModelShape.from_config(mcfg, f"{self.value(exp, 'model.model_path')}: config.json")
            x = qp.from_experiment(raw, self.deepspeed(exp), mcfg.get("torch_dtype") or mcfg.get("dtype"))
        except qp.PlanError as e:
            raise self.error(str(e)) from None
        run = qp.Run(gpus=gpus, nodes=nodes, cpu_ranks=cpu_ranks, threads=threads)
        return {s.stage: s for s in qp.plan(shape, x, run)}

    def resources(self, exp: str, rule: str, config: Mapping[str, Any]) -> dict[str, int]:
        """``mem_mb`` (host RAM of a node, x `PLAN_MARGIN`) and ``runtime`` (minutes) of `rule`'s
        job from the plan; config.yaml's ``mem_mb`` (and no runtime) where there is no plan."""
        stage = PLANNED.get(rule)
        fixed = {"mem_mb": int(config["mem_mb"].get(rule, 4000))}
        if stage is None:
            return fixed
        qat = stage == "zero3_qat"
        gpus = int(config["gpus_per_node"]) if qat else int(config["gpus"])
        key = (exp, gpus, int(config["nodes"]) if qat else 1, int(config["ranks"]) if qat else 1)
        found = self.plan(*key, int(config["threads"]), str(config["base_models"]))
        if stage not in found:
            return fixed
        s = found[stage]
        return {"mem_mb": max(MIN_MEM_MB, int(s.host_peak * PLAN_MARGIN / 1e6) + 1), "runtime": s.runtime_min}
