"""qatlib.checkpoint: the key table in both directions, where a checkpoint's files are, atomic
writes, and the safetensors reader / plans (which know names and shapes, no model)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import build_model, tiny_qwen3_config, tiny_qwen3_moe_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qatlib.checkpoint import keys
from qatlib.checkpoint import safetensors as st
from qatlib.checkpoint import st_write as stw
from qatlib.checkpoint.layout import (
    NESTED_DIR,
    SCHEME_FILE,
    AtomicDir,
    CheckpointError,
    check_scheme,
    resolve_dir,
    weight_files,
    write_json,
)
from qatlib.quant import Granularity, PrepareOptions, QuantScheme, QuantSpec, prepare, quant_linears

# Every kind of stored quantizer parameter: asymmetric weights and inputs (zero points), static
# q / k / v outputs (q: output keys, k / v: cache keys).
SCHEME = QuantScheme(
    "all_keys",
    weight=QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False),
    input=QuantSpec("int8", symmetric=False),
    q=QuantSpec("fp8"),
    k=QuantSpec("int8", symmetric=False),
    v=QuantSpec("fp8", Granularity.HEAD),
)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("lwc", [False, True], ids=["plain", "lwc"])
def test_parse_key_inverts_scale_keys(moe, lwc):
    model = build_model(tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    prepare(model, SCHEME, options=PrepareOptions(lwc_init=1.0 if lwc else None))
    table = keys.scale_keys(model)
    params = {n for n, _ in model.named_parameters() if "_quantizer." in n}
    assert set(table) == params  # every stored quantizer parameter has a key
    assert len(set(table.values())) == len(table)  # and no two share one
    kinds = set()
    for name, key in table.items():
        parsed = keys.parse_key(key)
        if parsed is None:  # LWC clip factors: stored under their own name
            assert key == name and name.rsplit(".", 1)[1] in keys.LWC_PARAMS
            kinds.add("lwc")
            continue
        assert name == f"{parsed.layer}.{parsed.role}_quantizer.{parsed.kind}", key
        assert keys.key_of(parsed.layer, parsed.role, parsed.kind, keys.kv_role(parsed.layer, model)) == key
        kinds.add(("cache" if "_cache." in key else parsed.role, parsed.kind))
    want = {
        ("input", "scale"),
        ("input", "zero_point"),
        ("output", "scale"),
        ("cache", "scale"),
        ("cache", "zero_point"),
    }
    want |= {"lwc"} if lwc else {("weight", "scale"), ("weight", "zero_point")}
    assert kinds == want
    assert "model.layers.1.self_attn.k_cache.zero_point" in table.values()
    assert "model.layers.0.self_attn.q_proj.output_scale" in table.values()
    if moe:
        assert "model.layers.1.mlp.experts.3.down_proj.input_scale" in table.values()


def test_scale_state_dict_uses_the_same_keys():
    model = prepare(build_model(tiny_qwen3_config()), SCHEME, options=PrepareOptions(lwc_init=1.0))
    sd = keys.scale_state_dict(model)
    table = keys.scale_keys(model)
    stored = {k for k in table.values() if keys.parse_key(k) is not None}
    # LWC: no stored weight scale, but the derived (clipped) one is saved under the weight keys
    derived = {
        keys.key_of(n, "weight", kind) for n, _ in quant_linears(model) for kind in ("scale", "zero_point")
    }
    assert set(sd) == stored | derived
    ql = model.model.layers[0].self_attn.k_proj
    assert torch.equal(sd["model.layers.0.self_attn.k_cache.scale"], ql.output_quantizer.scale.detach())
    s, _ = ql.weight_quantizer.qparams(ql.weight)
    assert torch.equal(sd["model.layers.0.self_attn.k_proj.weight_scale"], s.detach().float())


def test_scale_state_dict_nvfp4_global_scales():
    """NVFP4: weight and input global scales are keys of their own, in both directions; with LWC
    the weight global scale is derived from the weight (no parameter) and still saved."""
    from qatlib.quant import preset

    for lwc in (None, 1.0):
        model = prepare(
            build_model(tiny_qwen3_config()), preset("nvfp4"), options=PrepareOptions(lwc_init=lwc)
        )
        sd = keys.scale_state_dict(model)
        for n, ql in quant_linears(model):
            for role in ("weight", "input"):
                key = keys.key_of(n, role, "global_scale")
                assert keys.parse_key(key) == (n, role, "global_scale") and key in sd
            assert torch.equal(sd[keys.key_of(n, "weight", "global_scale")], ql.weight_global_scale())
        table = keys.scale_keys(model)
        assert {k for k in table.values() if keys.parse_key(k) is not None} <= set(sd)


def test_parse_key_edge_cases():
    assert keys.parse_key("k_cache.scale") == ("k_proj", "output", "scale")
    assert keys.parse_key("a.b.v_cache.zero_point") == ("a.b.v_proj", "output", "zero_point")
    assert keys.parse_key("a.weight") is None and keys.parse_key("a.k_cache.bias") is None
    assert keys.key_of("k_proj", "output", "scale", "k") == "k_cache.scale"
    assert keys.kv_role("x.k_proj") == "k" and keys.kv_role("x.q_proj") is None


def test_kv_role_is_structural_with_a_model():
    from torch import nn

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.k_proj = nn.Linear(2, 2)  # named like a key projection, but no attention module
    assert keys.kv_role("mlp.k_proj") == "k"
    assert keys.kv_role("mlp.k_proj", model) is None
    attn = build_model(tiny_qwen3_config())
    assert keys.kv_role("model.layers.0.self_attn.v_proj", attn) == "v"


# --------------------------------------------------------------------------- layout
def _ckpt(d, scheme=SCHEME, tensors=None, name="scales.safetensors"):
    d.mkdir(parents=True, exist_ok=True)
    (d / SCHEME_FILE).write_text(json.dumps(scheme.to_dict()))
    save_file(tensors or {"a.weight_scale": torch.ones(1)}, str(d / name))
    return d


def test_resolve_dir_top_nested_fallback_and_errors(tmp_path):
    top = _ckpt(tmp_path / "top")
    assert resolve_dir(top) == top
    nested = _ckpt(tmp_path / "n" / NESTED_DIR)
    assert resolve_dir(tmp_path / "n") == nested
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({"x.weight": torch.ones(2)}, str(bare / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no quant_scheme.json in"):
        resolve_dir(bare)
    assert resolve_dir(bare, safetensors_fallback=True) == bare
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_dir(tmp_path / "missing")


def test_check_scheme_refuses_another_format(tmp_path):
    d = _ckpt(tmp_path / "c")
    assert check_scheme(d, SCHEME) == (d, SCHEME)
    other = QuantScheme("fp8", weight=QuantSpec("fp8"))
    with pytest.raises(CheckpointError, match="incompatible with the configured 'fp8'"):
        check_scheme(d, other)
    (d / SCHEME_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a quant scheme"):
        check_scheme(d, SCHEME)


def test_weight_files(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    assert weight_files(d) == []
    save_file({"w": torch.ones(1)}, str(d / "scales.safetensors"))
    assert weight_files(d) == []  # a scale file holds no weight
    save_file({"w": torch.ones(1)}, str(d / "shard-b.safetensors"))
    save_file({"w": torch.ones(1)}, str(d / "shard-a.safetensors"))
    assert [p.name for p in weight_files(d)] == ["shard-a.safetensors", "shard-b.safetensors"]
    save_file({"w": torch.ones(1)}, str(d / "model.safetensors"))
    assert [p.name for p in weight_files(d)] == ["model.safetensors"]
    index = {
        "weight_map": {"a": "shard-b.safetensors", "b": "shard-a.safetensors", "c": "shard-b.safetensors"}
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files(d)] == ["shard-b.safetensors", "shard-a.safetensors"]
    index["weight_map"]["d"] = "gone.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        weight_files(d)
    outer = tmp_path / "outer"
    inner = outer / NESTED_DIR
    inner.mkdir(parents=True)
    save_file({"w": torch.ones(1)}, str(inner / "model.safetensors"))
    assert weight_files(outer) == [inner / "model.safetensors"]
    assert weight_files(inner / "model.safetensors") == [inner / "model.safetensors"]


def test_atomic_dir_is_all_or_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), AtomicDir(out) as tmp:
        (tmp / "half.txt").write_text("x")
        raise RuntimeError("boom")
    assert sorted(tmp_path.iterdir()) == []  # neither the output nor a temporary directory
    with AtomicDir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    assert [p.name for p in out.iterdir()] == ["a.txt"]
    with pytest.raises(FileExistsError, match="not empty"), AtomicDir(out):
        pass
    with pytest.raises(RuntimeError), AtomicDir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("2")
        raise RuntimeError
    assert [p.name for p in out.iterdir()] == ["a.txt"]  # a failed overwrite keeps the old content
    with AtomicDir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("2")
    assert [p.name for p in out.iterdir()] == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_json_replaces_atomically(tmp_path, monkeypatch):
    p = write_json(tmp_path / "sub" / "x.json", {"b": 1, "a": torch.float32}, sort_keys=True)
    assert p.read_text() == '{\n  "a": "torch.float32",\n  "b": 1\n}\n'

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json(p, {"c": 2})
    assert json.loads(p.read_text()) == {"a": "torch.float32", "b": 1}
    assert sorted(q.name for q in p.parent.iterdir()) == ["x.json"]


# --------------------------------------------------------------------------- safetensors
def test_reader_matches_safetensors_and_finds_truncation(tmp_path):
    tensors = {
        "f": torch.randn(3, 5),
        "b": torch.randn(4).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int8).reshape(2, 3),
        "e": torch.zeros(0, 2),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    infos = st.read_header(path)
    assert [i.start for i in infos] == sorted(i.start for i in infos)
    with open(path, "rb") as fh:
        got = {i.key: st.read_tensor(fh, i) for i in infos}
        out = torch.empty(3, 5)
        st.read_tensor(fh, next(i for i in infos if i.key == "f"), out=out)
    ref = load_file(str(path))
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert torch.equal(out, ref["f"])
    os.truncate(path, path.stat().st_size - 4)
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        st.read_header(path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_streamed_writer_matches_save_file_byte_for_byte(tmp_path, dtype):
    """`stw.TensorFileWriter` (the ZeRO-3 save's streamed shard) writes, piece by piece, the file
    safetensors' own ``save_file`` writes for the same tensor and metadata; keys and shapes chosen
    so that the JSON header needs padding to 8 bytes (the spec's spaces)."""
    g = torch.Generator().manual_seed(0)
    padded = {}
    for key, shape in (("model.embed_tokens.weight", (37, 11)), ("lm_head.weight", (5, 3, 7)), ("w", (1,))):
        t = torch.randn(shape, generator=g).to(dtype)
        ref, got = tmp_path / "ref.safetensors", tmp_path / "got.safetensors"
        save_file({key: t}, str(ref), metadata={"format": "pt"})
        flat = t.reshape(-1)
        with stw.TensorFileWriter(got, key, dtype, shape, metadata={"format": "pt"}) as w:
            for lo in range(0, flat.numel(), 6):  # uneven pieces, the last one shorter
                w.write(flat[lo : lo + 6])
        assert got.read_bytes() == ref.read_bytes(), key
        head = stw.header_bytes(key, dtype, shape, {"format": "pt"})
        n = int.from_bytes(head[:8], "little")
        assert len(head) == 8 + n and n % 8 == 0 and got.read_bytes()[: 8 + n] == head
        padded[key] = head.endswith(b" ")
        with safe_open(str(got), framework="pt") as f:
            assert f.metadata() == {"format": "pt"} and list(f.keys()) == [key]
            assert torch.equal(f.get_tensor(key), t) and f.get_tensor(key).dtype == dtype
    assert padded["model.embed_tokens.weight"]  # its header needed the spaces (both dtypes)


def test_streamed_writer_refuses_a_wrong_byte_count(tmp_path):
    path = tmp_path / "t.safetensors"
    with pytest.raises(CheckpointError, match="holds 24 bytes, got 16"):
        with stw.TensorFileWriter(path, "w", torch.float32, (2, 3)) as w:
            w.write(torch.zeros(4))
    assert not path.exists()  # no partial file left
    with pytest.raises(CheckpointError, match="holds 24 bytes, got 28"):
        with stw.TensorFileWriter(path, "w", torch.float32, (2, 3)) as w:
            w.write(torch.zeros(7))
    assert not path.exists()
    with pytest.raises(CheckpointError, match="got a torch.float16 piece"):
        with stw.TensorFileWriter(path, "w", torch.float32, (2, 3)) as w:
            w.write(torch.zeros(6, dtype=torch.float16))
    assert not path.exists()


def test_shard_writer_matches_save_file_byte_for_byte(tmp_path, monkeypatch):
    """`stw.ShardWriter` (the streamed export's shards) writes tensors of every dtype safetensors
    names, added one at a time in an arbitrary order (a scalar, an empty tensor, a non-contiguous
    view among them), into the file ``save_file`` writes for the same dict and metadata: the same
    storage order (dtype, then name), header and bytes; the spill is gone afterwards. The copy
    runs in 5-byte pieces here, so a tensor crosses several."""
    monkeypatch.setattr(stw, "COPY_BYTES", 5)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i, dtype in enumerate(stw.ST_DTYPES.values()):
        shape = [(3, 5), (7,), (), (0, 4)][i % 4]
        raw = torch.randint(0, 100, shape, generator=g)
        tensors[f"{'zyx'[i % 3]}.{i}.{str(dtype)[6:]}"] = raw.to(dtype)
    tensors["a.view"] = torch.randn(6, 4, generator=g).t()  # not contiguous
    order = list(tensors)
    order = order[1::2] + order[::2]  # not the storage order
    ref, got = tmp_path / "ref.safetensors", tmp_path / "got.safetensors"
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(ref), metadata={"format": "pt"})
    with stw.ShardWriter(got, metadata={"format": "pt"}) as w:
        for k in order:
            w.add(k, tensors[k])
        assert w.spill.is_file() and not got.exists()  # nothing assembled before close
    assert got.read_bytes() == ref.read_bytes()
    assert not w.spill.exists()
    with safe_open(str(got), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())


def test_save_tensors_writes_the_same_bytes_every_time(tmp_path):
    """`stw.save_tensors` (PTQ scales, a fake export's scales: two metadata keys) puts the metadata
    in key order, so the same tensors give the same file (safetensors' own ``save_file`` writes
    the metadata from a hash map: its order, hence the file's hash, may change from run to run);
    the tensors and metadata read back as saved."""
    t = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.int32)}
    meta = {"qatlib": "ptq-scales", "format": "pt"}
    for i in range(3):
        stw.save_tensors(
            t, tmp_path / f"{i}.safetensors", metadata=dict(reversed(meta.items())) if i else meta
        )
    files = [(tmp_path / f"{i}.safetensors").read_bytes() for i in range(3)]
    assert files[0] == files[1] == files[2]
    n = int.from_bytes(files[0][:8], "little")
    assert json.loads(files[0][8 : 8 + n])["__metadata__"] == {"format": "pt", "qatlib": "ptq-scales"}
    assert files[0][8:].index(b'"format"') < files[0][8:].index(b'"qatlib"')
    with safe_open(str(tmp_path / "0.safetensors"), framework="pt") as f:
        assert f.metadata() == meta and all(torch.equal(f.get_tensor(k), v) for k, v in t.items())


def test_shard_writer_leaves_nothing_on_an_error(tmp_path):
    path = tmp_path / "t.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with stw.ShardWriter(path) as w:
            w.add("w", torch.zeros(3))
            raise RuntimeError("boom")
    assert not path.exists() and not w.spill.exists()
    with pytest.raises(CheckpointError, match="w added twice"):
        with stw.ShardWriter(path) as w:
            w.add("w", torch.zeros(3))
            w.add("w", torch.zeros(3))
    assert not path.exists() and not w.spill.exists()


def test_read_elements_reads_a_range_and_finds_a_short_read(tmp_path):
    t = torch.randn(7, 5).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(3), "t": t}, str(path))
    info = next(i for i in st.read_header(path) if i.key == "t")
    assert info.torch_dtype == torch.bfloat16
    with open(path, "rb") as fh:
        for lo, n in ((0, 35), (3, 9), (34, 1), (35, 0)):
            out = torch.empty(n, dtype=torch.bfloat16)
            assert torch.equal(st.read_elements(fh, info, lo, out), t.reshape(-1)[lo : lo + n])
        with pytest.raises(CheckpointError, match="outside t"):
            st.read_elements(fh, info, 30, torch.empty(6, dtype=torch.bfloat16))
        with pytest.raises(CheckpointError, match="read into a torch.float32"):
            st.read_elements(fh, info, 0, torch.empty(2))
    os.truncate(path, info.start + 10)  # the file shrank after its header was read
    with open(path, "rb") as fh, pytest.raises(CheckpointError, match="short read of t"):
        st.read_elements(fh, info, 2, torch.empty(8, dtype=torch.bfloat16))


def test_weight_plan_from_shapes_alone(tmp_path):
    """A fused-expert checkpoint planned into linearised experts from a `ModelTensors` (no model):
    every slice lands once, and bad checkpoints are one error listing every problem."""
    E, inter, hidden = 2, 3, 4
    model = st.ModelTensors(
        params={
            **{
                f"mlp.experts.{e}.{p}.weight": (inter, hidden)
                for e in range(E)
                for p in ("gate_proj", "up_proj")
            },
            **{f"mlp.experts.{e}.down_proj.weight": (hidden, inter) for e in range(E)},
            "mlp.experts.0.up_proj.weight_quantizer.scale": (inter, 1),
        },
        buffers={},
        aliases={},
        experts={"mlp.experts": st.ExpertBlock(E, inter, fused=False)},
        optional=frozenset({"mlp.experts.0.up_proj.weight_quantizer.scale"}),
    )
    gate_up, down = torch.randn(E, 2 * inter, hidden), torch.randn(E, hidden, inter)
    f = tmp_path / "fused.safetensors"
    save_file(
        {
            "mlp.experts.gate_up_proj": gate_up,
            "mlp.experts.down_proj": down,
            "model.rotary_emb.inv_freq": torch.ones(2),
        },
        str(f),
    )
    plan = st.weight_plan([f], model, where="fused")
    dest = {n: torch.full(s, float("nan")) for n, s in model.params.items()}
    with open(f, "rb") as fh:
        for e in plan:
            st.copy_entry(fh, e, dest.__getitem__)
    for e in range(E):
        assert torch.equal(dest[f"mlp.experts.{e}.gate_proj.weight"], gate_up[e, :inter])
        assert torch.equal(dest[f"mlp.experts.{e}.up_proj.weight"], gate_up[e, inter:])
        assert torch.equal(dest[f"mlp.experts.{e}.down_proj.weight"], down[e])
    bad = tmp_path / "bad.safetensors"
    save_file(
        {"mlp.experts.gate_up_proj": gate_up[:, :, :2].contiguous(), "extra.weight": torch.ones(1)}, str(bad)
    )
    with pytest.raises(CheckpointError) as err:
        st.weight_plan([bad], model, where="bad")
    msg = str(err.value)
    assert "unexpected (1): extra.weight" in msg and "shape mismatch (1)" in msg
    # the mismatched target (expert 0's gate) is not listed again as missing; the quantizer scale
    # (optional) is not missing at all
    assert "missing (5): mlp.experts.0.up_proj.weight, mlp.experts.1.gate_proj.weight, " in msg
    assert "mlp.experts.0.gate_proj.weight (" not in msg and "weight_quantizer" not in msg


def test_publish_permissions_opens_a_private_temp_folder(tmp_path):
    """Model folders made through AtomicDir's mkdtemp (0700) with 0600 files become 0755 / 0644."""
    import stat

    from qatlib.checkpoint.layout import publish_permissions

    d = tmp_path / "out"
    d.mkdir(mode=0o700)
    (d / "model.safetensors").write_bytes(b"x")
    os.chmod(d / "model.safetensors", 0o600)
    publish_permissions(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert stat.S_IMODE((d / "model.safetensors").stat().st_mode) == 0o644


def test_weights_dir_names_a_missing_weights_file(tmp_path):
    """`layout.weights_dir`: None for a scales-only checkpoint, the folder when its record names
    weights it holds, and an error naming the record and the file when it names absent weights."""
    from qatlib.checkpoint.layout import CheckpointError, weights_dir

    rec = QuantScheme("int4", weight=QuantSpec("int4", Granularity.GROUP, group_size=16)).to_dict()
    (tmp_path / "quant_scheme.json").write_text(json.dumps(rec))
    assert weights_dir(tmp_path) is None
    (tmp_path / "quant_scheme.json").write_text(json.dumps({**rec, "weights": "model.safetensors"}))
    with pytest.raises(CheckpointError, match=r"quant_scheme\.json names the weights 'model\.safetensors'"):
        weights_dir(tmp_path)
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert weights_dir(tmp_path) == tmp_path
