"""Python tests for tessera.gemm: the grouped GEMM (fp8 per-tensor / block-wise and bf16; contiguous and masked).

GPU tests compare against a float64 torch reference computed from the very fp8/bf16 values the kernel reads (so
the only error is fp32 accumulation and the bf16 output rounding), on fresh random inputs, with the output
poisoned (NaN) first so that an unwritten row fails and a row written outside its group is caught. They skip
without torch or a CUDA device; the tests at the top run everywhere.

Tolerance: relative Frobenius error per group < 1e-2. Rounding the output to bf16 alone costs about 2e-3
(2^-9 relative per element, uniformly distributed); fp32 accumulation over K <= 1024 adds far less, and the fp8
tensor-core accumulation (reduced precision inside a 128-deep K block) a little more. A wrong scale, block or
group is an O(1) error.
"""

import math

import pytest

import tessera
from _host_capsule import DL_BFLOAT, DL_FLOAT, DL_INT, DL_UINT, HostCapsule

try:
    import torch
except ImportError:  # the no-GPU tests still run
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")

BLOCK = 128
TOL = 1e-2
OPS = ("grouped_gemm_fp8", "grouped_gemm_fp8_masked", "grouped_gemm_bf16", "grouped_gemm_bf16_masked")

# ================================================================================================================
# Tests without a GPU (and without torch)
# ================================================================================================================


def test_top_level_reexports():
    for name in OPS + ("grouped_gemm_workspace_bytes",):
        assert getattr(tessera, name) is getattr(tessera.gemm, name)
    assert tessera.gemm.BLOCK == 128
    assert tessera.gemm.MAX_GROUPS == 1024


@pytest.mark.parametrize("name", ["grouped_gemm_fp8", "grouped_gemm_fp8_masked"])
@pytest.mark.parametrize("mode", ["rowwise", "", None, "BLOCKWISE"])
def test_bad_scale_mode_raises_value_error(name, mode):
    # Checked before any tensor is looked at (and before torch is imported).
    fn = getattr(tessera, name)
    with pytest.raises(ValueError, match="'scale_mode'"):
        fn(object(), object(), object(), object(), object(), scale_mode=mode)


@pytest.mark.parametrize("name", OPS)
def test_bad_expected_m(name):
    fn = getattr(tessera, name)
    args = (object(),) * (5 if "fp8" in name else 3)
    with pytest.raises(ValueError, match="'expected_m'"):
        fn(*args, expected_m=-1)
    with pytest.raises(TypeError, match="'expected_m'"):
        fn(*args, expected_m=1.5)


def test_workspace_bytes():
    n = tessera.grouped_gemm_workspace_bytes(8, 7168, 2048)
    assert isinstance(n, int) and n >= 0
    assert tessera.grouped_gemm_workspace_bytes(1, 128, 128) >= 0


def test_binding_rejects_non_capsules():
    with pytest.raises(TypeError, match="'x'"):
        tessera._C.grouped_gemm_bf16(object(), None, None, None, None, 0, 0)
    with pytest.raises(TypeError, match="'x'"):
        tessera._C.grouped_gemm_fp8(object(), None, None, None, None, None, None, "per_tensor", 0, 0)


def test_binding_bad_scale_mode():
    with pytest.raises(ValueError, match="'scale_mode'"):
        tessera._C.grouped_gemm_fp8_masked(None, None, None, None, None, None, None, "per_row", 0, 0)


def test_binding_host_memory_is_value_error():
    M, N, K, G = 4, 128, 128, 1
    y = HostCapsule((M, N), DL_BFLOAT, 16)
    offsets = HostCapsule((G + 1,), DL_INT, 32)
    x16, w16 = HostCapsule((M, K), DL_BFLOAT, 16), HostCapsule((G, N, K), DL_BFLOAT, 16)
    with pytest.raises(ValueError):
        tessera._C.grouped_gemm_bf16(x16.capsule, w16.capsule, offsets.capsule, y.capsule, None, 0, 0)


def test_binding_reads_uint8_as_fp8_only_in_fp8_ops():
    # fp8 operands travel as uint8 bytes (how tessera.gemm passes them). The fp8 ops take them as e4m3: with a
    # wrong block-wise x_scale the complaint is about x_scale, checked after the dtypes of w and x (and before
    # any device query, so this runs without a GPU). The bf16 ops do not re-label.
    M, N, K, G = 4, 128, 256, 1
    y = HostCapsule((M, N), DL_BFLOAT, 16)
    offsets = HostCapsule((G + 1,), DL_INT, 32)
    x8, w8 = HostCapsule((M, K), DL_UINT, 8), HostCapsule((G, N, K), DL_UINT, 8)
    bad_xs = HostCapsule((M, 1), DL_FLOAT, 32)  # K/128 = 2 columns expected
    ws = HostCapsule((G, 1, 2), DL_FLOAT, 32)
    with pytest.raises(ValueError, match="'x_scale'"):
        tessera._C.grouped_gemm_fp8(x8.capsule, w8.capsule, offsets.capsule, bad_xs.capsule, ws.capsule,
                                    y.capsule, None, "blockwise", 0, 0)
    with pytest.raises(ValueError, match="'w'.*uint8"):
        tessera._C.grouped_gemm_bf16(x8.capsule, w8.capsule, offsets.capsule, y.capsule, None, 0, 0)


# ================================================================================================================
# GPU: the problem, its reference and the checks
# ================================================================================================================


def _clamp(v, hi):
    return min(max(v, 0), hi)


class Problem:
    """One grouped-GEMM call with fresh random inputs.

    kind 'fp8' | 'bf16'; layout 'contiguous' | 'masked'; scale_mode 'per_tensor' | 'blockwise' (fp8 only).
    contiguous: offsets = [lead, lead + sizes[0], ...] unless `offsets` is given; M = offsets[-1] + tail
                (or `rows`). masked: masked_m = sizes, max_m rows per group.
    x_row_pad: extra columns in x's rows (x is a column slice of a wider tensor); xs_transposed: block-wise
    x_scale stored column-major (the layout TMA-fed GEMMs read), so its strides are not row-major.
    """

    def __init__(self, kind, layout, G, N, K, sizes=None, *, scale_mode="per_tensor", lead=0, tail=0,
                 offsets=None, rows=None, max_m=None, x_row_pad=0, xs_transposed=False, seed=0):
        self.kind, self.layout, self.scale_mode = kind, layout, scale_mode
        self.G, self.N, self.K = G, N, K
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.gen = g
        if layout == "contiguous":
            if offsets is None:
                offsets = [lead]
                for s in sizes:
                    offsets.append(offsets[-1] + s)
            self.offset_list = list(offsets)
            self.M = rows if rows is not None else max(0, max(offsets)) + tail
            self.group_rows = torch.tensor(offsets, dtype=torch.int32, device="cuda")
            x_shape = (self.M, K)
        else:
            self.masked_list = list(sizes)
            self.max_m = max_m
            self.group_rows = torch.tensor(sizes, dtype=torch.int32, device="cuda")
            x_shape = (G, max_m, K)
        self.out_shape = x_shape[:-1] + (N,)

        wide = x_shape[:-1] + (K + x_row_pad,)
        self.x = self._operand(wide)[..., :K]
        self.w = self._operand((G, N, K))
        self.x_scale = self.w_scale = None
        if kind == "fp8":
            kb, nb = K // BLOCK, N // BLOCK
            if scale_mode == "per_tensor":
                self.x_scale = self._scale((1,))
                self.w_scale = self._scale((G,))
            elif xs_transposed:
                lead_shape = x_shape[:-1]
                self.x_scale = self._scale(lead_shape[:-1] + (kb, lead_shape[-1])).transpose(-1, -2)
                self.w_scale = self._scale((G, nb, kb))
            else:
                self.x_scale = self._scale(x_shape[:-1] + (kb,))
                self.w_scale = self._scale((G, nb, kb))

    def _operand(self, shape):
        v = torch.randn(shape, device="cuda", generator=self.gen)
        return v.to(torch.float8_e4m3fn) if self.kind == "fp8" else v.to(torch.bfloat16)

    def _scale(self, shape):
        return torch.rand(shape, device="cuda", generator=self.gen) * 0.9 + 0.1

    def refresh_inputs(self, seed):
        """New random x and w values, in place (same memory, e.g. for graph replays)."""
        self.gen.manual_seed(seed)
        self.x.copy_(self._operand(self.x.shape))
        self.w.copy_(self._operand(self.w.shape))

    def set_group_rows(self, values):
        """New offsets / masked_m, written into the same device tensor."""
        self.group_rows.copy_(torch.tensor(values, dtype=torch.int32, device="cuda"))
        if self.layout == "contiguous":
            self.offset_list = list(values)
        else:
            self.masked_list = list(values)

    def poisoned_out(self):
        return torch.full(self.out_shape, math.nan, dtype=torch.bfloat16, device="cuda")

    def run(self, out=None, expected_m=0):
        fn = getattr(tessera, self.op_name())
        if self.kind == "fp8":
            return fn(self.x, self.w, self.group_rows, self.x_scale, self.w_scale, scale_mode=self.scale_mode,
                      out=out, expected_m=expected_m)
        return fn(self.x, self.w, self.group_rows, out=out, expected_m=expected_m)

    def op_name(self):
        return f"grouped_gemm_{self.kind}" + ("_masked" if self.layout == "masked" else "")

    def row_sets(self):
        """[(g, index)]: the rows group g owns after clamping, as an index into out.view(-1, N)."""
        sets = []
        if self.layout == "contiguous":
            M = self.M
            for g in range(self.G):
                begin = _clamp(self.offset_list[g], M)
                end = _clamp(self.offset_list[g + 1], M)
                if end > begin:
                    sets.append((g, torch.arange(begin, end, device="cuda")))
        else:
            for g in range(self.G):
                m = _clamp(self.masked_list[g], self.max_m)
                if m > 0:
                    sets.append((g, g * self.max_m + torch.arange(m, device="cuda")))
        covered = torch.cat([r for _, r in sets]) if sets else torch.empty(0, dtype=torch.long, device="cuda")
        assert covered.numel() == covered.unique().numel(), "test bug: groups overlap"
        return sets

    def dequant(self):
        """(x, w) in float64 with the scales applied; x as [rows, K] matching out.view(-1, N)."""
        x = self.x.double().reshape(-1, self.K)
        w = self.w.double()
        if self.kind == "fp8":
            if self.scale_mode == "per_tensor":
                x = x * self.x_scale.double()
                w = w * self.w_scale.double().view(-1, 1, 1)
            else:
                x = x * self.x_scale.double().reshape(-1, self.K // BLOCK).repeat_interleave(BLOCK, dim=1)
                w = w * self.w_scale.double().repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
        return x, w

    def check(self, out, tol=TOL):
        torch.cuda.synchronize()
        assert out.shape == self.out_shape and out.dtype == torch.bfloat16
        y = out.reshape(-1, self.N)
        x, w = self.dequant()
        written = torch.zeros(y.shape[0], dtype=torch.bool, device="cuda")
        for g, rows in self.row_sets():
            written[rows] = True
            got = y[rows].double()
            assert bool(torch.isfinite(got).all()), f"group {g}: non-finite or unwritten output rows"
            ref = x[rows] @ w[g].T
            rel = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            assert rel < tol, f"group {g} ({rows.numel()} rows): relative Frobenius error {rel:.3g}"
        untouched = y[~written]
        assert bool(torch.isnan(untouched).all()), "rows outside every group were written"
        return written


# ================================================================================================================
# GPU: correctness
# ================================================================================================================

CONTIGUOUS_CASES = {
    # name: (G, N, K, sizes, lead, tail)
    "one_group": (1, 128, 128, [37], 0, 0),
    "ragged_empty": (5, 256, 384, [0, 1, 130, 0, 77], 0, 3),
    "lead_tail": (3, 128, 256, [64, 0, 129], 7, 9),
    "all_empty": (3, 128, 128, [0, 0, 0], 2, 3),
    "no_rows": (2, 128, 128, [0, 0], 0, 0),
    "many_groups": (24, 128, 256, [(i * 37) % 71 if i % 5 else 0 for i in range(24)], 0, 0),
    "deep_k": (2, 384, 1024, [200, 57], 0, 0),
}


@gpu
@pytest.mark.parametrize("scale_mode", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("name", list(CONTIGUOUS_CASES))
def test_fp8_contiguous(name, scale_mode):
    G, N, K, sizes, lead, tail = CONTIGUOUS_CASES[name]
    p = Problem("fp8", "contiguous", G, N, K, sizes, scale_mode=scale_mode, lead=lead, tail=tail, seed=G * N + K)
    p.check(p.run(out=p.poisoned_out()))
    y = p.run()  # allocated by tessera
    torch.cuda.synchronize()
    assert y.shape == (p.M, N) and y.dtype == torch.bfloat16 and y.device == p.x.device


@gpu
@pytest.mark.parametrize("scale_mode", ["per_tensor", "blockwise"])
def test_fp8_contiguous_strided(scale_mode):
    # x rows wider than K (a column slice), column-major block-wise x_scale.
    p = Problem("fp8", "contiguous", 4, 256, 256, [33, 0, 128, 70], scale_mode=scale_mode, tail=5, x_row_pad=128,
                xs_transposed=True, seed=3)
    assert not p.x.is_contiguous()
    p.check(p.run(out=p.poisoned_out()))


MASKED_CASES = {
    # name: (G, N, K, max_m, masked_m)
    "decode": (8, 256, 256, 16, [1, 0, 16, 3, 7, 0, 2, 16]),
    "ragged": (4, 128, 384, 96, [0, 1, 96, 45]),
    "single": (1, 384, 128, 200, [131]),
    "all_empty": (3, 128, 128, 32, [0, 0, 0]),
}


@gpu
@pytest.mark.parametrize("scale_mode", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("name", list(MASKED_CASES))
def test_fp8_masked(name, scale_mode):
    G, N, K, max_m, masked_m = MASKED_CASES[name]
    p = Problem("fp8", "masked", G, N, K, masked_m, scale_mode=scale_mode, max_m=max_m, seed=G + max_m)
    p.check(p.run(out=p.poisoned_out()))
    y = p.run()
    torch.cuda.synchronize()
    assert y.shape == (G, max_m, N) and y.dtype == torch.bfloat16


@gpu
def test_fp8_masked_blockwise_transposed_scales():
    p = Problem("fp8", "masked", 3, 256, 256, [5, 64, 0], scale_mode="blockwise", max_m=64, xs_transposed=True,
                x_row_pad=128, seed=8)
    p.check(p.run(out=p.poisoned_out()))


BF16_CONTIGUOUS_CASES = {
    "one_group": (1, 128, 64, [17], 0, 0),
    "ragged_empty": (5, 256, 192, [0, 1, 130, 0, 77], 0, 3),
    "lead_tail": (3, 128, 320, [64, 0, 129], 7, 9),
    "no_rows": (2, 128, 128, [0, 0], 0, 0),
    "deep_k": (2, 256, 1024, [150, 66], 0, 0),
}


@gpu
@pytest.mark.parametrize("name", list(BF16_CONTIGUOUS_CASES))
def test_bf16_contiguous(name):
    G, N, K, sizes, lead, tail = BF16_CONTIGUOUS_CASES[name]
    p = Problem("bf16", "contiguous", G, N, K, sizes, lead=lead, tail=tail, seed=N + K + G)
    p.check(p.run(out=p.poisoned_out()))
    y = p.run()
    torch.cuda.synchronize()
    assert y.shape == (p.M, N) and y.dtype == torch.bfloat16


@gpu
def test_bf16_contiguous_strided():
    p = Problem("bf16", "contiguous", 3, 128, 192, [40, 0, 90], x_row_pad=64, seed=12)
    assert not p.x.is_contiguous()
    p.check(p.run(out=p.poisoned_out()))


@gpu
@pytest.mark.parametrize("name", list(MASKED_CASES))
def test_bf16_masked(name):
    G, N, K, max_m, masked_m = MASKED_CASES[name]
    p = Problem("bf16", "masked", G, N, K, masked_m, max_m=max_m, seed=7 * G + max_m)
    p.check(p.run(out=p.poisoned_out()))


@gpu
@pytest.mark.parametrize("kind,layout", [("fp8", "contiguous"), ("fp8", "masked"), ("bf16", "contiguous"),
                                         ("bf16", "masked")])
def test_expected_m_changes_only_the_tiling(kind, layout):
    # expected_m is a tile-shape hint: every value must compute the same rows (and only those) correctly.
    if layout == "contiguous":
        p = Problem(kind, layout, 6, 256, 256, [300, 0, 5, 129, 1, 64], scale_mode="blockwise", tail=11, seed=5)
    else:
        p = Problem(kind, layout, 6, 256, 256, [1, 0, 200, 17, 256, 3], scale_mode="blockwise", max_m=256, seed=6)
    for expected_m in (0, 1, 8, 64, 256, 100000):
        p.check(p.run(out=p.poisoned_out(), expected_m=expected_m))


@gpu
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_contiguous_offsets_are_clamped(kind):
    K = 256
    # Below 0 and above M clamp: groups [0, 20), [], [20, 48).
    p = Problem(kind, "contiguous", 3, 128, K, offsets=[-5, 20, 20, 5000], rows=48, scale_mode="blockwise", seed=1)
    written = p.check(p.run(out=p.poisoned_out()))
    assert bool(written.all())
    # A decreasing pair is an empty group: [4, 30), [30, 12) = [], [12, 12) = []; rows 0-3 and 30-39 untouched.
    p = Problem(kind, "contiguous", 3, 128, K, offsets=[4, 30, 12, 12], rows=40, scale_mode="blockwise", seed=2)
    written = p.check(p.run(out=p.poisoned_out()))
    assert int(written.sum()) == 26


@gpu
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_masked_m_is_clamped(kind):
    p = Problem(kind, "masked", 4, 128, 256, [-3, 40, 5, 2**31 - 1], max_m=32, scale_mode="per_tensor", seed=4)
    written = p.check(p.run(out=p.poisoned_out()))
    assert int(written.sum()) == 32 + 5 + 32


@gpu
@pytest.mark.parametrize("kind,layout", [("fp8", "contiguous"), ("fp8", "masked"), ("bf16", "contiguous"),
                                         ("bf16", "masked")])
def test_deterministic(kind, layout):
    if layout == "contiguous":
        p = Problem(kind, layout, 4, 256, 512, [100, 0, 257, 31], scale_mode="blockwise", seed=9)
    else:
        p = Problem(kind, layout, 4, 256, 512, [100, 0, 128, 31], scale_mode="blockwise", max_m=128, seed=9)
    a = p.run(out=p.poisoned_out())
    b = p.run(out=p.poisoned_out())
    torch.cuda.synchronize()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@gpu
@pytest.mark.parametrize("pad_multiple", [1, 16])
def test_chain_after_permute(pad_multiple):
    # permute's fp8 block-wise output and expert_offsets feed grouped_gemm_fp8 as they are.
    T, H, E, k, N = 300, 512, 8, 2, 256
    g = torch.Generator(device="cuda").manual_seed(pad_multiple)
    x = torch.randn((T, H), device="cuda", generator=g).bfloat16()
    ids = torch.rand((T, E), device="cuda", generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    perm = tessera.permute(x, ids, E, pad_multiple=pad_multiple, quant="fp8_blockwise")
    w = torch.randn((E, N, H), device="cuda", generator=g).to(torch.float8_e4m3fn)
    w_scale = torch.rand((E, N // BLOCK, H // BLOCK), device="cuda", generator=g) * 0.01 + 0.001
    out = torch.full((perm.x_perm.shape[0], N), math.nan, dtype=torch.bfloat16, device="cuda")
    y = tessera.grouped_gemm_fp8(perm.x_perm, w, perm.expert_offsets, perm.scales, w_scale,
                                 scale_mode="blockwise", out=out, expected_m=T * k // E)
    assert y is out

    p = Problem.__new__(Problem)  # describe the permute output as a Problem to reuse the reference and checks
    p.kind, p.layout, p.scale_mode = "fp8", "contiguous", "blockwise"
    p.G, p.N, p.K = E, N, H
    p.x, p.w, p.x_scale, p.w_scale = perm.x_perm, w, perm.scales, w_scale
    p.offset_list = perm.expert_offsets.tolist()
    p.M = perm.x_perm.shape[0]
    p.out_shape = (p.M, N)
    written = p.check(out)
    assert int(written.sum()) == p.offset_list[-1]

    # And the experts' outputs go back to token order.
    weights = torch.rand((T, k), device="cuda", generator=g)
    combined = tessera.unpermute_reduce(y, perm.row_index, weights)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(combined).all())


# ================================================================================================================
# GPU: bad arguments
# ================================================================================================================


def _expect_error(p, match, out=None, **overrides):
    """Runs p's op with some arguments replaced; expects ValueError matching `match` and an untouched out."""
    out = p.poisoned_out() if out is None else out
    args = dict(x=p.x, w=p.w, group_rows=p.group_rows, x_scale=p.x_scale, w_scale=p.w_scale,
                scale_mode=p.scale_mode, expected_m=0)
    args.update(overrides)
    fn = getattr(tessera, p.op_name())
    with pytest.raises(ValueError, match=match):
        if p.kind == "fp8":
            fn(args["x"], args["w"], args["group_rows"], args["x_scale"], args["w_scale"],
               scale_mode=args["scale_mode"], out=out, expected_m=args["expected_m"])
        else:
            fn(args["x"], args["w"], args["group_rows"], out=out, expected_m=args["expected_m"])
    torch.cuda.synchronize()
    if out.dtype == torch.bfloat16:
        assert bool(torch.isnan(out).all()), "a rejected call wrote to the output"


@gpu
def test_fp8_bad_arguments_name_the_argument():
    M, N, K, G = 64, 128, 256, 2
    for mode in ("per_tensor", "blockwise"):
        p = Problem("fp8", "contiguous", G, N, K, [30, 30], scale_mode=mode, tail=4, seed=13)
        _expect_error(p, "'x'", x=p.x.float().bfloat16())
        _expect_error(p, "'x'", x=p.x.view(torch.uint8))  # raw bytes are not taken as e4m3 in Python
        _expect_error(p, "'w'", w=p.w.float().to(torch.float8_e5m2))
        _expect_error(p, "'x'", x=p.x.cpu())
        _expect_error(p, "'x'", x=p.x.view(1, M, K))  # masked rank for the contiguous op
        _expect_error(p, "'offsets'", group_rows=p.group_rows.long())
        _expect_error(p, "'offsets'", group_rows=p.group_rows[:G])
        _expect_error(p, "'offsets'", group_rows=p.group_rows.cpu())
        _expect_error(p, "'x_scale'", x_scale=p.x_scale.half())
        _expect_error(p, "'w_scale'", w_scale=p.w_scale.half())
        _expect_error(p, "'scale_mode'", scale_mode="per_token")
        _expect_error(p, "'expected_m'", expected_m=-2)
        _expect_error(p, "'(y|out)'", out=torch.full((M, N), math.nan, device="cuda"))  # fp32 output
        _expect_error(p, "'(y|out)'", out=torch.full((M, N + 128), math.nan, dtype=torch.bfloat16, device="cuda"))
        _expect_error(p, "'(y|out)'", out=torch.full((M, N), math.nan, dtype=torch.bfloat16).to("cuda").t()
                      .contiguous().t())  # column-major output
        if mode == "per_tensor":
            _expect_error(p, "'w_scale'", w_scale=torch.ones(G + 1, device="cuda"))
            _expect_error(p, "'x_scale'", x_scale=torch.ones(2, device="cuda"))
        else:
            _expect_error(p, "'x_scale'", x_scale=torch.ones((M, K // BLOCK + 1), device="cuda"))
            _expect_error(p, "'x_scale'", x_scale=torch.ones((M - 1, K // BLOCK), device="cuda"))
            _expect_error(p, "'w_scale'", w_scale=torch.ones((G, N // BLOCK, K // BLOCK - 1), device="cuda"))
            # Per-tensor scales where block-wise ones are expected.
            _expect_error(p, "'x_scale'", x_scale=torch.ones(1, device="cuda"))

    # N not a multiple of 128 (N is w's second dimension).
    p = Problem("fp8", "contiguous", G, N, K, [30, 30], seed=14)
    w_bad = torch.randn((G, 192, K), device="cuda").to(torch.float8_e4m3fn)
    _expect_error(p, "'w'", w=w_bad, out=torch.full((64 - 4, 192), math.nan, dtype=torch.bfloat16, device="cuda"))
    # More groups than one launch takes.
    many = tessera.gemm.MAX_GROUPS + 1
    _expect_error(p, "'(w|offsets)'", w=torch.zeros((many, N, K), device="cuda").to(torch.float8_e4m3fn),
                  group_rows=torch.zeros(many + 1, dtype=torch.int32, device="cuda"),
                  w_scale=torch.ones(many, device="cuda"))


@gpu
def test_masked_bad_arguments_name_the_argument():
    p = Problem("fp8", "masked", 3, 128, 256, [4, 0, 9], scale_mode="blockwise", max_m=16, seed=15)
    _expect_error(p, "'masked_m'", group_rows=p.group_rows.long())
    _expect_error(p, "'masked_m'", group_rows=torch.zeros(4, dtype=torch.int32, device="cuda"))
    _expect_error(p, "'x'", x=p.x[0])  # contiguous rank for the masked op
    _expect_error(p, "'x_scale'", x_scale=p.x_scale[0])
    _expect_error(p, "'(y|out)'", out=torch.full((3, 15, 128), math.nan, dtype=torch.bfloat16, device="cuda"))
    q = Problem("bf16", "masked", 3, 128, 256, [4, 0, 9], max_m=16, seed=16)
    _expect_error(q, "'masked_m'", group_rows=q.group_rows.cpu())
    _expect_error(q, "'(x|w|masked_m)'", w=q.w[:2])  # G disagrees between w and x / masked_m


@gpu
def test_bf16_bad_arguments_name_the_argument():
    p = Problem("bf16", "contiguous", 2, 128, 192, [10, 50], seed=17)
    _expect_error(p, "'x'", x=p.x.to(torch.float8_e4m3fn))  # fp8 belongs to grouped_gemm_fp8
    _expect_error(p, "'x'", x=p.x.half())
    _expect_error(p, "'w'", w=p.w.float())
    _expect_error(p, "'offsets'", group_rows=p.group_rows.long())
    _expect_error(p, "'(y|out)'", out=torch.full((60, 128), math.nan, dtype=torch.float16, device="cuda"))


# ================================================================================================================
# GPU: CUDA graphs
# ================================================================================================================


@gpu
@pytest.mark.parametrize("kind,layout,scale_mode", [
    ("fp8", "contiguous", "blockwise"),
    ("fp8", "contiguous", "per_tensor"),
    ("fp8", "masked", "blockwise"),
    ("bf16", "contiguous", None),
    ("bf16", "masked", None),
])
def test_cuda_graph_capture(kind, layout, scale_mode):
    # Group sizes change between replays through the same device tensor: the op reads them on the device.
    G, N, K = 4, 256, 256
    if layout == "contiguous":
        p = Problem(kind, layout, G, N, K, [40, 0, 100, 17], scale_mode=scale_mode, tail=20, seed=20)
        schedules = [[0, 1, 1, 150, 177], [10, 60, 61, 61, 120], [0, 0, 0, 0, 0]]
    else:
        p = Problem(kind, layout, G, N, K, [40, 0, 64, 17], scale_mode=scale_mode, max_m=64, seed=20)
        schedules = [[64, 64, 1, 0], [0, 3, 33, 64], [0, 0, 0, 0]]
    out = p.poisoned_out()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.run(out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = p.run(out=out)
    assert g_out is out

    for trial, rows in enumerate(schedules):
        p.set_group_rows(rows)
        p.refresh_inputs(seed=100 + trial)
        out.fill_(math.nan)
        graph.replay()
        p.check(out)
        eager = p.run(out=p.poisoned_out())
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), "replay differs from an eager run"


@gpu
def test_cuda_graph_capture_allocating_output():
    # out=None inside capture: the output comes from the graph's memory pool.
    p = Problem("fp8", "contiguous", 3, 128, 128, [20, 30, 0], scale_mode="per_tensor", tail=6, seed=30)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = p.run()
    p.refresh_inputs(seed=31)
    graph.replay()
    torch.cuda.synchronize()
    ref = p.run(out=p.poisoned_out())
    torch.cuda.synchronize()
    rows = slice(0, 50)
    assert torch.equal(y[rows].view(torch.int16), ref[rows].view(torch.int16))


@gpu
@pytest.mark.parametrize("kind,layout,scale_mode", [("fp8", "contiguous", "per_tensor"), ("fp8", "masked", "blockwise"),
                                                    ("bf16", "contiguous", "per_tensor"), ("bf16", "masked", "per_tensor")])
def test_eager_entry_equals_the_operator_and_hands_back_what_it_does_not_take(kind, layout, scale_mode, monkeypatch):
    # The eager call is one crossing into C++ (tessera._torch_C.grouped_gemm_eager): bitwise the result of
    # torch.ops.tessera.*, with or without out=. What it does not take (a DLPack producer, a wrong dtype or rank)
    # goes to the checked Python path, with that path's result or message.
    from tessera import _dlpack

    calls = []  # (entry, raised) of every call into tessera._torch_C
    real = _dlpack._eager

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def call(*args):
                try:
                    res = fn(*args)
                except Exception:
                    calls.append((name, True))
                    raise
                calls.append((name, False))
                return res

            return call

    monkeypatch.setattr(_dlpack, "_eager", Spy())
    p = Problem(kind, layout, 3, 256, 256, [40, 0, 77], scale_mode=scale_mode, tail=3,
                max_m=80 if layout == "masked" else None, seed=77)
    N = p.N

    def same(a, b):
        for _, idx in p.row_sets():
            assert torch.equal(a.view(-1, N)[idx].view(torch.int16), b.view(-1, N)[idx].view(torch.int16))

    eager_y = p.run()
    given = p.run(out=p.poisoned_out())
    assert calls == [("grouped_gemm_eager", False)] * 2, calls  # one crossing each, no fallback
    op = getattr(torch.ops.tessera, p.op_name())
    ref = torch.full_like(given, math.nan)
    if kind == "fp8":
        op(p.x, p.w, p.group_rows, p.x_scale, p.w_scale, ref, None, scale_mode, 0)
    else:
        op(p.x, p.w, p.group_rows, ref, None, 0)
    torch.cuda.synchronize()
    same(eager_y, ref)
    same(given, ref)

    class Producer:  # a DLPack producer that is not a torch tensor: the checked path converts it
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    fn = getattr(tessera, p.op_name())
    scales = (p.x_scale, p.w_scale) if kind == "fp8" else ()
    kw = {"scale_mode": scale_mode} if kind == "fp8" else {}
    calls.clear()
    via_producer = fn(Producer(p.x), p.w, p.group_rows, *scales, **kw)
    assert calls == [("grouped_gemm_eager", True), (p.op_name(), False)], calls  # handed to the checked path
    torch.cuda.synchronize()
    same(via_producer, ref)
    with pytest.raises(ValueError, match="'w' must have rank 3"):
        fn(p.x, p.w[0], p.group_rows, *scales, **kw)
    if kind == "fp8":
        with pytest.raises(ValueError, match="'x' must be torch.float8_e4m3fn"):
            fn(p.x.view(torch.uint8), p.w, p.group_rows, *scales, **kw)
    else:
        with pytest.raises(ValueError, match="'x' must be torch.bfloat16"):
            fn(p.x.to(torch.float8_e4m3fn), p.w, p.group_rows, **kw)
