"""Python tests for tessera.w8a8: int8 activations quantized on the fly × int8 weights (torch.ops.tessera.w8a8_quantize
and torch.ops.tessera.gemm_w8a8, the host step prepack_w8a8, the DLPack entries tessera._C.*w8a8*).

Semantics (include/tessera/w8a8.h): both operands int8 codes with an fp32 scale and an integer zero point per (row,
block of K columns); y = clamp(Σ_i sA·sB·Σ_{k in block i}(Aq − zA)(Bq − zB) + bias).

The tests at the top run without a GPU: prepack_w8a8 against the quantization rule of the header reimplemented here in
float64 (each fp32 step rounded to fp32 before the next, which is the fp32 operation's result exactly: float64 holds
the exact product of two fp32 values, and a sum or quotient rounded first to 53 then to 24 bits rounds as once to 24),
the binding's host checks, the schemas, meta / fake tensors, make_fx and Dynamo tracing, argument errors. The GPU tests
compare quantize_per_block's codes and parameters bit for bit with the same rule in torch float32 on the CPU (one op
per step, so nothing is fused), and the GEMM with the float64 product of the dequantized operands on outputs poisoned
with NaN first.

Tolerance of the GEMM (relative Frobenius error): each block's integer dot product is exact (int32), the rest is fp32
(a few roundings of 2^-24 per element), so the output rounding dominates: 4e-3 for bf16 y (2^-9 relative at most,
~2^-10 rms), 5e-4 for fp16, 1e-5 for fp32; an int8 y is within one code of rint(ref * out_scale). A wrong code, scale,
zero point or sum is an O(1) error.
"""

import math
import os
import subprocess
import sys

import pytest

import tessera
from _dispatch_record import recording_mode
from _host_capsule import DL_FLOAT, DL_INT, HostCapsule
from _optional import gpu, needs_torch, np, torch


TOL = {"bfloat16": 4e-3, "float16": 5e-4, "float32": 1e-5}
tw = tessera.w8a8


def _needs_kernels():
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(seed, n, k):
    """A float weight [N, K]: rows of different scales, one row 4x larger, an all-zero row and an all-positive row."""
    w = torch.randn((n, k), generator=_gen(seed)) * 0.05
    w *= torch.rand((n, 1), generator=_gen(seed + 1)) + 0.5
    w[1] *= 4.0
    w[2] = 0.0
    w[3] = w[3].abs()
    return w


# ================================================================================================================
# Without a GPU: exports, the host step, the binding's checks
# ================================================================================================================


def test_exports():
    for name in ("Int8Blocks", "gemm_w8a8", "linear_w8a8", "prepack_w8a8", "quantize_per_block", "w8a8"):
        assert name in tessera.__all__, name
    assert tessera.w8a8 is tw
    for name in ("Int8Blocks", "gemm_w8a8", "linear_w8a8", "prepack_w8a8", "quantize_per_block"):
        assert getattr(tessera, name) is getattr(tw, name), name
    for name in ("dequantize", "empty_blocks", "param_ld", "workspace_bytes"):
        assert name in tw.__all__ and callable(getattr(tw, name)), name
    for name in ("w8a8_quantize", "gemm_w8a8", "gemm_w8a8_workspace_bytes", "prepack_w8a8"):
        assert callable(getattr(tessera._C, name)), name


def test_signatures():
    import inspect

    params = inspect.signature(tw.gemm_w8a8).parameters
    assert list(params)[:3] == ["a", "w", "bias"]
    for name in ("activation", "clamp", "out_dtype", "out_scale", "out", "workspace", "stream"):
        assert params[name].kind == params[name].KEYWORD_ONLY and params[name].default is None, name
    params = inspect.signature(tw.linear_w8a8).parameters
    assert list(params)[:3] == ["x", "w", "bias"] and params["symmetric"].default is False
    for name in ("out", "a_out", "workspace", "stream"):
        assert params[name].kind == params[name].KEYWORD_ONLY and params[name].default is None, name
    params = inspect.signature(tw.quantize_per_block).parameters
    assert params["block"].default == 128 and params["symmetric"].default is False
    assert params["sums"].default is True and params["out"].default is None and params["stream"].default is None
    assert inspect.signature(tw.prepack_w8a8).parameters["symmetric"].default is True


def test_param_ld():
    assert [tw.param_ld(r) for r in (0, 1, 3, 4, 5, 8, 9)] == [4, 4, 4, 4, 8, 8, 12]


def test_import_without_a_gpu_and_without_torch():
    # No visible GPU: tessera imports and the host step runs; no torch: tessera imports and the torch layer says why.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def prints_ok(code):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

    prints_ok("import tessera\n"
              "try:\n"
              "    import torch\n"
              "except ImportError:\n"
              "    torch = None\n"
              "if torch is not None:\n"
              "    b = tessera.prepack_w8a8(torch.ones((4, 32)), block=32)\n"
              "    assert b.codes.dtype == torch.int8 and int(b.codes[0, 0]) == 127, b\n"
              "print('ok')\n")
    prints_ok("import sys; sys.modules['torch'] = None\n"
              "import tessera, tessera.w8a8\n"
              "try:\n"
              "    tessera.w8a8.prepack_w8a8([[1.0] * 32])\n"
              "except ImportError as e:\n"
              "    assert 'torch' in str(e)\n"
              "else:\n"
              "    raise SystemExit('no ImportError')\n"
              "assert tessera.w8a8.param_ld(5) == 8\n"
              "print('ok')\n")


def _f32(t):
    """A float64 tensor rounded to fp32 values: the result of one fp32 operation whose exact value t holds."""
    return t.float().double()


def _rule_f64(w, block, symmetric):
    """The header's quantization rule in float64, each fp32 step rounded to fp32: (codes, scale, zero, sums), the
    parameters [N, K // block]."""
    n, k = w.shape
    v = w.double().view(n, k // block, block)
    lo = v.amin(-1).clamp(max=0.0)
    hi = v.amax(-1).clamp(min=0.0)
    if symmetric:
        s = _f32(torch.maximum(hi, -lo) / 127.0)
    else:
        s = _f32(_f32(hi - lo) / 255.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    inv = _f32(1.0 / s)
    if symmetric:
        z, q_min = torch.zeros_like(s), -127.0
    else:
        z, q_min = torch.clamp(torch.round(_f32(-128.0 - _f32(lo * inv))), -128.0, 127.0), -128.0
    q = torch.clamp(torch.round(_f32(v * inv[..., None])) + z[..., None], q_min, 127.0)
    return q.view(n, k), s, z, q.sum(-1)


def _params(plane, rows):
    """A [K // block, ld] plane as the [rows, K // block] matrix of its meaningful columns."""
    return plane[:, :rows].t()


@needs_torch
@pytest.mark.parametrize("block", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n", [40, 13])
def test_prepack_follows_the_documented_rule(seed, block, symmetric, n):
    k = 256
    w = _weight(seed, n, k)
    w[4, :32] = 0.375  # a constant block (asymmetric: zero point -128)
    w[5, 40:] = -w[5, 40:].abs()  # negative blocks (asymmetric: zero point 127)
    b = tw.prepack_w8a8(w, block=block, symmetric=symmetric)
    blk = k if block is None else block
    ld = (n + 3) // 4 * 4
    assert isinstance(b, tw.Int8Blocks) and b.block == blk and b.symmetric == symmetric
    assert (b.rows, b.k, b.num_blocks, b.ld) == (n, k, k // blk, ld) and b.device.type == "cpu"
    assert b.codes.dtype == torch.int8 and b.codes.shape == (n, k) and b.codes.is_contiguous()
    for plane in (b.scale, b.sums) + ((b.zero,) if not symmetric else ()):
        assert plane.dtype == torch.float32 and plane.shape == (k // blk, ld) and plane.is_contiguous()
        assert bool((plane[:, n:] == 0).all()), "padding of the planes must be zero"
    assert (b.zero is None) == symmetric
    codes, scale, zero, sums = _rule_f64(w, blk, symmetric)
    assert torch.equal(b.codes.double(), codes), "codes differ from the documented rule"
    assert torch.equal(_params(b.scale, n).double(), scale)
    if not symmetric:
        assert torch.equal(_params(b.zero, n).double(), zero)
    assert torch.equal(_params(b.sums, n).double(), sums)
    assert bool((b.codes >= (-127 if symmetric else -128)).all())
    # Round to nearest: every weight within half a step of its value (x * (1 / s) carries ~127 * 2^-23 of fp32
    # rounding; with a zero point, itself rounded, an end of the range may clamp: one step).
    err = (tw.dequantize(b, torch.float64) - w.double()).abs()
    step = _params(b.scale, n).double().repeat_interleave(blk, dim=1)
    assert bool((err <= step * ((0.5 if symmetric else 1.0) + 1e-4)).all())
    # The all-zero row: scale 1, codes 0 (asymmetric: zero point and codes -128), exactly 0 again.
    assert float(_params(b.scale, n)[2].max()) == 1.0 and not bool(tw.dequantize(b)[2].any())
    if not symmetric:
        assert float(b.zero[0, 3]) == -128.0  # the all-positive row: lo = 0


@needs_torch
def test_prepack_takes_other_dtypes_devices_and_numpy(seed):
    w = _weight(seed, 24, 128)
    want = tw.prepack_w8a8(w.bfloat16().float(), block=64)
    got = tw.prepack_w8a8(w.bfloat16(), block=64)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
    assert torch.equal(got.sums, want.sums) and got.zero is None
    if np is not None:
        got = tw.prepack_w8a8(w.bfloat16().float().numpy(), block=64)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
    m = want.to("meta")
    assert m.device.type == "meta" and m.block == 64 and m.scale.shape == want.scale.shape and m.zero is None
    assert want.cpu().codes is want.codes  # already there: the same tensors
    assert "Int8Blocks(rows=24, k=128, block=64, symmetric=True" in repr(want)


@needs_torch
def test_dequantize():
    codes = torch.tensor([[1, -2, 3, 4]], dtype=torch.int8).repeat_interleave(8, dim=1)  # [1, 32]
    scale = torch.tensor([[0.5, 9.0, 9.0, 9.0]])  # ld 4, one row
    zero = torch.tensor([[1.0, 7.0, 7.0, 7.0]])
    b = tw.Int8Blocks(codes, scale, zero, None, 32)
    want = (codes.double() - 1.0) * 0.5
    assert torch.equal(tw.dequantize(b, torch.float64), want)
    assert torch.equal(tw.dequantize(b._replace(zero=None), torch.float64), codes.double() * 0.5)


@needs_torch
@pytest.mark.parametrize("symmetric", [False, True])
def test_the_float32_reference_agrees_with_prepack(seed, symmetric):
    # The GPU tests' reference (_quantize_ref) is the rule once more, in fp32 torch ops: on the host it must give
    # prepack_w8a8's codes and parameters (the C++ host quantizer), so that a GPU mismatch is the kernel's.
    w = _weight(seed, 20, 256).bfloat16().float() * 30.0
    for block in (32, 256):
        b = tw.prepack_w8a8(w, block=block, symmetric=symmetric)
        codes, scale, zero, sums = _quantize_ref(w, block, symmetric)
        assert torch.equal(b.codes, codes)
        assert torch.equal(_params(b.scale, 20), scale) and torch.equal(_params(b.sums, 20), sums)
        assert symmetric or torch.equal(_params(b.zero, 20), zero)


@needs_torch
def test_host_step_errors_name_the_argument(seed):
    w = _weight(seed, 16, 128)
    with pytest.raises(ValueError, match="'block'"):
        tw.prepack_w8a8(w, block=48)
    with pytest.raises(ValueError, match="'block'"):
        tw.prepack_w8a8(_weight(seed, 16, 96), block=64)  # does not divide K
    with pytest.raises(ValueError, match="'k'"):
        tw.prepack_w8a8(w[:, :120])  # K not a multiple of 16
    with pytest.raises(ValueError, match="'w'"):
        tw.prepack_w8a8(w[0])
    with pytest.raises(ValueError, match="'w'"):
        tw.prepack_w8a8(torch.ones((4, 64), dtype=torch.int32))
    bad = w.clone()
    bad[3, 7] = float("inf")
    with pytest.raises(ValueError, match=r"'w' must be finite.*\[3, 7\]"):
        tw.prepack_w8a8(bad)
    with pytest.raises(TypeError, match="'w'"):
        tw.prepack_w8a8(object())
    with pytest.raises(ValueError, match="'blocks'"):
        tw.dequantize(w)
    with pytest.raises(ValueError, match="'w'"):
        tw.workspace_bytes(4, w)
    with pytest.raises(ValueError, match="'max_m'"):
        tw.workspace_bytes(-1, tw.prepack_w8a8(w))
    with pytest.raises(ValueError, match="'block'"):
        tw.empty_blocks(4, 128, 48, device="meta")


def test_binding_checks_host_arrays_before_reading_them():
    # The raw entries (tessera._C) read through raw pointers: a capsule labelled as device memory, a wrong dtype or
    # a plane narrower than the codes' rows is refused, named, before anything is read or launched. No torch needed.
    w = HostCapsule((16, 64), DL_FLOAT, 32)
    d = tessera._C.prepack_w8a8(w.capsule, 32, False)  # zeros: a valid weight
    assert (d["n"], d["k"], d["block"], d["ld"], d["symmetric"]) == (16, 64, 32, 16, False)
    assert isinstance(d["codes"], bytearray) and len(d["codes"]) == 16 * 64
    assert len(d["scale"]) == len(d["zero"]) == len(d["sums"]) == 2 * 16 * 4
    assert tessera._C.prepack_w8a8(w.capsule, 64, True)["zero"] is None
    wrong = HostCapsule((16, 64), DL_INT, 32)
    with pytest.raises(ValueError, match="'w' must be fp32"):
        tessera._C.prepack_w8a8(wrong.capsule, 32, True)
    on_gpu = HostCapsule((16, 64), DL_FLOAT, 32)
    on_gpu.managed.dl_tensor.device.device_type = 2  # kDLCUDA
    with pytest.raises(ValueError, match="'w' must be host"):
        tessera._C.prepack_w8a8(on_gpu.capsule, 32, True)
    # The device ops: host memory and a plane without room for the rows are argument errors (named), not launches.
    x = HostCapsule((8, 64), DL_FLOAT, 32)
    codes = HostCapsule((8, 64), DL_INT, 8)
    scale = HostCapsule((2, 8), DL_FLOAT, 32)
    narrow = HostCapsule((2, 4), DL_FLOAT, 32)
    with pytest.raises(ValueError, match="'scale' must be \\[K / block, ld\\] with ld >= rows \\(8"):
        tessera._C.w8a8_quantize(x.capsule, codes.capsule, narrow.capsule, None, None, 32, 0)
    with pytest.raises(ValueError, match="'x' must be in device memory"):
        tessera._C.w8a8_quantize(x.capsule, codes.capsule, scale.capsule, None, None, 32, 0)
    y = HostCapsule((8, 8), DL_FLOAT, 32)
    with pytest.raises(ValueError, match="'w_scale' must be \\[K / block, ld\\]"):
        tessera._C.gemm_w8a8(codes.capsule, scale.capsule, None, None, codes.capsule, narrow.capsule, None, None,
                             None, y.capsule, None, 32, -math.inf, math.inf, 1.0, 0)
    with pytest.raises(ValueError, match="in device memory"):
        tessera._C.gemm_w8a8(codes.capsule, scale.capsule, None, None, codes.capsule, scale.capsule, None, None,
                             None, y.capsule, None, 32, -math.inf, math.inf, 1.0, 0)
    assert tessera._C.gemm_w8a8_workspace_bytes(0, 256, 512, 128) == 0  # no rows: asked of no device
    with pytest.raises(ValueError, match="'block'"):
        tessera._C.gemm_w8a8_workspace_bytes(16, 256, 512, 48)


# ---- the operators: schemas, meta and fake tensors, tracing (no GPU) ----------------------------------------------


@needs_torch
def test_schemas_mark_what_they_write():
    from tessera import _torch_ops

    expected = {
        "w8a8_quantize": (["x", "codes", "scale", "zero", "sums", "block"], {"codes", "scale", "zero", "sums"}),
        "gemm_w8a8": (["a_codes", "a_scale", "a_zero", "a_sums", "w_codes", "w_scale", "w_zero", "w_sums", "bias", "y",
                       "workspace", "block", "clamp_min", "clamp_max", "out_scale"], {"y", "workspace"}),
    }
    for name, (args, written) in expected.items():
        assert name in _torch_ops.OPS
        schema = getattr(torch.ops.tessera, name).default._schema
        assert [a.name for a in schema.arguments] == args, name
        assert len(schema.returns) == 0
        assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == written
    types = {a.name: str(a.type) for a in torch.ops.tessera.gemm_w8a8.default._schema.arguments}
    assert types["a_zero"] == types["w_sums"] == types["bias"] == types["workspace"] == "Optional[Tensor]"
    assert (types["block"], types["clamp_min"], types["out_scale"]) == ("int", "float", "float")


@needs_torch
def test_cuda_kernels_and_direct_entries_are_registered():
    _needs_kernels()
    for name in ("w8a8_quantize", "gemm_w8a8"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{name}", "CUDA"), name
        assert hasattr(tessera._torch_C, name) and hasattr(tessera._torch_C, name + "_eager"), name


def _meta_weight(seed, n=40, k=256, block=128, symmetric=True):
    return tw.prepack_w8a8(_weight(seed, n, k), block=block, symmetric=symmetric).to("meta")


@needs_torch
def test_meta_tensors_give_shapes_through_the_operators(seed):
    _needs_kernels()
    w = _meta_weight(seed, symmetric=False)
    x = torch.empty((3, 5, 256), dtype=torch.bfloat16, device="meta")
    with recording_mode() as mode:
        y = tw.linear_w8a8(x, w, torch.empty((40,), device="meta"), activation="relu")
    assert [c for c in mode.calls if c.startswith("tessera")] == ["tessera.w8a8_quantize.default",
                                                                  "tessera.gemm_w8a8.default"], mode.calls
    assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16 and y.is_meta
    y = tw.linear_w8a8(torch.empty((256,), dtype=torch.float32, device="meta"), w)  # y [N] of x's dtype
    assert y.shape == (40,) and y.dtype == torch.float32
    for block, symmetric, sums, rows in ((64, True, False, 15), (None, False, True, 0), (32, False, False, 5)):
        a = tw.quantize_per_block(x.reshape(15, 256)[:rows], block, symmetric, sums=sums)
        blk = 256 if block is None else block
        assert isinstance(a, tw.Int8Blocks) and a.block == blk and a.codes.shape == (rows, 256)
        assert a.codes.dtype == torch.int8 and a.scale.dtype == torch.float32
        assert a.scale.shape == (256 // blk, tw.param_ld(rows)) and a.scale.is_contiguous()
        assert (a.zero is None) == symmetric and (a.sums is None) == (not sums)
        if a.zero is not None:
            assert a.zero.shape == a.scale.shape
    a = tw.quantize_per_block(x, 128)
    assert a.codes.shape == (15, 256) and a.scale.shape == (2, 16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert tw.gemm_w8a8(a, w, out_dtype=dtype).dtype == dtype
    y = tw.gemm_w8a8(a, w, out_dtype=torch.int8, out_scale=4.0)
    assert y.shape == (15, 40) and y.dtype == torch.int8
    out = torch.empty((15, 40), dtype=torch.float16, device="meta")
    assert tw.gemm_w8a8(a, w, out=out) is out
    out3 = torch.empty((3, 5, 40), dtype=torch.float16, device="meta")
    assert tw.linear_w8a8(x, w, out=out3) is out3
    pre = tw.empty_blocks(15, 256, 128, device="meta")
    assert tw.quantize_per_block(x, 128, out=pre) is pre
    assert tw.linear_w8a8(x, w, a_out=pre, out=out3) is out3


@needs_torch
def test_argument_errors_without_a_gpu(seed):
    _needs_kernels()
    w = _meta_weight(seed)
    wz = _meta_weight(seed, symmetric=False)
    x = torch.empty((4, 256), dtype=torch.bfloat16, device="meta")
    a = tw.quantize_per_block(x, 128)
    with pytest.raises(ValueError, match="'block' must be 32, 64, 128 or K \\(256\\), got 48"):
        tw.quantize_per_block(x, 48)
    with pytest.raises(ValueError, match="'block' must divide K"):
        tw.quantize_per_block(torch.empty((4, 96), device="meta"), 64)
    with pytest.raises(ValueError, match="'x' must have K \\(its last dim\\) a positive multiple of 16"):
        tw.quantize_per_block(torch.empty((4, 200), device="meta"), None)
    with pytest.raises(ValueError, match="'x' must be \\[\\.\\.\\., K\\], got a scalar"):
        tw.quantize_per_block(torch.empty((), device="meta"))
    with pytest.raises(ValueError, match="'x' must be a CUDA tensor"):  # host tensors: named, never launched
        tw.quantize_per_block(torch.zeros((4, 256)))
    with pytest.raises(ValueError, match="'out' must have block 128"):
        tw.quantize_per_block(x, 128, out=tw.empty_blocks(4, 256, 64, device="meta"))
    with pytest.raises(ValueError, match="'out' must hold zero points"):
        tw.quantize_per_block(x, 128, out=tw.empty_blocks(4, 256, symmetric=True, device="meta"))
    with pytest.raises(ValueError, match="'out' must not hold sums"):
        tw.quantize_per_block(x, 128, sums=False, out=tw.empty_blocks(4, 256, device="meta"))
    with pytest.raises(ValueError, match="'out'"):
        tw.quantize_per_block(x, 128, out=(a.codes, a.scale, None, None, 128))
    with pytest.raises(ValueError, match="'a' must be a tessera.w8a8.Int8Blocks"):
        tw.gemm_w8a8(x, w)
    # A field the eager entry does not read (a bool block): its TypeError sends the call to
    # the checked path, which names the argument.
    with pytest.raises(ValueError, match="'w' must have a's block"):
        tw.gemm_w8a8(a._replace(block=True), w)
    with pytest.raises(ValueError, match="'out' must have block 128"):
        tw.quantize_per_block(x, 128, out=a._replace(block=True))
    with pytest.raises(ValueError, match="'w' must be a tessera.w8a8.Int8Blocks"):
        tw.gemm_w8a8(a, w.codes)
    with pytest.raises(ValueError, match="'w' must have a's block \\(128\\), got block 256"):
        tw.gemm_w8a8(a, _meta_weight(seed, block=None))
    with pytest.raises(ValueError, match="'out_scale' is required"):
        tw.gemm_w8a8(a, w, out_dtype=torch.int8)
    # The eager entry's common case (no epilogue, out_dtype and out_scale None) takes y's dtype from out: an out it
    # cannot take goes to the checked path and its messages, ahead of the device and rank rules.
    for codes in (a.codes, torch.zeros((4, 256), dtype=torch.int8), torch.empty((1, 4, 256), dtype=torch.int8,
                                                                                 device="meta")):
        bad = a._replace(codes=codes)
        with pytest.raises(ValueError, match="'out_scale' is required"):
            tw.gemm_w8a8(bad, w, out=torch.empty((4, w.codes.shape[0]), dtype=torch.int8, device="meta"))
        with pytest.raises(ValueError, match="'out_dtype' must be torch.bfloat16, .*got torch.float64"):
            tw.gemm_w8a8(bad, w, out=torch.empty((4, w.codes.shape[0]), dtype=torch.float64, device="meta"))
    y = tw.gemm_w8a8(a, w, out=torch.empty((4, w.codes.shape[0]), dtype=torch.float16, device="meta"))
    assert y.dtype == torch.float16 and y.shape == (4, w.codes.shape[0])
    assert tw.gemm_w8a8(a, w).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'out_scale' must be positive"):
        tw.gemm_w8a8(a, w, out_dtype=torch.int8, out_scale=0.0)
    with pytest.raises(ValueError, match="'out_scale' applies to an int8 output only"):
        tw.gemm_w8a8(a, w, out_scale=2.0)
    with pytest.raises(ValueError, match="'out_dtype'"):
        tw.gemm_w8a8(a, w, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="'out' must be torch.float16"):
        tw.gemm_w8a8(a, w, out_dtype=torch.float16, out=torch.empty((4, 40), dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="'out' must be \\[M, N\\] = \\[4, 40\\]"):
        tw.gemm_w8a8(a, w, out=torch.empty((4, 41), dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="'activation'"):
        tw.gemm_w8a8(a, w, activation="gelu")
    with pytest.raises(ValueError, match="'clamp'"):
        tw.gemm_w8a8(a, w, clamp=(1.0, 0.0))
    with pytest.raises(ValueError, match="'a.codes' must have rank 2"):
        tw.gemm_w8a8(a._replace(codes=a.codes[0]), w)
    with pytest.raises(ValueError, match="'x' must be \\[\\.\\.\\., K\\] with K = 256"):
        tw.linear_w8a8(torch.empty((4, 128), dtype=torch.bfloat16, device="meta"), w)
    with pytest.raises(ValueError, match="'out' must be \\[\\.\\.\\., N\\]"):
        tw.linear_w8a8(x, w, out=torch.empty((4, 8), dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="'a_out' must hold sums"):
        tw.linear_w8a8(x, wz, a_out=tw.empty_blocks(4, 256, sums=False, device="meta"))
    with pytest.raises(ValueError, match="'w'"):
        tw.linear_w8a8(x, w.codes)
    with recording_mode() as mode:  # the GEMM's arguments are checked before the quantizer runs
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'out_scale' applies"):
            tw.linear_w8a8(x, w, out_scale=2.0)
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'clamp'"):
            tw.linear_w8a8(x, w, clamp=(2.0, 1.0))
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'w' must be on x's device"):
            tw.linear_w8a8(x, tw.prepack_w8a8(_weight(seed, 40, 256), block=128))  # the weight left on the host
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'bias' must be float32 \\[N\\] = \\[40\\]"):
            tw.linear_w8a8(x, w, torch.empty((41,), device="meta"))
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'bias' must be float32"):
            tw.linear_w8a8(x, w, torch.empty((40,), dtype=torch.float16, device="meta"))
        with pytest.raises(ValueError, match="tessera.linear_w8a8: 'out' must be viewable"):
            tw.linear_w8a8(torch.empty((3, 5, 256), dtype=torch.bfloat16, device="meta"), w,
                           out=torch.empty((5, 3, 40), dtype=torch.bfloat16, device="meta").transpose(0, 1))
    assert not [c for c in mode.calls if c.startswith("tessera")], mode.calls


@needs_torch
def test_opcheck_on_meta_tensors(seed):
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    w = _meta_weight(seed, symmetric=False)
    x = torch.empty((5, 256), dtype=torch.bfloat16, device="meta")
    a = tw.empty_blocks(5, 256, 128, device="meta")
    torch.library.opcheck(torch.ops.tessera.w8a8_quantize.default, (x, a.codes, a.scale, a.zero, a.sums, 128))
    y = torch.empty((5, 40), dtype=torch.bfloat16, device="meta")
    bias = torch.empty((40,), device="meta")
    torch.library.opcheck(torch.ops.tessera.gemm_w8a8.default,
                          (a.codes, a.scale, a.zero, a.sums, w.codes, w.scale, w.zero, w.sums, bias, y, None, 128,
                           0.0, math.inf, 1.0))


@needs_torch
def test_symbolic_tracing_sees_the_operators(seed):
    # make_fx with dynamic shapes (what AOT autograd and export use): the eager entries hand symbolic sizes to the
    # torch layer's checked path, which allocates with torch (the planes' ld from the symbolic row count).
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        c = dict(device="cuda")
        x = torch.empty((2, 7, 256), dtype=torch.bfloat16, **c)
        codes = torch.empty((40, 256), dtype=torch.int8, **c)
        scale = torch.empty((2, 40), **c)

    def fn(x, codes, scale):
        w = tw.Int8Blocks(codes, scale, None, None, 128)
        return tw.linear_w8a8(x, w, activation="relu6")

    graph = make_fx(fn, tracing_mode="symbolic")(x, codes, scale)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.w8a8_quantize.default", "tessera.gemm_w8a8.default"], traced


@needs_torch
def test_dynamo_traces_the_wrappers_whole(seed):
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors: both wrappers' checked paths, the Int8Blocks tuples and the leading-dims reshape trace without a GPU.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Layer(torch.nn.Module):
        def forward(self, x, codes, scale, zero, sums, bias):
            w = tw.Int8Blocks(codes, scale, zero, sums, 128)
            h = tw.linear_w8a8(x, w, bias, activation="relu", clamp=(None, 4.0), out_dtype=torch.float16)
            a = tw.quantize_per_block(h, 128, symmetric=True)
            return tw.gemm_w8a8(a, w, out_dtype=torch.int8, out_scale=8.0), a.scale

    with FakeTensorMode():
        c = dict(device="cuda")
        args = (torch.empty((2, 5, 256), dtype=torch.bfloat16, **c), torch.empty((256, 256), dtype=torch.int8, **c),
                torch.empty((2, 256), **c), torch.empty((2, 256), **c), torch.empty((2, 256), **c),
                torch.empty((256,), **c))
        program = torch.export.export(Layer(), args, strict=True)
    traced = [str(n.target) for n in program.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.w8a8_quantize.default", "tessera.gemm_w8a8.default", "tessera.w8a8_quantize.default",
                      "tessera.gemm_w8a8.default"], traced
    output = next(n for n in program.graph.nodes if n.op == "output")
    y, planes = (v.meta["val"] for v in output.args[0])
    assert tuple(y.shape) == (10, 256) and y.dtype == torch.int8
    assert tuple(planes.shape) == (2, 12)

    class Quantize(torch.nn.Module):  # an Int8Blocks leaves a traced region as a namedtuple
        def forward(self, x):
            return tw.quantize_per_block(x, 64)

    with FakeTensorMode():
        program = torch.export.export(Quantize(), (torch.empty((6, 256), device="cuda"),), strict=True)
    assert program.call_spec.out_spec.context is tw.Int8Blocks


# ================================================================================================================
# GPU: the quantizer bit for bit, the GEMM against float64, epilogues, torch.compile, CUDA graphs, errors
# ================================================================================================================


def _quantize_ref(x, block, symmetric):
    """quantize_per_block's rule in torch float32 on the CPU, one op per step (nothing fused): (codes int8 [M, K],
    scale, zero, sums float32 [M, K // block])."""
    x = x.detach().cpu().float()
    m, k = x.shape
    v = x.view(m, k // block, block)
    zero_f = torch.zeros((), dtype=torch.float32)
    lo = torch.minimum(v.amin(-1), zero_f)
    hi = torch.maximum(v.amax(-1), zero_f)
    if symmetric:
        s = torch.div(torch.maximum(hi, torch.neg(lo)), 127.0)
    else:
        s = torch.div(torch.sub(hi, lo), 255.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    inv = torch.div(torch.ones_like(s), s)
    if symmetric:
        z, q_min = torch.zeros_like(s), -127.0
    else:
        t = torch.mul(lo, inv)
        t = torch.sub(torch.full_like(t, -128.0), t)
        z, q_min = torch.clamp(torch.round(t), -128.0, 127.0), -128.0
    y = torch.mul(v, inv[..., None])
    q = torch.clamp(torch.add(torch.round(y), z[..., None]), q_min, 127.0)
    return q.view(m, k).to(torch.int8), s, z, q.sum(-1)


def _x(seed, shape, dtype, positive_rows=True):
    """Activations: normal, with outlier columns 20x larger (as LLM activations have), one all-zero row and one
    all-positive row (post-activation data: the asymmetric zero point at -128) where there are enough rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    x[..., 5] *= 20.0
    flat = x.view(-1, shape[-1])
    if flat.shape[0] >= 4 and positive_rows:
        flat[1] = 0.0
        flat[2] = flat[2].abs()
    return x.to(dtype)


def _rel(got, want):
    d = (got.double() - want).norm().item()
    ref = want.norm().item()
    return d / ref if ref > 0 else d


def _poisoned_blocks(m, k, block, symmetric, sums, fill):
    b = tw.empty_blocks(m, k, block, symmetric=symmetric, sums=sums)
    b.codes.fill_(fill)
    for p in (b.scale, b.zero, b.sums):
        if p is not None:
            p.fill_(float("nan"))
    return b


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("block,k", [(32, 416), (64, 320), (128, 384), (None, 256), (None, 4096)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m", [1, 7, 100])
def test_quantize_matches_the_rule_bit_for_bit(seed, dtype, block, k, symmetric, m):
    dt = getattr(torch, dtype)
    x = _x(seed, (m, k), dt)
    blk = k if block is None else block
    want_codes, want_scale, want_zero, want_sums = _quantize_ref(x, blk, symmetric)
    # Twice, with codes poisoned differently: every int8 is a valid code, so an unwritten one matches once at most.
    for fill in (0x5A, -0x5B):
        b = _poisoned_blocks(m, k, blk, symmetric, True, fill)
        got = tw.quantize_per_block(x, block, symmetric, out=b)
        torch.cuda.synchronize()
        assert got is b
        assert torch.equal(b.codes.cpu(), want_codes), "codes differ from the rule"
        assert torch.equal(_params(b.scale, m).cpu(), want_scale)
        if not symmetric:
            assert torch.equal(_params(b.zero, m).cpu(), want_zero)
        assert torch.equal(_params(b.sums, m).cpu(), want_sums)
        for p in (b.scale, b.zero, b.sums):
            if p is not None:
                assert bool(p[:, m:].isnan().all()), "the planes' padding was written"
    # The allocating path writes the same values.
    a = tw.quantize_per_block(x, block, symmetric)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale[:, :m], b.scale[:, :m])


@gpu
def test_quantize_leading_dims_strided_rows_and_empty(seed):
    k = 256
    wide = _x(seed, (2, 9, 320), torch.bfloat16)
    x = wide[..., :k]  # rows of a wider tensor: a view, no copy
    a = tw.quantize_per_block(x, 64)
    want = _quantize_ref(x.reshape(-1, k), 64, False)
    torch.cuda.synchronize()
    assert a.codes.shape == (18, k) and torch.equal(a.codes.cpu(), want[0])
    assert torch.equal(_params(a.sums, 18).cpu(), want[3])
    e = tw.quantize_per_block(x[:, :0], 64)  # no rows: nothing launched
    assert e.codes.shape == (0, k) and e.scale.shape == (4, 4)


def _gemm_ref(a, w, bias=None, lo=-math.inf, hi=math.inf):
    y = tw.dequantize(a, torch.float64) @ tw.dequantize(w, torch.float64).t()
    if bias is not None:
        y = y + bias.double().cpu()
    return y.clamp(lo, hi)


def _bias(seed, n):
    return torch.randn((n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))


@gpu
@pytest.mark.parametrize("block,k", [(128, 384), (None, 384), (32, 416)])
@pytest.mark.parametrize("zero_points", ["none", "a", "w", "both"])
@pytest.mark.parametrize("m", [1, 7, 100, 300])
def test_gemm_matches_float64_reference(seed, block, k, zero_points, m):
    n = 136 if m % 3 == 0 else 200
    w = tw.prepack_w8a8(_weight(seed, n, k), block=block, symmetric=zero_points not in ("w", "both")).cuda()
    x = _x(seed + 1, (m, k), torch.bfloat16)
    a = tw.quantize_per_block(x, block, symmetric=zero_points not in ("a", "both"), sums=w.zero is not None)
    y = tw.gemm_w8a8(a, w, out=torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert bool(torch.isfinite(y).all()), "unwritten (NaN) outputs"
    err = _rel(y.cpu(), _gemm_ref(a, w))
    assert err <= TOL["bfloat16"], f"rel err {err:.3e}"
    assert torch.equal(tw.gemm_w8a8(a, w), y), "not deterministic"
    # ... and the whole layer stays close to the float product (the quantization error, not the kernel's).
    loose = _rel(y.cpu(), x.double().cpu() @ _weight(seed, n, k).double().t())
    assert loose < 0.25, f"quantized layer off the float layer by {loose:.3e}"


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8"])
@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("epilogue", [dict(), dict(activation="relu"), dict(clamp=(-0.5, 0.25)),
                                      dict(activation="relu6", clamp=(None, 1.0))],
                         ids=["bias", "relu", "clamp", "relu6_clamp"])
def test_output_types_bias_and_clamp(seed, dtype, block, epilogue):
    m, n, k = 45, 200, 512
    dt = getattr(torch, dtype)
    w = tw.prepack_w8a8(_weight(seed, n, k), block=block, symmetric=False).cuda()
    x = _x(seed + 1, (m, k), torch.float16) * 0.3
    bias = _bias(seed + 2, n) * 0.1
    a = tw.quantize_per_block(x, block)
    out_scale = 64.0 if dtype == "int8" else None  # some values saturate at -128 / 127
    poison = torch.full((m, n), 0x55 if dtype == "int8" else float("nan"), device="cuda").to(dt)
    y = tw.gemm_w8a8(a, w, bias, out=poison, out_scale=out_scale, **epilogue)
    torch.cuda.synchronize()
    lo, hi = tessera.linear._bounds("test", epilogue.get("activation"), epilogue.get("clamp"))
    want = _gemm_ref(a, w, bias, lo, hi)
    if dtype == "int8":
        code = torch.clamp(torch.round(want * out_scale), -128, 127)
        assert int((y.cpu().double() - code).abs().max()) <= 1, "int8 y off its code by more than one"
        assert float((y.cpu().double() == code).double().mean()) > 0.9
        if epilogue.get("clamp") is None and epilogue.get("activation") is None:
            assert int(y.min()) == -128 and int(y.max()) == 127, "the saturation was not exercised"
        return
    assert float(y.min()) >= lo and float(y.max()) <= hi and bool(torch.isfinite(y).all())
    err = _rel(y.cpu(), want)
    assert err <= TOL[dtype], f"rel err {err:.3e}"


@gpu
@pytest.mark.parametrize("block", [128, None])
def test_linear_w8a8_leading_dims_out_and_stream(seed, block):
    n, k = 256, 512
    w = tw.prepack_w8a8(_weight(seed, n, k), block=block).cuda()
    x = _x(seed + 1, (2, 3, 5, k), torch.bfloat16)
    bias = _bias(seed + 2, n)
    y = tw.linear_w8a8(x, w, bias, activation="relu")
    assert y.shape == (2, 3, 5, n) and y.dtype == torch.bfloat16
    a = tw.quantize_per_block(x.reshape(30, k), block)
    want = tw.gemm_w8a8(a, w, bias, activation="relu")
    torch.cuda.synchronize()
    assert torch.equal(y.reshape(30, n), want), "linear_w8a8 differs from its two steps"
    assert _rel(y.reshape(30, n).cpu(), _gemm_ref(a, w, bias, 0.0)) <= TOL["bfloat16"]
    assert tw.linear_w8a8(x.float(), w).dtype == torch.float32  # y of x's dtype by default
    out = torch.full((2, 3, 5, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert tw.linear_w8a8(x, w, bias, activation="relu", out=out) is out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got = tw.linear_w8a8(x, w, bias, activation="relu", stream=side)
    side.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(out, y) and torch.equal(got, y)
    assert tw.linear_w8a8(x[0, 0, 0], w).shape == (n,)
    assert tw.linear_w8a8(x[:0], w).shape == (0, 3, 5, n)  # M = 0: nothing launched


@gpu
def test_workspace(seed):
    # Small M over a long K splits K across CTAs: the partial sums need the workspace.
    n, k, m = 256, 8192, 1
    w = tw.prepack_w8a8(_weight(seed, n, k), block=128).cuda()
    x = _x(seed + 1, (m, k), torch.bfloat16)
    want = tw.linear_w8a8(x, w)
    sizes = [tw.workspace_bytes(mm, w) for mm in (0, 1, 16, 256)]
    assert sizes[0] == 0 and all(isinstance(s, int) for s in sizes) and sizes == sorted(sizes) and sizes[1] > 0
    assert tw.workspace_bytes(16, w) == sizes[2]  # cached
    ws = torch.empty(sizes[1], dtype=torch.uint8, device="cuda")
    assert torch.equal(tw.linear_w8a8(x, w, workspace=ws), want)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="'workspace' must hold"):
        tw.linear_w8a8(x, w, workspace=torch.empty(16, dtype=torch.uint8, device="cuda"), out=y)
    torch.cuda.synchronize()
    assert bool(y.isnan().all()), "a refused call wrote y"


@gpu
@pytest.mark.parametrize("block", [128, None])
def test_compile_fullgraph_matches_eager(seed, block):
    n, k = 256, 512
    w = tw.prepack_w8a8(_weight(seed, n, k), block=block, symmetric=False).cuda()
    x = _x(seed + 1, (2, 37, k), torch.bfloat16)
    bias = _bias(seed + 2, n)

    def layer(x, bias):
        return tw.linear_w8a8(x, w, bias, activation="relu") * 2.0

    eager = layer(x, bias)
    got = torch.compile(layer, fullgraph=True)(x, bias)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), "compiled linear_w8a8 differs from eager"
    a = tw.quantize_per_block(x.reshape(-1, k), block)
    assert _rel((eager / 2.0).reshape(-1, n).cpu(), _gemm_ref(a, w, bias, 0.0)) <= TOL["bfloat16"]


@gpu
@pytest.mark.parametrize("preallocated", [True, False])
def test_cuda_graph_capture_and_replay(seed, preallocated):
    n, k, m = 256, 512, 16
    w = tw.prepack_w8a8(_weight(seed, n, k), block=128, symmetric=False).cuda()
    x = _x(seed + 1, (m, k), torch.float16)
    bias = _bias(seed + 2, n)
    kw = {}
    if preallocated:  # nothing allocated inside the capture
        kw = dict(out=torch.empty((m, n), dtype=torch.float16, device="cuda"),
                  a_out=tw.empty_blocks(m, k, 128, sums=True),
                  workspace=torch.empty(max(tw.workspace_bytes(m, w), 16), dtype=torch.uint8, device="cuda"))
    tw.linear_w8a8(x, w, bias, **kw)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tw.linear_w8a8(x, w, bias, activation="relu6", **kw)
    for round_ in range(2):
        x.copy_(_x(seed + 10 + round_, (m, k), torch.float16))
        y.fill_(float("nan"))
        graph.replay()
        want = tw.linear_w8a8(x, w, bias, activation="relu6")
        torch.cuda.synchronize()
        assert torch.equal(y, want), f"replay {round_} differs from eager"


@gpu
def test_bad_arguments_are_value_errors_and_write_nothing(seed):
    n, k, m = 128, 256, 4
    w = tw.prepack_w8a8(_weight(seed, n, k), block=64, symmetric=False).cuda()
    x = _x(seed + 1, (m, k), torch.bfloat16)
    a = tw.quantize_per_block(x, 64)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bias"):  # bf16 bias: the epilogue takes fp32
        tw.gemm_w8a8(a, w, torch.zeros(n, dtype=torch.bfloat16, device="cuda"), out=y)
    with pytest.raises(ValueError, match="bias"):
        tw.gemm_w8a8(a, w, torch.zeros(n + 8, device="cuda"), out=y)
    with pytest.raises(ValueError, match="w.codes"):  # the weight left on the host
        tw.gemm_w8a8(a, w.cpu(), out=y)
    with pytest.raises(ValueError, match="a.sums"):  # the weight has zero points: the activations' sums are needed
        tw.gemm_w8a8(a._replace(sums=None), w, out=y)
    with pytest.raises(ValueError, match="a_scale"):  # a plane without room for the rows
        tw.gemm_w8a8(a._replace(scale=a.scale[:, :2]), w, out=y)
    torch.cuda.synchronize()
    assert bool(y.isnan().all()), "a refused call wrote y"
    # Through the dispatcher (what torch.compile calls) the same errors are ValueErrors.
    with pytest.raises(ValueError, match="block"):
        torch.ops.tessera.gemm_w8a8(a.codes, a.scale, a.zero, a.sums, w.codes, w.scale, w.zero, w.sums, None, y,
                                    None, 48, -math.inf, math.inf, 1.0)
    with pytest.raises(ValueError, match="out.scale"):  # planes of block 64 for block 32
        b = tw.empty_blocks(m, k, 64)
        torch.ops.tessera.w8a8_quantize(x, b.codes, b.scale, b.zero, b.sums, 32)
    with pytest.raises(ValueError, match="'x'"):  # an int8 x
        tw.quantize_per_block(a.codes, 64)


@gpu
def test_plane_views_must_cover_their_last_row(seed):
    # The GEMM reads a parameter plane by TMA in whole rows of its ld: a strided view of a buffer that ends inside the
    # last row's ld is refused by name (found in review: it was read past its storage's end).
    _needs_kernels()
    x = torch.randn((5, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()
    w = tw.prepack_w8a8(_weight(seed, 40, 64), block=32, symmetric=True).cuda()
    a = tw.quantize_per_block(x, 32, symmetric=True)
    tight = torch.zeros(13, device="cuda")
    scale = tight.as_strided((2, 5), (8, 1))  # ld 8: the last row's ld ends at element 16 of 13
    with pytest.raises(ValueError, match="'a_scale' must have storage for all its 2 rows of ld = 8"):
        tw.gemm_w8a8(a._replace(scale=scale), w)
    assert tuple(a.scale.shape) == (2, 8)  # quantize_per_block's own planes: ld 8, whole rows
    want = tw.gemm_w8a8(a, w)
    roomy = a.scale.clone()  # the same strided view over storage that holds both rows' ld runs, and agrees
    got = tw.gemm_w8a8(a._replace(scale=roomy.as_strided((2, 5), (8, 1))), w)
    assert torch.equal(got, want)
