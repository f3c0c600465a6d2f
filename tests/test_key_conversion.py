"""transformers' checkpoint-key conversion in qatlib's streamed readers (`qatlib.checkpoint.conversion`):
a Mixtral / MiniMax-M2 checkpoint in the hub layout (``block_sparse_moe.experts.{e}.w1|w2|w3.weight``,
what ``save_pretrained`` writes for these classes) loads under the 2-rank ZeRO-3 streamed load, the
streamed PTQ and the streamed export exactly as ``from_pretrained`` (+ qatlib's linearisation) reads
it; each converter's slices agree with transformers' own operations run on tensors; a key no rule
explains is an error naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, local_texts, one_thread, stage_inputs, torchrun
from safetensors.torch import load_file, save_file

from qatlib.checkpoint import safetensors as st
from qatlib.checkpoint.conversion import KeyRules, ModelTensors, place_keys
from qatlib.checkpoint.layout import weight_files
from qatlib.surgery.moe import linearize_moe_experts
from qatlib.zero3 import load as zl
from qatlib.zero3.io import Zero3Error

ROOT = Path(__file__).resolve().parents[1]
DS_TEST = ROOT / "config" / "deepspeed" / "zero3_cpu_test.json"
EXPS = ROOT / "config" / "experiments"
# odd widths (hidden 36, expert width 21: gate_up 42 rows), 3 experts, 2 layers, sharded
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=36,
    intermediate_size=21,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    num_local_experts=3,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
FAMILIES = ("mixtral", "minimax_m2")


def family_config(family: str, **kw):
    from transformers import MiniMaxM2Config, MixtralConfig

    cls = {"mixtral": MixtralConfig, "minimax_m2": MiniMaxM2Config}[family]
    return cls(**{**SIZES, **kw})


def reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained`` + qatlib's linearisation: the model every qatlib path must hold."""
    from transformers import AutoModelForCausalLM

    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    linearize_moe_experts(model)
    return model.state_dict()


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny random model as ``save_pretrained`` writes it: the hub layout, sharded."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(i)
        d = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(family_config(family)).save_pretrained(d, max_shard_size="60KB")
        keys = {k for f in d.glob("*.safetensors") for k in load_file(str(f))}
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in keys  # the real checkpoints' keys
        assert (
            "model.layers.0.block_sparse_moe.gate.weight" in keys and len(list(d.glob("*.safetensors"))) > 3
        )
        assert not any(".mlp." in k for k in keys)
        out[family] = d
    return out


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("linearised", [True, False], ids=["linearised", "fused"])
def test_hub_layout_streams_as_from_pretrained_reads_it(hub, family, linearised):
    """The streamed reader on a plain model of other random weights: every parameter and buffer
    equals ``from_pretrained``'s (+ linearisation), into qatlib's linearised experts and into
    transformers' fused ones; each checkpoint tensor is read once, whole, into one target."""
    from transformers import AutoModelForCausalLM

    ref = reference(hub[family])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(family_config(family))
    if linearised:
        linearize_moe_experts(model, copy_weights=False)
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(hub[family]), dtype=torch.float32).state_dict()
    plan = st.weight_plan(weight_files(hub[family]), st.model_tensors(model), where=family)
    if linearised:  # per expert: one key -> one whole linear, as a Qwen3-MoE per-expert key
        w1 = [e for e in plan if e.info.key.endswith("experts.1.w1.weight")]
        assert [a.target for a in w1[0].assigns] == ["model.layers.0.mlp.experts.1.gate_proj.weight"]
        assert all(
            len(e.assigns) == 1 and e.assigns[0].dst is None and e.assigns[0].src is None for e in plan
        )
    zl.stream_load_weights(model, hub[family])
    got = model.state_dict()
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_a_key_no_rule_explains_is_an_error_naming_it(hub, tmp_path):
    """An extra expert projection, an expert the model lacks and a renamed router that lost its
    target: one error naming each key (and what the rules read it as)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "bad"
    shutil.copytree(hub["mixtral"], d)
    f = sorted(d.glob("model-*.safetensors"))[-1]
    sd = load_file(str(f))
    sd["model.layers.0.block_sparse_moe.experts.0.w4.weight"] = torch.zeros(21, 36)
    sd["model.layers.0.block_sparse_moe.router.weight"] = torch.zeros(3, 36)
    save_file(sd, str(f), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for k in (
        "model.layers.0.block_sparse_moe.experts.0.w4.weight",
        "model.layers.0.block_sparse_moe.router.weight",
    ):
        index["weight_map"][k] = f.name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    model = AutoModelForCausalLM.from_config(family_config("mixtral"))
    linearize_moe_experts(model, copy_weights=False)
    with pytest.raises(Zero3Error) as err:
        zl.stream_load_weights(model, d)
    msg = str(err.value)
    assert "unexpected (2): " in msg
    assert (
        "model.layers.0.block_sparse_moe.experts.0.w4.weight (read as model.layers.0.mlp.experts.0.w4.weight)"
        in msg
    )
    assert "model.layers.0.block_sparse_moe.router.weight (read as model.layers.0.mlp.router.weight)" in msg
    assert "missing" not in msg


def test_a_missing_expert_is_a_shape_mismatch_naming_the_target(hub, tmp_path):
    """An expert's w1 gone: the stacked gate/up tensor is one expert short, as from_pretrained
    would find it (a size mismatch), named with its target."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "short"
    shutil.copytree(hub["mixtral"], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    f = d / index["weight_map"].pop(gone)
    sd = load_file(str(f))
    del sd[gone]
    save_file(sd, str(f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    model = AutoModelForCausalLM.from_config(family_config("mixtral"))
    linearize_moe_experts(model, copy_weights=False)
    with pytest.raises(Zero3Error) as err:
        zl.stream_load_weights(model, d)
    msg = str(err.value)
    # the stacked w1 ([2, 21, 36]) does not concatenate with the stacked w3 ([3, 21, 36])
    assert "model.layers.1.block_sparse_moe.experts.0.w3.weight: checkpoint part [3, 21, 36] does not" in msg
    assert "model.layers.1.mlp.experts.gate_up_proj: converted from 5 keys" in msg
    assert msg.endswith("to [2, 21, 36], model [3, 42, 36]")


# --------------------------------------------------------------------------- 2 ranks, ZeRO-3
@pytest.mark.multirank
def test_zero3_streamed_load_of_the_hub_layout_is_from_pretrained_bit_for_bit(hub, tmp_path):
    """The ZeRO-3 QAT's load (`qatlib.zero3.load.load_model`: empty partitioned build, experts
    linearised, weights streamed; tensors above 4 KB sent partition by partition) on 2 gloo
    ranks: every gathered parameter and every buffer equals ``from_pretrained`` + linearisation.
    Then the experts change and the ZeRO-3 save writes the QAT checkpoint: ``from_pretrained`` of it
    holds the changed experts bit for bit, under the hub's keys (none missing, none unexpected)."""
    out = tmp_path / "run"
    out.mkdir()
    spec = {"out": str(out), "ds_config": str(DS_TEST), "models": {f: str(hub[f]) for f in FAMILIES},
            "chunk_bytes": 4096, "save": True}  # fmt: skip
    proc, _ = torchrun(ROOT / "tests" / "zero3_workers" / "key_conversion.py", spec, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("WORKER OK") == 2
    for family in FAMILIES:
        ref = reference(hub[family])
        r = torch.load(out / f"{family}.pt", weights_only=False)
        assert all(x["partitioned"] for x in r["ranks"]) and r["ranks"][0]["held"] > 0
        got = {**r["params"], **{k: v for k, v in r["buffers"].items() if k in ref}}
        assert got.keys() == ref.keys(), family
        assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], family
        if family == "minimax_m2":  # a buffer renamed by the rules, read by rank 0, broadcast
            assert "model.layers.0.mlp.e_score_correction_bias" in r["buffers"]
        # the QAT checkpoint `save_consolidated` wrote after the experts changed, read by plain
        # `from_pretrained` (transformers' fused experts): the trained experts, nothing missing
        from transformers import AutoModelForCausalLM

        trained, saved = r["trained"], out / f"{family}-saved"
        keys = {k for f in weight_files(saved) for k in load_file(str(f))}
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in keys and not any(
            "_proj." in k and ".experts." in k for k in keys
        )
        with one_thread():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(saved), dtype=torch.float32, output_loading_info=True
            )
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
        for layer in range(SIZES["num_hidden_layers"]):
            experts, p = model.model.layers[layer].mlp.experts, f"model.layers.{layer}.mlp.experts"
            for e in range(SIZES["num_local_experts"]):
                gate, up = trained[f"{p}.{e}.gate_proj.weight"], trained[f"{p}.{e}.up_proj.weight"]
                assert not torch.equal(gate, r["params"][f"{p}.{e}.gate_proj.weight"])  # trained
                assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up])), (family, layer, e)
                assert torch.equal(experts.down_proj[e], trained[f"{p}.{e}.down_proj.weight"]), (
                    family,
                    layer,
                    e,
                )


# --------------------------------------------------------------------------- streamed PTQ / export
def _same_dir(a: Path, b: Path) -> int:
    """The same files; safetensors byte for byte, JSON equal. Returns the tensors compared."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert fa == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    n = 0
    for f in fa:
        if f.endswith(".safetensors"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
            n += len(load_file(str(a / f)))
        elif f.endswith(".json"):
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_ptq_and_export_read_the_hub_layout(hub, tmp_path, tiny_tokenizer, single_thread, family):
    """PTQ (fp8 static: calibration batches carried layer to layer) and the real export of a
    hub-layout checkpoint: streamed (no whole-model fallback: the records say so) and the same
    bytes as the whole-model path (``from_pretrained``), keys named as ``save_pretrained`` names them."""
    from qatlib.config import load_config
    from qatlib.pipeline import run_export, run_ptq

    fp8_static = ["compression.quantization.name=fp8_static", "compression.quantization.quant_method.weight=per-tensor",
                  "compression.QAT.plugin_config.quant_config.use_activation_quant=true"]  # fmt: skip
    base, sets = stage_inputs(tmp_path, hub[family], tiny_tokenizer, fp8_static)
    sets.append(f"compression.QAT.from_ptq_ckpt={tmp_path / 'ptq-whole'}")

    def cfg(out: str):
        return load_config(EXPS / "tiny-qwen3-moe.yaml", [*sets, f"global.save_path={tmp_path / out}"])

    assert run_ptq(cfg("ptq-stream"), progress=False)["streamed"] is True
    assert run_ptq(cfg("ptq-whole"), whole_model=True, progress=False)["streamed"] is False
    n = _same_dir(tmp_path / "ptq-whole", tmp_path / "ptq-stream")
    scales = load_file(str(tmp_path / "ptq-whole" / "scales.safetensors"))
    assert "model.layers.1.mlp.experts.2.up_proj.input_scale" in scales and n == len(scales)
    qat = tmp_path / "qat"  # the base weights beside PTQ's scales, as a QAT checkpoint
    shutil.copytree(base, qat)
    for f in ("scales.safetensors", "quant_scheme.json"):
        shutil.copy(tmp_path / "ptq-whole" / f, qat)
    assert run_export(cfg("export-stream"), qat)["streamed"] is True
    assert run_export(cfg("export-whole"), qat, whole_model=True)["streamed"] is False
    assert _same_dir(tmp_path / "export-whole", tmp_path / "export-stream") > 0
    keys = load_file(str(tmp_path / "export-stream" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys  # transformers' reverse renaming


# --------------------------------------------------------------------------- writing: the hub's expert keys
def test_every_writer_names_the_experts_as_the_hub_does(hub, tmp_path, single_thread):
    """`qatlib.checkpoint.saved_keys`: the linearised model's tensors named by `checkpoint_names`
    are exactly the keys ``save_pretrained`` of transformers' fused model wrote (the ``hub``
    fixture), each holding that checkpoint's tensor; handed to ``save_pretrained`` (the PTQ
    checkpoint, the in-memory export) `expert_names`' keys come out as they went in, and
    `qatlib.resume` reads such a save back into another model. Qwen3-MoE,
    whose hub keys are qatlib's names: every name unchanged."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from qatlib.checkpoint.saved_keys import checkpoint_names, expert_names
    from qatlib.resume import load_saved_weights, saved_weights_derive_from

    for family in FAMILIES:
        stored = {k: v for f in weight_files(hub[family]) for k, v in load_file(str(f)).items()}
        with one_thread():
            model = AutoModelForCausalLM.from_pretrained(str(hub[family]), dtype=torch.float32)
        linearize_moe_experts(model)
        sd = model.state_dict()
        name_of = checkpoint_names(model)
        named = {name_of(k): k for k in sd}
        assert sorted(named) == sorted(stored), family
        assert [k for k, n in named.items() if not torch.equal(stored[k], sd[n])] == [], family
        assert name_of("model.layers.1.mlp.experts.2.up_proj.weight_scale") == (
            "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
        )
        experts = expert_names(model)
        model.save_pretrained(tmp_path / family, state_dict={experts(k): v for k, v in sd.items()})
        assert sorted(load_file(str(tmp_path / family / "model.safetensors"))) == sorted(stored), family
        # and qatlib's resume reads that save back (`qatlib.resume`: the same names)
        fresh = AutoModelForCausalLM.from_config(family_config(family))
        linearize_moe_experts(fresh, copy_weights=False)
        assert not saved_weights_derive_from(fresh, tmp_path / family)
        assert load_saved_weights(fresh, tmp_path / family) == len(stored)
        assert saved_weights_derive_from(fresh, tmp_path / family)
        assert [k for k, v in fresh.state_dict().items() if not torch.equal(v, sd[k])] == [], family
    qwen = AutoModelForCausalLM.from_config(
        Qwen3MoeConfig(**{**SIZES, "num_experts": 3, "moe_intermediate_size": 21})
    )
    linearize_moe_experts(qwen)
    experts, name_of = expert_names(qwen), checkpoint_names(qwen)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in qwen.state_dict()
    assert [k for k in qwen.state_dict() if experts(k) != k or name_of(k) != k] == []


@pytest.fixture(scope="module")
def fp8_exports(hub, tmp_path_factory, tiny_tokenizer):
    """Each family's fp8_static export (streamed, from its PTQ's scales beside the hub weights),
    with the base weights and scales it was made from."""
    from qatlib.config import load_config
    from qatlib.pipeline import run_export, run_ptq

    out = {}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(f"fp8-{family}")
        qat = tmp / "qat"
        shutil.copytree(hub[family], qat)
        tiny_tokenizer.save_pretrained(qat)
        if family == "minimax_m2":  # fields of the released config.json vLLM reads (transformers' model)
            released = {"rotary_dim": SIZES["head_dim"], "scoring_func": "sigmoid", "use_routing_bias": True}
            config = json.loads((qat / "config.json").read_text())
            (qat / "config.json").write_text(json.dumps({**config, **released}))
        (tmp / "train.txt").write_text("\n\n".join(local_texts(20)))
        sets = ["compression.quantization.name=fp8_static", "compression.quantization.quant_method.weight=per-tensor",
                "compression.QAT.plugin_config.quant_config.use_activation_quant=true",
                f"dataset.data_path={tmp / 'train.txt'}", "dataset.num_samples=3", "dataset.max_seq_length=32",
                f"model.model_path={qat}", f"compression.QAT.from_ptq_ckpt={tmp / 'ptq'}"]  # fmt: skip

        def cfg(name: str, sets=sets, tmp=tmp):
            return load_config(EXPS / "tiny-qwen3-moe.yaml", [*sets, f"global.save_path={tmp / name}"])

        with one_thread():
            run_ptq(cfg("ptq"), progress=False)
            for f in ("scales.safetensors", "quant_scheme.json"):
                shutil.copy(tmp / "ptq" / f, qat)
            assert run_export(cfg("export"), qat)["streamed"] is True
        base = {k: v for f in weight_files(hub[family]) for k, v in load_file(str(f)).items()}
        out[family] = (tmp / "export", base, load_file(str(tmp / "ptq" / "scales.safetensors")))
    return out


def _fp8_codes(base, scales, layer: int, e: int, w: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, scale) of expert ``e``'s ``w1|w2|w3`` computed here from the base weight and
    PTQ's scale: ``(W / s)`` clamped to E4M3's range, cast (round to nearest even)."""
    proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[w]
    s = scales[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight_scale"]
    W = base[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"]
    return (W.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_export_experts_load_in_vllm_and_from_pretrained(fp8_exports, family):
    """The export names each expert as vLLM 0.33's Mixtral / MiniMax-M2 loaders and
    ``from_pretrained`` read it (``block_sparse_moe.experts.{e}.w1|w2|w3.weight`` + scales). vLLM's
    own load (`qatlib.runtime.oracle`) places every expert: its ``w2`` codes and scales are the ones
    computed here, its ``w13`` what vLLM's own max-scale requantization makes of the codes computed
    here (gate rows, then up rows). ``from_pretrained`` (transformers + compressed-tensors)
    decompresses every expert to codes x scale, nothing missing."""
    from transformers import AutoModelForCausalLM

    from qatlib.runtime import oracle

    d, base, scales = fp8_exports[family]
    keys = load_file(str(d / "model.safetensors"))
    assert not [k for k in keys if ".mlp." in k or ("_proj." in k and ".experts." in k)]
    E, L, inter = SIZES["num_local_experts"], SIZES["num_hidden_layers"], SIZES["intermediate_size"]
    codes = {(i, e, w): _fp8_codes(base, scales, i, e, w) for i in range(L) for e in range(E) for w in ("w1", "w2", "w3")}  # fmt: skip
    for (i, e, w), (c, s) in codes.items():
        key = f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
        assert torch.equal(keys[f"{key}.weight"].view(torch.uint8), c.view(torch.uint8)), key
        assert torch.equal(keys[f"{key}.weight_scale"], s) and f"{key}.input_scale" in keys
    if oracle.vllm_version() is None:
        pytest.skip("vllm is not installed (pip install --no-deps -r requirements/runtime-oracle.txt)")
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    with oracle.vllm_loaded(d) as vm:
        mods = dict(vm.named_modules())
        for i in range(L):
            moe = mods[f"model.layers.{i}.block_sparse_moe.experts.routed_experts"]
            w13 = torch.stack([torch.cat([codes[i, e, "w1"][0], codes[i, e, "w3"][0]]) for e in range(E)])
            s13 = torch.stack([torch.cat([codes[i, e, "w1"][1], codes[i, e, "w3"][1]]) for e in range(E)])
            want, want_s = fp8_utils.process_fp8_weight_tensor_strategy_moe(w13, s13, inter, E)
            assert torch.equal(moe.w13_weight.view(torch.uint8), want.view(torch.uint8)), i
            assert torch.equal(moe.w13_weight_scale, want_s), i
            for e in range(E):
                c, s = codes[i, e, "w2"]
                assert torch.equal(moe.w2_weight[e].view(torch.uint8), c.view(torch.uint8)), (i, e)
                assert torch.equal(moe.w2_weight_scale[e].reshape(1), s), (i, e)
    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    for i in range(L):
        experts = model.model.layers[i].mlp.experts
        for e in range(E):
            gate_up = torch.cat([codes[i, e, w][0].float() * codes[i, e, w][1] for w in ("w1", "w3")])
            assert torch.equal(experts.gate_up_proj[e], gate_up), (i, e)
            assert torch.equal(experts.down_proj[e], codes[i, e, "w2"][0].float() * codes[i, e, "w2"][1])


# --------------------------------------------------------------------------- each operation vs transformers
def _converter_case(name: str):
    """(transforms, checkpoint tensors, the model's tensors in transformers' layout)."""
    from transformers.core_model_loading import (
        Chunk,
        Concatenate,
        Interleave,
        MergeModulelist,
        Split,
        Transpose,
        WeightConverter,
        WeightRenaming,
    )

    g = torch.Generator().manual_seed(0)
    E, inter, hidden = 3, 5, 4
    if name == "merge_concat":  # Mixtral's, with its renaming
        conv = [
            WeightRenaming(".block_sparse_moe.", ".mlp."),
            WeightConverter([".experts.*.w1.weight", ".experts.*.w3.weight"], ".experts.gate_up_proj",
                            [MergeModulelist(dim=0), Concatenate(dim=1)]),
            WeightConverter([".experts.*.w2.weight"], ".experts.down_proj", [MergeModulelist(dim=0)]),
        ]  # fmt: skip
        ckpt = {f"l.block_sparse_moe.experts.{e}.w{w}.weight": torch.randn(
            (hidden, inter) if w == 2 else (inter, hidden), generator=g) for e in range(E) for w in (1, 2, 3)}  # fmt: skip
        shapes = {
            "l.mlp.experts.gate_up_proj": (E, 2 * inter, hidden),
            "l.mlp.experts.down_proj": (E, hidden, inter),
        }
    elif name == "transpose":  # qwen3_vl_moe's: a fused [E, H, 2I] tensor transposed into [E, 2I, H]
        conv = [WeightConverter("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", [Transpose(1, 2)])]
        ckpt = {"l.mlp.experts.gate_up_proj": torch.randn(E, hidden, 2 * inter, generator=g)}
        shapes = {"l.mlp.experts.gate_up_proj": (E, 2 * inter, hidden)}
    elif name == "merge_transpose":  # stacked, then its last two dims swapped
        conv = [WeightConverter("experts.*.w.weight", "experts.w", [MergeModulelist(dim=0), Transpose(1, 2)])]
        ckpt = {f"l.experts.{e}.w.weight": torch.randn(inter, hidden, generator=g) for e in range(11)}
        shapes = {"l.experts.w": (11, hidden, inter)}
    elif name == "chunk":  # a fused qkv split in three (16 rows: torch.chunk cuts 6, 6, 4)
        conv = [
            WeightConverter(
                "attn.qkv.weight", ["attn.q.weight", "attn.k.weight", "attn.v.weight"], [Chunk(dim=0)]
            )
        ]
        ckpt = {"l.attn.qkv.weight": torch.randn(16, hidden, generator=g)}  # torch.chunk: 6, 6, 4
        shapes = {
            "l.attn.q.weight": (6, hidden),
            "l.attn.k.weight": (6, hidden),
            "l.attn.v.weight": (4, hidden),
        }
    elif name == "split":  # a fused GQA qkv cut at the model's own sizes (q 6 rows, k and v 2)
        conv = [WeightConverter("query_key_value", ["q_proj", "k_proj", "v_proj"], [Split(dim=0)])]
        ckpt = {"l.attn.query_key_value": torch.randn(10, hidden, generator=g)}
        shapes = {"l.attn.q_proj": (6, hidden), "l.attn.k_proj": (2, hidden), "l.attn.v_proj": (2, hidden)}
    else:  # interleave: no slice reading
        conv = [WeightConverter("mlp.experts.w13", "mlp.experts.gate_up_proj", [Interleave(dim=1)])]
        ckpt = {"l.mlp.experts.w13": torch.randn(E, 2 * inter, hidden, generator=g)}
        shapes = {"l.mlp.experts.gate_up_proj": (E, 2 * inter, hidden)}
    return conv, ckpt, shapes


def _transformers_converts(conv, ckpt: dict[str, torch.Tensor], shapes) -> dict[str, torch.Tensor]:
    """transformers' own loading step on tensors: rename each key, collect per converter, convert
    (``Split`` reads its sizes from a model: one holding ``shapes``)."""
    from copy import deepcopy

    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    ren = [t for t in conv if isinstance(t, WeightRenaming)]
    cvs = [t for t in conv if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in cvs for p in c.source_patterns}
    groups, out = {}, {}
    for k in sorted(ckpt, key=dot_natural_key):
        target, pattern = rename_source_key(k, ren, cvs)
        if pattern is None:
            out[target] = ckpt[k]
            continue
        c = groups.setdefault(target, deepcopy(by_pattern[pattern]))
        c.add_tensor(target, k, pattern, lambda t=ckpt[k]: t)
    model = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = model
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))
    for target, c in groups.items():
        out.update({n: v[0] if isinstance(v, list) else v for n, v in c.convert(target, model=model).items()})
    return out


@pytest.mark.parametrize("case", ["merge_concat", "transpose", "merge_transpose", "chunk", "split"])
def test_each_key_lands_where_transformers_operations_put_it(tmp_path, case):
    """Every converter's slices (stack position, concatenation offset, transposition, chunk, split), copied
    key by key, give exactly the tensors transformers' operations build from the same checkpoint."""
    conv, ckpt, shapes = _converter_case(case)
    want = _transformers_converts(conv, ckpt, shapes)
    assert {k: tuple(v.shape) for k, v in want.items()} == shapes
    f = tmp_path / "c.safetensors"
    save_file(ckpt, str(f))
    model = ModelTensors(dict(shapes), {}, {}, {}, frozenset(), KeyRules(tuple(conv), None, None, ()))
    plan = st.weight_plan([f], model, where=case)
    dest = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    with open(f, "rb") as fh:
        for e in plan:
            st.copy_entry(fh, e, dest.__getitem__)
    for n in shapes:
        assert torch.equal(dest[n], want[n]), n


def test_an_operation_without_a_slice_reading_is_refused_by_name(tmp_path):
    conv, ckpt, shapes = _converter_case("interleave")
    model = ModelTensors(dict(shapes), {}, {}, {}, frozenset(), KeyRules(tuple(conv), None, None, ()))
    placed = place_keys({k: tuple(v.shape) for k, v in ckpt.items()}, model)
    assert placed.problems["not convertible slice by slice"] == [
        "l.mlp.experts.w13 (transformers applies Interleave)"
    ]
    assert placed.assigns == {}
