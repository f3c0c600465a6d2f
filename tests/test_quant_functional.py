"""qatlib.quant.functional against a plain, independently written reference.

The reference below follows docs/design.md literally, one scalar at a time, in numpy float32
(IEEE-754 single precision, the same correctly rounded + - * / as torch's fp32 kernels), with
Python's ``round`` (half-to-even, like ``torch.round``) and a hand-written FP8 E4M3 rounding. It
shares no code with qatlib, so every comparison below is bit-exact unless stated otherwise.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np
import pytest
import torch

from qatlib.quant import compute_qparams, dequantize, fake_quantize, quantize
from qatlib.quant import functional as QF
from qatlib.quant.spec import FP4_FORMATS, QTYPES, Granularity, QuantSpec

F32 = np.float32
FP8 = torch.float8_e4m3fn


# =========================================================================== reference
def ref_range(qtype: str) -> tuple[int, int]:
    """Signed code range: int b -> [-2^(b-1), 2^(b-1) - 1]; fp8 E4M3 -> [-448, 448]."""
    if qtype == "fp8":
        return -448, 448
    b = int(qtype[3:])
    return -(2 ** (b - 1)), 2 ** (b - 1) - 1


def _e4m3_positive_values() -> list[float]:
    """Every finite non-negative E4M3 value, indexed by its 7-bit code (0x7F is NaN in e4m3fn)."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


E4M3 = _e4m3_positive_values()


def e4m3_round(t: float) -> float:
    """Round to the nearest E4M3 value, ties to the even code (mantissa LSB 0); |t| <= 448."""
    a = abs(t)
    assert a <= 448.0
    i = bisect.bisect_right(E4M3, a) - 1
    if i == len(E4M3) - 1:
        r = E4M3[i]
    else:
        lo, hi = E4M3[i], E4M3[i + 1]
        if a - lo < hi - a:
            r = lo
        elif a - lo > hi - a:
            r = hi
        else:  # exact tie: codes i and i + 1 are adjacent, the even one wins
            r = lo if i % 2 == 0 else hi
    return math.copysign(r, t)


def ref_qparams_slice(vals: list, qtype: str, sym: bool) -> tuple[np.float32, int | None]:
    """docs/design.md: sym s = absmax / qmax; asym s = (max - min) / (qmax - qmin) with
    min <= 0 <= max, z = clamp(round(qmin - min / s)); an all-zero slice gets s = 1."""
    qmin, qmax = ref_range(qtype)
    if sym:
        absmax = F32(max(abs(F32(v)) for v in vals))
        s = absmax / F32(qmax)
        return (s if s > 0 else F32(1.0)), None
    mn = min(F32(min(vals)), F32(0.0))
    mx = max(F32(max(vals)), F32(0.0))
    s = F32(mx - mn) / F32(qmax - qmin)
    if not s > 0:
        s = F32(1.0)
    z = round(float(F32(qmin) - mn / s))
    return s, min(max(z, qmin), qmax)


def ref_code(v, s, z, qtype: str) -> float:
    """q = clamp(round(x / s) + z, qmin, qmax); fp8: q = fp8(clamp(x / s, -448, 448))."""
    qmin, qmax = ref_range(qtype)
    t = F32(v) / F32(s)
    if qtype == "fp8":
        return e4m3_round(float(min(max(t, F32(-448.0)), F32(448.0))))
    return float(min(max(round(float(t)) + (z or 0), qmin), qmax))


def ref_dequant(q: float, s, z) -> np.float32:
    """x ~ (q - z) * s."""
    return F32(q - (z or 0)) * F32(s)


def scale_key(idx: tuple, kind: str, shape: tuple, group_size=None, num_heads=None) -> tuple:
    """Index of the stored scale that element ``idx`` of a ``shape`` tensor uses (design.md table)."""
    if kind == "tensor":
        return (0,)
    if kind in ("channel", "token"):
        return (*idx[:-1], 0)
    if kind == "group":
        return (*idx[:-1], idx[-1] // group_size)
    head = idx[-1] // (shape[-1] // num_heads)
    if kind == "head-static":
        return (head,)
    if kind == "head-dynamic":
        return (*idx[:-1], head)
    raise AssertionError(kind)


def ref_qparams(x: np.ndarray, kind: str, qtype: str, sym: bool, **kw):
    """Reference scale / zero point arrays (stored shape) by explicit loops over slices."""
    slices: dict[tuple, list] = {}
    for idx in np.ndindex(*x.shape):
        slices.setdefault(scale_key(idx, kind, x.shape, **kw), []).append(x[idx])
    shape = tuple(max(k[d] for k in slices) + 1 for d in range(len(next(iter(slices)))))
    scale = np.zeros(shape, dtype=F32)
    zp = None if sym else np.zeros(shape, dtype=F32)
    for key, vals in slices.items():
        s, z = ref_qparams_slice(vals, qtype, sym)
        scale[key] = s
        if zp is not None:
            zp[key] = z
    return scale, zp


def ref_quant_dequant(x: np.ndarray, scale: np.ndarray, zp, kind: str, qtype: str, **kw):
    codes = np.zeros(x.shape, dtype=np.float64)
    deq = np.zeros(x.shape, dtype=F32)
    for idx in np.ndindex(*x.shape):
        key = scale_key(idx, kind, x.shape, **kw)
        s = scale[key]
        z = None if zp is None else round(float(zp[key]))
        codes[idx] = ref_code(x[idx], s, z, qtype)
        deq[idx] = ref_dequant(codes[idx], s, z)
    return codes, deq


# =========================================================================== fixed tensors
def weight_tensor() -> torch.Tensor:
    """[4, 16] weight, groups of 4, with the edge cases in fixed places."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(4, 16, generator=g) * 2
    w[0, 0:4] = 0.0  # an all-zero group
    w[0, 4:8] = torch.tensor([-0.5, -1.25, -3.0, -0.1])  # negative-only group (asym: z = qmax)
    w[0, 8:12] = torch.tensor([1e-30, -3e-30, 2e-30, 0.0])  # tiny magnitudes
    w[0, 12:16] = torch.tensor([2.0, -7.0, 0.25, 3.5])  # int4 sym: s = 1, x/s = 3.5 is a tie
    w[2] = 0.0  # an all-zero row (per-channel)
    w[3, 0:4] = torch.tensor([0.1, 0.7, 2.0, 0.3])  # positive-only group
    return w


def act_tensor() -> torch.Tensor:
    """[2, 3, 16] activation: 4 heads of 4, with an all-zero token, an all-zero head (every token),
    a negative-only token and a tiny token."""
    g = torch.Generator().manual_seed(99)
    a = torch.randn(2, 3, 16, generator=g) * 3
    a[0, 0] = 0.0
    a[..., 12:16] = 0.0
    a[1, 2] = -a[1, 2].abs() - 0.01
    a[1, 0] = torch.tensor([1e-30, -2e-30, 5e-31, 0.0] * 4)
    return a


CASES = {
    # name: (tensor factory, granularity, dynamic, extra spec kwargs, reference kwargs)
    "tensor-weight": (weight_tensor, Granularity.TENSOR, False, {}, {}),
    "tensor-act-dynamic": (act_tensor, Granularity.TENSOR, True, {}, {}),
    "channel": (weight_tensor, Granularity.CHANNEL, False, {}, {}),
    "group": (weight_tensor, Granularity.GROUP, False, {"group_size": 4}, {"group_size": 4}),
    "token": (act_tensor, Granularity.TOKEN, True, {}, {}),
    "head-static": (act_tensor, Granularity.HEAD, False, {"num_heads": 4}, {"num_heads": 4}),
    "head-dynamic": (act_tensor, Granularity.HEAD, True, {"num_heads": 4}, {"num_heads": 4}),
}
REF_KIND = {
    "tensor-weight": "tensor",
    "tensor-act-dynamic": "tensor",
    "channel": "channel",
    "group": "group",
    "token": "token",
    "head-static": "head-static",
    "head-dynamic": "head-dynamic",
}
# the FP4 formats (per-group of a fixed size only) have their own reference: tests/test_fp4.py
_GRID_QTYPES = [q for q in QTYPES if q not in FP4_FORMATS]
QTYPE_SYM = [(q, True) for q in _GRID_QTYPES] + [(q, False) for q in _GRID_QTYPES if q != "fp8"]


def _spec(case: str, qtype: str, sym: bool) -> QuantSpec:
    _, gran, dynamic, kw, _ = CASES[case]
    return QuantSpec(qtype, gran, symmetric=sym, dynamic=dynamic, **kw)


def _check_against_reference(x: torch.Tensor, scale, zp, spec: QuantSpec, case: str) -> None:
    kind, rkw = REF_KIND[case], CASES[case][4]
    xn = x.numpy()
    zn = None if zp is None else zp.detach().numpy()
    codes_ref, deq_ref = ref_quant_dequant(xn, scale.detach().numpy(), zn, kind, spec.qtype, **rkw)

    q = quantize(x, scale, zp, spec)
    assert q.shape == x.shape
    assert q.dtype == (FP8 if spec.is_fp8 else torch.int8)
    np.testing.assert_array_equal(q.float().numpy(), codes_ref)
    qmin, qmax = ref_range(spec.qtype)
    assert q.float().min() >= qmin and q.float().max() <= qmax

    deq = dequantize(q, scale, zp, spec)
    assert deq.dtype == torch.float32
    np.testing.assert_array_equal(deq.numpy(), deq_ref)

    fq = fake_quantize(x, scale, zp, spec)
    assert torch.equal(fq, deq)
    assert not torch.isnan(fq).any()


# =========================================================================== the grid
def test_code_ranges_follow_design():
    for b in range(2, 9):
        spec = QuantSpec(f"int{b}")
        assert (spec.qmin, spec.qmax) == (-(2 ** (b - 1)), 2 ** (b - 1) - 1)
    assert (QuantSpec("int4").qmin, QuantSpec("int4").qmax) == (-8, 7)
    assert (QuantSpec("fp8").qmin, QuantSpec("fp8").qmax) == (-448, 448)
    assert E4M3[-1] == 448.0 and float(torch.finfo(FP8).max) == 448.0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("qtype,sym", QTYPE_SYM, ids=[f"{q}-{'sym' if s else 'asym'}" for q, s in QTYPE_SYM])
def test_grid_against_reference(case, qtype, sym):
    """compute_qparams / quantize / dequantize / fake_quantize for every qtype x granularity x
    symmetry, bit-exact against the reference; then again with a shrunken scale (clipping) and a
    shifted zero point."""
    x = CASES[case][0]()
    spec = _spec(case, qtype, sym)
    kind, rkw = REF_KIND[case], CASES[case][4]

    scale, zp = compute_qparams(x, spec)
    scale_ref, zp_ref = ref_qparams(x.numpy(), kind, qtype, sym, **rkw)
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == scale_ref.shape
    np.testing.assert_array_equal(scale.numpy(), scale_ref)
    if sym:
        assert zp is None
    else:
        assert zp.dtype == torch.float32 and zp.shape == scale.shape
        np.testing.assert_array_equal(zp.numpy(), zp_ref)
        qmin, qmax = ref_range(qtype)
        assert ((zp >= qmin) & (zp <= qmax)).all()
    if not spec.dynamic:  # weights [out, in]; static activation scales are sized from [in]
        assert tuple(scale.shape) == QF.scale_shape(x.shape if x.dim() == 2 else x.shape[-1:], spec)
    assert torch.isfinite(scale).all() and (scale > 0).all()

    _check_against_reference(x, scale, zp, spec, case)

    # shrink the scale so that the range clips, and move the zero point off its optimum
    g = torch.Generator().manual_seed(7)
    scale2 = scale * (0.2 + 0.5 * torch.rand(scale.shape, generator=g))
    zp2 = None if zp is None else zp + torch.randint(-2, 3, zp.shape, generator=g).float()
    _check_against_reference(x, scale2, zp2, spec, case)
    q = quantize(x, scale2, zp2, spec).float()
    qmin, qmax = ref_range(qtype)
    assert (q == qmax).any() or (q == qmin).any(), "the shrunken scale should clip something"


def test_all_zero_slices_get_scale_one():
    w = weight_tensor()
    for qtype, sym in QTYPE_SYM:
        s, z = compute_qparams(w, QuantSpec(qtype, Granularity.GROUP, group_size=4, symmetric=sym))
        assert s[0, 0] == 1.0 and (s[2] == 1.0).all()
        s, z = compute_qparams(w, QuantSpec(qtype, Granularity.CHANNEL, symmetric=sym))
        assert s[2, 0] == 1.0
        assert fake_quantize(w, s, z, QuantSpec(qtype, Granularity.CHANNEL, symmetric=sym))[2].eq(0).all()
    s, _ = compute_qparams(torch.zeros(3, 8), QuantSpec("int8", Granularity.TOKEN))
    assert torch.equal(s, torch.ones(3, 1))


def test_negative_only_asym_zero_point_is_qmax_and_tiny_values_survive():
    w = weight_tensor()
    spec = QuantSpec("int4", Granularity.GROUP, group_size=4, symmetric=False)
    s, z = compute_qparams(w, spec)
    assert z[0, 1] == 7  # min=-3, max clamps to 0 -> zero maps to qmax
    assert s[0, 1] == F32(3.0) / F32(15)
    fq = fake_quantize(w, s, z, spec)
    assert fq[0, 4:8].max() <= 0
    # tiny group: exact scale, codes use the full range, no underflow to NaN / inf
    spec = QuantSpec("int8", Granularity.GROUP, group_size=4)
    s, _ = compute_qparams(w, spec)
    assert s[0, 2] == F32(3e-30) / F32(127)
    assert quantize(w, s, None, spec)[0, 8:12].tolist() == [42, -127, 85, 0]
    assert torch.isfinite(fake_quantize(w, s, None, spec)).all()
    torch.testing.assert_close(fake_quantize(w, s, None, spec)[0, 8:12], w[0, 8:12], rtol=1e-2, atol=0)


# =========================================================================== rounding ties
def test_round_half_to_even_int4_sym():
    """x / s = k + 0.5 exactly (s = 0.25): torch.round / the design round half to even."""
    spec = QuantSpec("int4")
    s = torch.tensor([0.25])
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 7.5, -8.5]) * 0.25
    q = quantize(x, s, None, spec)
    assert q.tolist() == [0, 2, 2, 4, 0, -2, -2, -4, 7, -8]  # half-away-from-zero would give 1, 2, 3, 4, ...
    assert fake_quantize(x, s, None, spec).tolist() == [v * 0.25 for v in [0, 2, 2, 4, 0, -2, -2, -4, 7, -8]]


def test_round_half_to_even_asym_zero_point():
    spec = QuantSpec("int8", symmetric=False)
    s, z = torch.tensor([0.5]), torch.tensor([3.0])
    x = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75]) * 1.0  # x / s = 0.5, 1.5, 2.5, -0.5, -1.5
    assert quantize(x, s, z, spec).tolist() == [3, 5, 5, 3, 1]
    # a non-integer stored zero point is rounded half-to-even too (2.5 -> 2)
    assert quantize(x, s, torch.tensor([2.5]), spec).tolist() == [2, 4, 4, 2, 0]


def test_round_half_to_even_in_qparams_zero_point():
    # int4 asym, min = -10.5, max = 4.5: s = 15 / 15 = 1, z = round(-8 + 10.5) = round(2.5) = 2
    # (half-up and half-away-from-zero would both give 3)
    s, z = compute_qparams(torch.tensor([-10.5, 4.5]), QuantSpec("int4", symmetric=False))
    assert s.item() == 1.0 and z.item() == 2.0
    # z = round(-8 + 5.5) = round(-2.5) = -2 (half-away would give -3)
    s, z = compute_qparams(torch.tensor([-5.5, 9.5]), QuantSpec("int4", symmetric=False))
    assert s.item() == 1.0 and z.item() == -2.0


def test_e4m3_reference_matches_torch_cast_and_ties_to_even():
    """The hand-written E4M3 rounding equals torch's cast on a dense sweep, midpoints included."""
    mids = [(a + b) / 2 for a, b in itertools.pairwise(E4M3)]
    sweep = (
        torch.linspace(-448, 448, 20001).tolist()
        + E4M3
        + mids
        + [-m for m in mids]
        + [1e-30, 2.0**-10, 3 * 2.0**-11]
    )
    t = torch.tensor(sweep, dtype=torch.float32)
    ours = [e4m3_round(v) for v in t.tolist()]
    assert t.to(FP8).float().tolist() == ours
    # explicit ties: 1.0625 is halfway between 1.0 (mantissa 000) and 1.125 (001) -> 1.0
    assert e4m3_round(1.0625) == 1.0 and e4m3_round(1.1875) == 1.25
    assert torch.tensor([1.0625, 1.1875]).to(FP8).float().tolist() == [1.0, 1.25]


def test_fp8_codes_equal_direct_cast():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 32, generator=g) * 5
    for gran, kw in [
        (Granularity.TENSOR, {}),
        (Granularity.CHANNEL, {}),
        (Granularity.GROUP, {"group_size": 8}),
    ]:
        spec = QuantSpec("fp8", gran, **kw)
        s, _ = compute_qparams(x, spec)
        s = s * 0.6  # some elements clip at +-448
        q = quantize(x, s, None, spec)
        se = s.unsqueeze(-1) if gran is Granularity.GROUP else s
        direct = torch.clamp(QF._grouped(x, spec) / se, -448, 448).to(FP8).reshape(x.shape)
        assert q.dtype == FP8
        assert torch.equal(q.float(), direct.float())
        assert (q.float().abs() == 448).any()
        assert torch.equal(dequantize(q, s, None, spec), (QF._grouped(q.float(), spec) * se).reshape(x.shape))


# =========================================================================== bit-exactness
SPECS_FOR_RANDOM = [
    QuantSpec("int4", Granularity.GROUP, group_size=8),
    QuantSpec("int4", Granularity.GROUP, group_size=8, symmetric=False),
    QuantSpec("int4", Granularity.GROUP, group_size=8, fp8_recast=True),
    QuantSpec("int8", Granularity.CHANNEL),
    QuantSpec("int3", Granularity.CHANNEL, symmetric=False),
    QuantSpec("int2", Granularity.TENSOR, symmetric=False),
    QuantSpec("int8", Granularity.TOKEN),
    QuantSpec("int6", Granularity.TOKEN, symmetric=False),
    QuantSpec("fp8", Granularity.TENSOR),
    QuantSpec("fp8", Granularity.CHANNEL),
    QuantSpec("fp8", Granularity.GROUP, group_size=16),
    QuantSpec("fp8", Granularity.TOKEN),
    QuantSpec("int8", Granularity.HEAD, num_heads=4),
    QuantSpec("int8", Granularity.HEAD, num_heads=4, dynamic=True, symmetric=False),
    QuantSpec("fp8", Granularity.HEAD, num_heads=2, dynamic=True),
]


@pytest.mark.parametrize("seed", range(12))
def test_fake_quantize_equals_dequantize_of_quantize(seed):
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for i, spec in enumerate(SPECS_FOR_RANDOM):
        lead = tuple(int(d) for d in torch.randint(1, 5, (1 + (i + seed) % 2,), generator=g))
        x = (torch.randn(*lead, 32, generator=g) * torch.rand(1, generator=g) * 10).to(dtypes[(i + seed) % 3])
        scale, zp = compute_qparams(x, spec)
        scale = scale * (0.3 + 1.2 * torch.rand(scale.shape, generator=g))  # some clip, some don't
        if zp is not None:
            zp = zp + torch.rand(zp.shape, generator=g) - 0.5  # a trained, non-integer zero point
        if seed % 3 == 0:
            x = x.clone()
            x.view(-1)[0] = 6e4 if x.dtype == torch.float16 else 1e9  # far outside the range
        q = quantize(x, scale, zp, spec)
        for clamp_grad in ("mask", "pass"):
            fq = fake_quantize(x, scale, zp, spec, clamp_grad=clamp_grad)
            assert fq.dtype == x.dtype
            dq = dequantize(q, scale, zp, spec, x.dtype)
            assert torch.equal(fq, dq), (spec.describe(), clamp_grad, (fq.float() - dq.float()).abs().max())


def test_pass_mode_is_exact_far_out_of_range():
    """``x + (clamp(x) - x).detach()`` loses the clamped value once |x| >> qmax (1e10 + (7 - 1e10)
    is 0 in fp32); the value of fake_quantize must not depend on clamp_grad."""
    spec = QuantSpec("int4")
    x = torch.tensor([1e10, 3.0, -2e12, 5e8])
    s = torch.tensor([1.0])
    expect = torch.tensor([7.0, 3.0, -8.0, 7.0])
    for mode in ("mask", "pass"):
        assert torch.equal(fake_quantize(x, s, None, spec, clamp_grad=mode), expect)
    fp8 = QuantSpec("fp8")
    assert torch.equal(
        fake_quantize(x, s, None, fp8, clamp_grad="pass"), torch.tensor([448.0, 3.0, -448.0, 448.0])
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_in_out(dtype):
    x = weight_tensor()[1:].to(dtype)
    for spec in (
        QuantSpec("int4", Granularity.GROUP, group_size=4, symmetric=False),
        QuantSpec("fp8", Granularity.CHANNEL),
    ):
        s, z = compute_qparams(x, spec)
        assert s.dtype == torch.float32 and (z is None or z.dtype == torch.float32)
        out = fake_quantize(x, s, z, spec)
        assert out.dtype == dtype
        # computed in fp32, cast once at the end
        ref = fake_quantize(x.float(), s, z, spec).to(dtype)
        assert torch.equal(out, ref)
        assert dequantize(quantize(x, s, z, spec), s, z, spec, dtype).dtype == dtype
    assert QF.dynamic_fake_quantize(x, QuantSpec("int8", Granularity.TOKEN)).dtype == dtype


def test_fp8_recast_output_is_fp8_representable():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    spec = QuantSpec("int4", Granularity.GROUP, group_size=32, fp8_recast=True)
    s, _ = compute_qparams(w, spec)
    out = fake_quantize(w, s, None, spec)
    plain = fake_quantize(w, s, None, spec.replace(fp8_recast=False))
    st = plain.abs().max() / 448
    assert torch.equal(out, (plain / st).to(FP8).float() * st)
    assert not torch.equal(out, plain)


def test_shape_errors():
    with pytest.raises(ValueError, match="group_size 5 does not divide"):
        compute_qparams(torch.zeros(4, 12), QuantSpec("int4", Granularity.GROUP, group_size=5))
    with pytest.raises(ValueError, match="num_heads"):
        compute_qparams(torch.zeros(4, 12), QuantSpec("int8", Granularity.HEAD))
    with pytest.raises(ValueError, match="num_heads 5 does not divide"):
        compute_qparams(torch.zeros(4, 12), QuantSpec("int8", Granularity.HEAD, num_heads=5))
    with pytest.raises(ValueError, match="dynamic"):
        QF.scale_shape((4, 12), QuantSpec("int8", Granularity.TOKEN))
    with pytest.raises(ValueError, match="clamp_grad"):
        fake_quantize(torch.zeros(2), torch.ones(1), None, QuantSpec("int8"), clamp_grad="clip")
    with pytest.raises(ValueError):
        QuantSpec("fp8", symmetric=False)


# =========================================================================== gradients
def _per_element(x: torch.Tensor, s: torch.Tensor, z=None):
    """Per-channel spec on an [N, 1] tensor: every element has its own scale -> per-element grads."""
    return x.reshape(-1, 1), s.reshape(-1, 1), None if z is None else z.reshape(-1, 1)


def test_ste_and_clamp_gradient_to_x():
    spec = QuantSpec("int4")
    s = torch.tensor([0.5])
    x = torch.tensor([0.1, -0.7, 1.26, 3.4, -3.9, 3.76, 10.0, -4.3, -100.0], requires_grad=True)
    inside = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)  # 3.76/0.5 -> 8 > 7 clips
    for mode, expect in (("mask", inside.float()), ("pass", torch.ones(9))):
        x.grad = None
        fake_quantize(x, s, None, spec, clamp_grad=mode).sum().backward()
        assert torch.equal(x.grad, expect), mode
    # fp8: inside |x/s| <= 448 -> 1 (STE through the cast)
    fp8 = QuantSpec("fp8")
    xf = torch.tensor([0.1, 200.0, 224.0, 225.0, -300.0], requires_grad=True)
    fake_quantize(xf, s, None, fp8).sum().backward()
    assert xf.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    xf.grad = None
    fake_quantize(xf, s, None, fp8, clamp_grad="pass").sum().backward()
    assert xf.grad.tolist() == [1.0] * 5
    # upstream gradient is passed through unchanged (chain rule), in bf16 too
    xb = torch.tensor([0.1, 1.3, 50.0], dtype=torch.bfloat16, requires_grad=True)
    w = torch.tensor([2.0, -3.0, 5.0], dtype=torch.bfloat16)
    (fake_quantize(xb, s, None, spec) * w).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and xb.grad.tolist() == [2.0, -3.0, 0.0]


@pytest.mark.parametrize("mode", ["mask", "pass"])
@pytest.mark.parametrize("qtype", ["int4", "int8", "int2"])
def test_lsq_scale_gradient_sym(qtype, mode):
    qmin, qmax = ref_range(qtype)
    spec = QuantSpec(qtype, Granularity.CHANNEL)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, generator=g) * qmax
    s = torch.full((40,), 0.8)
    x, s, _ = _per_element(x, s)
    s.requires_grad_(True)
    fake_quantize(x, s, None, spec, clamp_grad=mode).sum().backward()
    v = x / s.detach()
    r = torch.round(v)
    expect = torch.where(r > qmax, float(qmax), torch.where(r < qmin, float(qmin), r - v))
    clipped = (r > qmax) | (r < qmin)
    assert clipped.any() and (~clipped).any()
    # r - v loses ~ulp(x/s) when autograd forms it as q - s * x / s^2 (|x/s| up to ~3 qmax here)
    torch.testing.assert_close(s.grad, expect, rtol=0, atol=4 * qmax * 2.0**-23)


@pytest.mark.parametrize("mode", ["mask", "pass"])
def test_lsq_scale_and_zero_point_gradient_asym(mode):
    qmin, qmax = -8, 7
    spec = QuantSpec("int4", Granularity.CHANNEL, symmetric=False)
    x = torch.tensor([0.3, -1.1, 2.2, 4.4, -9.0, 6.0, 0.05, -3.3])
    s = torch.full((8,), 0.5)
    z = torch.full((8,), 3.0)  # codes: round(x/s) + 3, range [-8, 7]
    x, s, z = _per_element(x, s, z)
    s.requires_grad_(True)
    z.requires_grad_(True)
    fake_quantize(x, s, z, spec, clamp_grad=mode).sum().backward()
    v = x / 0.5
    pre = torch.round(v) + 3
    hi, lo = pre > qmax, pre < qmin
    assert hi.any() and lo.any()
    expect_s = torch.where(hi, qmax - 3.0, torch.where(lo, qmin - 3.0, torch.round(v) - v))
    torch.testing.assert_close(s.grad, expect_s, rtol=1e-5, atol=1e-6)
    # LSQ+: zero point gets -s where clipped, 0 inside (the +z and -z cancel)
    expect_z = torch.where(hi | lo, -0.5, 0.0)
    assert torch.equal(z.grad, expect_z)


def test_lsq_fp8_scale_gradient():
    spec = QuantSpec("fp8", Granularity.CHANNEL)
    x = torch.tensor([0.3, -1.7, 100.0, 223.0, 300.0, -500.0])
    s = torch.full((6,), 0.5)
    x, s, _ = _per_element(x, s)
    s.requires_grad_(True)
    fake_quantize(x, s, None, spec).sum().backward()
    v = x / 0.5
    q = v.clamp(-448, 448).to(FP8).float()
    expect = torch.where(v.abs() > 448, torch.sign(v) * 448, q - v)
    torch.testing.assert_close(s.grad, expect, rtol=1e-5, atol=1e-6)


def test_finite_differences_where_defined():
    """FD is meaningful only where the function is differentiable: dequantize is linear in s
    ((q - z) * s), and a clipped element of fake_quantize is exactly (qmax - z) * s. For an element
    inside the range the true derivative (codes held fixed) is q - z; LSQ adds the STE term -x/s."""
    spec = QuantSpec("int4", Granularity.CHANNEL, symmetric=False)
    x = torch.tensor([0.62, -1.13, 2.27, 4.4, -9.1, 6.0, 0.13, -3.34]).reshape(-1, 1)
    s0 = torch.full((8, 1), 0.5)
    z = torch.full((8, 1), 3.0)
    h = 1e-4

    def fq(s):
        return fake_quantize(x, s, z, spec)

    q = quantize(x, s0, z, spec)
    assert torch.equal(quantize(x, s0 + h, z, spec), q) and torch.equal(quantize(x, s0 - h, z, spec), q)
    fd = (fq(s0 + h) - fq(s0 - h)) / (2 * h)
    torch.testing.assert_close(fd, q.float() - z, rtol=0, atol=2e-3)

    s = s0.clone().requires_grad_(True)
    fq(s).sum().backward()
    clipped = (q.float() == 7) | (q.float() == -8)
    assert clipped.any()
    torch.testing.assert_close(s.grad[clipped], fd[clipped], rtol=0, atol=2e-3)
    torch.testing.assert_close(s.grad[~clipped], (fd - x / s0)[~clipped], rtol=0, atol=2e-3)

    # dequantize: autograd through the dequant part equals FD (and q - z) for int and fp8 codes
    for sp, zz in ((spec, z), (QuantSpec("fp8", Granularity.CHANNEL), None)):
        codes = quantize(x, s0, zz, sp)
        s = s0.clone().requires_grad_(True)
        dequantize(codes, s, zz, sp).sum().backward()
        fd = (dequantize(codes, s0 + h, zz, sp) - dequantize(codes, s0 - h, zz, sp)) / (2 * h)
        torch.testing.assert_close(s.grad, fd, rtol=0, atol=2e-3)
        torch.testing.assert_close(s.grad, codes.float() - (0 if zz is None else zz), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 inputs on purpose: qparams compute in fp32
def test_gradcheck_lwc_scale_is_smooth():
    """The LWC-derived scale is a smooth function of the clip factors: compare autograd with
    torch.autograd.gradcheck (central differences) and with the hand formula."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 16, generator=g)
    for sym in (True, False):
        spec = QuantSpec("int4", Granularity.GROUP, group_size=8, symmetric=sym)
        xmin, xmax = QF.observe_range(w, spec)
        cmax = torch.randn(4, 2, generator=g) + 2
        cmin = torch.randn(4, 2, generator=g) + 2

        def scale_of(a, b, xmin=xmin, xmax=xmax, spec=spec):
            return QF.qparams_from_range(xmin * torch.sigmoid(b), xmax * torch.sigmoid(a), spec)[0]

        a = cmax.clone().requires_grad_(True)
        b = cmin.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(scale_of, (a, b), eps=1e-3, atol=1e-4, rtol=1e-2)
        scale_of(a, b).sum().backward()
        sig = torch.sigmoid

        def dsig(c):
            return torch.sigmoid(c) * (1 - torch.sigmoid(c))

        if sym:
            use_max = (xmax * sig(cmax)).abs() >= (xmin * sig(cmin)).abs()
            torch.testing.assert_close(a.grad, torch.where(use_max, dsig(cmax) * xmax.abs() / 7, 0.0))
            torch.testing.assert_close(b.grad, torch.where(use_max, 0.0, dsig(cmin) * xmin.abs() / 7))
        else:
            torch.testing.assert_close(a.grad, dsig(cmax) * xmax.clamp(min=0) / 15)
            torch.testing.assert_close(b.grad, -dsig(cmin) * xmin.clamp(max=0) / 15)


def test_dynamic_fake_quantize_detaches_qparams():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 16, generator=g) * 4).requires_grad_(True)
    spec = QuantSpec("int8", Granularity.TOKEN)
    out = QF.dynamic_fake_quantize(x, spec)
    s, _ = compute_qparams(x, spec)
    assert torch.equal(out, fake_quantize(x.detach(), s, None, spec))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # sym: absmax maps to qmax, nothing clips


def test_fp8_cast_ste():
    x = torch.tensor([0.3, 0.0123, 0.9], requires_grad=True)
    y = QF.fp8_cast_ste(x)
    assert torch.equal(y, x.detach().to(FP8).float())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


# =========================================================================== fake-quant linear (issue #16)
# `fq_linear.fake_quant_linear` keeps no fake-quantized weight for backward and writes the STE / LSQ
# gradients out. Its values, input and (bf16) weight gradients must equal autograd through
# `fake_quantize` bit for bit (bf16 input gradients on the CPU: within one bf16 ulp); scale / zero-point / global-scale gradients differ only in fp32
# summation order (autograd sums the division and multiplication paths separately): measured
# <= 8e-7 of the largest entry, bound FQL_RTOL. A wrong term (sign, mask, missing 1/gs) is O(1).
FQL_RTOL = 1e-5
FQL_SPECS = [
    QuantSpec("int4", Granularity.GROUP, group_size=16),
    QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False),
    QuantSpec("int8", Granularity.CHANNEL),
    QuantSpec("int8", Granularity.CHANNEL, symmetric=False),
    QuantSpec("int8", Granularity.TENSOR, symmetric=False),
    QuantSpec("fp8", Granularity.TENSOR),
    QuantSpec("fp8", Granularity.CHANNEL),
    QuantSpec("int4", Granularity.GROUP, group_size=16, fp8_recast=True),  # w4a8_fp8
    QuantSpec("nvfp4", Granularity.GROUP, group_size=16),
    QuantSpec("mxfp4", Granularity.GROUP, group_size=32),
]


def _fql_case(spec: QuantSpec, dtype: torch.dtype, seed: int = 0):
    """A weight, a batched input, trained-looking qparams (some elements clip) and an upstream grad."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(24, 64, generator=g) * 0.05).to(dtype).requires_grad_(True)
    x = torch.randn(3, 5, 64, generator=g).to(dtype).requires_grad_(True)
    gsc = QF.fp4_global_scale(w.detach().abs().amax()) if spec.has_global_scale else None
    sc, zp = compute_qparams(w, spec, gsc)
    sc = (sc * 0.7).requires_grad_(True)
    zp = None if zp is None else (zp + 0.3).requires_grad_(True)
    gsc = None if gsc is None else (gsc * 1.1).requires_grad_(True)
    bias = torch.randn(24, generator=g).to(dtype).requires_grad_(True)
    gout = torch.randn(3, 5, 24, generator=g).to(dtype)
    return x, w, bias, sc, zp, gsc, gout


def _fql_grads(fn, x, w, bias, sc, zp, gsc, gout):
    leaves = [t for t in (x, w, bias, sc, zp, gsc) if t is not None]
    for t in leaves:
        t.grad = None
    out = fn()
    out.backward(gout)
    return out.detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("spec", FQL_SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp_grad", ["mask", "pass"])
def test_fake_quant_linear_equals_autograd_through_fake_quantize(spec, dtype, clamp_grad):
    from qatlib.quant.fq_linear import fake_quant_linear

    case = _fql_case(spec, dtype)
    x, w, bias, sc, zp, gsc, gout = case
    ref_out, ref = _fql_grads(
        lambda: torch.nn.functional.linear(
            x, fake_quantize(w, sc, zp, spec, clamp_grad=clamp_grad, global_scale=gsc), bias
        ),
        *case,
    )
    out, got = _fql_grads(
        lambda: fake_quant_linear(x, w, bias, sc, zp, spec, clamp_grad=clamp_grad, global_scale=gsc), *case
    )
    assert torch.equal(out, ref_out)
    if dtype is torch.float32:
        assert torch.equal(got[0], ref[0])  # input gradient: grad @ W_q, the same W_q, the same mm
    else:  # bf16 on the CPU: the product in fp32, rounded once (`qatlib.surgery.frozen_linear.grad_input`): <= 1 bf16 ulp
        torch.testing.assert_close(got[0], ref[0], rtol=2**-7, atol=1e-6 * ref[0].abs().max().item())
    assert torch.equal(got[2], ref[2])  # bias
    if dtype is torch.bfloat16:
        assert torch.equal(got[1], ref[1])  # weight (STE): identical once rounded to bf16
    else:  # fp32: autograd's (G * s) / s differs from G by <= 1 ulp
        torch.testing.assert_close(got[1], ref[1], rtol=2.5e-7, atol=0)
    for a, b in zip(got[3:], ref[3:]):  # scale, zero point, global scale
        assert a.shape == b.shape
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=FQL_RTOL * b.abs().max().item())


# One scale for a 16-bit weight: `fq_linear` computes every per-element result once per 16-bit value
# and gathers (`_by_table`). Every bit pattern (NaN, infinities, subnormals, -0) must come out as the
# elementwise path computes it, bit for bit.
TABLE_SPECS = [
    QuantSpec("fp8", Granularity.TENSOR),
    QuantSpec("int8", Granularity.TENSOR, symmetric=False),
    QuantSpec("int4", Granularity.TENSOR),
]


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.dtype is torch.bool:
        return t
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("spec", TABLE_SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("frozen", [False, True], ids=["free", "frozen-codes"])
def test_fake_quant_by_table_equals_the_elementwise_path_for_every_16_bit_value(spec, dtype, frozen):
    from qatlib.quant import fq_linear as FQ

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    perm = torch.randperm(4 * 65536, generator=torch.Generator().manual_seed(0))
    w = every.repeat(4)[perm].reshape(512, 512)  # each pattern 4 times, shuffled
    s = torch.tensor([0.0123])
    zp = torch.tensor([3.3]) if spec.has_zero_point else None
    frozen_at = (s * 1.1, None if zp is None else zp + 1) if frozen else None
    blocks = w.split(64)  # 32,768 elements: below the table's threshold, the elementwise path
    assert FQ._by_table(w, spec, s, zp) and not FQ._by_table(blocks[0], spec, s, zp)
    for terms in (False, True):
        got = FQ._fake_quant_parts(w, s, zp, spec, None, with_grad_terms=terms, frozen_at=frozen_at)
        ref = [
            FQ._fake_quant_parts(b, s, zp, spec, None, with_grad_terms=terms, frozen_at=frozen_at)
            for b in blocks
        ]
        for i in range(3):  # the weight, the clamp mask, dW_q/ds
            want = None if ref[0][i] is None else torch.cat([r[i] for r in ref])
            assert (got[i] is None) == (want is None)
            if want is not None:
                assert got[i].shape == w.shape and got[i].dtype == want.dtype
                assert torch.equal(_bits(got[i]), _bits(want))
        assert torch.equal(got[3], ref[0][3])
    assert torch.isnan(got[0]).sum() == 4 * torch.isnan(every).sum()  # NaNs were in the sweep


@pytest.mark.parametrize("spec", TABLE_SPECS[:2], ids=lambda s: s.describe())
def test_fake_quant_linear_by_table_equals_autograd_through_fake_quantize(spec):
    """A weight large enough for the table, bf16: output and input gradient within one bf16 ulp
    (fp32 products rounded once), the weight's STE gradient within one ulp, the scale / zero-point
    gradients to fp32 summation order."""
    from qatlib.quant import fq_linear as FQ

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(512, 512, generator=g) * 0.05).bfloat16().requires_grad_(True)
    x = torch.randn(3, 7, 512, generator=g).bfloat16().requires_grad_(True)
    sc, zp = compute_qparams(w, spec, None)
    sc = (sc * 0.7).requires_grad_(True)
    zp = None if zp is None else (zp + 0.3).requires_grad_(True)
    gout = torch.randn(3, 7, 512, generator=g).bfloat16()
    assert FQ._by_table(w, spec, sc, zp)
    case = (x, w, None, sc, zp, None, gout)
    ref_out, ref = _fql_grads(lambda: torch.nn.functional.linear(x, fake_quantize(w, sc, zp, spec)), *case)
    out, got = _fql_grads(lambda: FQ.fake_quant_linear(x, w, None, sc, zp, spec), *case)
    torch.testing.assert_close(out, ref_out, rtol=2**-7, atol=1e-6 * ref_out.abs().max().item())
    torch.testing.assert_close(got[0], ref[0], rtol=2**-7, atol=1e-6 * ref[0].abs().max().item())
    torch.testing.assert_close(got[1], ref[1], rtol=2**-7, atol=1e-6 * ref[1].abs().max().item())
    # scale, zero point: one fp32 sum over 262,144 terms each, in another order than autograd's
    # (measured 1.3e-5 of the value); a wrong term (sign, mask) is O(1)
    for a, b in zip(got[2:], ref[2:]):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("spec", TABLE_SPECS[:2], ids=lambda s: s.describe())
def test_fake_quant_linear_reused_table_buffers_keep_each_layer_its_own_values(spec):
    """The table path gathers into reused CPU buffers (`fq_linear._scratch`): two table-path
    linears in a chain, run forward and backward, give what autograd through `fake_quantize` gives
    for each (a buffer still read while the other layer overwrote it would not), and the second
    call really reuses the first one's buffer."""
    from qatlib.quant import fq_linear as FQ

    g = torch.Generator().manual_seed(5)
    w1 = (torch.randn(512, 512, generator=g) * 0.05).bfloat16().requires_grad_(True)
    w2 = (torch.randn(512, 512, generator=g) * 0.03).bfloat16().requires_grad_(True)
    x = torch.randn(2, 5, 512, generator=g).bfloat16().requires_grad_(True)
    (s1, z1), (s2, z2) = compute_qparams(w1, spec, None), compute_qparams(w2, spec, None)
    s1, s2 = s1 * 0.7, s2 * 0.8  # some weights clamped: every gradient term is exercised
    z1, z2 = (None, None) if z1 is None else (z1 + 0.3, z2 - 0.2)
    leaves = [t.requires_grad_(True) for t in (s1, s2, *(z for z in (z1, z2) if z is not None))]
    gout = torch.randn(2, 5, 512, generator=g).bfloat16()

    def run(linear):
        for t in (x, w1, w2, *leaves):
            t.grad = None
        out = linear(linear(x, w1, s1, z1), w2, s2, z2)
        out.backward(gout)
        return out.detach(), [t.grad.clone() for t in (x, w1, w2, *leaves)]

    ref_out, ref = run(lambda x_, w, s, z: torch.nn.functional.linear(x_, fake_quantize(w, s, z, spec)))
    out, got = run(lambda x_, w, s, z: FQ.fake_quant_linear(x_, w, None, s, z, spec))
    torch.testing.assert_close(out, ref_out, rtol=2**-6, atol=1e-5 * ref_out.abs().max().item())
    for a, b in zip(got, ref):  # x, w1, w2 (bf16 products), then the scales / zero points (fp32 sums)
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=2**-6, atol=1e-4 * b.abs().max().item())
    first = FQ._fake_quant_parts(w1.detach(), s1, z1, spec, None, with_grad_terms=True, scratch=True)
    again = FQ._fake_quant_parts(w2.detach(), s2, z2, spec, None, with_grad_terms=True, scratch=True)
    assert first[0].data_ptr() == again[0].data_ptr() and first[2].data_ptr() == again[2].data_ptr()
    fresh = FQ._fake_quant_parts(w2.detach(), s2, z2, spec, None, with_grad_terms=True)
    assert fresh[0].data_ptr() != again[0].data_ptr()
    for i in (0, 1, 2):
        assert torch.equal(_bits(again[i]), _bits(fresh[i]))


@pytest.mark.parametrize(
    "spec",
    [QuantSpec("fp8", Granularity.TENSOR), QuantSpec("int4", Granularity.TENSOR)],
    ids=lambda s: s.describe(),
)
@pytest.mark.parametrize("rows", [24, 512], ids=["elementwise", "table"])
def test_fake_quant_linear_scale_gradient_of_a_frozen_weight_is_the_exact_sum(spec, rows):
    """Only the per-tensor scale trains (the width rehearsal's experts): the backward sums
    ``g * (x d^T)`` instead of forming ``G_q = g^T x`` (`fq_linear`). Against float64
    ``sum(G_q * dW_q/ds)``: within fp32 accumulation of the terms' magnitudes; autograd through
    `fake_quantize` (G_q rounded to bf16 first) agrees to bf16 rounding of G_q."""
    from qatlib.quant import fq_linear as FQ

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(rows, 512, generator=g) * 0.05).bfloat16()  # frozen: no gradient
    x = torch.randn(2, 9, 512, generator=g).bfloat16().requires_grad_(True)
    gout = torch.randn(2, 9, rows, generator=g).bfloat16()
    sc, _ = compute_qparams(w, spec, None)
    sc = (sc * 0.7).requires_grad_(True)
    FQ.fake_quant_linear(x, w, None, sc, None, spec).backward(gout)
    got = sc.grad.clone()
    _, _, d, _, _ = FQ._fake_quant_parts(w[:24], sc, None, spec, None, with_grad_terms=True)  # elementwise
    d = torch.cat(
        [d]
        + [FQ._fake_quant_parts(b, sc, None, spec, None, with_grad_terms=True)[2] for b in w[24:].split(24)]
    )
    gq = gout.reshape(-1, rows).double().t() @ x.detach().reshape(-1, 512).double()
    terms = gq * d.double()
    exact = terms.sum()
    bound = 1e-6 * terms.abs().sum()  # fp32 accumulation
    assert got.shape == sc.shape and exact.abs() > 100 * bound  # the bound is <= 1% of the value
    assert (got.double() - exact).abs() <= bound
    x.grad, sc.grad = None, None
    torch.nn.functional.linear(x, fake_quantize(w, sc, None, spec)).backward(gout)
    # autograd rounds each G_q element to bf16 (<= 2^-9 relative, independent signs)
    assert (sc.grad.double() - exact).abs() <= 8 * 2**-9 * terms.square().sum().sqrt()


def test_fake_quant_linear_finite_differences_where_defined():
    """The output is linear in x (FD exact up to fp32), and with codes held fixed in s; where the
    clamp is active LSQ's scale gradient IS the derivative, inside it LSQ adds -sum(G * w / s)."""
    from qatlib.quant.fq_linear import fake_quant_linear

    spec = QuantSpec("int4", Granularity.CHANNEL)
    w = torch.tensor([[0.62, -1.13, 2.27, 4.4], [-9.1, 6.0, 0.13, -3.34]], dtype=torch.float64).float()
    x = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.5, 0.75, -0.5, 1.0], [0.1, 0.2, 0.3, 0.4]])
    s0 = torch.tensor([[0.3], [0.8]])  # row 0: 4.4 / 0.3 clips at 7; row 1: -9.1 / 0.8 clips at -8
    gout = torch.tensor([[1.0, -2.0], [0.5, 1.0], [-1.0, 0.25]])
    h = 1e-3

    def loss(s, xx=x):
        return (fake_quant_linear(xx, w, None, s, None, spec) * gout).sum()

    q = quantize(w, s0, None, spec)
    assert torch.equal(quantize(w, s0 + h, None, spec), q) and torch.equal(quantize(w, s0 - h, None, spec), q)
    s = s0.clone().requires_grad_(True)
    xx = x.clone().requires_grad_(True)
    loss(s, xx).backward()
    gq = gout.t() @ x  # dL/dW_q
    inside = (q.float() > -8) & (q.float() < 7)
    for r in range(2):
        e = torch.zeros(2, 1)
        e[r] = h
        fd = (loss(s0 + e) - loss(s0 - e)) / (2 * h)  # = sum_j G_rj q_rj (codes fixed)
        lsq = fd - (gq[r] * inside[r] * w[r] / s0[r]).sum()
        assert (lsq - fd).abs() > 1.0  # the STE term matters here
        torch.testing.assert_close(s.grad[r, 0], lsq, rtol=2e-4, atol=0)  # FD in fp32
    fd_x = torch.zeros_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        e = e.view_as(x)
        fd_x.view(-1)[i] = (loss(s0, x + e) - loss(s0, x - e)) / (2 * h)
    torch.testing.assert_close(xx.grad, fd_x, rtol=0, atol=2e-3)


def test_fake_quant_linear_keeps_no_fake_quantized_weight():
    """What the forward keeps for backward is the tensors it was given (the input, the weight itself,
    the scale): no new storage. autograd through `fake_quantize` keeps three fp32 weight copies."""
    from qatlib.quant.fq_linear import fake_quant_linear

    spec = QuantSpec("fp8")
    w = torch.randn(256, 512).bfloat16()
    x = torch.randn(4, 512).bfloat16()
    s = (w.float().abs().amax() / 448).reshape(1).requires_grad_(True)
    given = {t.untyped_storage().data_ptr() for t in (w, x, s)}

    def new_bytes(fn):
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in given:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return sum(saved.values()), out

    kept, out = new_bytes(lambda: fake_quant_linear(x, w, None, s, None, spec))
    today, ref = new_bytes(lambda: torch.nn.functional.linear(x, fake_quantize(w, s, None, spec)))
    assert torch.equal(out, ref)
    assert kept == 0
    assert today >= 3 * w.numel() * 4  # the old path: 3 fp32 weight copies (this test's point)


def test_fake_quant_linear_empty_input_gives_zero_scale_gradients():
    """An MoE expert with no token: nothing is computed, and the scales still get a gradient (zeros,
    the true value), so ZeRO-3 reduces the same parameters on every rank whatever the routing."""
    from qatlib.quant.fq_linear import fake_quant_linear

    spec = QuantSpec("int4", Granularity.GROUP, group_size=16, symmetric=False)
    w = torch.randn(8, 32)
    s = torch.full((8, 2), 0.1, requires_grad=True)
    z = torch.zeros(8, 2, requires_grad=True)
    x = torch.zeros(0, 32, requires_grad=True)
    out = fake_quant_linear(x, w, None, s, z, spec)
    assert out.shape == (0, 8) and out.requires_grad
    out.sum().backward()
    assert torch.equal(s.grad, torch.zeros_like(s)) and torch.equal(z.grad, torch.zeros_like(z))
    assert x.grad.shape == (0, 32)
    with pytest.raises(ValueError, match="clamp_grad"):
        fake_quant_linear(x, w, None, s, z, spec, clamp_grad="nope")


def test_e4m3_values_equal_the_torch_cast_in_every_binade():
    """`fq_linear._e4m3_values` (fp32 arithmetic) against ``.to(float8_e4m3fn).float()``: every E4M3
    value, every midpoint between neighbours (ties to even), their fp32 neighbours, +-0, fp32
    subnormals and a dense random sweep of [-448, 448] across all binades."""
    from qatlib.quant.fq_linear import _e4m3_values

    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    g = torch.Generator().manual_seed(0)
    sweep = torch.sign(torch.randn(200_000, generator=g)) * torch.exp2(
        torch.rand(200_000, generator=g) * 24 - 15
    )
    x = torch.cat([pts, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 448.0, -448.0]), sweep]).clamp(-448, 448)
    ref = x.to(FP8).float()
    got = _e4m3_values(x.clone())
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # the sign of zero too
