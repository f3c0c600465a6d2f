# Helpers shared by the rules: experiment loading, per-stage parameters, inputs, code dependencies.
#
# Re-run policy (what makes Snakemake re-run a stage):
# - the experiment YAML is NOT an input (its mtime would re-run every stage on any edit); each
#   rule's `params.config` holds the JSON of just the config sections the stage reads, so a change
#   re-runs that stage (Snakemake's params trigger) and, through the new outputs, what follows;
# - the stage's script, scripts/_common.py and the qatlib sources it runs ARE inputs: a code
#   change re-runs the stages that execute it;
# - data and checkpoints flow as inputs / outputs as usual.

import json
import re
import shlex
import time
from functools import cache

import yaml
from snakemake.exceptions import WorkflowError

RESULTS = config["results"]
EXP = config["experiment"]
VARIANTS = config["variants"]
STARTED_AT = time.time()

# Paths an experiment YAML may point at workflow products with: `results/...` is rewritten to
# the configured results folder (config["results"]).
PRODUCT_PREFIX = "results/"
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".md", ".rst")
HUB_PPL_SETS = ("wikitext2", "c4")
# absolute: snakemake.utils.validate resolves a relative schema against the including file
EXPERIMENT_SCHEMA = os.path.join(
    workflow.basedir, "workflow/schemas/experiment.schema.json"
)


wildcard_constraints:
    exp=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    name=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    task=r"[A-Za-z0-9_]+",
    variant="|".join(re.escape(v) for v in VARIANTS),


def repo_path(p):
    """A path from a config file: absolute, or relative to the repository root."""
    p = Path(os.path.expanduser(str(p)))
    return p if p.is_absolute() else REPO / p


def exp_dir(exp):
    return f"{RESULTS}/{exp}"


def report_html(exp):
    return f"{RESULTS}/{exp}/report.html"


# ----------------------------------------------------------------------------- experiment YAMLs
class _YamlLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, plus `1e-4` read as a float (YAML 1.2; upstream configs write it).

    The same reading as `qatlib.config.load_yaml`, without importing qatlib (and torch) while
    Snakemake builds the DAG; tests/test_workflow.py checks that the two agree.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)


def yaml_leaves(d):
    """String leaves read as YAML values, like the scripts' --set (`snakemake --config
    'overrides={...}'` hands every nested value over as a string)."""
    if isinstance(d, dict):
        return {k: yaml_leaves(v) for k, v in d.items()}
    if isinstance(d, list):
        return [yaml_leaves(v) for v in d]
    if isinstance(d, str):
        try:
            return yaml.load(d, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError:
            return d
    return d


OVERRIDES = yaml_leaves(config.get("overrides") or {})


def deep_merge(base, extra):
    """`extra` merged into a copy of `base` (mappings recursively; anything else replaced)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def flatten(d, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1} (the dotted keys of the scripts' --set)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def experiment_yaml(exp):
    return repo_path(config["experiments_dir"]) / f"{exp}.yaml"


@cache
def experiment(exp):
    """The effective experiment config: the YAML, deep-merged with params.yaml's `overrides` (for
    the active experiment only), validated against the exported schema (keys and types; the
    cross-field rules run in every script, via qatlib.config.load_config)."""
    path = experiment_yaml(exp)
    if not path.is_file():
        known = sorted(
            p.stem for p in repo_path(config["experiments_dir"]).glob("*.yaml")
        )
        raise WorkflowError(
            f"experiment {exp!r}: {path} does not exist (experiments: {', '.join(known)})"
        )
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise WorkflowError(f"{path}: the top level must be a mapping of sections")
    if exp == EXP and OVERRIDES:
        raw = deep_merge(raw, OVERRIDES)
    try:
        validate(raw, EXPERIMENT_SCHEMA, set_default=False)
    except WorkflowError as e:
        raise WorkflowError(
            f"{path} (with params.yaml overrides {OVERRIDES or '{}'}): {e}"
        ) from None
    return raw


def section(raw, dotted):
    cur = raw
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


# What each stage reads from the experiment config: its `params.config`, hence what re-runs it.
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
    "sqnr": ["compression.quantization", "compression.QAT.plugin_config"],
    "report": [""],
}
# Keys inside those sections that only training reads (a sweep over them re-runs QAT, not PTQ).
TRAINING_ONLY = [
    "compression.QAT.plugin_config.quant_config.learnable",
    "compression.QAT.plugin_config.quant_config.lazy_init_samples",
    "compression.QAT.plugin_config.quant_config.lwc.lwc_lr",
]
STAGE_EXCLUDE = {
    stage: TRAINING_ONLY
    for stage in ("ptq_calibrate", "convert_export", "evaluate_quant", "sqnr")
}


def without(tree, prefix, exclude):
    """`tree` (the config value at dotted `prefix`) minus the dotted `exclude` paths in it."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else k
        if path not in exclude:
            out[k] = without(v, path, exclude)
    return out


def reads(stage, key):
    """Whether `stage` reads the dotted config `key` (its sections, minus exclusions)."""
    inside = any(
        not s or key == s or key.startswith(f"{s}.") for s in STAGE_SECTIONS[stage]
    )
    excluded = any(
        key == e or key.startswith(f"{e}.") for e in STAGE_EXCLUDE.get(stage, ())
    )
    return inside and not excluded


def stage_config(exp, stage, **extra):
    """JSON of the config sections `stage` reads (plus `extra`): the rule's `params.config`."""
    raw = experiment(exp)
    exclude = STAGE_EXCLUDE.get(stage, ())
    picked = {
        key or "all": without(raw if not key else section(raw, key), key, exclude)
        for key in STAGE_SECTIONS[stage]
    }
    picked.update(extra)
    return json.dumps(picked, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- paths in the YAML
def product(p):
    """`results/x` -> `<results>/x` (a workflow product), else None."""
    if isinstance(p, str) and p.startswith(PRODUCT_PREFIX):
        return f"{RESULTS}/{p[len(PRODUCT_PREFIX):]}".rstrip("/")
    return None


def local_file(p):
    """A repository-relative (or absolute) local path, if `p` names an existing path or a data file;
    None for what looks like a hub id (`Qwen/Qwen3-4B`, `wikitext2`)."""
    if not isinstance(p, str) or not p:
        return None
    q = repo_path(p)
    if (
        q.exists()
        or p.endswith(TEXT_SUFFIXES)
        or os.path.isabs(p)
        or p.startswith((".", "~"))
    ):
        return str(q)
    return None


def resolve(p):
    """Where the workflow finds `p`: a product path, a local path, or `p` itself (a hub id)."""
    return product(p) or local_file(p) or p


def as_input(p):
    """`p` as a Snakemake input (products and local paths), or None (hub ids)."""
    return product(p) or local_file(p)


def model_path(exp):
    return resolve(section(experiment(exp), "model.model_path"))


def data_path(exp):
    raw = experiment(exp)
    return section(raw, "compression.QAT.hf_dataset") or section(
        raw, "dataset.data_path"
    )


def eval_sources(exp):
    """(ppl sources, tasks) of `evaluation`, with local / product paths resolved."""
    ev = section(experiment(exp), "evaluation") or {}
    ppl = [p if p in HUB_PPL_SETS else resolve(p) for p in ev.get("ppl") or []]
    tasks = [resolve(t) for t in ev.get("tasks") or []]
    return ppl, tasks


def base_inputs(exp):
    """Inputs every model-reading stage shares: the base model (if local or a product)."""
    m = as_input(section(experiment(exp), "model.model_path"))
    return {"model": m} if m else {}


def data_inputs(exp):
    d = data_path(exp)
    d = as_input(d) if d else None
    return {"data": d} if d else {}


def eval_inputs(exp):
    ev = section(experiment(exp), "evaluation") or {}
    srcs = [p for p in (ev.get("ppl") or []) if p not in HUB_PPL_SETS] + list(
        ev.get("tasks") or []
    )
    return [x for x in (as_input(p) for p in srcs) if x]


def stage_overrides(exp, stage):
    """params.yaml's overrides (active experiment only) under the sections `stage` reads, as
    {dotted key: value}: a stage never sees (nor re-runs for) an override it does not read.
    """
    if exp != EXP:
        return {}
    return {k: v for k, v in flatten(OVERRIDES).items() if reads(stage, k)}


def cli_sets(exp, stage, *keys):
    """`--set key=value` arguments of a stage's script: its params.yaml overrides, and the YAML
    paths the workflow resolves (the DeepSpeed JSON and `keys`, dotted paths) where the resolved
    path differs from the YAML's."""
    raw = experiment(exp)
    sets = stage_overrides(exp, stage)
    # every script validates the whole config, so each gets the DeepSpeed JSON's path
    for key in ("compression.QAT.hf_args.deepspeed", *keys):
        v = section(raw, key)
        if key == "evaluation.ppl" or key == "evaluation.tasks":
            ppl, tasks = eval_sources(exp)
            new = ppl if key == "evaluation.ppl" else tasks
            if v and new != v:
                sets[key] = new
        elif key == "compression.QAT.hf_args.deepspeed":
            if isinstance(v, str) and repo_path(v).is_file() and str(repo_path(v)) != v:
                sets[key] = str(repo_path(v))
        elif isinstance(v, str) and resolve(v) != v:
            sets[key] = resolve(v)
    return " ".join(
        shlex.quote(f"--set={k}={json.dumps(v)}") for k, v in sorted(sets.items())
    )


# ----------------------------------------------------------------------------- code dependencies
# qatlib sources (files or folders, recursively) each stage executes: code changes re-run it.
STAGE_CODE = {
    "corpus": ["qatlib/corpus.py"],
    "local_task": ["qatlib/eval/tasks"],
    "base_model": [
        "qatlib/pretrain.py",
        "qatlib/tokenizer.py",
        "qatlib/eval/perplexity.py",
    ],
    "ptq_calibrate": [
        "qatlib/config.py",
        "qatlib/quant",
        "qatlib/moe.py",
        "qatlib/models.py",
        "qatlib/data.py",
        "qatlib/ptq.py",
        "qatlib/gptq.py",
    ],
    "zero3_qat": [
        "qatlib/config.py",
        "qatlib/quant",
        "qatlib/moe.py",
        "qatlib/models.py",
        "qatlib/data.py",
        "qatlib/losses.py",
        "qatlib/trainers",
        "qatlib/resume.py",
        "qatlib/zero3_io.py",
    ],
    "convert_export": [
        "qatlib/config.py",
        "qatlib/quant",
        "qatlib/moe.py",
        "qatlib/models.py",
        "qatlib/zero3_io.py",
        "qatlib/export.py",
        "qatlib/ptq.py",
    ],
    "evaluate": [
        "qatlib/config.py",
        "qatlib/quant",
        "qatlib/moe.py",
        "qatlib/models.py",
        "qatlib/zero3_io.py",
        "qatlib/eval",
    ],
    "sqnr": ["qatlib/analysis.py", "qatlib/quant"],
    "report": ["qatlib/report", "qatlib/analysis.py"],
}


@cache
def _py_files(entry):
    p = REPO / entry
    if p.is_dir():
        return sorted(
            str(f) for f in p.rglob("*") if f.suffix in (".py", ".html") and f.is_file()
        )
    return [str(p)]


def code(stage, script):
    """The stage's script, scripts/_common.py and the qatlib sources the stage runs."""
    files = [str(REPO / "scripts" / script), str(REPO / "scripts/_common.py")]
    for entry in STAGE_CODE[stage]:
        files += _py_files(entry)
    return files


# ----------------------------------------------------------------------------- resources
def mem_mb(stage):
    return config["mem_mb"].get(stage, 4000)


def gpus(n=1):
    """GPUs a job asks for: `n` GPUs when config["gpus"] is on, else none (CPU run)."""
    return n if config["gpus"] else 0


def progress_flag():
    return "" if config["progress"] else "--no-progress"


def announce_reports():
    """Say where the reports are: the last lines of a successful `snakemake`."""
    fresh = sorted(
        str(p)
        for p in Path(RESULTS).glob("*/report.html")
        if p.stat().st_mtime >= STARTED_AT
    )
    default = report_html(EXP)
    if not fresh and Path(default).is_file():
        fresh = [default]
    for html in fresh:
        print(f"\nReport: {html}  (self-contained HTML: open it in a browser)")


# ----------------------------------------------------------------------------- rule helpers
def local_task_spec(wildcards):
    tasks = config["local_tasks"]
    if wildcards.task not in tasks:
        raise WorkflowError(
            f"no local task {wildcards.task!r} in config local_tasks (has: {', '.join(tasks)})"
        )
    return json.dumps(tasks[wildcards.task], sort_keys=True)


def base_model_spec(wildcards):
    models = load_yaml(repo_path(config["base_models"]))
    if wildcards.name not in models:
        raise WorkflowError(
            f"no base model {wildcards.name!r} in {config['base_models']} (has: {', '.join(models)})"
        )
    return json.dumps(models[wildcards.name], sort_keys=True)


def deepspeed_json(wc):
    """The DeepSpeed config's content (part of params.config: editing the JSON re-runs QAT)."""
    ds = section(experiment(wc.exp), "compression.QAT.hf_args.deepspeed")
    if isinstance(ds, str) and repo_path(ds).is_file():
        return json.loads(repo_path(ds).read_text())
    return ds


def eval_stage(variant):
    """The config sections an evaluation reads: the scheme too for the in-memory fake-quant ones."""
    return "evaluate_quant" if variant in ("ptq", "qat") else "evaluate"


def variant_inputs(wc):
    """The model folder (`model`) and the scales (`scales`) a variant is evaluated from."""
    if wc.variant == "bf16":
        return base_inputs(wc.exp)
    if wc.variant == "ptq":
        return {**base_inputs(wc.exp), "scales": f"{RESULTS}/{wc.exp}/ptq"}
    if wc.variant == "qat":
        return {"model": f"{RESULTS}/{wc.exp}/qat", "scales": f"{RESULTS}/{wc.exp}/qat"}
    return {"model": f"{RESULTS}/{wc.exp}/export"}


def variant_args(wc, input):
    model = input.get("model") or model_path(wc.exp)
    scales = input.get("scales")
    return f"--model-path {shlex.quote(str(model))}" + (
        f" --scales {shlex.quote(str(scales))}" if scales else ""
    )


def report_inputs(wc):
    """Everything the report shows: evaluations, SQNR, both checkpoints, every stage's timing."""
    d = f"{RESULTS}/{wc.exp}"
    return {
        "evals": [f"{d}/eval/{v}.json" for v in VARIANTS],
        "sqnr": f"{d}/analysis/sqnr.csv",
        "ptq": f"{d}/ptq",
        "qat": f"{d}/qat",
        "timings": [
            f"{d}/timings/{s}.json"
            for s in ["ptq_calibrate", "zero3_qat", "convert_export", "sqnr"]
            + [f"evaluate-{v}" for v in VARIANTS]
        ],
        "shared_timings": shared_timings(wc.exp),
    }


def shared_timings(exp):
    """Timings of the shared stages the experiment uses (corpus, local tasks, its base model)."""
    raw = experiment(exp)
    paths = [data_path(exp), section(raw, "model.model_path")]
    paths += (section(raw, "evaluation.ppl") or []) + (
        section(raw, "evaluation.tasks") or []
    )
    products = [product(p) or "" for p in paths if isinstance(p, str)]
    out = []
    if any(p.startswith((f"{RESULTS}/corpus/", f"{RESULTS}/base/")) for p in products):
        out.append(f"{RESULTS}/timings/corpus.json")
    for p in products:
        if p.startswith(f"{RESULTS}/corpus/tasks/"):
            out.append(f"{RESULTS}/timings/local_task-{Path(p).name}.json")
        elif p.startswith(f"{RESULTS}/base/"):
            out.append(f"{RESULTS}/timings/base_model-{Path(p).name}.json")
    return out
