# Evaluation of five variants, each its own job (with more cores than QAT takes, bf16 and ptq
# run while QAT trains):
#   bf16    the base model as it is (the experiment's dtype; "bf16" = unquantized)
#   ptq     base model + PTQ scales, fake-quantized in memory
#   qat     the QAT checkpoint (weights + trained scales), fake-quantized in memory
#   export  the exported compressed-tensors checkpoint, reloaded from disk with
#           AutoModelForCausalLM.from_pretrained (transformers + compressed-tensors)
#   deployed  the export as deploy.target (vLLM / SGLang) computes it: qatlib.runtime.emulate
#           applies the runtime's load-time transformations; deploy.target none writes a
#           {"skipped": reason} result the report shows
#   served  (rule serve_evaluate) the export in vLLM's own engine -> eval/served.json, and the
#           PTQ model's export (rule export_ptq) there too -> eval/served_ptq.json
# Perplexity on evaluation.ppl and accuracy on evaluation.tasks (lm-eval) -> eval/<variant>.json.


rule evaluate:
    """Perplexity and task accuracy of one variant."""
    input:
        unpack(variant_inputs),
        sources=lambda wc: EXPERIMENTS.eval_inputs(wc.exp),
        code=code("evaluate.py"),
    output:
        result=f"{RESULTS}/{{exp}}/eval/{{variant}}.json",
        timing=f"{RESULTS}/{{exp}}/timings/evaluate-{{variant}}.json",
    log:
        f"{RESULTS}/{{exp}}/logs/evaluate-{{variant}}.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("evaluate"),
        runtime=runtime("evaluate"),
        gpu=gpus(1),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, eval_stage(wc.variant)),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        args=variant_args,
        sets=lambda wc: EXPERIMENTS.cli_sets(
            wc.exp, eval_stage(wc.variant), "evaluation.ppl", "evaluation.tasks"
        ),
        hf_home=f"{RESULTS}/.hf_home",
        progress=progress_flag(),
    shell:
        "python {input.code[0]} -c {params.yaml} --variant {wildcards.variant} {params.args}"
        " --out {output.result} {params.sets} --hf-home {params.hf_home} --threads {threads}"
        " {params.progress} --timing {output.timing} 2>&1 | tee {log}"


rule sqnr:
    """Per-layer weight SQNR (dB) of the weight PTQ deploys and of the weight QAT deploys, both
    against the base model's weights (qatlib.analysis.checkpoint_sqnr); a hub-id base model is not
    read (no download): the QAT checkpoint's weights stand in, and the CSV's notes say so.
    """
    input:
        ptq=rules.ptq_calibrate.output.ptq,
        qat=rules.zero3_qat.output.qat,
        code=code("sqnr.py"),
    output:
        csv=report(
            f"{RESULTS}/{{exp}}/analysis/sqnr.csv",
            caption="../report/sqnr.rst",
            category="Analysis",
            subcategory="{exp}",
        ),
        timing=f"{RESULTS}/{{exp}}/timings/sqnr.json",
    log:
        f"{RESULTS}/{{exp}}/logs/sqnr.log",
    conda:
        "../envs/qatlib.yaml"
    resources:
        mem_mb=mem_mb("analyze"),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, "sqnr"),
        base=lambda wc: (
            f"--base-weights {b}" if (b := EXPERIMENTS.base_weights(wc.exp)) else ""
        ),
    shell:
        "python {input.code[0]} --ptq-ckpt {input.ptq} --qat-ckpt {input.qat} {params.base} --out {output.csv}"
        " --timing {output.timing} 2>&1 | tee {log}"


rule serve_evaluate:
    """Perplexity of an export as vLLM's own engine serves it (qatlib.serve, in the serving
    environment .venv-serve made by install.sh), on the evaluate stage's windows: eval/served.json
    the QAT export, eval/served_ptq.json the PTQ one (QAT's gain as served). A format the engine
    refuses on this machine, or serve: false / QATLIB_NO_SERVE=1, is a skipped record with the
    reason (the DAG goes on); a missing serving environment fails the job.
    """
    input:
        model=lambda wc: f"{RESULTS}/{wc.exp}/{SERVED_EXPORTS[wc.served]}",
        sources=lambda wc: EXPERIMENTS.eval_inputs(wc.exp),
        code=code("serve_evaluate.py"),
    output:
        result=f"{RESULTS}/{{exp}}/eval/{{served}}.json",
        timing=f"{RESULTS}/{{exp}}/timings/evaluate-{{served}}.json",
    log:
        f"{RESULTS}/{{exp}}/logs/evaluate-{{served}}.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("serve_evaluate"),
        runtime=30,
    params:
        config=lambda wc: EXPERIMENTS.stage_config(
            wc.exp, "evaluate", serve=config["serve"]
        ),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(wc.exp, "evaluate", "evaluation.ppl"),
        serve="" if config["serve"] else "--no-serve",
        hf_home=f"{RESULTS}/.hf_home",
        progress=progress_flag(),
    shell:
        "python {input.code[0]} -c {params.yaml} --export {input.model} --variant {wildcards.served}"
        " --out {output.result} {params.sets} {params.serve} --hf-home {params.hf_home}"
        " --threads {threads} {params.progress} --timing {output.timing} 2>&1 | tee {log}"
