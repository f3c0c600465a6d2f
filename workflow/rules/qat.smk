# ZeRO-3 QAT: `torchrun --standalone --nproc_per_node=<ranks>` over scripts/qat.py with the
# experiment's DeepSpeed JSON (compression.QAT.hf_args.deepspeed, under config/deepspeed/).
# Snakemake exports OMP/MKL_NUM_THREADS = the job's threads (ranks x threads_per_rank); each
# rank must use threads_per_rank, or the ranks oversubscribe the cores (several times slower).


rule zero3_qat:
    """End-to-end QAT (LM + KD losses) on `ranks` processes under DeepSpeed ZeRO-3, warm-started
    from the PTQ scales; writes the consolidated QAT checkpoint (loads without DeepSpeed).
    """
    input:
        unpack(lambda wc: base_inputs(wc.exp)),
        unpack(lambda wc: data_inputs(wc.exp)),
        ptq=rules.ptq_calibrate.output.ptq,
        code=code("zero3_qat", "qat.py"),
    output:
        qat=directory(f"{RESULTS}/{{exp}}/qat"),
        timing=f"{RESULTS}/{{exp}}/timings/zero3_qat.json",
    log:
        f"{RESULTS}/{{exp}}/logs/zero3_qat.log",
    conda:
        "../envs/qatlib.yaml"
    threads: config["ranks"] * config["threads_per_rank"]
    resources:
        mem_mb=mem_mb("zero3_qat"),
        gpu=gpus(config["ranks"]),
        tasks_per_gpu=0,
    params:
        config=lambda wc: stage_config(
            wc.exp, "zero3_qat", deepspeed=deepspeed_json(wc), ranks=config["ranks"]
        ),
        yaml=lambda wc: experiment_yaml(wc.exp),
        model=lambda wc: model_path(wc.exp),
        sets=lambda wc: cli_sets(
            wc.exp,
            "zero3_qat",
            "dataset.data_path",
            "compression.QAT.hf_dataset",
        ),
        run_dir=f"{RESULTS}/{{exp}}/qat_run",
        ranks=config["ranks"],
        threads_per_rank=config["threads_per_rank"],
        progress=progress_flag(),
    shell:
        "OMP_NUM_THREADS={params.threads_per_rank} MKL_NUM_THREADS={params.threads_per_rank}"
        " torchrun --standalone --nproc_per_node={params.ranks} {input.code[0]} -c {params.yaml}"
        " --model-path {params.model} --from-ptq-ckpt {input.ptq} --save-path {output.qat}"
        " --run-dir {params.run_dir} {params.sets} --threads {params.threads_per_rank}"
        " {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"
