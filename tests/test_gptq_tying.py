"""GPTQ under ``deploy.target: vllm``: the shards of a fused group (q/k/v, gate/up, each expert's
gate/up) share one per-tensor weight scale, the one the runtime serves. GPTQ must quantize every
shard at that scale (computed first from all shards' float weights: the max of their absmax / 448),
not let the last shard's own scale win.

Bounds: the deployed (emulated) model equals the trained GPTQ model within EQUAL = 1e-5 (max |logit
difference|; measured 0), and GPTQ's dequantized weights are exactly on the grid of the shared
scale (fake-quantizing them changes nothing, atol 0)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config

from qatlib.export import export
from qatlib.ptq.gptq import gptq
from qatlib.quant import PrepareOptions, preset
from qatlib.runtime import emulate as E
from qatlib.runtime.fusion import GroupKind, fused_groups
from qatlib.runtime.tying import tie_for

EQUAL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _batches(n=2, b=2, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gptq_uses_the_tied_scale_and_deploys_as_trained(tmp_path, moe):
    model = build_model(tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    mods = dict(model.named_modules())
    pairs = [g for g in fused_groups(model) if g.kind in (GroupKind.QKV, GroupKind.GATE_UP)]
    # by hand, from the float weights before GPTQ: the one scale of each group
    want = {
        g.members: max(mods[m].weight.detach().abs().max().item() for m in g.members) / 448.0 for g in pairs
    }
    scheme = preset("fp8_static")
    report = gptq(model, scheme, _batches(), options=PrepareOptions(deploy=tie_for("vllm")))
    mods = dict(model.named_modules())
    for members, scale in want.items():
        qs = [mods[m].weight_quantizer for m in members]
        assert all(q.scale is qs[0].scale for q in qs)  # still one Parameter
        assert qs[0].scale.item() == pytest.approx(scale, rel=1e-6), members
        for m in members:  # each shard's GPTQ result is on that scale's grid: nothing re-rounded
            ql = mods[m]
            torch.testing.assert_close(ql.fake_quant_weight(), ql.weight, rtol=0, atol=0)
    export(model, report.scheme, tmp_path / "e", "real")
    dep = E.emulate_export(tmp_path / "e", "vllm")
    ids = _batches(n=1, seed=11)[0]
    with torch.no_grad():
        diff = (dep.model(ids).logits.float() - model(ids).logits.float()).abs().max().item()
    assert diff <= EQUAL, diff
    assert any(a.startswith("fused weight scales") or "max" in a for a in dep.applied)
