"""Python tests for tessera.linear: the weight-only quantized linear layer (torch.ops.tessera.linear, the host steps
quantize / import_gptq / import_awq / prepack / unpack / dequantize, and the DLPack entries tessera.dlpack.linear*).

Semantics (include/tessera/linear.h, docs/ops/linear.md): y = clamp(x @ W.T + bias) with W [N, K] held as int4 / int8
codes and one (scale, offset) or (scale, zero) pair per output channel and block of K columns.

The tests at the top run without a GPU: the host steps (quantize's rounding rule, prepack / unpack round trips, the
GPTQ and AWQ importers fed with checkpoint tensors this file packs itself from a float weight, following the layouts
of include/tessera/linear.h, and compared with the test's own dequantization), the schema, meta / fake tensors,
Dynamo tracing (torch.export strict on fake CUDA tensors), argument errors. The GPU tests compare the op with a
float64 torch reference over dequantize(packed) (the very weight values the kernel reads, its parameters rounded to
the compute dtype) on outputs poisoned with NaN first.

Tolerance (relative Frobenius error): 5e-3 for bf16 compute, 2e-3 for fp16. The kernel rounds each weight once to the
compute dtype (relative 2^-9 bf16, 2^-12 fp16, random over K) and y once to x's dtype; fp32 accumulation adds far
less. fp32 x is rounded to the compute dtype too (bf16 here: one more 2^-9 rounding, within 5e-3). A wrong code,
block, zero point or permutation is an O(1) error.
"""

import math
import re

import pytest

import tessera
from _dispatch_record import recording_mode
from _host_capsule import DL_FLOAT, DL_UINT, HostCapsule
from _optional import gpu, needs_torch, np, torch


TOL = {"bfloat16": 5e-3, "float16": 2e-3}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
tl = tessera.linear


def _needs_kernels():
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(seed, n, k, outliers=True):
    """A float weight [N, K] with outlier columns (every 17th column 8x larger), as real layers have them."""
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    if outliers:
        w[:, ::17] *= 8.0
    return w


# ================================================================================================================
# Without a GPU: exports, the host steps
# ================================================================================================================


def test_exports():
    import tessera.dlpack as td

    assert tessera.linear is tl and "linear" in tessera.__all__
    for name in ("PackedLinearWeight", "QuantizedLinearWeight"):
        assert getattr(tessera, name) is getattr(tl, name) and name in tessera.__all__
    for name in ("linear", "quantize", "import_gptq", "import_awq", "prepack", "unpack", "dequantize",
                 "workspace_bytes"):
        assert name in tl.__all__ and callable(getattr(tl, name)), name
    for name in ("linear", "linear_workspace_bytes", "linear_quantize", "linear_import_gptq", "linear_import_awq",
                 "linear_prepack", "linear_unpack"):
        assert getattr(td, name) is getattr(tessera._C, name) and name in td.__all__, name


def test_linear_signature():
    import inspect

    params = inspect.signature(tl.linear).parameters
    assert list(params)[:3] == ["x", "weight", "bias"] and params["bias"].default is None
    for name in ("activation", "clamp", "out", "workspace", "stream"):
        assert params[name].kind == params[name].KEYWORD_ONLY and params[name].default is None, name


def _rtn_reference(w, bits, block, zero_mode):
    """quantize's documented rule (include/tessera/linear.h) in fp32 torch: codes, scale, offset, zero."""
    n, k = w.shape
    levels = float((1 << bits) - 1)
    v = w.float().view(n, k // block, block)
    lo, hi = v.amin(-1), v.amax(-1)
    if zero_mode == "offset":
        scale = (hi - lo) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.where(scale[..., None] > 0, torch.clamp(torch.round((v - lo[..., None]) / safe[..., None]), 0,
                                                              levels), torch.zeros_like(v))
        return codes.to(torch.uint8).view(n, k), scale, lo, None
    lo, hi = torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.clamp(torch.round(-lo / scale), 0, levels)
    codes = torch.clamp(torch.round(v / scale[..., None]) + zero[..., None], 0, levels)
    return codes.to(torch.uint8).view(n, k), scale, -zero * scale, zero.to(torch.uint8)


@needs_torch
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_mode", ["offset", "zero_point"])
@pytest.mark.parametrize("block", [32, 128, None])
def test_quantize_follows_the_documented_rule(seed, bits, zero_mode, block):
    n, k = 24, 256  # N not a multiple of the 16-row stripe
    w = _weight(seed, n, k)
    w[3, :32] = 0.25  # a constant block (scale 0 in offset mode)
    w[5, :] = 0.0  # an all-zero row (scale 1 in zero_point mode)
    q = tl.quantize(w, bits=bits, block=block, zero_mode=zero_mode)
    b = k if block is None else block
    assert isinstance(q, tl.QuantizedLinearWeight)
    assert (q.n, q.k, q.bits, q.block, q.zero_mode) == (n, k, bits, b, zero_mode)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (n, k) and q.k_perm is None
    assert q.scale.dtype == torch.float32 and q.scale.shape == (n, k // b) and q.offset.shape == (n, k // b)
    codes, scale, offset, zero = _rtn_reference(w, bits, b, zero_mode)
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.offset, offset)
    if zero_mode == "zero_point":
        assert q.zero.dtype == torch.uint8 and torch.equal(q.zero, zero)
    else:
        assert q.zero is None
    # Round to nearest: every weight within half a step (offset) or a step (zero_point: the grid is shifted by the
    # rounded zero point, so an end of the range may clamp) of its value.
    err = (tl.dequantize(q, torch.float64) - w.double()).abs()
    step = q.scale.double().repeat_interleave(b, dim=1)
    assert bool((err <= step * (0.5 if zero_mode == "offset" else 1.0) + 1e-6).all())


@needs_torch
@pytest.mark.parametrize("bits,k,block", [(4, 256, 64), (8, 256, 128), (4, 96, 32), (8, 200, 200), (4, 192, 192)])
@pytest.mark.parametrize("zero_mode", ["offset", "zero_point"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepack_unpack_round_trip(seed, bits, k, block, zero_mode, dtype):
    # K not a multiple of the 64 / 32-column tile (96, 200) and per-channel blocks (block = K) included.
    dt = getattr(torch, dtype)
    n = 40
    q = tl.quantize(_weight(seed, n, k), bits=bits, block=block, zero_mode=zero_mode)
    p = tl.prepack(q, compute_dtype=dt)
    assert isinstance(p, tl.PackedLinearWeight)
    tile = 64 if bits == 4 else 32
    np_, kp = (n + 15) // 16 * 16, (k + tile - 1) // tile * tile
    nb = 1 if block == k else kp // block
    assert (p.n, p.k, p.bits, p.block, p.zero_mode) == (n, k, bits, block, zero_mode)
    assert (p.padded_n, p.padded_k, p.num_blocks) == (np_, kp, nb)
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (np_, kp * bits // 8) and p.codes.is_contiguous()
    assert p.params.dtype == dt and p.params.shape == (np_, nb, 2) and p.compute_dtype == dt
    assert p.k_perm is None and p.device == torch.device("cpu")
    u = tl.unpack(p)
    assert (u.n, u.k, u.bits, u.block, u.zero_mode) == (n, k, bits, block, zero_mode)
    assert torch.equal(u.codes, q.codes), "codes changed through prepack / unpack"
    assert torch.equal(u.scale, q.scale.to(dt).float()), "scales are not the compute-dtype rounding"
    if zero_mode == "zero_point":
        assert torch.equal(u.zero, q.zero)
    else:
        assert torch.equal(u.offset, q.offset.to(dt).float())
    # The packed weight's values: the canonical ones with the parameters rounded once to the compute dtype.
    rounded = tl.QuantizedLinearWeight(**{**q.__dict__, "scale": q.scale.to(dt).float(),
                                          "offset": q.offset.to(dt).float()})
    got = tl.dequantize(p, torch.float64)
    assert got.shape == (n, k) and got.dtype == torch.float64
    assert torch.equal(got, tl.dequantize(rounded, torch.float64))
    # Prepacking is deterministic and its layout covers every byte (padding is zero).
    assert torch.equal(tl.prepack(q, compute_dtype=dt).codes, p.codes)


@needs_torch
def test_packed_codes_are_a_permutation_of_the_canonical_codes(seed):
    # The layout moves codes, never changes them: the multiset of nibbles (int4) equals the canonical codes' plus
    # the padding's zeros.
    n, k = 32, 128
    q = tl.quantize(_weight(seed, n, k), bits=4, block=64)
    p = tl.prepack(q)
    nibbles = torch.cat([p.codes & 0xF, p.codes >> 4]).flatten()
    assert torch.equal(torch.bincount(nibbles.long(), minlength=16), torch.bincount(q.codes.flatten().long(),
                                                                                     minlength=16))


@needs_torch
def test_packed_weight_moves_and_keeps_its_constants(seed):
    q = tl.quantize(_weight(seed, 16, 64), bits=8, block=32, zero_mode="zero_point")
    p = tl.prepack(q, compute_dtype=torch.float16)
    m = p.to("meta")
    assert m.device.type == "meta" and m.params.dtype == torch.float16 and m.codes.shape == p.codes.shape
    assert (m.n, m.k, m.bits, m.block, m.zero_mode) == (p.n, p.k, p.bits, p.block, p.zero_mode)
    assert p.device.type == "cpu"  # the original is unchanged
    assert p.cpu().codes is p.codes  # already there: the same tensors
    assert "PackedLinearWeight(n=16, k=64, bits=8" in repr(p)


# ---- checkpoint importers: tensors packed here from the layouts of include/tessera/linear.h --------------------


def _quantize_groups(w, bits, group, g_idx):
    """Asymmetric per (output, group) quantization by group membership g_idx (original column order):
    q [N, K] int64, z [G, N] int64, s [G, N] fp16; w ~= (q - z) * s. Returns (q, z, s, dequantized float64)."""
    n, k = w.shape
    groups = k // group
    qmax = (1 << bits) - 1
    q = torch.zeros((n, k), dtype=torch.int64)
    z = torch.zeros((groups, n), dtype=torch.int64)
    s = torch.zeros((groups, n), dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        v = w[:, cols]
        lo = torch.clamp(v.amin(1), max=0.0)
        hi = torch.clamp(v.amax(1), min=0.0)
        sg = torch.clamp((hi - lo) / qmax, min=1e-3).half()
        zg = torch.clamp(torch.round(-lo / sg.float()), 0, qmax).long()
        q[:, cols] = torch.clamp(torch.round(v / sg.float()[:, None]).long() + zg[:, None], 0, qmax)
        s[g], z[g] = sg, zg
    deq = (q.double() - z.double()[g_idx.long()].t()) * s.double()[g_idx.long()].t()
    return q, z, s, deq


def _words(fields, bits):
    """int64 fields [..., per] (field j at bits [bits*j, ...)) packed into int32 words [...] (bit patterns)."""
    per = fields.shape[-1]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    word = (fields << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _pack_gptq(q, z, bits, minus_one):
    n, k = q.shape
    per = 32 // bits
    qweight = _words(q.t().reshape(k // per, per, n).transpose(1, 2), bits)  # [K/per, N]: k = r*per + j
    stored = (z - 1) & ((1 << bits) - 1) if minus_one else z
    qzeros = _words(stored.reshape(z.shape[0], n // per, per), bits)  # [G, N/per]: n = c*per + j
    return qweight, qzeros


def _pack_awq(q, z):
    n, k = q.shape
    order = torch.tensor(AWQ_ORDER)
    qweight = _words(q.t().reshape(k, n // 8, 8)[:, :, order], 4)  # [K, N/8]
    qzeros = _words(z.reshape(z.shape[0], n // 8, 8)[:, :, order], 4)  # [G, N/8]
    return qweight, qzeros


@needs_torch
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("minus_one", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_import_gptq_matches_the_checkpoint(seed, bits, minus_one, group):
    n, k = 24, 256
    w = _weight(seed, n, k)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    q, z, s, want = _quantize_groups(w, bits, group, g_idx)
    qweight, qzeros = _pack_gptq(q, z, bits, minus_one)
    assert qweight.shape == (k * bits // 32, n) and qzeros.shape == (k // group, n * bits // 32)
    for gi in (g_idx, None):  # an in-order g_idx is the identity
        imp = tl.import_gptq(qweight, qzeros, s, gi, bits=bits, group=group, zero_stored_minus_one=minus_one)
        assert (imp.n, imp.k, imp.bits, imp.block, imp.zero_mode) == (n, k, bits, group, "zero_point")
        assert imp.k_perm is None
        assert torch.equal(imp.codes.long(), q)
        assert torch.equal(imp.zero.long(), z.t())
        assert torch.equal(tl.dequantize(imp, torch.float64), want), "imported values differ from the checkpoint's"
    # fp16 parameters hold fp16 scales and integer zeros exactly: the packed weight is the checkpoint's.
    assert torch.equal(tl.dequantize(tl.prepack(imp, torch.float16), torch.float64), want)
    # ... and it stays close to the float weight it came from (a step per weight at most).
    assert ((want - w.double()).abs() <= s.double().repeat_interleave(group, 0).t() + 1e-6).all()


@needs_torch
@pytest.mark.parametrize("bits", [4, 8])
def test_import_gptq_act_order(seed, bits):
    n, k, group = 32, 256, 64
    w = _weight(seed, n, k)
    g_idx = (torch.arange(k, dtype=torch.int32) // group)[torch.randperm(k, generator=_gen(seed + 1))]
    q, z, s, want = _quantize_groups(w, bits, group, g_idx)
    qweight, qzeros = _pack_gptq(q, z, bits, True)
    imp = tl.import_gptq(qweight, qzeros, s, g_idx, bits=bits, group=group)
    assert imp.k_perm is not None and imp.k_perm.dtype == torch.int32 and imp.k_perm.shape == (k,)
    assert torch.equal(torch.sort(imp.k_perm).values, torch.arange(k, dtype=torch.int32))
    # The groups are contiguous in the import's column order, stable in k.
    assert torch.equal(g_idx[imp.k_perm.long()], torch.arange(k, dtype=torch.int32) // group)
    assert torch.equal(tl.dequantize(imp, torch.float64), want)
    p = tl.prepack(imp, torch.float16)
    assert torch.equal(p.k_perm, imp.k_perm)
    assert torch.equal(tl.dequantize(p, torch.float64), want)
    # Without the permutation the columns would be in group order, not W's.
    assert not torch.equal(tl.dequantize(tl.QuantizedLinearWeight(**{**imp.__dict__, "k_perm": None}),
                                         torch.float64), want)


@needs_torch
def test_import_gptq_per_channel_and_other_input_types(seed):
    n, k, bits = 16, 128, 4
    w = _weight(seed, n, k)
    g_idx = torch.zeros(k, dtype=torch.int32)
    q, z, s, want = _quantize_groups(w, bits, k, g_idx)
    qweight, qzeros = _pack_gptq(q, z, bits, True)
    for group in (-1, None, k):
        imp = tl.import_gptq(qweight, qzeros, s, bits=bits, group=group)
        assert imp.block == k and torch.equal(tl.dequantize(imp, torch.float64), want)
    # NumPy arrays (uint32 words) and int64 tensors holding the unsigned words, fp32 scales (rounded to fp16).
    if np is not None:
        imp = tl.import_gptq(qweight.numpy().view(np.uint32), qzeros.numpy().view(np.uint32), s.float().numpy(),
                             bits=bits, group=k)
        assert torch.equal(tl.dequantize(imp, torch.float64), want)
    imp = tl.import_gptq(qweight.long() & 0xFFFFFFFF, qzeros.long() & 0xFFFFFFFF, s, bits=bits, group=k)
    assert torch.equal(tl.dequantize(imp, torch.float64), want)


@needs_torch
@pytest.mark.parametrize("group", [64, 128])
def test_import_awq_matches_the_checkpoint(seed, group):
    n, k = 32, 256
    w = _weight(seed, n, k)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    q, z, s, want = _quantize_groups(w, 4, group, g_idx)
    qweight, qzeros = _pack_awq(q, z)
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
    imp = tl.import_awq(qweight, qzeros, s, group=group)
    assert (imp.n, imp.k, imp.bits, imp.block, imp.zero_mode) == (n, k, 4, group, "zero_point")
    assert imp.k_perm is None and torch.equal(imp.codes.long(), q)
    assert torch.equal(tl.dequantize(imp, torch.float64), want)
    assert torch.equal(tl.dequantize(tl.prepack(imp, torch.float16), torch.float64), want)
    # The nibble order matters: the words read in plain order give another weight.
    plain = _words(q.t().reshape(k, n // 8, 8), 4)
    assert not torch.equal(tl.dequantize(tl.import_awq(plain, qzeros, s, group=group), torch.float64), want)


# ---- argument errors of the host steps ---------------------------------------------------------------------------


@needs_torch
def test_host_step_errors_name_the_argument(seed):
    w = _weight(seed, 16, 128)
    with pytest.raises(ValueError, match="'bits'"):
        tl.quantize(w, bits=5)
    with pytest.raises(ValueError, match="'zero_mode'"):
        tl.quantize(w, zero_mode="symmetric")
    with pytest.raises(ValueError, match="'block'"):
        tl.quantize(w, block=48)  # does not divide K = 128
    with pytest.raises(ValueError, match="'w'"):
        tl.quantize(w[0])
    with pytest.raises(ValueError, match="'w'"):
        tl.quantize(torch.ones((4, 64), dtype=torch.int32))
    with pytest.raises(TypeError, match="'w'"):
        tl.quantize(object())
    q = tl.quantize(w, bits=4, block=32)
    with pytest.raises(ValueError, match="'compute_dtype'"):
        tl.prepack(q, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="'weight'"):
        tl.prepack(w)
    with pytest.raises(ValueError, match="'weight'"):
        tl.prepack(tl.prepack(q))
    bad = tl.QuantizedLinearWeight(**{**q.__dict__, "codes": q.codes.clone()})
    bad.codes[3, 5] = 16  # not a 4-bit code
    with pytest.raises(ValueError, match="codes"):
        tl.prepack(bad)
    with pytest.raises(ValueError, match="'scale'"):
        tl.prepack(tl.QuantizedLinearWeight(**{**q.__dict__, "scale": q.scale.t().contiguous()}))
    with pytest.raises(ValueError, match="'offset'"):
        tl.prepack(tl.QuantizedLinearWeight(**{**q.__dict__, "offset": None}))
    with pytest.raises(ValueError, match="block"):
        tl.prepack(tl.QuantizedLinearWeight(**{**q.__dict__, "block": 16}))
    with pytest.raises(ValueError, match="k_perm"):
        perm = torch.zeros(128, dtype=torch.int32)  # not a permutation
        tl.prepack(tl.QuantizedLinearWeight(**{**q.__dict__, "k_perm": perm}))
    with pytest.raises(ValueError, match="'packed'"):
        tl.unpack(q)
    p = tl.prepack(q)
    with pytest.raises(ValueError, match="codes"):
        tl.unpack(tl.PackedLinearWeight(**{**p.__dict__, "codes": p.codes[:, :-16].contiguous()}))
    with pytest.raises(ValueError, match="'weight'"):
        tl.dequantize(w)


@needs_torch
def test_importer_errors_name_the_argument(seed):
    n, k, group = 16, 128, 32
    g_idx = torch.arange(k, dtype=torch.int32) // group
    q, z, s, _ = _quantize_groups(_weight(seed, n, k), 4, group, g_idx)
    qweight, qzeros = _pack_gptq(q, z, 4, True)
    with pytest.raises(ValueError, match="'bits'"):
        tl.import_gptq(qweight, qzeros, s, bits=3, group=group)
    with pytest.raises(ValueError, match="'group'"):
        tl.import_gptq(qweight, qzeros, s, bits=4, group=48)
    with pytest.raises(ValueError, match="'qzeros'"):
        tl.import_gptq(qweight, qzeros[:, :1], s, bits=4, group=group)
    with pytest.raises(ValueError, match="'scales'"):
        tl.import_gptq(qweight, qzeros, s.t().contiguous(), bits=4, group=group)
    with pytest.raises(ValueError, match="'g_idx'"):
        tl.import_gptq(qweight, qzeros, s, g_idx[:-1], bits=4, group=group)
    with pytest.raises(ValueError, match="'g_idx'"):  # a group with the wrong number of columns
        tl.import_gptq(qweight, qzeros, s, torch.zeros(k, dtype=torch.int32), bits=4, group=group)
    with pytest.raises(ValueError, match="'qweight'"):
        tl.import_gptq(qweight.float(), qzeros, s, bits=4, group=group)
    aw, az = _pack_awq(q, z)
    with pytest.raises(ValueError, match="'qzeros'"):
        tl.import_awq(aw, az[:-1], s, group=group)
    with pytest.raises(ValueError, match="'group'"):
        tl.import_awq(aw, az, s, group=0)
    # Scales that are not finite in float16 (NaN, inf, or past its range once rounded) would give wrong weights.
    for bad, where in ((float("nan"), [1, 3]), (float("inf"), [0, 0]), (1.0e6, [2, 5])):
        broken = s.clone().float()
        broken[where[0], where[1]] = bad
        with pytest.raises(ValueError, match="'scales' must be finite in torch.float16 .* first at index " +
                           re.escape(str(where))):
            tl.import_gptq(qweight, qzeros, broken, bits=4, group=group)
        with pytest.raises(ValueError, match="'scales' must be finite"):
            tl.import_awq(aw, az, broken, group=group)


def test_binding_checks_host_arrays_before_reading_them():
    # The raw entry points (tessera.dlpack) read host memory through raw pointers: a capsule labelled as device
    # memory, a wrong dtype or shape is refused, named, before anything is read. No torch needed.
    w = HostCapsule((16, 64), DL_FLOAT, 32)
    d = tessera._C.linear_quantize(w.capsule, 4, 32, "offset")  # zeros: a valid weight
    assert d["n"] == 16 and d["k"] == 64 and d["zero_mode"] == "offset" and d["zero"] is None
    assert isinstance(d["codes"], bytearray) and len(d["codes"]) == 16 * 64 and len(d["scale"]) == 16 * 2 * 4
    with pytest.raises(ValueError, match="'zero_mode'"):
        tessera._C.linear_quantize(w.capsule, 4, 32, "symmetric")
    wrong = HostCapsule((16, 64), DL_UINT, 8)
    with pytest.raises(ValueError, match="'w' must be fp32"):
        tessera._C.linear_quantize(wrong.capsule, 4, 32, "offset")
    on_gpu = HostCapsule((16, 64), DL_FLOAT, 32)
    on_gpu.managed.dl_tensor.device.device_type = 2  # kDLCUDA
    with pytest.raises(ValueError, match="'w' must be host"):
        tessera._C.linear_quantize(on_gpu.capsule, 4, 32, "offset")
    with pytest.raises(TypeError, match="'codes'"):
        tessera._C.linear_prepack(object(), None, None, None, None, 4, 32, "offset", "bfloat16")
    codes = HostCapsule((16, 64), DL_UINT, 8)
    scale = HostCapsule((16, 3), DL_FLOAT, 32)  # K/block = 2 columns expected
    with pytest.raises(ValueError, match="scale"):
        tessera._C.linear_prepack(codes.capsule, scale.capsule, scale.capsule, None, None, 4, 32, "offset",
                                  "bfloat16")
    with pytest.raises(ValueError, match="'compute_dtype'"):
        tessera._C.linear_prepack(codes.capsule, scale.capsule, scale.capsule, None, None, 4, 32, "offset",
                                  "float32")


# ---- the operator: schema, meta and fake tensors, tracing (no GPU) ----------------------------------------------


def _packed(seed, n=48, k=256, bits=4, block=64, zero_mode="offset", dtype=None):
    q = tl.quantize(_weight(seed, n, k), bits=bits, block=block, zero_mode=zero_mode)
    return tl.prepack(q, compute_dtype=dtype or torch.bfloat16)


@needs_torch
def test_schema_marks_what_it_writes():
    from tessera import _torch_ops

    assert "linear" in _torch_ops.OPS
    schema = torch.ops.tessera.linear.default._schema
    assert [a.name for a in schema.arguments] == ["x", "codes", "params", "k_perm", "bias", "y", "workspace", "n", "k",
                                                  "bits", "block", "zero_mode", "clamp_min", "clamp_max"]
    assert len(schema.returns) == 0
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"y", "workspace"}
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types["k_perm"] == types["bias"] == types["workspace"] == "Optional[Tensor]"
    assert (types["n"], types["bits"], types["zero_mode"], types["clamp_min"]) == ("int", "int", "str", "float")


@needs_torch
def test_cuda_kernel_and_direct_entry_are_registered():
    _needs_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("tessera::linear", "CUDA")
    assert hasattr(tessera._torch_C, "linear") and hasattr(tessera._torch_C, "linear_eager")


@needs_torch
def test_meta_tensors_give_shapes_through_the_operator(seed):
    _needs_kernels()
    p = _packed(seed).to("meta")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty((3, 5, 256), dtype=dtype, device="meta")
        with recording_mode() as mode:
            y = tl.linear(x, p, torch.empty((48,), dtype=dtype, device="meta"), activation="relu")
        assert "tessera.linear.default" in mode.calls, mode.calls
        assert y.shape == (3, 5, 48) and y.dtype == dtype and y.is_meta
    y = tl.linear(torch.empty((256,), dtype=torch.bfloat16, device="meta"), p)  # no leading dims: y [N]
    assert y.shape == (48,)
    y = tl.linear(torch.empty((0, 256), dtype=torch.bfloat16, device="meta"), p)
    assert y.shape == (0, 48)
    out = torch.empty((4, 48), dtype=torch.bfloat16, device="meta")
    assert tl.linear(torch.empty((4, 256), dtype=torch.bfloat16, device="meta"), p, out=out) is out
    out3 = torch.empty((2, 2, 48), dtype=torch.bfloat16, device="meta")
    assert tl.linear(torch.empty((2, 2, 256), dtype=torch.bfloat16, device="meta"), p, out=out3) is out3


@needs_torch
def test_operator_argument_errors_without_a_gpu(seed):
    _needs_kernels()
    p = _packed(seed)
    pm = p.to("meta")
    xm = torch.empty((4, 256), dtype=torch.bfloat16, device="meta")
    q = tl.quantize(_weight(seed, 48, 256), bits=4, block=64)
    with pytest.raises(ValueError, match="'weight' must be a tessera.linear.PackedLinearWeight"):
        tl.linear(xm, q)  # the canonical (unpacked) form on the packed path
    with pytest.raises(ValueError, match="'weight'"):
        tl.linear(xm, p.codes)
    with pytest.raises(ValueError, match="'activation'"):
        tl.linear(xm, pm, activation="gelu")
    with pytest.raises(ValueError, match="'clamp'"):
        tl.linear(xm, pm, clamp=(1.0, 0.0))
    with pytest.raises(ValueError, match="'clamp'"):
        tl.linear(xm, pm, clamp=3.0)
    with pytest.raises(ValueError, match=r"'x' must be \[\.\.\., K\] with K = 256"):
        tl.linear(torch.empty((4, 128), dtype=torch.bfloat16, device="meta"), pm)
    with pytest.raises(ValueError, match="'out'"):
        tl.linear(xm, pm, out=torch.empty((4, 40), dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="'zero_mode'"):
        tl.linear(xm, tl.PackedLinearWeight(**{**pm.__dict__, "zero_mode": "symmetric"}))
    with pytest.raises(ValueError, match="'x' must be a CUDA tensor"):  # host tensors: named, never launched
        tl.linear(torch.zeros((4, 256), dtype=torch.bfloat16), p)


@needs_torch
def test_clamp_bounds():
    b = tl._bounds
    inf = math.inf
    assert b("op", None, None) == (-inf, inf)
    assert b("op", "relu", None) == (0.0, inf)
    assert b("op", "relu6", None) == (0.0, 6.0)
    assert b("op", None, (-1, 2)) == (-1.0, 2.0)
    assert b("op", None, (None, 2)) == (-inf, 2.0)
    assert b("op", "relu", (-1, 2)) == (0.0, 2.0)
    assert b("op", "relu6", (1, None)) == (1.0, 6.0)
    with pytest.raises(ValueError, match="'clamp'"):
        b("op", "relu6", (7, 8))
    with pytest.raises(ValueError, match="'clamp'"):
        b("op", None, (float("nan"), 1))


@needs_torch
def test_opcheck_on_meta_tensors(seed):
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    p = _packed(seed).to("meta")
    x = torch.empty((5, 256), dtype=torch.bfloat16, device="meta")
    y = torch.empty((5, 48), dtype=torch.bfloat16, device="meta")
    bias = torch.empty((48,), dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.tessera.linear.default,
                          (x, p.codes, p.params, p.k_perm, bias, y, None, 48, 256, 4, 64, "offset", 0.0, math.inf))


@needs_torch
def test_symbolic_tracing_sees_the_operator(seed):
    # make_fx with dynamic shapes (what AOT autograd and export use): the eager entry hands symbolic sizes to the
    # torch layer's checked path, which allocates with torch.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty((2, 7, 256), dtype=torch.bfloat16, device="cuda")
        codes = torch.empty((48, 128), dtype=torch.uint8, device="cuda")
        params = torch.empty((48, 4, 2), dtype=torch.bfloat16, device="cuda")

    def fn(x, codes, params):
        w = tl.PackedLinearWeight(codes, params, None, 48, 256, 4, 64, "offset")
        return tl.linear(x, w, activation="relu6")

    graph = make_fx(fn, tracing_mode="symbolic")(x, codes, params)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.linear.default"], traced


@needs_torch
def test_dynamo_traces_the_wrapper_whole(seed):
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors: the torch layer's checked path, the PackedLinearWeight and the leading-dims reshape trace without a
    # GPU. The GPU test below compiles and runs.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Layer(torch.nn.Module):
        def forward(self, x, codes, params, k_perm, bias):
            w = tl.PackedLinearWeight(codes, params, k_perm, 48, 256, 4, 64, "zero_point")
            return tl.linear(x, w, bias, activation="relu", clamp=(None, 4.0))

    with FakeTensorMode():
        c = dict(device="cuda")
        args = (torch.empty((2, 5, 256), dtype=torch.float16, **c), torch.empty((48, 128), dtype=torch.uint8, **c),
                torch.empty((48, 4, 2), dtype=torch.float16, **c), torch.empty((256,), dtype=torch.int32, **c),
                torch.empty((48,), dtype=torch.float16, **c))
        program = torch.export.export(Layer(), args, strict=True)
    traced = [n for n in program.graph.nodes if "tessera" in str(n.target)]
    assert [str(n.target) for n in traced] == ["tessera.linear.default"], traced
    output = next(n for n in program.graph.nodes if n.op == "output")
    assert tuple(output.args[0][0].meta["val"].shape) == (2, 5, 48)


# ================================================================================================================
# GPU: correctness against a float64 reference, epilogue, leading dims, torch.compile, CUDA graphs, errors
# ================================================================================================================


def _reference(x, packed, bias=None, lo=-math.inf, hi=math.inf):
    w = tl.dequantize(packed, torch.float64).to(x.device)
    y = x.double().reshape(-1, packed.k) @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.clamp(lo, hi).reshape(*x.shape[:-1], packed.n)


def _rel(got, want):
    d = (got.double() - want).norm().item()
    ref = want.norm().item()
    return d / ref if ref > 0 else d


def _x(seed, shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


# (N, K, bits, block, zero_mode): int4 / int8, every block size and per channel, both conventions, N not a multiple
# of the 16-row stripe and K not a multiple of the tile where the layout allows.
SHAPES = [
    (256, 512, 4, 128, "zero_point"),
    (200, 320, 8, 32, "offset"),
    (136, 416, 4, 32, "offset"),  # K = 6.5 tiles of 64: padded to 448
    (64, 1000, 8, 1000, "zero_point"),  # per output channel, K padded to 1024
]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}_K{}_int{}_b{}_{}".format(*s))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 7, 16, 100])
def test_matches_float64_reference(seed, shape, dtype, m):
    n, k, bits, block, zero_mode = shape
    dt = getattr(torch, dtype)
    packed = _packed(seed, n, k, bits, block, zero_mode, dt).cuda()
    assert packed.device.type == "cuda" and packed.codes.is_cuda and packed.params.is_cuda
    x = _x(seed + 1, (m, k), dt)
    y = tl.linear(x, packed, out=_poisoned((m, n), dt))
    torch.cuda.synchronize()
    assert y.shape == (m, n) and y.dtype == dt
    assert bool(torch.isfinite(y).all()), "unwritten (NaN) outputs"
    err = _rel(y, _reference(x, packed))
    assert err <= TOL[dtype], f"rel err {err:.3e}"
    # The default allocation gives the same bits; repeated calls are deterministic.
    assert torch.equal(tl.linear(x, packed), y)


@gpu
@pytest.mark.parametrize("m", [1, 16, 100])
def test_fp32_x_gives_fp32_y(seed, m):
    n, k = 128, 512
    packed = _packed(seed, n, k, 4, 128, "offset", torch.bfloat16).cuda()
    x = _x(seed + 1, (m, k), torch.float32)
    y = tl.linear(x, packed, out=_poisoned((m, n), torch.float32))
    torch.cuda.synchronize()
    assert y.dtype == torch.float32 and bool(torch.isfinite(y).all())
    err = _rel(y, _reference(x, packed))
    assert err <= TOL["bfloat16"], f"rel err {err:.3e}"  # x rounded to bf16 once (2^-9), no output rounding


@gpu
@pytest.mark.parametrize("m", [1, 7, 100])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order_weight(seed, m, bits):
    # k_perm applied by the op: y = x[:, k_perm] @ w.T == x @ W.T in W's original column order.
    n, k, group = 128, 512, 128
    w = _weight(seed, n, k)
    g_idx = (torch.arange(k, dtype=torch.int32) // group)[torch.randperm(k, generator=_gen(seed + 2))]
    q, z, s, want = _quantize_groups(w, bits, group, g_idx)
    qweight, qzeros = _pack_gptq(q, z, bits, True)
    packed = tl.prepack(tl.import_gptq(qweight, qzeros, s, g_idx, bits=bits, group=group), torch.float16).cuda()
    assert packed.k_perm is not None and packed.k_perm.is_cuda
    x = _x(seed + 3, (m, k), torch.float16)
    y = tl.linear(x, packed, out=_poisoned((m, n), torch.float16))
    torch.cuda.synchronize()
    ref = x.double() @ want.cuda().t()
    err = _rel(y, ref)
    assert err <= TOL["float16"], f"rel err {err:.3e}"


@gpu
@pytest.mark.parametrize("m", [1, 16, 100])
@pytest.mark.parametrize("epilogue", [dict(), dict(activation="relu"), dict(activation="relu6"),
                                      dict(clamp=(-0.5, 0.25)), dict(activation="relu", clamp=(None, 1.0))],
                         ids=["bias", "relu", "relu6", "clamp", "relu_clamp"])
def test_bias_and_clamp(seed, m, epilogue):
    n, k = 192, 384
    dt = torch.bfloat16
    packed = _packed(seed, n, k, 4, 128, "zero_point", dt).cuda()
    x = _x(seed + 1, (m, k), dt) * 0.3
    bias = _x(seed + 2, (n,), dt)
    y = tl.linear(x, packed, bias, out=_poisoned((m, n), dt), **epilogue)
    torch.cuda.synchronize()
    lo, hi = tl._bounds("test", epilogue.get("activation"), epilogue.get("clamp"))
    want = _reference(x, packed, bias, lo, hi)
    assert float(y.min()) >= lo and float(y.max()) <= hi
    err = _rel(y, want)
    assert err <= TOL["bfloat16"], f"rel err {err:.3e}"


@gpu
def test_leading_dims_and_strided_rows(seed):
    n, k = 128, 256
    dt = torch.float16
    packed = _packed(seed, n, k, 8, 64, "offset", dt).cuda()
    x = _x(seed + 1, (2, 3, 5, k), dt)
    y = tl.linear(x, packed)
    assert y.shape == (2, 3, 5, n) and y.dtype == dt
    flat = tl.linear(x.reshape(30, k), packed)
    torch.cuda.synchronize()
    assert torch.equal(y.reshape(30, n), flat), "leading dims change the result"
    assert _rel(y, _reference(x, packed)) <= TOL["float16"]
    # Rows of a wider tensor (row stride 320 elements, a multiple of 8): a view, no copy.
    wide = _x(seed + 2, (7, 320), dt)
    got = tl.linear(wide[:, :k], packed)
    torch.cuda.synchronize()
    assert torch.equal(got, tl.linear(wide[:, :k].contiguous(), packed))
    # One row without leading dims: y [N]; M = 0: nothing launched.
    assert tl.linear(x[0, 0, 0], packed).shape == (n,)
    assert tl.linear(x[:0].reshape(0, k), packed).shape == (0, n)
    # out= with leading dims.
    out = _poisoned((2, 3, 5, n), dt)
    assert tl.linear(x, packed, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(out, y)


@gpu
def test_workspace_and_stream_arguments(seed):
    n, k, m = 256, 1024, 16
    dt = torch.bfloat16
    packed = _packed(seed, n, k, 4, 128, "offset", dt).cuda()
    x = _x(seed + 1, (m, k), dt)
    want = tl.linear(x, packed)
    sizes = [tl.workspace_bytes(mm, packed) for mm in (1, 16, 256)]
    assert all(isinstance(s, int) and s >= 0 for s in sizes) and sizes == sorted(sizes)
    assert tl.workspace_bytes(m, packed, torch.float32) >= 0
    ws = torch.empty(max(sizes[1], 16), dtype=torch.uint8, device="cuda")
    assert torch.equal(tl.linear(x, packed, workspace=ws), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    y = tl.linear(x, packed, stream=side)
    side.synchronize()
    assert torch.equal(y, want)
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("m", [1, 100])
def test_compile_fullgraph_matches_eager(seed, m):
    n, k = 256, 512
    dt = torch.bfloat16
    packed = _packed(seed, n, k, 4, 128, "zero_point", dt).cuda()
    x = _x(seed + 1, (2, m, k), dt)
    bias = _x(seed + 2, (n,), dt)

    def layer(x, bias):
        return tl.linear(x, packed, bias, activation="relu") * 2.0

    eager = layer(x, bias)
    got = torch.compile(layer, fullgraph=True)(x, bias)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), "compiled linear differs from eager"
    assert _rel(eager / 2.0, _reference(x, packed, bias, 0.0)) <= TOL["bfloat16"]


@gpu
@pytest.mark.parametrize("preallocated", [True, False])
def test_cuda_graph_capture_and_replay(seed, preallocated):
    n, k, m = 256, 512, 16
    dt = torch.float16
    packed = _packed(seed, n, k, 8, 128, "offset", dt).cuda()
    x = _x(seed + 1, (m, k), dt)
    bias = _x(seed + 2, (n,), dt)
    kw = {}
    if preallocated:  # nothing allocated inside the capture
        kw = dict(out=torch.empty((m, n), dtype=dt, device="cuda"),
                  workspace=torch.empty(max(tl.workspace_bytes(m, packed, dt), 16), dtype=torch.uint8,
                                        device="cuda"))
    tl.linear(x, packed, bias, **kw)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tl.linear(x, packed, bias, activation="relu6", **kw)
    for round_ in range(2):
        x.copy_(_x(seed + 10 + round_, (m, k), dt))
        y.fill_(float("nan"))
        graph.replay()
        want = tl.linear(x, packed, bias, activation="relu6")
        torch.cuda.synchronize()
        assert torch.equal(y, want), f"replay {round_} differs from eager"


@gpu
def test_bad_arguments_are_value_errors(seed):
    n, k = 128, 256
    packed = _packed(seed, n, k, 4, 64, "offset", torch.bfloat16).cuda()
    x = _x(seed + 1, (4, k), torch.bfloat16)
    with pytest.raises(ValueError, match="'x'"):  # fp16 x with a bf16 weight
        tl.linear(x.half(), packed)
    with pytest.raises(ValueError, match=r"'x' must be \[\.\.\., K\]"):
        tl.linear(x[:, :128], packed)
    with pytest.raises(ValueError, match="bias"):
        tl.linear(x, packed, torch.zeros(n + 8, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="bias"):
        tl.linear(x, packed, torch.zeros(n, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="codes"):  # the weight left on the host
        tl.linear(x, packed.cpu())
    wrong = tl.PackedLinearWeight(**{**packed.__dict__, "bits": 8})  # codes of an int4 weight read as int8
    with pytest.raises(ValueError, match="codes"):
        tl.linear(x, wrong)
    # An undersized workspace where one is needed (fp32 x is rounded into the workspace first; the size query is an
    # upper bound over M, so a 16-bit call may need none).
    with pytest.raises(ValueError, match="workspace"):
        tl.linear(x.float(), packed, workspace=torch.empty(1, dtype=torch.uint8, device="cuda"))
    # Through the dispatcher (what torch.compile calls) the same errors are ValueErrors.
    y = torch.empty((4, n), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bits"):
        torch.ops.tessera.linear(x, packed.codes, packed.params, None, None, y, None, n, k, 5, 64, "offset",
                                 -math.inf, math.inf)
    with pytest.raises(ValueError, match="zero_mode"):
        torch.ops.tessera.linear(x, packed.codes, packed.params, None, None, y, None, n, k, 4, 64, "none",
                                 -math.inf, math.inf)


@gpu
def test_cupy_through_the_dlpack_entry(seed):
    cp = pytest.importorskip("cupy")
    import tessera.dlpack as td

    n, k, m = 128, 256, 3
    packed = _packed(seed, n, k, 4, 64, "zero_point", torch.float16).cuda()
    x_t = _x(seed + 1, (m, k), torch.float16)
    want = tl.linear(x_t, packed)
    torch.cuda.synchronize()
    x = cp.asarray(x_t.cpu().numpy())
    codes, params = cp.asarray(packed.codes.cpu().numpy()), cp.asarray(packed.params.cpu().numpy())
    y = cp.full((m, n), cp.nan, dtype=cp.float16)
    need = td.linear_workspace_bytes(m, codes, params, None, n, k, 4, 64, "zero_point", "float16")
    ws = cp.empty(max(need, 16), dtype=cp.uint8)
    stream = cp.cuda.get_current_stream()
    td.linear(x, codes, params, None, None, y, ws, n, k, 4, 64, "zero_point", -math.inf, math.inf, stream.ptr)
    stream.synchronize()
    assert (cp.asnumpy(y) == want.cpu().numpy()).all()


@needs_torch
def test_dlpack_capsule_that_owns_its_memory_lives_through_the_call():
    # A producer may hand out a capsule that is the only owner of the memory it describes (here a copy made in
    # __dlpack__, as copy=None allows). The entry point keeps every capsule it asked for until it returns; it used
    # to drop them once read, and this call then read freed memory (a 32 MB copy, unmapped on free: a crash).
    class CopyingProducer:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None, **kwargs):
            return torch.utils.dlpack.to_dlpack(self.t.clone())

        def __dlpack_device__(self):
            return (1, 0)  # kDLCPU

    w = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(5))
    got = tessera.dlpack.linear_quantize(CopyingProducer(w), 4, 128, "offset")
    want = tessera.dlpack.linear_quantize(w, 4, 128, "offset")
    for key in ("codes", "scale", "offset"):
        assert bytes(got[key]) == bytes(want[key]), key
