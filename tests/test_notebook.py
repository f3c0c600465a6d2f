"""notebooks/scale_distributions.ipynb runs top to bottom on synthetic PTQ / QAT checkpoints.

The parameters cell (tag ``parameters``, as papermill expects) is rewritten to point at checkpoints
written here, then the notebook is executed with nbclient in a fresh kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qatlib.quant import compute_qparams
from qatlib.quant.spec import Granularity, QuantScheme, QuantSpec

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "scale_distributions.ipynb"
SCHEME = QuantScheme(
    "int4_g16", weight=QuantSpec("int4", Granularity.GROUP, group_size=16), input=QuantSpec("fp8")
)


def _scales(jitter: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [
        f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    out = {}
    for n in names:
        w = torch.randn(16, 32, generator=g)
        out[f"{n}.weight_scale"] = compute_qparams(w, SCHEME.weight)[0] * (
            1 + jitter * torch.rand(16, 2, generator=g)
        )
        out[f"{n}.input_scale"] = torch.tensor([0.01 * (1 + jitter)])
    out["model.layers.0.self_attn.k_cache.scale"] = torch.tensor([0.02])
    return out


def _checkpoint(
    d: Path, scales: dict[str, torch.Tensor], extra: dict[str, torch.Tensor] | None = None
) -> Path:
    d.mkdir(parents=True)
    (d / "quant_scheme.json").write_text(json.dumps(SCHEME.to_dict()))
    save_file(scales, str(d / "scales.safetensors"))
    if extra:
        save_file(extra, str(d / "model.safetensors"))
    return d


def test_parameters_cell_and_cleared_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert 'ptq_dir = "results/tiny-qwen3-moe/ptq"' in params[0].source
    assert 'qat_dir = "results/tiny-qwen3-moe/qat"' in params[0].source
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, "commit the notebook with outputs cleared"


def test_notebook_runs_on_synthetic_checkpoints(tmp_path):
    ptq = _checkpoint(tmp_path / "ptq", _scales(0.0))
    # QAT: nested final_quant_checkpoint/, with model weights beside the scales
    qat = _checkpoint(
        tmp_path / "qat" / "final_quant_checkpoint", _scales(0.3), {"lm_head.weight": torch.ones(4, 4)}
    )
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = f"ptq_dir = {str(ptq)!r}\nqat_dir = {str(qat.parent)!r}\ntop_n = 5"
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 4  # weight, input and output scale histograms, weight-scale ratios
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "PTQ: 21 tensors" in text and "QAT: 21 tensors" in text
    changes = next(c for c in nb.cells if c.get("id") == "changes")
    html = changes.outputs[0]["data"]["text/html"]
    assert html.count("</tr>") == 1 + 5  # header + top_n rows
    assert "expert.gate_proj" in html or "expert.up_proj" in html or "expert.down_proj" in html
