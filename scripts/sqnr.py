"""Stage `sqnr`: per-layer weight quantization SQNR of the PTQ and QAT scales -> analysis/sqnr.csv.

    python scripts/sqnr.py --ptq-ckpt results/tiny-qwen3-moe/ptq --qat-ckpt results/tiny-qwen3-moe/qat \
        --out results/tiny-qwen3-moe/analysis/sqnr.csv

SQNR = 10 log10(|W|^2 / |W - Q(W)|^2) in dB per weight-quantized linear, Q the fake quantization
with the checkpoint's scales: `qatlib.analysis.checkpoint_sqnr`, the same table the report computes
when this file is absent. Its rule for which weights each column quantizes: QAT, the QAT
checkpoint's; PTQ, the PTQ checkpoint's own (GPTQ), else ``--base-weights``, else the QAT
checkpoint's (QAT trains scales only, so those are the full-precision weights of both).
Columns: layer, layer_type, ptq_db, qat_db, delta_db.
"""

from __future__ import annotations

from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False, save=False)
    ap.add_argument("--ptq-ckpt", required=True)
    ap.add_argument("--qat-ckpt", required=True)
    ap.add_argument("--base-weights", default=None, help="the weights PTQ calibrated on (model folder)")
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
                f"{r['layer_type']:>18s} x{r['count']:<4d} PTQ {r['ptq_db']:7.2f} dB  QAT {r['qat_db']:7.2f} dB"
                f"  delta {r['delta_db']:+.3f} dB"
            )
        record["layers"] = len(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
