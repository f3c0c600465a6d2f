# Export: the QAT checkpoint -> a deployable compressed-tensors checkpoint (vLLM / SGLang /
# transformers), by compression.QAT.save_format; the PTQ model too (export-ptq, for the engine).


rule convert_export:
    """Rebuild the QAT model (trained scales; weights streamed one decoder layer at a time, the
    script's default as qatlib.plan.streamed says), convert and export it shard by shard.
    """
    input:
        qat=rules.zero3_qat.output.qat,
        code=code("export.py"),
    output:
        export=directory(f"{RESULTS}/{{exp}}/export"),
        timing=f"{RESULTS}/{{exp}}/timings/convert_export.json",
    log:
        f"{RESULTS}/{{exp}}/logs/convert_export.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("convert_export"),
        runtime=runtime("convert_export"),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, "convert_export"),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(wc.exp, "convert_export"),
    shell:
        "python {input.code[0]} -c {params.yaml} --model-path {input.qat}"
        " --save-path {output.export} {params.sets} --threads {threads}"
        " --timing {output.timing} 2>&1 | tee {log}"


rule export_ptq:
    """The PTQ model exported the same way (base model + the PTQ checkpoint's scales): what plain
    PTQ would deploy, served by vLLM's engine beside the QAT export (rule serve_evaluate,
    eval/served_ptq.json) so that QAT's gain over PTQ is measured as served.
    """
    input:
        unpack(lambda wc: base_inputs(wc.exp)),
        ptq=rules.ptq_calibrate.output.ptq,
        code=code("export.py"),
    output:
        export=directory(f"{RESULTS}/{{exp}}/export-ptq"),
        timing=f"{RESULTS}/{{exp}}/timings/export_ptq.json",
    log:
        f"{RESULTS}/{{exp}}/logs/export_ptq.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("convert_export"),
        runtime=runtime("convert_export"),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, "convert_export"),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(wc.exp, "convert_export"),
        model=lambda wc: EXPERIMENTS.model_path(wc.exp),
    shell:
        "python {input.code[0]} -c {params.yaml} --model-path {params.model} --scales {input.ptq}"
        " --save-path {output.export} {params.sets} --threads {threads}"
        " --timing {output.timing} 2>&1 | tee {log}"
