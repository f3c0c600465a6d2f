# QAT: scripts/qat.py with the experiment's training_mode. End-to-end under ZeRO-3
# (compression.QAT.hf_args.deepspeed with stage 3, under config/deepspeed/) runs on
# `torchrun --standalone --nproc_per_node=<ranks per node>` on one node, and on
# `srun` + `torchrun --nnodes=<nodes>` (c10d rendezvous) across config `nodes` > 1
# (workflow/lib/launch.py); blockwise, or without ZeRO-3, one process.
# Snakemake exports OMP/MKL_NUM_THREADS = the job's threads (ranks x threads_per_rank); each
# rank must use threads_per_rank, or the ranks oversubscribe the cores (several times slower).


# the name stays `zero3_qat` in either mode: the report and the benchmarks read its timing file
rule zero3_qat:
    """QAT warm-started from the PTQ scales: end-to-end (LM + KD losses) on `ranks` processes
    under DeepSpeed ZeRO-3, or blockwise in one process; writes the consolidated QAT checkpoint
    (loads without DeepSpeed).
    """
    input:
        unpack(lambda wc: base_inputs(wc.exp)),
        unpack(lambda wc: data_inputs(wc.exp)),
        ptq=rules.ptq_calibrate.output.ptq,
        code=code("qat.py"),
    output:
        qat=directory(f"{RESULTS}/{{exp}}/qat"),
        timing=f"{RESULTS}/{{exp}}/timings/zero3_qat.json",
    log:
        f"{RESULTS}/{{exp}}/logs/zero3_qat.log",
    conda:
        "../envs/qatlib.yaml"
    threads: lambda wc: qat_procs(wc)[0] * qat_procs(wc)[1]
    resources:
        mem_mb=mem_mb("zero3_qat"),
        runtime=runtime("zero3_qat"),
        # per node: Slurm's --nodes / --ntasks (one torchrun per node) / --cpus-per-task /
        # --gres=gpu:<gpus_per_node>; `mpi` (multi-node only) = the command runs its own srun
        nodes=qat_resource("nodes", 1),
        tasks=qat_resource("tasks", 1),
        cpus_per_task=qat_resource("cpus_per_task", 1),
        gres=qat_resource("gres", ""),
        mpi=qat_resource("mpi", ""),
        tasks_per_gpu=0,
    params:
        # + the DeepSpeed JSON's content (editing it re-runs QAT) and the number of processes
        config=lambda wc: EXPERIMENTS.stage_config(
            wc.exp,
            "zero3_qat",
            deepspeed=EXPERIMENTS.deepspeed(wc.exp),
            # the world size (nodes x ranks per node): what changes the training
            ranks=qat_launch(wc).world_size,
        ),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        model=lambda wc: EXPERIMENTS.model_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(
            wc.exp,
            "zero3_qat",
            "dataset.data_path",
            "compression.QAT.hf_dataset",
        ),
        run_dir=f"{RESULTS}/{{exp}}/qat_run",
        launch=qat_launcher,
        rank_threads=lambda wc: qat_procs(wc)[1],
        progress=progress_flag(),
    shell:
        "{params.launch} {input.code[0]} -c {params.yaml}"
        " --model-path {params.model} --from-ptq-ckpt {input.ptq} --save-path {output.qat}"
        " --run-dir {params.run_dir} {params.sets} --threads {params.rank_threads}"
        " {params.progress}"
        " --timing {output.timing} 2>&1 | tee {log}"
