# The self-contained HTML report of one experiment, plus DVC's metrics.json and plots/*.csv.


rule report:
    """Evaluation table with recovery, training curves, scale histograms, per-layer SQNR,
    warm-start hits and run metadata, in one HTML file that opens offline."""
    input:
        unpack(report_inputs),
        code=code("report.py"),
    output:
        html=report(
            f"{RESULTS}/{{exp}}/report.html",
            caption="../report/report.rst",
            category="Report",
            subcategory="{exp}",
        ),
        metrics=f"{RESULTS}/{{exp}}/metrics.json",
        plots=directory(f"{RESULTS}/{{exp}}/plots"),
        config=f"{RESULTS}/{{exp}}/config.yaml",
        timing=f"{RESULTS}/{{exp}}/timings/report.json",
    log:
        f"{RESULTS}/{{exp}}/logs/report.log",
    conda:
        "../envs/qatlib.yaml"
    resources:
        mem_mb=mem_mb("report"),
    params:
        config=lambda wc: EXPERIMENTS.stage_config(wc.exp, "report"),
        yaml=lambda wc: EXPERIMENTS.yaml_path(wc.exp),
        sets=lambda wc: EXPERIMENTS.cli_sets(wc.exp, "report"),
        exp_dir=lambda wc: f"{RESULTS}/{wc.exp}",
        base=lambda wc: EXPERIMENTS.model_path(wc.exp),
    shell:
        "python {input.code[0]} -c {params.yaml} {params.sets} --exp-dir {params.exp_dir}"
        " --out {output.html} --config-out {output.config} --shared-timings {input.shared_timings}"
        " --timing {output.timing} 2>&1 | tee {log}"
