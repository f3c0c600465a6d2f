"""Stage `sqnr`: per-layer weight quantization SQNR of the PTQ and QAT scales -> analysis/sqnr.csv.

    python scripts/sqnr.py --ptq-ckpt results/tiny-qwen3-moe/ptq --qat-ckpt results/tiny-qwen3-moe/qat \
        --out results/tiny-qwen3-moe/analysis/sqnr.csv

SQNR = 10 log10(|W|^2 / |W - Q(W)|^2) in dB per weight-quantized linear, Q the fake quantization
with the checkpoint's scales. QAT trains scales only (linear weights stay frozen), so the QAT
checkpoint's weights are the full-precision weights of both; a PTQ checkpoint that carries its own
weights (GPTQ) is measured against those. Columns: layer, layer_type, ptq_db, qat_db, delta_db.
"""

from __future__ import annotations

from pathlib import Path

import _common

COLUMNS = ["layer", "layer_type", "ptq_db", "qat_db", "delta_db"]


def main(argv=None) -> int:
    ap = _common.parser(__doc__.splitlines()[0], config=False, model=False, save=False)
    ap.add_argument("--ptq-ckpt", required=True)
    ap.add_argument("--qat-ckpt", required=True)
    ap.add_argument("--out", required=True, help="CSV to write")
    args = ap.parse_args(argv)

    with _common.stage("sqnr", args) as record:
        from qatlib import analysis

        per = {}
        for name, ckpt in (("ptq", args.ptq_ckpt), ("qat", args.qat_ckpt)):
            scheme = analysis.load_scheme(ckpt)
            scales = analysis.load_scales(ckpt)
            layers = sorted({p.layer for k in scales if (p := analysis.parse_key(k)) and p.role == "weight"})
            source = ckpt if name == "ptq" and analysis.weight_bytes(ckpt, layers) else args.qat_ckpt
            rows = analysis.layer_sqnr(analysis.iter_weights(source, layers), scheme, scales)
            if len(rows) != len(layers):
                raise SystemExit(
                    f"error: {source} has weights for {len(rows)} of the {len(layers)} layers of {ckpt}"
                )
            per[name] = rows
        rows = analysis.compare_sqnr(per["ptq"], per["qat"])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        analysis.write_csv(rows, args.out, COLUMNS)
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
