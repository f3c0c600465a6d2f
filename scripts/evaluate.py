"""Stage `evaluate`: perplexity and task accuracy of one variant -> eval/<variant>.json.

    python scripts/evaluate.py -c config/experiments/tiny-qwen3-moe.yaml --variant qat \
        --model-path results/tiny-qwen3-moe/qat --scales results/tiny-qwen3-moe/qat \
        --out results/tiny-qwen3-moe/eval/qat.json

Variants: ``bf16`` (the model as it is), ``ptq`` / ``qat`` (``--scales``: the model is prepared with
the experiment's scheme and the scales are loaded: fake quantization in memory), ``export`` (the
exported checkpoint reloaded from disk with ``AutoModelForCausalLM.from_pretrained``, which
decompresses compressed-tensors weights and applies its activation quantization), ``deployed``
(the export as ``deploy.target`` computes it: `qatlib.runtime.emulate`; skipped under ``none``).
``evaluation.ppl``: ``wikitext2``, ``c4`` or local text files; ``evaluation.tasks``: lm-eval task
names, or local task folders (``<dir>/<name>.yaml``, e.g. the corpus rule's multiple-choice task).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import _common

VARIANTS = ("bf16", "ptq", "qat", "export", "deployed")


def main(argv=None) -> int:
    ap = _common.parser(__doc__, save=False)
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--scales", default=None, help="PTQ / QAT checkpoint whose scales to load (ptq, qat)")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument(
        "--layerwise", action="store_true", help="one decoder layer at a time (qatlib.eval.layerwise)"
    )
    ap.add_argument("--hf-home", default=None, help="HF cache folder for datasets (lm-eval's Arrow files)")
    args = ap.parse_args(argv)
    if args.variant in ("ptq", "qat") and not args.scales:
        ap.error(f"--variant {args.variant} needs --scales")
    cfg = _common.load_experiment(args)
    ev = cfg.evaluation
    if ev is None or not (ev.ppl or ev.tasks):
        ap.error(f"{args.config}: no `evaluation` (ppl / tasks) to run")
    from qatlib.eval.layerwise import layerwise_problem

    if args.layerwise and (why := layerwise_problem(args.variant, ev.tasks)):
        ap.error(why)
    from qatlib.eval.harness import split_tasks

    try:  # before any model is loaded
        names, include, hub = split_tasks(ev.tasks)
    except ValueError as e:
        ap.error(str(e))

    with _common.stage(f"evaluate-{args.variant}", args) as record:
        from qatlib.checkpoint.layout import write_json
        from qatlib.eval.harness import evaluate_tasks
        from qatlib.eval.perplexity import perplexity, ppl_label
        from qatlib.eval.variants import load_variant
        from qatlib.models import load_tokenizer, resolve_model_dir

        t0 = time.perf_counter()
        model_dir = resolve_model_dir(cfg.model.model_path, cache_dir=cfg.model.cache_dir)
        result = {"variant": args.variant, "model_path": str(model_dir), "scales": args.scales}
        result.update(ppl={}, tasks={})
        onload = None  # --layerwise: the skeleton's weights streamed one layer at a time
        if args.layerwise:
            from qatlib.eval.layerwise import load_layerwise

            model, onload, extra = load_layerwise(cfg, args.variant, model_dir, args.scales)
        else:
            model, extra = load_variant(cfg, args.variant, model_dir, args.scales)
        result.update(extra)
        # not evaluated: deploy.target none, the runtime refuses, transformers cannot reload it
        if model is None:
            print(f"{args.variant}: skipped ({extra['skipped']})")
            write_json(args.out, result, sort_keys=True)
            return 0
        tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        run = dict(batch_size=ev.batch_size, limit=ev.limit)
        for src in ev.ppl:
            kw = dict(seq_len=ev.max_seq_length, progress=not args.no_progress, cache_dir=args.hf_home)
            r = perplexity(model, tok, src, **run, **kw, onload=onload)
            result["ppl"][ppl_label(src)] = r
            # the same windows' next-token top-1 accuracy: a task row, per window for paired errors
            top1 = {"acc": r["top1"], "acc_stderr": r["top1_stderr"], "acc_windows": r["window_top1"]}
            result["tasks"][f"next_token_{Path(src).stem}"] = top1
            print(
                f"{args.variant} ppl {ppl_label(src)}: {r['ppl']:.4f}, top-1 {r['top1']:.4f} ({r['windows']} windows)"
            )
        if ev.tasks:
            kw = dict(include_path=include or None, include_defaults=bool(hub), hf_home=args.hf_home)
            kw.update(num_fewshot=ev.num_fewshot, max_length=ev.max_seq_length, seed=cfg.global_.seed)
            result["tasks"].update(evaluate_tasks(model, tok, names, **run, **kw))
            for task, m in result["tasks"].items():
                scalars = {k: v for k, v in m.items() if isinstance(v, (int, float))}  # not *_windows
                print(f"{args.variant} {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in scalars.items()))
        result["wall_s"] = round(time.perf_counter() - t0, 3)
        bad = [k for k, r in result["ppl"].items() if not math.isfinite(r["ppl"])]
        if bad:
            raise SystemExit(f"error: non-finite perplexity on {', '.join(bad)} ({args.variant})")
        write_json(args.out, result, sort_keys=True)
        record.update(variant=args.variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
