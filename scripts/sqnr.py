"""Stage `sqnr`: per-layer weight SQNR of the PTQ and QAT models against BF16 -> analysis/sqnr.csv.

    python scripts/sqnr.py --ptq-ckpt results/tiny-qwen3-moe/ptq --qat-ckpt results/tiny-qwen3-moe/qat \
        --base-weights results/base/tiny-qwen3-moe --out results/tiny-qwen3-moe/analysis/sqnr.csv

The table and its definition are `qatlib.analysis.checkpoint_sqnr`'s (the report computes the same
when this file is absent): per weight-quantized linear, the SQNR in dB of the weight each variant
deploys (PTQ, QAT) against the BF16 weight of ``--base-weights`` (the base model; without it the
QAT checkpoint's weights stand in, with a note). Columns: layer, layer_type, ptq_db, qat_db,
delta_db.
"""

from __future__ import annotations

from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False, save=False)
    ap.add_argument("--ptq-ckpt", required=True)
    ap.add_argument("--qat-ckpt", required=True)
    ap.add_argument(
        "--base-weights", default=None, help="the BF16 weights SQNR is measured against (base model folder)"
    )
    ap.add_argument("--out", required=True, help="CSV to write")
    args = ap.parse_args(argv)

    with _common.stage("sqnr", args) as record:
        from qatlib import analysis

        try:
            rows, notes = analysis.checkpoint_sqnr(args.ptq_ckpt, args.qat_ckpt, args.base_weights)
        except analysis.SqnrError as e:
            raise SystemExit(f"error: {e}") from None
        for n in notes:
            print(f"note: {n}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        analysis.write_csv(rows, args.out, analysis.SQNR_COLUMNS)
        summary = analysis.summarize(rows, ["ptq_db", "qat_db", "delta_db"])
        for r in summary:
            print(
                f"{r['layer_type']:>18s} x{r['count']:<4d} vs BF16: PTQ {r['ptq_db']:7.2f} dB"
                f"  QAT {r['qat_db']:7.2f} dB"
                f"  delta {r['delta_db']:+.3f} dB"
            )
        record["layers"] = len(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
