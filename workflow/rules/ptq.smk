# PTQ: calibrate every scale of the experiment's format on the base model -> the checkpoint QAT
# warm-starts from (quant_scheme.json + scales.safetensors, docs/design.md).


rule ptq_calibrate:
    """Round-to-nearest PTQ: weight scales from the weights, static activation scales from
    calibration batches of the experiment's dataset (single process). The script streams one
    decoder layer at a time where qatlib.plan.streamed says so (its default, no flag).
    """
    input:
        unpack(lambda wc: base_inputs(wc.exp)),
        unpack(lambda wc: data_inputs(wc.exp)),
        code=code("ptq.py"),
    output:
        ptq=directory(f"{RESULTS}/{{exp}}/ptq"),
        timing=f"{RESULTS}/{{exp}}/timings/ptq_calibrate.json",
    log:
        f"{RESULTS}/{{exp}}/logs/ptq_calibrate.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["threads"]
    resources:
        mem_mb=mem_mb("ptq_calibrate"),
        runtime=runtime("ptq_calibrate"),
        gpu=gpus(1),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, "ptq_calibrate"),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        model=lambda wc: EXPERIMENTS.model_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(
            wc.exp, "ptq_calibrate", "dataset.data_path", "compression.QAT.hf_dataset"
        ),
        progress=progress_flag(),
    shell:
        "python {input.code[0]} -c {params.yaml} --model-path {params.model}"
        " --save-path {output.ptq} {params.sets} --threads {threads} {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"
