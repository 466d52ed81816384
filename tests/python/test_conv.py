"""Python tests for tessera.conv: conv2d with int4 / int8 weights (torch.ops.tessera.conv2d, the host steps
quantize_weight / dequantize, the queries conv2d_path / workspace_bytes / output_size, and the raw entries in
tessera._C).

Semantics (include/tessera/conv.h): torch.nn.functional.conv2d(x, W, bias, stride, padding, dilation, groups) with W
[Co, Ci_g, Kh, Kw] held as a weight-only linear weight over the reduction index r = (kh*Kw + kw)*Ci_g + ci, then the
linear layer's clamp. x is read NHWC when channels_last, NCHW when contiguous; y comes back in x's format (or out='s).

The tests at the top run without a GPU: the weight's layout (the permutation to [Co, Kh, Kw, Ci_g] and the linear
layer's quantization and prepack), output sizes against PyTorch's rule and its own meta kernels, output shapes,
dtypes and memory formats on meta tensors through both ways into the operator (the C++ eager entry and the Python
checked path), the schema, Dynamo tracing (strict torch.export on fake CUDA tensors), make_fx, and argument errors,
raised before anything is launched. The GPU tests compare the op with torch.nn.functional.conv2d in float64 over
dequantize(weight) (the very weight values the kernels read, the parameters rounded to the compute dtype), on outputs
poisoned with NaN first, over NCHW and channels_last inputs, bf16 / fp16 / fp32 x, int4 / int8, both parameter
conventions, bias and clamps, strides, padding, dilation, groups (depthwise too), odd sizes and each of the three
paths (the path each case takes is asserted, following the header's rules).

Tolerance (relative Frobenius error): 5e-3 for bf16 compute, 2e-3 for fp16, as test_linear.py: the tensor-core paths
round each weight once to the compute dtype, every path rounds y once to x's dtype (and fp32 x once to the compute
dtype); fp32 accumulation adds far less. A wrong tap, channel, group or block is an O(1) error.
"""

import math

import pytest

import tessera
from _dispatch_record import recording_mode

from _optional import gpu, needs_torch, np, torch

F = torch.nn.functional if torch is not None else None

TOL = {"bfloat16": 5e-3, "float16": 2e-3}
tc = tessera.conv
tl = tessera.linear


def _needs_kernels():
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _conv_weight(seed, co, ci_g, kh, kw):
    """A float conv weight [Co, Ci_g, Kh, Kw] with outlier input channels (every 5th 8x larger) and output channels
    of different scales, as trained layers have them."""
    w = torch.randn((co, ci_g, kh, kw), generator=_gen(seed)) * 0.05
    w[:, ::5] *= 8.0
    w *= torch.rand((co, 1, 1, 1), generator=_gen(seed + 1)) + 0.5
    return w


def _weight(seed, co=32, ci_g=64, kh=3, kw=3, bits=4, block=64, zero_mode="offset", dtype=None):
    return tc.quantize_weight(_conv_weight(seed, co, ci_g, kh, kw), bits=bits, block=block, zero_mode=zero_mode,
                              compute_dtype=dtype)


def _expected_path(n, h, w, c, co, kh, kw, stride, padding, dilation, groups):
    """The path include/tessera/conv.h says a call takes."""
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    ci_g, co_g = c // groups, co // groups
    if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and (ph, pw) == (0, 0) and groups == 1 and c % 8 == 0:
        return "linear"
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    eh, ew = dh * (kh - 1), dw * (kw - 1)
    # The TMA im2col box needs at least 2 x 2 output pixels (src/conv: a non-empty bounding box).
    if (ci_g % 64 == 0 and (groups == 1 or co_g % 128 == 0) and max(ph, pw) <= 127 and max(sh, sw) <= 8
            and max(eh, ew) <= 255 and eh - ph <= 128 and ew - pw <= 128 and n * ho * wo < 2**24 and ho >= 2
            and wo >= 2):
        return "implicit_gemm"
    return "direct"


# ================================================================================================================
# Without a GPU: exports, the weight, output sizes
# ================================================================================================================


def test_exports():
    assert tessera.conv is tc and "conv" in tessera.__all__
    assert tessera.conv2d is tc.conv2d and "conv2d" in tessera.__all__
    assert tessera.ConvWeight is tc.ConvWeight and "ConvWeight" in tessera.__all__
    for name in ("conv2d", "conv2d_path", "dequantize", "output_size", "quantize_weight", "workspace_bytes"):
        assert name in tc.__all__ and callable(getattr(tc, name)), name
    for name in ("conv2d", "conv2d_path", "conv2d_workspace_bytes", "conv2d_output_size", "conv_path_name"):
        assert callable(getattr(tessera._C, name)), name
    assert tc.PATHS == ("linear", "implicit_gemm", "direct")
    assert tuple(tessera._C.conv_paths) == tc.PATHS
    assert [tessera._C.conv_path_name(i) for i in range(3)] == list(tc.PATHS)
    with pytest.raises(ValueError, match="'path'"):
        tessera._C.conv_path_name(3)


def test_conv2d_signature():
    import inspect

    params = inspect.signature(tc.conv2d).parameters
    assert list(params)[:7] == ["x", "weight", "bias", "stride", "padding", "dilation", "groups"]
    assert [params[n].default for n in ("bias", "stride", "padding", "dilation", "groups")] == [None, 1, 0, 1, 1]
    for name in ("activation", "clamp", "out", "workspace", "stream"):
        assert params[name].kind == params[name].KEYWORD_ONLY and params[name].default is None, name
    for fn in (tc.conv2d_path, tc.workspace_bytes):
        p = inspect.signature(fn).parameters
        assert list(p)[:6] == ["x", "weight", "stride", "padding", "dilation", "groups"], fn
        assert p["out"].kind == p["out"].KEYWORD_ONLY and p["out"].default is None
    params = inspect.signature(tc.quantize_weight).parameters
    assert list(params) == ["w", "bits", "block", "zero_mode", "compute_dtype"]
    assert [p.default for p in params.values()][1:] == [4, 64, "offset", None]


def _torch_rule(size, k, stride, pad, dil):
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1  # Python's // is a floor, negatives included


def test_output_size_follows_pytorchs_rule():
    # Every combination of small sizes, kernels, strides, padding and dilation (negative numerators included: a
    # floor, so stride 3 over a numerator of -4 gives -1, where truncation would give 0).
    for size in range(1, 14):
        for k in range(1, 6):
            for stride in (1, 2, 3):
                for pad in range(4):
                    for dil in (1, 2, 3):
                        got = tc.output_size(size, k, stride, pad, dil)
                        assert got == _torch_rule(size, k, stride, pad, dil), (size, k, stride, pad, dil)
                        assert got == tessera._C.conv2d_output_size(size, k, stride, pad, dil)
    assert tc.output_size(1, 5, 3) == -1
    assert tc.output_size(224, 7, 2, 3) == 112 and tc.output_size(56, 3, 1, 1) == 56
    assert tc.output_size(4096, 3, 1, 0, 2) == 4092
    for args, arg in (((5, 3, 0), "stride"), ((5, 0), "k"), ((5, 3, 1, -1), "padding"), ((5, 3, 1, 0, 0), "dilation")):
        with pytest.raises(ValueError, match=f"'{arg}' must be >= "):
            tc.output_size(*args)
    with pytest.raises(ValueError, match="tessera.conv2d_output_size: 'stride' must be >= 1, got 0"):
        tessera._C.conv2d_output_size(5, 3, 0, 0, 1)


@needs_torch
def test_output_size_matches_torch_conv2d():
    # PyTorch's own conv2d on meta tensors, on the sizes that give an output (it refuses the others).
    x = torch.empty((1, 2, 1, 1), device="meta")
    for size in (1, 2, 5, 8, 13):
        for k in (1, 2, 3, 5):
            for stride in (1, 2, 3):
                for pad in (0, 1, 3):
                    for dil in (1, 2):
                        want = _torch_rule(size, k, stride, pad, dil)
                        if want < 1:
                            continue
                        x = torch.empty((1, 2, size, size + 1), device="meta")
                        w = torch.empty((4, 2, k, k), device="meta")
                        y = F.conv2d(x, w, stride=stride, padding=pad, dilation=dil)
                        assert y.shape[2] == tc.output_size(size, k, stride, pad, dil), (size, k, stride, pad, dil)
                        assert y.shape[3] == tc.output_size(size + 1, k, stride, pad, dil)


# Weight geometries (Co, Ci_g, Kh, Kw, block): K = Kh*Kw*Ci_g from 9 (a depthwise 3x3) to 1152, blocks of 32, 64,
# 128 and per channel; K = 27 and 9 are not multiples of 8 (a conv weight may have any K > 0).
WEIGHTS = [(32, 64, 3, 3, 64), (24, 32, 1, 1, 32), (40, 128, 3, 3, 128), (16, 16, 2, 2, 32), (8, 3, 3, 3, None),
           (16, 1, 3, 3, None), (20, 8, 5, 3, None)]


@needs_torch
@pytest.mark.parametrize("geom", WEIGHTS, ids=lambda g: "Co{}_Cig{}_{}x{}_b{}".format(*g))
@pytest.mark.parametrize("bits,zero_mode", [(4, "offset"), (8, "zero_point"), (4, "zero_point")])
def test_quantize_weight_is_the_linear_weight_of_the_permuted_weight(seed, geom, bits, zero_mode):
    co, ci_g, kh, kw, block = geom
    k = kh * kw * ci_g
    w = _conv_weight(seed, co, ci_g, kh, kw)
    for dtype in (torch.bfloat16, torch.float16):
        cw = tc.quantize_weight(w, bits=bits, block=block, zero_mode=zero_mode, compute_dtype=dtype)
        assert isinstance(cw, tc.ConvWeight) and isinstance(cw.packed, tl.PackedLinearWeight)
        p = cw.packed
        assert (cw.kh, cw.kw, cw.kernel_size) == (kh, kw, (kh, kw))
        assert (cw.out_channels, cw.in_channels_per_group) == (co, ci_g)
        assert (p.n, p.k, p.bits, p.block, p.zero_mode) == (co, k, bits, k if block is None else block, zero_mode)
        assert p.k_perm is None and cw.compute_dtype == dtype and cw.device == torch.device("cpu")
        # The same bytes as the linear layer's steps on W permuted to [Co, Kh, Kw, Ci_g] and flattened.
        flat = w.permute(0, 2, 3, 1).reshape(co, k)
        want = tl.prepack(tl.quantize(flat, bits=bits, block=block, zero_mode=zero_mode), compute_dtype=dtype)
        assert torch.equal(p.codes, want.codes) and torch.equal(p.params, want.params)
    # dequantize goes back to PyTorch's layout, value by value.
    got = tc.dequantize(cw, torch.float64)
    assert got.shape == (co, ci_g, kh, kw) and got.dtype == torch.float64
    assert tc.dequantize(cw).dtype == torch.float32
    lin = tl.dequantize(cw.packed, torch.float64)
    for o in range(0, co, 7):
        for ci in range(ci_g):
            for i in range(kh):
                for j in range(kw):
                    assert got[o, ci, i, j] == lin[o, (i * kw + j) * ci_g + ci]
    # Round to nearest: every weight within a step of its value (a step and a half: the zero-point grid is shifted
    # by the rounded zero point, and the parameters are rounded to the compute dtype).
    q = tl.unpack(cw.packed)
    step = q.scale.double().repeat_interleave(q.block, dim=1).view(co, kh, kw, ci_g).permute(0, 3, 1, 2)
    assert bool(((got - w.double()).abs() <= step * 1.5 + 1e-3 * w.abs().max()).all())


@needs_torch
def test_quantize_weight_takes_numpy_and_any_float_dtype(seed):
    w = _conv_weight(seed, 16, 32, 3, 3)
    want = tc.quantize_weight(w, bits=8, block=32)
    for other in (w.double(), w.numpy() if np is not None else w, w.to(torch.float16).float()):
        got = tc.quantize_weight(other, bits=8, block=32)
        assert got.packed.codes.shape == want.packed.codes.shape
    assert torch.equal(tc.quantize_weight(w.numpy(), bits=8, block=32).packed.codes, want.packed.codes)
    per_channel = tc.quantize_weight(w, bits=4, block=None)
    assert per_channel.packed.block == 288 and per_channel.packed.num_blocks == 1


@needs_torch
def test_conv_weight_moves_and_keeps_its_constants(seed):
    cw = _weight(seed, co=24, ci_g=16, kh=3, kw=1, bits=8, block=None, dtype=torch.float16)
    m = cw.to("meta")
    assert m.device.type == "meta" and m.compute_dtype == torch.float16 and (m.kh, m.kw) == (3, 1)
    assert m.packed.codes.shape == cw.packed.codes.shape and m.packed.k == cw.packed.k == 48
    assert cw.device.type == "cpu" and cw.cpu().packed.codes is cw.packed.codes
    r = repr(cw)
    assert "ConvWeight(out_channels=24, in_channels_per_group=16, kernel_size=(3, 1), bits=8" in r, r


@needs_torch
def test_host_step_errors_name_the_argument(seed):
    w = _conv_weight(seed, 16, 64, 3, 3)  # K = 576
    op = "tessera.conv.quantize_weight"
    with pytest.raises(ValueError, match=f"{op}: 'w' must have rank 4"):
        tc.quantize_weight(w[0])
    with pytest.raises(ValueError, match="'w' must have rank 4"):
        tc.quantize_weight(torch.empty((0, 64, 3, 3)))
    with pytest.raises(ValueError, match="'w'"):
        tc.quantize_weight(torch.ones((4, 8, 3, 3), dtype=torch.int32))
    with pytest.raises(TypeError, match="'w'"):
        tc.quantize_weight(object())
    with pytest.raises(ValueError, match="'bits'"):
        tc.quantize_weight(w, bits=2)
    with pytest.raises(ValueError, match="'zero_mode'"):
        tc.quantize_weight(w, zero_mode="symmetric")
    with pytest.raises(ValueError, match="'compute_dtype'"):
        tc.quantize_weight(w, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="'block' must be 32, 64, 128 or None"):
        tc.quantize_weight(w, block=48)
    with pytest.raises(ValueError, match=r"'block' must divide K = Kh·Kw·Ci_g = 3·3·64 = 576 \(of 32, 64, 128: 32"):
        tc.quantize_weight(w, block=128)
    with pytest.raises(ValueError, match=r"= 27 \(none of 32, 64, 128 does: use None\), got 32"):
        tc.quantize_weight(_conv_weight(seed, 8, 3, 3, 3), block=32)
    with pytest.raises(ValueError, match="'weight'"):
        tc.dequantize(w)
    with pytest.raises(ValueError, match="'weight'"):
        tc.dequantize(tl.prepack(tl.quantize(w.reshape(16, 576), block=64)))


# ---- the operator: schema, meta and fake tensors, tracing, argument errors (no GPU) -----------------------------


@needs_torch
def test_schema_marks_what_it_writes():
    from tessera import _torch_ops

    assert "conv2d" in _torch_ops.OPS
    schema = torch.ops.tessera.conv2d.default._schema
    assert [a.name for a in schema.arguments] == [
        "x", "codes", "params", "bias", "y", "workspace", "n", "k", "bits", "block", "zero_mode", "kh", "kw",
        "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w", "groups", "x_layout", "y_layout", "clamp_min",
        "clamp_max"]
    assert len(schema.returns) == 0
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"y", "workspace"}
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types["bias"] == types["workspace"] == "Optional[Tensor]"
    assert (types["groups"], types["x_layout"], types["clamp_max"]) == ("int", "str", "float")


@needs_torch
def test_cuda_kernel_and_direct_entry_are_registered():
    _needs_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("tessera::conv2d", "CUDA")
    assert hasattr(tessera._torch_C, "conv2d") and hasattr(tessera._torch_C, "conv2d_eager")


def _calls(mode, name="tessera.conv2d.default"):
    return [c for c in mode.calls if c == name]


def _operator_args_mode():
    """A dispatch mode that records the arguments of every torch.ops.tessera.conv2d call reaching it."""
    return recording_mode(args_of="tessera.conv2d.default")


@pytest.fixture(params=["eager", "checked"])
def way(request, monkeypatch):
    """Each meta-tensor test runs through both ways into the operator: the C++ eager entry (tessera._torch_C
    .conv2d_eager, which checks, allocates and routes meta tensors to the operator) and the Python checked path
    (what torch.compile traces and stream= takes)."""
    if request.param == "checked":
        monkeypatch.setattr(tc, "fast_entry", lambda stream: None)
    return request.param


# (N, C, H, W, Co, Kh, Kw, stride, padding, dilation, groups): odd sizes, asymmetric kernels and strides, groups,
# depthwise, padding larger than the input, 'same' and 'valid'.
GEOMETRIES = [
    (2, 64, 9, 7, 32, 3, 3, 1, 1, 1, 1),
    (1, 64, 15, 13, 48, 3, 3, 2, 1, 1, 1),
    (3, 32, 8, 8, 32, 3, 3, 1, 1, 1, 32),
    (2, 16, 11, 5, 32, 5, 3, (2, 1), (2, 1), (1, 2), 4),
    (1, 3, 31, 29, 16, 7, 7, 2, 3, 1, 1),
    (2, 24, 6, 6, 40, 1, 1, 1, 0, 1, 1),
    (1, 8, 2, 3, 8, 3, 3, 1, 2, 1, 2),
    (2, 16, 10, 9, 16, 3, 3, 1, "same", 2, 1),
    (2, 16, 10, 9, 16, 3, 2, 1, "valid", 1, 1),
]


def _meta_weight(co, ci_g, kh, kw, bits=4, block=None, zero_mode="offset", dtype=None):
    """A ConvWeight of meta tensors shaped as prepack makes them (no host step: any K)."""
    k = kh * kw * ci_g
    block = k if block is None else block
    tile = 64 if bits == 4 else 32
    np_, kp = (co + 15) // 16 * 16, (k + tile - 1) // tile * tile
    nb = 1 if block == k else kp // block
    codes = torch.empty((np_, kp * bits // 8), dtype=torch.uint8, device="meta")
    params = torch.empty((np_, nb, 2), dtype=dtype or torch.bfloat16, device="meta")
    return tc.ConvWeight(tl.PackedLinearWeight(codes, params, None, co, k, bits, block, zero_mode), kh, kw)


def _meta_case(geom, dtype=torch.bfloat16 if torch else None):
    n, c, h, w, co, kh, kw, stride, padding, dilation, groups = geom
    cw = _meta_weight(co, c // groups, kh, kw, dtype=dtype)
    x = torch.empty((n, c, h, w), dtype=dtype, device="meta")
    ref = F.conv2d(x.float(), torch.empty((co, c // groups, kh, kw), device="meta"), stride=stride, padding=padding,
                   dilation=dilation, groups=groups)
    return cw, x, dict(stride=stride, padding=padding, dilation=dilation, groups=groups), ref.shape


@needs_torch
@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "N{}_C{}_{}x{}_Co{}_k{}x{}".format(*g[:7]))
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_meta_tensors_give_torchs_shapes_and_the_input_format(seed, way, geom, memory_format):
    _needs_kernels()
    for dtype in (torch.bfloat16, torch.float32):
        cw, x, kwargs, shape = _meta_case(geom, torch.bfloat16)
        if memory_format == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        bias = torch.empty((cw.out_channels,), dtype=dtype, device="meta")
        x = x.to(dtype)
        with _operator_args_mode() as mode:
            y = tc.conv2d(x, cw, bias, activation="relu", **kwargs)
        assert y.shape == shape and y.dtype == dtype and y.is_meta
        nhwc = memory_format == "channels_last"
        assert len(mode.calls) == 1
        args = mode.calls[0]
        x_arg, y_arg = args[0], args[4]
        assert (args[20], args[21]) == (("NHWC", "NHWC") if nhwc else ("NCHW", "NCHW"))
        assert x_arg.is_contiguous() and y_arg.is_contiguous()
        if nhwc:
            assert y.is_contiguous(memory_format=torch.channels_last) and y.permute(0, 2, 3, 1).is_contiguous()
            assert x_arg.shape == (x.shape[0], x.shape[2], x.shape[3], x.shape[1])
            assert y_arg.shape == (y.shape[0], y.shape[2], y.shape[3], y.shape[1])
        else:
            assert y.is_contiguous() and x_arg.shape == x.shape and y_arg.shape == y.shape
        assert args[22:] == (0.0, math.inf)


@needs_torch
def test_meta_out_picks_the_output_layout(seed, way):
    _needs_kernels()
    cw, x, kwargs, shape = _meta_case(GEOMETRIES[1])
    for x_format in (torch.contiguous_format, torch.channels_last):
        for y_format, layout in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
            xi = x.contiguous(memory_format=x_format)
            out = torch.empty(shape, dtype=x.dtype, device="meta").contiguous(memory_format=y_format)
            with _operator_args_mode() as mode:
                assert tc.conv2d(xi, cw, out=out, **kwargs) is out
            assert mode.calls[0][21] == layout
            assert mode.calls[0][20] == ("NHWC" if x_format == torch.channels_last else "NCHW")
    # x in neither format: read as a contiguous NCHW copy.
    wide = torch.empty((1, 64, 15, 26), dtype=x.dtype, device="meta")[:, :, :, ::2]
    with _operator_args_mode() as mode:
        y = tc.conv2d(wide, cw, **kwargs)
    assert mode.calls[0][20] == "NCHW" and mode.calls[0][0].is_contiguous() and y.is_contiguous()
    # A size-1 channel dim: a standard-contiguous tensor stays NCHW, a channels_last one is read NHWC.
    one = _meta_weight(4, 1, 3, 3)
    for fmt, layout in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
        xi = torch.empty((2, 1, 6, 5), dtype=torch.bfloat16, device="meta", memory_format=fmt)
        with _operator_args_mode() as mode:
            tc.conv2d(xi, one)
        assert mode.calls[0][20] == layout, fmt


@needs_torch
def test_recording_mode_sees_the_operator(seed):
    _needs_kernels()
    cw, x, kwargs, shape = _meta_case(GEOMETRIES[0])
    with recording_mode() as mode:
        y = tc.conv2d(x, cw, **kwargs)
    assert _calls(mode) == ["tessera.conv2d.default"], mode.calls
    assert y.shape == shape


def _errors(seed):
    """(expected match, call) pairs: each call breaks one rule, checked before anything is allocated or launched."""
    cw = _meta_weight(32, 16, 3, 3)  # Co 32, Ci_g 16, K 144
    x = torch.empty((2, 32, 9, 9), dtype=torch.bfloat16, device="meta")  # groups 2 fits
    x256 = torch.empty((2, 256, 9, 9), dtype=torch.bfloat16, device="meta")
    out_small = torch.empty((2, 32, 7, 7), dtype=torch.bfloat16, device="meta")
    out_strided = torch.empty((2, 32, 9, 18), dtype=torch.bfloat16, device="meta")[..., ::2]
    ok = dict(groups=2, padding=1)
    wrong_k = tc.ConvWeight(cw.packed, 5, 5)  # 144 is not a multiple of 25
    with_perm = tc.ConvWeight(tl.PackedLinearWeight(**{**cw.packed.__dict__,
                                                       "k_perm": torch.empty(144, dtype=torch.int32,
                                                                             device="meta")}), 3, 3)
    return [
        ("'stride' must be >= 1", lambda: tc.conv2d(x, cw, stride=0, **{**ok})),
        ("'stride' must be >= 1", lambda: tc.conv2d(x, cw, stride=(1, -1), **ok)),
        ("'stride' must be an int or a pair", lambda: tc.conv2d(x, cw, stride=(1, 1, 1), **ok)),
        ("'padding' must be >= 0", lambda: tc.conv2d(x, cw, padding=-1, groups=2)),
        ("'padding' must be an int, a pair of ints, 'valid' or 'same'", lambda: tc.conv2d(x, cw, padding="full",
                                                                                         groups=2)),
        ("'padding' 'same' needs stride 1", lambda: tc.conv2d(x, cw, padding="same", stride=2, groups=2)),
        ("'dilation' must be >= 1", lambda: tc.conv2d(x, cw, dilation=(0, 1), **ok)),
        ("'groups' must be >= 1", lambda: tc.conv2d(x, cw, groups=0, padding=1)),
        ("'groups' must divide x's channels C = 32, got 3", lambda: tc.conv2d(x, cw, groups=3, padding=1)),
        ("'groups' must divide the weight's output channels Co = 32, got 64",
         lambda: tc.conv2d(x256, cw, groups=64)),
        (r"'x' must have C = groups·Ci_g = 1·16 = 16 channels", lambda: tc.conv2d(x, cw, padding=1)),
        (r"'x' must have C = groups·Ci_g = 2·16 = 32 channels .* got shape \[2, 24, 9, 9\]",
         lambda: tc.conv2d(x[:, :24], cw, **ok)),
        (r"'x' must have rank 4 \[N, C, H, W\], got shape \[32, 9, 9\]", lambda: tc.conv2d(x[0], cw, **ok)),
        (r"'x' \[H, W\] = \[2, 9\] with padding \[0, 0\] is smaller than the dilated kernel \[5, 5\]",
         lambda: tc.conv2d(x[:, :, :2], cw, groups=2, dilation=2)),
        ("'weight' must have K = Kh·Kw·Ci_g, a multiple of Kh·Kw = 5·5, got K = 144",
         lambda: tc.conv2d(x, wrong_k, **ok)),
        ("'weight' must not have an act-order permutation", lambda: tc.conv2d(x, with_perm, **ok)),
        ("'weight' must be a tessera.conv.ConvWeight", lambda: tc.conv2d(x, cw.packed, **ok)),
        ("'weight.kh' must be >= 1", lambda: tc.conv2d(x, tc.ConvWeight(cw.packed, 0, 3), **ok)),
        ("'zero_mode'", lambda: tc.conv2d(x, tc.ConvWeight(tl.PackedLinearWeight(
            **{**cw.packed.__dict__, "zero_mode": "symmetric"}), 3, 3), **ok)),
        ("'clamp' must not hold NaN", lambda: tc.conv2d(x, cw, clamp=(float("nan"), 1.0), **ok)),
        ("'clamp' must give min <= max", lambda: tc.conv2d(x, cw, activation="relu6", clamp=(7.0, None), **ok)),
        ("'clamp' must be a", lambda: tc.conv2d(x, cw, clamp=2.0, **ok)),
        ("'activation'", lambda: tc.conv2d(x, cw, activation="gelu", **ok)),
        (r"'out' must be \[N, Co, Ho, Wo\] = \[2, 32, 9, 9\], got shape \[2, 32, 7, 7\]",
         lambda: tc.conv2d(x, cw, out=out_small, **ok)),
        ("'out' must be contiguous or channels_last-contiguous", lambda: tc.conv2d(x, cw, out=out_strided, **ok)),
    ]


@needs_torch
def test_argument_errors_without_a_gpu(seed, way):
    _needs_kernels()
    for match, call in _errors(seed):
        with recording_mode() as mode:
            with pytest.raises(ValueError, match=match):
                call()
        assert not _calls(mode), f"{match}: the operator was called"
        assert not [c for c in mode.calls if "empty" in c], f"{match}: allocated before the check"


@needs_torch
def test_host_tensors_are_refused_before_launch(seed, way):
    _needs_kernels()
    cw = _weight(seed, co=16, ci_g=64)
    x = torch.zeros((1, 64, 5, 5), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tessera.conv2d: 'x' must be a CUDA tensor"):
        tc.conv2d(x, cw, padding=1)
    with pytest.raises(TypeError, match="'groups' must be an int"):
        tc.conv2d(x, cw, groups=1.5)
    # Both paths bound the geometry by the op's limit (2^20) before any shape arithmetic (the eager entry's int64
    # products; the checked path's allocation of y), ahead of the host-tensor check.
    for kwargs, arg in ((dict(dilation=2 ** 62), "dilation"), (dict(stride=(1, 2 ** 21)), "stride"),
                        (dict(padding=2 ** 40), "padding")):
        with pytest.raises(ValueError, match=f"tessera.conv2d: '{arg}' must be <= 1048576"):
            tc.conv2d(x, cw, **kwargs)


def test_raw_queries_check_their_strings_first():
    # The raw entries parse the layouts, the dtype name and zero_mode before they read a tensor (no GPU needed).
    args = (2, 14, 14, None, None, 128, 576, 4, 64, "offset", 3, 3, 1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(TypeError, match="tessera.conv2d_path: 'codes' must be a DLPack capsule"):
        tessera._C.conv2d_path(*args, "NHWC", "NHWC", "bfloat16")
    with pytest.raises(ValueError, match="'x_dtype' must be 'bfloat16', 'float16' or 'float32', got 'int8'"):
        tessera._C.conv2d_path(*args, "NHWC", "NHWC", "int8")
    with pytest.raises(ValueError, match="'x_layout' must be 'NHWC' or 'NCHW', got 'nhwc'"):
        tessera._C.conv2d_path(*args, "nhwc", "NHWC", "bfloat16")
    with pytest.raises(ValueError, match="'y_layout'"):
        tessera._C.conv2d_workspace_bytes(*args, "NHWC", "CHWN", "bfloat16")
    # The raw op checks its strings before it reads a tensor, and names a missing one.
    full = (None, None, None, None, None, None, 128, 576, 4, 64, "offset", 3, 3, 1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="tessera.conv2d: 'x_layout'"):
        tessera._C.conv2d(*full, "NWHC", "NHWC", 0.0, math.inf, 0)
    with pytest.raises(ValueError, match="tessera.conv2d: 'zero_mode'"):
        tessera._C.conv2d(*full[:10], "none", *full[11:], "NHWC", "NHWC", 0.0, math.inf, 0)
    with pytest.raises(TypeError, match="tessera.conv2d: 'codes' must be a DLPack capsule"):
        tessera._C.conv2d(*full, "NHWC", "NHWC", 0.0, math.inf, 0)


@gpu
def test_conv2d_path_names_the_header_rules(seed):
    # conv2d_path on the header's examples (the shapes of x only: a meta x is enough; the weight on the host or the
    # GPU), and it checks its arguments as conv2d does.
    cw = _weight(seed, co=128, ci_g=64)
    x = torch.empty((2, 64, 14, 14), dtype=torch.bfloat16, device="meta")
    assert tc.conv2d_path(x, cw, padding=1) == "implicit_gemm"
    assert tc.conv2d_path(x, cw.cuda(), padding=1) == "implicit_gemm"
    assert tc.conv2d_path(x.to(memory_format=torch.channels_last), cw, padding=1) == "implicit_gemm"
    assert tc.conv2d_path(x.float(), cw, padding=1) == "implicit_gemm"
    one = _weight(seed, co=96, ci_g=64, kh=1, kw=1)
    assert tc.conv2d_path(x, one) == "linear"
    assert tc.conv2d_path(x, one, stride=2) == "implicit_gemm"
    assert tc.conv2d_path(x, one, padding=1) == "implicit_gemm"
    assert tc.conv2d_path(x[:, :, :1, :1], one, padding=1) == "implicit_gemm"  # a 3 x 3 output
    assert tc.conv2d_path(x[:, :, :1], one, stride=2) == "direct"  # Ho = 1: no im2col box
    dw = _weight(seed, co=64, ci_g=1, block=None)
    assert tc.conv2d_path(x, dw, padding=1, groups=64) == "direct"
    g2 = _weight(seed, co=256, ci_g=32, block=32)
    assert tc.conv2d_path(x, g2, padding=1, groups=2) == "direct"  # Ci_g = 32
    rgb = _weight(seed, co=32, ci_g=3, kh=7, kw=7, bits=8, block=None)
    assert tc.conv2d_path(torch.empty((1, 3, 224, 224), device="meta"), rgb, stride=2, padding=3) == "direct"
    with pytest.raises(ValueError, match="'groups'"):
        tc.conv2d_path(x, cw, groups=3)
    with pytest.raises(ValueError, match="tessera.conv2d_path: 'x' must be torch.bfloat16, torch.float16 or"):
        tc.conv2d_path(x.to(torch.int32), cw)
    with pytest.raises(ValueError, match="'x'"):  # the C++ rule: 16-bit x must be the compute dtype
        tc.conv2d_path(x.half(), cw)


@needs_torch
def test_opcheck_on_meta_tensors(seed):
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    p = _weight(seed, co=32, ci_g=64).packed.to("meta")
    x = torch.empty((2, 9, 7, 64), dtype=torch.bfloat16, device="meta")
    y = torch.empty((2, 9, 7, 32), dtype=torch.bfloat16, device="meta")
    bias = torch.empty((32,), dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.tessera.conv2d.default,
                          (x, p.codes, p.params, bias, y, None, 32, 576, 4, 64, "offset", 3, 3, 1, 1, 1, 1, 1, 1, 1,
                           "NHWC", "NHWC", 0.0, math.inf))


@needs_torch
def test_symbolic_tracing_sees_the_operator(seed):
    # make_fx with dynamic shapes: the eager entry hands symbolic sizes to the checked path, which allocates with
    # torch.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    p = _weight(seed, co=32, ci_g=64).packed
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty((2, 64, 9, 7), dtype=torch.bfloat16, device="cuda").to(memory_format=torch.channels_last)
        codes = torch.empty(tuple(p.codes.shape), dtype=torch.uint8, device="cuda")
        params = torch.empty(tuple(p.params.shape), dtype=torch.bfloat16, device="cuda")

    def fn(x, codes, params):
        w = tc.ConvWeight(tl.PackedLinearWeight(codes, params, None, 32, 576, 4, 64, "offset"), 3, 3)
        return tc.conv2d(x, w, padding=1, activation="relu6")

    graph = make_fx(fn, tracing_mode="symbolic")(x, codes, params)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.conv2d.default"], traced


@needs_torch
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_dynamo_traces_the_wrapper_whole(seed, memory_format):
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors: the checked path, the ConvWeight, the format rule and the NHWC views trace without a GPU. The GPU test
    # below compiles and runs.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = _weight(seed, co=48, ci_g=32, kh=3, kw=3, block=32, zero_mode="zero_point", dtype=torch.float16).packed
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format

    class Layer(torch.nn.Module):
        def forward(self, x, codes, params, bias):
            w = tc.ConvWeight(tl.PackedLinearWeight(codes, params, None, 48, 288, 4, 32, "zero_point"), 3, 3)
            return tc.conv2d(x, w, bias, stride=2, padding=1, groups=2, activation="relu", clamp=(None, 4.0))

    with FakeTensorMode():
        c = dict(device="cuda")
        args = (torch.empty((2, 64, 11, 10), dtype=torch.float16, **c).contiguous(memory_format=fmt),
                torch.empty(tuple(p.codes.shape), dtype=torch.uint8, **c),
                torch.empty(tuple(p.params.shape), dtype=torch.float16, **c),
                torch.empty((48,), dtype=torch.float16, **c))
        program = torch.export.export(Layer(), args, strict=True)
    traced = [n for n in program.graph.nodes if "tessera" in str(n.target)]
    assert [str(n.target) for n in traced] == ["tessera.conv2d.default"], traced
    assert traced[0].args[20:22] == (("NHWC", "NHWC") if memory_format == "channels_last" else ("NCHW", "NCHW"))
    output = next(n for n in program.graph.nodes if n.op == "output")
    val = output.args[0][0].meta["val"]
    assert tuple(val.shape) == (2, 48, 6, 5)
    assert val.is_contiguous(memory_format=fmt)


# ================================================================================================================
# GPU: correctness against a float64 reference, the three paths, epilogue, formats, torch.compile, CUDA graphs
# ================================================================================================================


def _reference(x, weight, bias=None, lo=-math.inf, hi=math.inf, **geometry):
    w = tc.dequantize(weight, torch.float64).to(x.device)
    y = F.conv2d(x.double(), w, None if bias is None else bias.double(), **geometry)
    return y.clamp(lo, hi)


def _rel(got, want):
    d = (got.double() - want).norm().item()
    ref = want.norm().item()
    return d / ref if ref > 0 else d


def _x(seed, shape, dtype, memory_format=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    return x if memory_format is None else x.contiguous(memory_format=memory_format)


def _poisoned(shape, dtype, memory_format):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda").contiguous(memory_format=memory_format)


def _formats(layout):
    return torch.channels_last if layout == "NHWC" else torch.contiguous_format


def _case(id, n, c, h, w, co, k, stride=1, padding=0, dilation=1, groups=1, bits=4, block=None, zero_mode="offset",
          bias=True):
    kh, kw = (k, k) if isinstance(k, int) else k
    pair = (lambda v: (v, v) if isinstance(v, int) else tuple(v))
    path = _expected_path(n, h, w, c, co, kh, kw, pair(stride), pair(padding), pair(dilation), groups)
    return pytest.param(dict(n=n, c=c, h=h, w=w, co=co, kh=kh, kw=kw, stride=stride, padding=padding,
                             dilation=dilation, groups=groups, bits=bits, block=block, zero_mode=zero_mode,
                             bias=bias, path=path), id=f"{id}-{path}")


# Every case names its path (checked against conv2d_path): 1x1 linear, Ci_g multiple of 64 implicit GEMM, the rest
# direct. Odd spatial sizes, Co not a multiple of 16, int4 / int8, both conventions, every block form.
CASES = [
    _case("1x1", 2, 64, 14, 13, 96, 1, bits=4, block=64),
    _case("1x1_ci24_int8", 3, 24, 7, 9, 40, 1, bits=8, block=None, zero_mode="zero_point"),
    _case("1x1_ci20", 2, 20, 5, 6, 24, 1, bits=4, block=None),  # Ci % 8 != 0: not the linear path
    _case("1x1_s2", 2, 128, 9, 11, 64, 1, stride=2, bits=4, block=128),
    _case("1x1_pad1", 1, 64, 5, 5, 32, 1, padding=1, bits=8, block=32, bias=False),
    _case("3x3", 2, 64, 15, 13, 64, 3, padding=1, bits=4, block=64, zero_mode="zero_point"),
    _case("3x3_s2_int8", 2, 128, 15, 13, 136, 3, stride=2, padding=1, bits=8, block=128),
    _case("3x3_nopad_co40", 1, 64, 7, 7, 40, 3, bits=4, block=32),
    _case("3x3_dil2", 1, 64, 12, 11, 64, 3, padding=2, dilation=2, bits=4, block=64),
    _case("5x3_asym", 2, 64, 13, 12, 48, (5, 3), stride=(1, 2), padding=(2, 1), bits=8, block=64,
          zero_mode="zero_point"),
    _case("g2_cog128", 1, 128, 9, 10, 256, 3, padding=1, groups=2, bits=4, block=64),
    _case("g2_cog64", 2, 128, 9, 7, 128, 3, padding=1, groups=2, bits=4, block=64),
    _case("ci96", 1, 96, 9, 9, 64, 3, padding=1, bits=4, block=32),
    _case("g4_ci8", 2, 32, 10, 9, 32, 3, padding=1, groups=4, bits=8, block=None),
    _case("depthwise", 2, 32, 17, 15, 32, 3, padding=1, groups=32, bits=4, block=None),
    _case("depthwise_s2_x2", 1, 16, 16, 15, 32, 3, stride=2, padding=1, groups=16, bits=8, block=None,
          zero_mode="zero_point"),
    _case("rgb_7x7_s2", 2, 3, 31, 29, 32, 7, stride=2, padding=3, bits=8, block=None),
    _case("rgb_3x3", 1, 3, 16, 17, 16, 3, padding=1, bits=4, block=None, zero_mode="zero_point"),
    _case("pad_exceeds_input", 1, 64, 2, 3, 32, 3, padding=2, bits=4, block=64),
]


def _run_case(seed, case, dtype, layout, x_dtype=None):
    """(y written into a NaN-poisoned out=, the float64 reference, the case's weight, x, bias, geometry)."""
    dt = getattr(torch, dtype)
    cw = _weight(seed, case["co"], case["c"] // case["groups"], case["kh"], case["kw"], case["bits"], case["block"],
                 case["zero_mode"], dt).cuda()
    fmt = _formats(layout)
    xdt = dt if x_dtype is None else x_dtype
    x = _x(seed + 1, (case["n"], case["c"], case["h"], case["w"]), xdt, fmt)
    bias = _x(seed + 2, (case["co"],), xdt) if case["bias"] else None
    geometry = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}
    want = _reference(x, cw, bias, **geometry)
    out = _poisoned(tuple(want.shape), xdt, fmt)
    y = tc.conv2d(x, cw, bias, out=out, **geometry)
    torch.cuda.synchronize()
    assert y is out
    return y, want, cw, x, bias, geometry


@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_matches_float64_reference(seed, case, dtype, layout):
    y, want, cw, x, bias, geometry = _run_case(seed, case, dtype, layout)
    assert tc.conv2d_path(x, cw, **geometry) == case["path"]
    assert y.dtype == x.dtype and y.shape == want.shape
    assert bool(torch.isfinite(y).all()), "unwritten (NaN) outputs"
    err = _rel(y, want)
    assert err <= TOL[dtype], f"rel err {err:.3e} on the {case['path']} path"
    # The default allocation: the same bits, in x's memory format; repeated calls are deterministic.
    again = tc.conv2d(x, cw, bias, **geometry)
    torch.cuda.synchronize()
    assert again.is_contiguous(memory_format=_formats(layout))
    assert torch.equal(again, y)


@gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.id.split("-")[0] in ("1x1", "3x3_s2_int8", "depthwise",
                                                                             "rgb_7x7_s2", "g2_cog64")])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_fp32_x_gives_fp32_y(seed, case, layout):
    y, want, cw, x, bias, geometry = _run_case(seed, case, "bfloat16", layout, x_dtype=torch.float32)
    assert y.dtype == torch.float32 and bool(torch.isfinite(y).all())
    err = _rel(y, want)
    assert err <= TOL["bfloat16"], f"rel err {err:.3e}"  # x rounded to bf16 once (2^-9), no output rounding


@gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.id.split("-")[0] in ("1x1", "3x3", "depthwise", "rgb_3x3")])
@pytest.mark.parametrize("epilogue", [dict(activation="relu"), dict(activation="relu6"), dict(clamp=(-0.5, 0.25)),
                                      dict(activation="relu", clamp=(None, 1.0))],
                         ids=["relu", "relu6", "clamp", "relu_clamp"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_bias_and_clamp(seed, case, epilogue, layout):
    dt = torch.bfloat16
    cw = _weight(seed, case["co"], case["c"] // case["groups"], case["kh"], case["kw"], case["bits"], case["block"],
                 case["zero_mode"], dt).cuda()
    fmt = _formats(layout)
    x = _x(seed + 1, (case["n"], case["c"], case["h"], case["w"]), dt, fmt) * 2.0
    bias = _x(seed + 2, (case["co"],), dt)
    geometry = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}
    lo, hi = tl._bounds("test", epilogue.get("activation"), epilogue.get("clamp"))
    # The error is relative to the product before the clamp (as the C++ tests take it): a narrow clamp keeps mostly
    # the elements whose sums cancelled, whose error is relative to their terms, not to what is left of them.
    product = _reference(x, cw, bias, **geometry)
    want = product.clamp(lo, hi)
    y = tc.conv2d(x, cw, bias, out=_poisoned(tuple(want.shape), dt, fmt), **epilogue, **geometry)
    torch.cuda.synchronize()
    assert float(y.min()) >= lo and float(y.max()) <= hi
    err = (y.double() - want).norm().item() / product.norm().item()
    assert err <= TOL["bfloat16"], f"rel err {err:.3e}"


@gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.id.split("-")[0] in ("1x1", "3x3", "g4_ci8")])
def test_formats_in_and_out_are_independent(seed, case):
    # Every (x format, out format) pair, and an x in neither format, give the same values.
    dt = torch.float16
    cw = _weight(seed, case["co"], case["c"] // case["groups"], case["kh"], case["kw"], case["bits"], case["block"],
                 case["zero_mode"], dt).cuda()
    x = _x(seed + 1, (case["n"], case["c"], case["h"], case["w"]), dt)
    geometry = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}
    want = tc.conv2d(x, cw, **geometry)
    for x_fmt in (torch.contiguous_format, torch.channels_last):
        for y_fmt in (torch.contiguous_format, torch.channels_last):
            out = _poisoned(tuple(want.shape), dt, y_fmt)
            tc.conv2d(x.contiguous(memory_format=x_fmt), cw, out=out, **geometry)
            torch.cuda.synchronize()
            assert _rel(out, want.double()) <= TOL["float16"], (x_fmt, y_fmt)
    strided = torch.cat([x, x], dim=3)[..., : x.shape[3]]  # x's values in neither format: a contiguous copy
    assert not strided.is_contiguous() and not strided.is_contiguous(memory_format=torch.channels_last)
    got = tc.conv2d(strided, cw, **geometry)
    torch.cuda.synchronize()
    assert got.is_contiguous() and torch.equal(got, want)


@gpu
def test_padding_same_and_valid(seed):
    dt = torch.bfloat16
    cw = _weight(seed, 64, 64, 3, 3, 4, 64, "offset", dt).cuda()
    x = _x(seed + 1, (2, 64, 9, 8), dt, torch.channels_last)
    for padding, dilation in (("same", 1), ("same", 2), ("valid", 1)):
        y = tc.conv2d(x, cw, padding=padding, dilation=dilation)
        want = _reference(x, cw, padding=padding, dilation=dilation)
        torch.cuda.synchronize()
        assert y.shape == want.shape and _rel(y, want) <= TOL["bfloat16"], (padding, dilation)


@gpu
def test_workspace_and_stream_arguments(seed):
    dt = torch.bfloat16
    cw = _weight(seed, 64, 64, 3, 3, 4, 64, "offset", dt).cuda()
    for x in (_x(seed + 1, (2, 64, 12, 10), dt), _x(seed + 1, (2, 64, 12, 10), dt, torch.channels_last),
              _x(seed + 1, (2, 64, 12, 10), torch.float32, torch.channels_last)):
        want = tc.conv2d(x, cw, padding=1)
        need = tc.workspace_bytes(x, cw, padding=1)
        assert isinstance(need, int) and need >= 0
        ws = torch.empty(max(need, 16), dtype=torch.uint8, device="cuda")
        assert torch.equal(tc.conv2d(x, cw, padding=1, workspace=ws), want)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        y = tc.conv2d(x, cw, padding=1, stream=side)
        side.synchronize()
        assert torch.equal(y, want)
    # An NCHW x is rewritten NHWC into the workspace: an undersized one is refused, named.
    x = _x(seed + 1, (2, 64, 12, 10), dt)
    if tc.workspace_bytes(x, cw, padding=1) > 16:
        with pytest.raises(ValueError, match="workspace"):
            tc.conv2d(x, cw, padding=1, workspace=torch.empty(16, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.id.split("-")[0] in ("1x1", "3x3", "depthwise")])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_compile_fullgraph_matches_eager(seed, case, layout):
    dt = torch.bfloat16
    cw = _weight(seed, case["co"], case["c"] // case["groups"], case["kh"], case["kw"], case["bits"], case["block"],
                 case["zero_mode"], dt).cuda()
    x = _x(seed + 1, (case["n"], case["c"], case["h"], case["w"]), dt, _formats(layout))
    bias = _x(seed + 2, (case["co"],), dt)
    geometry = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}

    def layer(x, bias):
        return tc.conv2d(x, cw, bias, activation="relu", **geometry) * 2.0

    eager = layer(x, bias)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, bias)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), "compiled conv2d differs from eager"
    assert _rel(eager / 2.0, _reference(x, cw, bias, 0.0, **geometry)) <= TOL["bfloat16"]


@gpu
@pytest.mark.parametrize("preallocated", [True, False])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_cuda_graph_capture_and_replay(seed, preallocated, layout):
    dt = torch.float16
    cw = _weight(seed, 64, 64, 3, 3, 8, 64, "offset", dt).cuda()
    fmt = _formats(layout)
    shape = (2, 64, 11, 9)
    x = _x(seed + 1, shape, dt, fmt)
    bias = _x(seed + 2, (64,), dt)
    kw = dict(stride=2, padding=1)
    if preallocated:  # nothing allocated inside the capture
        kw["out"] = torch.empty((2, 64, 6, 5), dtype=dt, device="cuda").contiguous(memory_format=fmt)
        kw["workspace"] = torch.empty(max(tc.workspace_bytes(x, cw, stride=2, padding=1), 16), dtype=torch.uint8,
                                      device="cuda")
    tc.conv2d(x, cw, bias, **kw)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tc.conv2d(x, cw, bias, activation="relu6", **kw)
    for round_ in range(2):
        x.copy_(_x(seed + 10 + round_, shape, dt, fmt))
        y.fill_(float("nan"))
        graph.replay()
        want = tc.conv2d(x, cw, bias, activation="relu6", stride=2, padding=1)
        torch.cuda.synchronize()
        assert torch.equal(y, want), f"replay {round_} differs from eager"


@gpu
def test_bad_arguments_are_value_errors(seed):
    cw = _weight(seed, 64, 64, 3, 3, 4, 64, "offset", torch.bfloat16).cuda()
    x = _x(seed + 1, (2, 64, 8, 8), torch.bfloat16, torch.channels_last)
    with pytest.raises(ValueError, match="'x'"):  # fp16 x with a bf16 weight
        tc.conv2d(x.half(), cw, padding=1)
    with pytest.raises(ValueError, match="bias"):
        tc.conv2d(x, cw, torch.zeros(72, dtype=torch.bfloat16, device="cuda"), padding=1)
    with pytest.raises(ValueError, match="bias"):
        tc.conv2d(x, cw, torch.zeros(64, dtype=torch.float16, device="cuda"), padding=1)
    with pytest.raises(ValueError, match="codes"):  # the weight left on the host
        tc.conv2d(x, cw.cpu(), padding=1)
    with pytest.raises(ValueError, match="'y'|'out'"):  # out of another dtype than x (the C++ op's 'y')
        tc.conv2d(x, cw, padding=1, out=torch.empty((2, 64, 8, 8), dtype=torch.float16, device="cuda"))
    # Through the dispatcher (what torch.compile calls) the C++ validation's errors are ValueErrors too.
    p = cw.packed
    xs, y = x.permute(0, 2, 3, 1), torch.empty((2, 8, 8, 64), dtype=torch.bfloat16, device="cuda")
    args = [xs, p.codes, p.params, None, y, None, 64, 576, 4, 64, "offset", 3, 3, 1, 1, 1, 1, 1, 1, 1, "NHWC", "NHWC",
            -math.inf, math.inf]
    torch.ops.tessera.conv2d(*args)
    for i, value, match in ((8, 5, "bits"), (10, "none", "zero_mode"), (20, "nhwc", "x_layout"),
                            (21, "NCHW", "y"), (19, 3, "groups"), (13, 0, "stride"), (15, -1, "pad")):
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=match):
            torch.ops.tessera.conv2d(*bad)
    torch.cuda.synchronize()


@gpu
def test_raw_dlpack_entry_matches_the_torch_layer(seed):
    # tessera._C.conv2d (DLPack capsules, preallocated y and workspace, the stream as an int) on the NHWC views.
    from tessera._dlpack import to_capsule

    cw = _weight(seed, 64, 64, 3, 3, 4, 64, "zero_point", torch.float16).cuda()
    x = _x(seed + 1, (2, 64, 9, 9), torch.float16, torch.channels_last)
    want = tc.conv2d(x, cw, padding=1)
    p = cw.packed
    y = torch.full((2, 9, 9, 64), float("nan"), dtype=torch.float16, device="cuda")
    constants = (64, 576, 4, 64, "zero_point", 3, 3, 1, 1, 1, 1, 1, 1, 1)
    need = tessera._C.conv2d_workspace_bytes(2, 9, 9, to_capsule(p.codes), to_capsule(p.params), *constants, "NHWC",
                                             "NHWC", "float16")
    ws = torch.empty(max(need, 16), dtype=torch.uint8, device="cuda")
    tessera._C.conv2d(to_capsule(x.permute(0, 2, 3, 1)), to_capsule(p.codes), to_capsule(p.params), None,
                      to_capsule(y), to_capsule(ws), *constants, "NHWC", "NHWC", -math.inf, math.inf,
                      torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(y.permute(0, 3, 1, 2), want)


@needs_torch
def test_geometry_upper_bounds_on_every_path():
    # Each geometry value is bounded by 2^20 (tessera::conv::kConvMaxParam) whichever path the call takes: the eager
    # entry (meta x and a meta bias here) and the checked path (a numpy bias falls back to it), which allocated y for
    # the huge output shape before. Meta tensors: no GPU needed.
    w = tessera.conv.quantize_weight(torch.randn(16, 8, 1, 1), bits=4, block=None)
    x = torch.empty(1, 8, 8, 8, dtype=torch.bfloat16, device="meta")
    big = tessera._C.conv_max_param * 2
    for bias in (torch.zeros(16, dtype=torch.bfloat16, device="meta"), np.zeros(16, np.float32)):
        for arg, kwargs in (("padding", dict(padding=big)), ("stride", dict(stride=big)),
                            ("dilation", dict(dilation=(1, big))), ("groups", dict(groups=big))):
            with pytest.raises(ValueError, match=f"'{arg}' must be <= {tessera._C.conv_max_param}"):
                tessera.conv2d(x, w, bias, **kwargs)
