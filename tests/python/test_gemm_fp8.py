"""tessera.gemm_fp8: dense FP8 (e4m3) GEMM as the grouped GEMM with one group.

The GPU test compares with a float64 torch product of the very e4m3 values and scales the kernel reads (relative
Frobenius error < 1e-2: the bf16 output rounding costs ~2e-3), for both scale modes, with y poisoned (NaN) first,
under torch.compile(fullgraph=True) and in a CUDA graph. Argument errors need no GPU.
"""

import pytest

import tessera

try:
    import torch
except ImportError:
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def test_exported():
    assert tessera.gemm_fp8 is tessera.gemm.gemm_fp8


@needs_torch
def test_argument_errors_name_the_argument():
    x = torch.zeros(4, 128)
    with pytest.raises(ValueError, match="scale_mode"):
        tessera.gemm_fp8(x, torch.zeros(128, 128), torch.ones(1), torch.ones(1), scale_mode="per_row")
    with pytest.raises(ValueError, match="'w'"):
        tessera.gemm_fp8(x, torch.zeros(1, 128, 128), torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="'w_scale'"):
        tessera.gemm_fp8(x, torch.zeros(128, 128), torch.ones(1), torch.ones(2))


def _case(mode, m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    if mode == "per_tensor":
        xs = torch.rand(1, device="cuda", generator=g) + 0.5
        ws = torch.rand(1, device="cuda", generator=g) + 0.5
        ref = (x.double() @ w.double().T) * xs.double() * ws.double()
    else:
        xs = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
        ws = torch.rand(n // 128, k // 128, device="cuda", generator=g) + 0.5
        xe = x.double() * xs.double().repeat_interleave(128, dim=1)
        we = w.double() * ws.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        ref = xe @ we.T
    return x, w, xs, ws, ref


def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@gpu
@pytest.mark.parametrize("mode", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("m", [1, 77, 640])
def test_matches_float64(mode, m, seed):
    x, w, xs, ws, ref = _case(mode, m, 256, 384, seed)
    out = torch.full((m, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = tessera.gemm_fp8(x, w, xs, ws, scale_mode=mode, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert _rel(y, ref) < 1e-2


@gpu
def test_compile_and_graph(seed):
    x, w, xs, ws, ref = _case("blockwise", 100, 256, 256, seed)
    f = torch.compile(lambda a, b, c, d: tessera.gemm_fp8(a, b, c, d, scale_mode="blockwise"), fullgraph=True)
    assert _rel(f(x, w, xs, ws), ref) < 1e-2
    out = torch.empty(100, 256, device="cuda", dtype=torch.bfloat16)
    tessera.gemm_fp8(x, w, xs, ws, scale_mode="blockwise", out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tessera.gemm_fp8(x, w, xs, ws, scale_mode="blockwise", out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, ref) < 1e-2
