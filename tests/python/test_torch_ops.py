"""tessera's ops as PyTorch custom operators: registration, fake tensors, torch.compile(fullgraph=True), CUDA graphs,
the DLPack path without torch (CuPy), and the error types.

The compile tests run each chain eagerly and compiled on the same inputs and require bitwise equal results: the
operators are deterministic, and the compiled graph must call them with the same arguments. Inputs are fresh
random values from the seed in TESSERA_SEED (see conftest.py), printed when a test fails.
"""

import os
import subprocess
import sys

import pytest

import tessera
from _dispatch_record import recording_mode

try:
    import torch
except ImportError:
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")


# ================================================================================================================
# Without a GPU
# ================================================================================================================


def test_import_without_torch():
    # A Python where `import torch` fails still imports tessera and its DLPack entry points.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tessera, tessera.dlpack\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n"
            "    tessera.fused_gate(object(), topk=8)\n"
            "except ImportError as e:\n"
            "    assert 'torch' in str(e)\n"
            "else:\n"
            "    raise SystemExit('no ImportError')\n"
            "print(tessera.__version__)\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == tessera.__version__


def test_dlpack_module_exports_every_entry_point():
    # tessera.dlpack is the non-torch path: every callable entry point of the extension is there, as itself, and
    # in __all__ (session 19 found the four W8A8 entries missing).
    import tessera._C as ext
    import tessera.dlpack as td

    entries = sorted(n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n)))
    assert "gemm_w8a8" in entries and "moe_layer" in entries
    missing = [n for n in entries if getattr(td, n, None) is not getattr(ext, n)]
    assert not missing, f"tessera.dlpack lacks {missing}"
    assert sorted(td.__all__) == entries


def test_every_op_takes_out_workspace_and_stream():
    import inspect

    ops = {"fused_gate": ("out",), "permute": ("out", "workspace"), "unpermute_reduce": ("out",),
           "grouped_gemm_fp8": ("out", "workspace"), "grouped_gemm_fp8_masked": ("out", "workspace"),
           "grouped_gemm_bf16": ("out", "workspace"), "grouped_gemm_bf16_masked": ("out", "workspace"),
           "attention_decode": ("out", "workspace"), "append_kv": (),  # append_kv writes into the cache it is given
           "quantize_per_block": ("out",), "gemm_w8a8": ("out", "workspace"), "linear_w8a8": ("out", "workspace")}
    for name, extra in ops.items():
        params = inspect.signature(getattr(tessera, name)).parameters
        for arg in extra + ("stream",):
            assert arg in params, f"tessera.{name} has no {arg}="
            assert params[arg].default is None, f"tessera.{name}: {arg} must default to None"


def test_bench_and_tests_never_share_a_build_folder():
    import re
    from pathlib import Path

    tools = Path(__file__).resolve().parents[2] / "tools"
    default = {}
    for script in ("test.sh", "bench.sh"):
        m = re.search(r"build=\$\{BUILD_DIR:-([^}]+)\}", (tools / script).read_text())
        assert m, f"tools/{script} does not name its build folder"
        default[script] = m.group(1)
    assert default["test.sh"] != default["bench.sh"], default


def test_summary_counts_skipped_tests(tmp_path):
    from pathlib import Path

    ctest = tmp_path / "ctest.xml"
    ctest.write_text('<testsuite><testcase name="A.Cpu" status="run"/>'
                     '<testcase name="B.Gpu" status="run"><skipped message="no GPU"/></testcase>'
                     '<testcase name="C.Gpu" status="fail"><failure message="x"/></testcase></testsuite>')
    pyx = tmp_path / "pytest.xml"
    pyx.write_text('<testsuites><testsuite><testcase name="t1"/><testcase name="t2"><skipped message="needs torch '
                   'with a CUDA device"/></testcase></testsuite></testsuites>')
    script = Path(__file__).resolve().parents[2] / "tools" / "test_summary.py"
    r = subprocess.run([sys.executable, str(script), str(ctest), str(pyx)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "3 in ctest: 2 ran (1 passed, 1 failed), 1 skipped" in r.stdout, r.stdout
    assert "2 cases: 1 passed, 0 failed, 1 skipped" in r.stdout, r.stdout


@needs_torch
def test_every_op_is_registered_with_its_mutations():
    from tessera import _torch_ops

    written = {
        "fused_gate": {"weights", "ids"},
        "permute": {"x_perm", "scales", "expert_offsets", "expert_counts", "row_index", "row_token", "workspace"},
        "unpermute_reduce": {"out"},
        "grouped_gemm_fp8": {"y", "workspace"},
        "grouped_gemm_fp8_masked": {"y", "workspace"},
        "grouped_gemm_bf16": {"y", "workspace"},
        "grouped_gemm_bf16_masked": {"y", "workspace"},
        "attention_decode": {"out", "lse", "workspace"},
        "append_kv": {"k_cache", "v_cache", "k_scale", "v_scale", "k_residual"},
        "attention_prefill": {"out", "lse"},
        "attention_prefill_varlen": {"out", "lse"},
        "attention_prefill_with_cache": {"out", "lse"},
        "linear": {"y", "workspace"},
        "conv2d": {"y", "workspace"},
        "w8a8_quantize": {"codes", "scale", "zero", "sums"},
        "gemm_w8a8": {"y", "workspace"},
        "moe_layer": {"y", "workspace"},
    }
    assert set(_torch_ops.OPS) == set(written)
    for name, expected in written.items():
        schema = getattr(torch.ops.tessera, name).default._schema
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == expected, name
        assert len(schema.returns) == 0, name


@needs_torch
def test_schemas_have_cuda_kernels():
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)
    for name in _torch_ops.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{name}", "CUDA"), name


def _meta_decode_chain(fmt="int8"):
    """append_kv then attention_decode on meta tensors (shapes only), through the eager entry points."""
    B, HQ, HKV, D, pages, page = 3, 8, 2, 128, 10, 16
    meta = dict(device="meta")
    q = torch.empty((B, HQ, D), dtype=torch.bfloat16, **meta)
    kc = torch.empty((pages, page, HKV, D), dtype=torch.uint8, **meta)
    sc = torch.empty((pages, page, HKV, 2), dtype=torch.float16, **meta)
    kw = dict(format=fmt, k_scale=sc, v_scale=sc, block_table=torch.empty((B, 3), dtype=torch.int32, **meta))
    lengths = torch.empty((B,), dtype=torch.int32, **meta)
    k_new = torch.empty((B, 1, HKV, D), dtype=torch.bfloat16, **meta)
    tessera.append_kv(k_new, k_new, lengths, kc, kc, **kw)
    return tessera.attention_decode(q, kc, kc, lengths, num_splits=3, return_lse=True, **kw)


@needs_torch
def test_eager_calls_reach_the_operator_under_a_dispatch_mode_and_with_meta_tensors():
    # The direct eager entries are a shortcut only: a dispatch mode sees torch.ops.tessera.* (and with it every
    # tool built on one), and meta/fake tensors go to the fake implementation instead of being refused.
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)
    with recording_mode() as mode:
        out, lse = _meta_decode_chain()
    assert "tessera.append_kv.default" in mode.calls and "tessera.attention_decode.default" in mode.calls, mode.calls
    assert out.shape == (3, 8, 128) and out.dtype == torch.bfloat16 and out.is_meta
    assert lse.shape == (3, 8) and lse.dtype == torch.float32
    out, lse = _meta_decode_chain()  # no mode: the meta key alone routes them
    assert out.is_meta and lse.shape == (3, 8)
    o = torch.empty((3, 8, 128), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="'window'"):  # the eager entry's own checks come first
        tessera.attention_decode(o, o, o, o, window=-2)
    with pytest.raises(ValueError, match="'format'"):
        tessera.attention_decode(o, o, o, o, format="int2")
    # The MoE ops' eager entries alike.
    logits = torch.empty((5, 64), device="meta")
    with recording_mode() as mode:
        weights, ids = tessera.fused_gate(logits, topk=4, num_shared_experts=1)
        y = torch.empty((20, 128), dtype=torch.bfloat16, device="meta")
        reduced = tessera.unpermute_reduce(y, ids[:, :4].contiguous(), weights[:, :4].contiguous())
        x = torch.empty((5, 128), dtype=torch.bfloat16, device="meta")
        perm = tessera.permute(x, ids[:, :4].contiguous(), 64, quant="fp8_blockwise", pad_multiple=4)
    assert "tessera.fused_gate.default" in mode.calls and "tessera.unpermute_reduce.default" in mode.calls
    assert "tessera.permute.default" in mode.calls and isinstance(perm, tessera.PermuteResult)
    assert perm.x_perm.shape == (5 * 4 + 64 * 3, 128) and perm.x_perm.dtype == torch.float8_e4m3fn
    assert perm.scales.shape == (5 * 4 + 64 * 3, 1) and perm.row_token.shape == (5 * 4 + 64 * 3,)
    assert perm.expert_offsets.shape == (65,) and perm.row_index.shape == (5, 4)
    assert weights.shape == (5, 5) and weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert reduced.shape == (5, 128) and reduced.dtype == torch.bfloat16 and reduced.is_meta
    with pytest.raises(ValueError, match="'topk' must be >= 1"):
        tessera.fused_gate(logits, topk=0)
    with pytest.raises(ValueError, match="'logits' must have rank 2"):
        tessera.fused_gate(logits[0], topk=4)
    with pytest.raises(ValueError, match="'row_index' must have rank 2"):
        tessera.unpermute_reduce(y, ids[0], weights)
    with pytest.raises(ValueError, match="'pad_multiple' must be >= 1"):
        tessera.permute(x, ids, 64, pad_multiple=0)
    with pytest.raises(ValueError, match="'quant'"):
        tessera.permute(x, ids, 64, quant="int4")


@needs_torch
def test_eager_entries_keep_the_fast_path_contract():
    # python/src/fastcall.h: each <op>_eager entry converts its positional arguments itself. What cannot be converted
    # is a TypeError with pybind11's phrase (the torch layer's FALLBACK to its checked path) before anything runs;
    # tessera's argument errors stay ValueErrors; the attention entries return out, or (out, lse) with return_lse.
    from tessera import _dlpack, _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)
    ext = tessera._torch_C
    names = sorted(n for n in dir(ext) if n.endswith("_eager"))
    assert len(names) == 14, names
    for name in names:
        fn = getattr(ext, name)
        for args in ((), (None,) * 40, (object(),) * 3):
            with pytest.raises(TypeError, match=_dlpack.FALLBACK):
                fn(*args)
    meta = dict(device="meta")
    q = torch.empty((3, 8, 128), dtype=torch.bfloat16, **meta)
    kc = torch.empty((3, 16, 2, 128), dtype=torch.bfloat16, **meta)
    lengths = torch.empty((3,), dtype=torch.int32, **meta)
    args = [q, kc, kc, lengths, None, None, None, None, None, False, None, "native", None, 0.0, 0, 0]
    out = ext.attention_decode_eager(*args)  # k_residual, the last, left out: None
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.is_meta
    args[9] = True
    out, lse = ext.attention_decode_eager(*args, None)
    assert out.shape == q.shape and lse.shape == (3, 8) and lse.dtype == torch.float32
    args[14] = -1
    with pytest.raises(ValueError, match="'window' must be >= 0"):
        ext.attention_decode_eager(*args)
    args[14], args[11] = 0, 3  # an int for the format string
    with pytest.raises(TypeError, match=_dlpack.FALLBACK):
        ext.attention_decode_eager(*args)
    # Only optional parameters may be left out: prefill without its last argument (causal) is refused, not run.
    with pytest.raises(TypeError, match=_dlpack.FALLBACK):
        ext.attention_prefill_eager(q, kc, kc, None, None, False, None, 0.0, 0)


@needs_torch
def test_symbolic_tracing_sees_the_operators():
    # make_fx with dynamic shapes (what AOT autograd and export use): the eager entries do not allocate with symbolic
    # sizes but hand the call to the torch layer's checked path, which traces the operators.
    from tessera import _torch_ops
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)
    with FakeTensorMode(shape_env=ShapeEnv()):
        cuda = dict(device="cuda")
        args = (torch.empty((5, 64), **cuda), torch.empty((5, 128), dtype=torch.bfloat16, **cuda),
                torch.empty((3, 8, 128), dtype=torch.bfloat16, **cuda),
                torch.empty((10, 16, 2, 128), dtype=torch.uint8, **cuda),
                torch.empty((10, 16, 2, 2), dtype=torch.float16, **cuda), torch.empty((3, 3), dtype=torch.int32, **cuda),
                torch.empty((3,), dtype=torch.int32, **cuda))

    def chain(logits, x, q, kc, sc, bt, lengths):
        weights, ids = tessera.fused_gate(logits, topk=4)
        p = tessera.permute(x, ids, 64)
        y = tessera.unpermute_reduce(p.x_perm, p.row_index, weights)
        o = tessera.attention_decode(q, kc, kc, lengths, format="int8", k_scale=sc, v_scale=sc, block_table=bt)
        return y, o

    graph = make_fx(chain, tracing_mode="symbolic")(*args)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.fused_gate.default", "tessera.permute.default", "tessera.unpermute_reduce.default",
                      "tessera.attention_decode.default"], traced


def test_device_errors_are_runtime_errors_without_build_paths():
    # With no usable GPU the C++ device query fails: a RuntimeError (not ValueError) whose message names no
    # directory of the build machine. With an sm_90 GPU the same call goes through.
    from _host_capsule import DL_FLOAT, DL_INT, HostCapsule

    logits = HostCapsule((4, 64), DL_FLOAT, 32)
    weights = HostCapsule((4, 8), DL_FLOAT, 32)
    ids = HostCapsule((4, 8), DL_INT, 32)
    for c in (logits, weights, ids):
        c.managed.dl_tensor.device.device_type = 2  # kDLCUDA: host memory the binding must not touch
    try:
        tessera._C.fused_gate(logits.capsule, None, weights.capsule, ids.capsule, 8, 1, 1, "sigmoid", "top2_sum",
                              False, 1.0, 0, 1.0, 0)
    except RuntimeError as e:
        msg = str(e)
        assert "tessera" in msg and "CUDA" in msg, msg
        assert os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in msg, msg
        assert not any(part.startswith("/") and "/src/" in part for part in msg.split()), msg
    except ValueError as e:
        # A GPU is present: the pointers are not on it, which is an argument error of the tensors (named).
        assert HAS_CUDA or "device" in str(e), str(e)
    else:
        pytest.fail("host memory labelled as CUDA memory was accepted")


# ================================================================================================================
# GPU: the MoE chain and the decode chain, eager vs torch.compile vs CUDA graph
# ================================================================================================================


@needs_torch
def test_dynamo_traces_both_chains_whole_without_a_gpu():
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors: every wrapper's fast path must step aside under tracing (fast_entry gives None) and its checked path
    # trace to the operators. The GPU tests below compile, run and compare.
    from tessera import _torch_ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)

    class Moe(torch.nn.Module):
        def forward(self, logits, bias, x, w, w_scale):
            return _moe_chain(logits, bias, x, w, w_scale, 4, 32)[0]

    class Decode(torch.nn.Module):
        def forward(self, q, k_new, lengths, k_cache, k_scale, block_table):
            o, lse = _decode_chain(q, k_new, k_new, lengths, k_cache, k_cache, k_scale, k_scale, block_table,
                                   "int8")
            return tessera.prefill(o[:, None], o[:, None], o[:, None]), lse

    with FakeTensorMode():
        cuda = dict(device="cuda")
        moe_args = (torch.empty((96, 32), **cuda), torch.empty((32,), **cuda),
                    torch.empty((96, 256), dtype=torch.bfloat16, **cuda),
                    torch.empty((32, 256, 256), dtype=torch.float8_e4m3fn, **cuda), torch.empty((32, 2, 2), **cuda))
        moe = torch.export.export(Moe(), moe_args, strict=True)
        dec_args = (torch.empty((3, 8, 128), dtype=torch.bfloat16, **cuda),
                    torch.empty((3, 1, 2, 128), dtype=torch.bfloat16, **cuda), torch.empty((3,), dtype=torch.int32, **cuda),
                    torch.empty((26, 16, 2, 128), dtype=torch.uint8, **cuda),
                    torch.empty((26, 16, 2, 2), dtype=torch.float16, **cuda),
                    torch.empty((3, 8), dtype=torch.int32, **cuda))
        dec = torch.export.export(Decode(), dec_args, strict=True)
    traced = [str(n.target) for n in moe.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.fused_gate.default", "tessera.permute.default", "tessera.grouped_gemm_fp8.default",
                      "tessera.unpermute_reduce.default"], traced
    traced = [str(n.target) for n in dec.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.append_kv.default", "tessera.attention_decode.default",
                      "tessera.attention_prefill.default"], traced


def _moe_inputs(seed, T=96, E=32, H=256, N=256, k=4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn((T, E), device="cuda", generator=g)
    logits[:, 3] += 4.0  # a hot expert: skewed routing, as real gates produce
    bias = torch.randn((E,), device="cuda", generator=g) * 0.1
    x = torch.randn((T, H), device="cuda", generator=g).bfloat16()
    x[:, 7] *= 30.0  # an outlier channel
    w = (torch.randn((E, N, H), device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    w_scale = torch.rand((E, N // 128, H // 128), device="cuda", generator=g) * 0.01 + 0.001
    return dict(logits=logits, bias=bias, x=x, w=w, w_scale=w_scale, k=k, E=E)


def _moe_chain(logits, bias, x, w, w_scale, k, E):
    weights, ids = tessera.fused_gate(logits, bias, topk=k, num_groups=4, topk_groups=2, renormalize=True,
                                      routed_scaling_factor=2.5)
    p = tessera.permute(x, ids, E, quant="fp8_blockwise")
    y = tessera.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale, scale_mode="blockwise")
    return tessera.unpermute_reduce(y, p.row_index, weights), weights, ids


def _moe_reference(inp, weights, ids):
    # float64 on the GPU from tessera's own routing and its fp8 block-wise quantization rule (per 128 columns).
    x = inp["x"].double()
    T, H = x.shape
    blocks = x.view(T, H // 128, 128)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
    xq = (blocks / scale).float().to(torch.float8_e4m3fn).double() * scale
    xq = xq.view(T, H)
    w = inp["w"].double() * inp["w_scale"].double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    out = torch.zeros((T, w.shape[1]), dtype=torch.float64, device="cuda")
    for j in range(ids.shape[1]):
        out += weights[:, j:j + 1].double() * torch.einsum("th,tnh->tn", xq, w[ids[:, j].long()])
    return out


@gpu
def test_compile_moe_chain_fullgraph_matches_eager(seed):
    inp = _moe_inputs(seed)
    eager, weights, ids = _moe_chain(**inp)
    compiled = torch.compile(_moe_chain, fullgraph=True)
    got, got_w, got_ids = compiled(**inp)
    torch.cuda.synchronize()
    assert torch.equal(got_ids, ids) and torch.equal(got_w, weights)
    assert torch.equal(got, eager), "compiled MoE chain differs from eager"
    ref = _moe_reference(inp, weights, ids)
    err = ((eager.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err  # fp8 operands, bf16 output


@gpu
def test_moe_chain_in_a_cuda_graph(seed):
    inp = _moe_inputs(seed)
    static = {key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}
    _moe_chain(**static)  # warm-up (first-call work stays out of the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, _ = _moe_chain(**static)
    for round_ in range(2):
        fresh = _moe_inputs(seed + 1 + round_)
        for key in ("logits", "bias", "x"):
            static[key].copy_(fresh[key])
        out.fill_(float("nan"))
        graph.replay()
        expected, _, _ = _moe_chain(**{**inp, **{k_: static[k_] for k_ in ("logits", "bias", "x")}})
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {round_} differs from eager"


def _decode_inputs(seed, fmt="int8", B=3, HQ=8, HKV=2, D=128, page=16, pages_per_seq=8):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = B * pages_per_seq + 2
    block_table = torch.randperm(num_pages, device="cuda", generator=g)[:B * pages_per_seq]
    block_table = block_table.view(B, pages_per_seq).to(torch.int32)
    row = D // 2 if fmt.startswith("int4") else D
    k_cache = torch.randint(0, 256, (num_pages, page, HKV, row), dtype=torch.uint8, device="cuda", generator=g)
    v_cache = k_cache.clone()
    k_scale = (torch.rand((num_pages, page, HKV, 2), device="cuda", generator=g) * 0.05).half()
    v_scale = k_scale.clone()
    lengths = torch.randint(1, page * pages_per_seq - 2, (B,), device="cuda", generator=g).to(torch.int32)
    k_new = torch.randn((B, 1, HKV, D), device="cuda", generator=g).bfloat16()
    v_new = torch.randn((B, 1, HKV, D), device="cuda", generator=g).bfloat16()
    q = torch.randn((B, HQ, D), device="cuda", generator=g).bfloat16()
    return dict(q=q, k_new=k_new, v_new=v_new, lengths=lengths, k_cache=k_cache, v_cache=v_cache,
                k_scale=k_scale, v_scale=v_scale, block_table=block_table, fmt=fmt)


def _decode_chain(q, k_new, v_new, lengths, k_cache, v_cache, k_scale, v_scale, block_table, fmt):
    kw = dict(format=fmt, k_scale=k_scale, v_scale=v_scale, block_table=block_table)
    tessera.append_kv(k_new, v_new, lengths - 1, k_cache, v_cache, **kw)
    return tessera.attention_decode(q, k_cache, v_cache, lengths, num_splits=3, return_lse=True, **kw)


def _cache_copy(inp):
    return {key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}


@gpu
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_compile_decode_chain_fullgraph_matches_eager(seed, fmt):
    inp = _decode_inputs(seed, fmt)
    a, b = _cache_copy(inp), _cache_copy(inp)
    out, lse = _decode_chain(**a)
    compiled = torch.compile(_decode_chain, fullgraph=True)
    got, got_lse = compiled(**b)
    torch.cuda.synchronize()
    for key in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(a[key], b[key]), f"compiled append_kv wrote a different {key}"
    assert not torch.equal(a["k_cache"], inp["k_cache"]), "append_kv wrote nothing"
    assert torch.equal(got, out) and torch.equal(got_lse, lse), "compiled decode differs from eager"
    assert bool(torch.isfinite(out).all())


@gpu
def test_decode_chain_in_a_cuda_graph(seed):
    inp = _decode_inputs(seed)
    static = _cache_copy(inp)
    # Preallocated outputs and workspace: nothing is allocated inside the capture.
    out = torch.empty_like(static["q"])
    lse = torch.empty(static["q"].shape[:-1], dtype=torch.float32, device="cuda")
    kw = dict(format="int8", k_scale=static["k_scale"], v_scale=static["v_scale"],
              block_table=static["block_table"])
    ws = torch.empty(tessera.decode_workspace_size(static["q"], static["k_cache"], static["v_cache"], num_splits=3,
                                                   **kw), dtype=torch.uint8, device="cuda")

    def step():
        tessera.append_kv(static["k_new"], static["v_new"], static["lengths"] - 1, static["k_cache"],
                          static["v_cache"], **kw)
        tessera.attention_decode(static["q"], static["k_cache"], static["v_cache"], static["lengths"], out=out,
                                 lse=lse, workspace=ws, num_splits=3, **kw)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for round_ in range(2):
        fresh = _decode_inputs(seed + 1 + round_)
        for key in ("q", "k_new", "v_new", "lengths"):
            static[key].copy_(fresh[key])
        eager = _cache_copy(static)
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = _decode_chain(**{**eager, "fmt": "int8"})
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"replay {round_} differs from eager"
        assert torch.equal(static["k_cache"], eager["k_cache"])


@gpu
def test_eager_decode_chain_under_a_dispatch_mode_runs_the_operators(seed):
    # Real CUDA tensors under a TorchDispatchMode: the calls go through the dispatcher (the mode sees them) and give
    # what the direct path gives.
    inputs = _decode_inputs(seed)
    direct = _decode_chain(**{**_cache_copy(inputs), "fmt": "int8"})
    routed_inputs = {**_cache_copy(inputs), "fmt": "int8"}
    with recording_mode() as mode:
        routed = _decode_chain(**routed_inputs)
    torch.cuda.synchronize()
    assert "tessera.attention_decode.default" in mode.calls and "tessera.append_kv.default" in mode.calls
    assert torch.equal(routed[0], direct[0]) and torch.equal(routed[1], direct[1])


@gpu
def test_fake_tensors_trace_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty((5, 64), device="cuda")
        weights, ids = tessera.fused_gate(logits, topk=4)
        assert weights.shape == (5, 4) and ids.dtype == torch.int32
        x = torch.empty((5, 128), dtype=torch.bfloat16, device="cuda")
        p = tessera.permute(x, ids, 64, quant="fp8_blockwise", pad_multiple=4)
        assert p.x_perm.shape == (5 * 4 + 64 * 3, 128) and p.x_perm.dtype == torch.float8_e4m3fn
        assert p.scales.shape == (5 * 4 + 64 * 3, 1)


# ================================================================================================================
# GPU: the DLPack path with a non-torch producer (CuPy), and errors through the operators
# ================================================================================================================


@gpu
def test_cupy_arrays_through_the_dlpack_entry_points(seed):
    cp = pytest.importorskip("cupy")
    import tessera.dlpack as td

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits_t = torch.randn((40, 256), device="cuda", generator=g)
    want_w, want_ids = tessera.fused_gate(logits_t, topk=8, num_groups=8, topk_groups=4, renormalize=True,
                                          routed_scaling_factor=2.5)
    torch.cuda.synchronize()
    logits = cp.asarray(logits_t.cpu().numpy())
    weights = cp.full((40, 8), cp.nan, dtype=cp.float32)
    ids = cp.full((40, 8), -1, dtype=cp.int32)
    stream = cp.cuda.get_current_stream()
    td.fused_gate(logits, None, weights, ids, 8, 8, 4, "sigmoid", "top2_sum", True, 2.5, 0, 1.0, stream.ptr)
    stream.synchronize()
    assert (cp.asnumpy(ids) == want_ids.cpu().numpy()).all()
    assert (cp.asnumpy(weights) == want_w.cpu().numpy()).all()
    with pytest.raises(ValueError, match="'weights'"):
        td.fused_gate(logits, None, cp.empty((40, 7), cp.float32), ids, 8, 8, 4, "sigmoid", "top2_sum", True,
                      2.5, 0, 1.0, stream.ptr)


@gpu
def test_operator_errors_are_value_errors_naming_the_argument():
    logits = torch.randn((4, 64), device="cuda")
    bad_ids = torch.empty((4, 8), dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="'ids'") as info:
        tessera.fused_gate(logits, topk=8, out=(torch.empty((4, 8), device="cuda"), bad_ids))
    assert "/src/" not in str(info.value) and "Exception raised" not in str(info.value)
    with pytest.raises(ValueError, match="'logits'"):
        tessera.fused_gate(torch.randn((4, 64)), topk=8)  # a CPU tensor


@gpu
def test_every_op_takes_out_and_stream(seed):
    # permute with out= and workspace= allocates nothing; a side stream orders everything after it.
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, H, E, k = 50, 128, 16, 2
    x = torch.randn((T, H), device="cuda", generator=g).bfloat16()
    ids = torch.rand((T, E), device="cuda", generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    rows = tessera.permute_capacity_rows(T, k, E)
    out = tessera.PermuteResult(
        torch.full((rows, H), float("nan"), dtype=torch.bfloat16, device="cuda"), None,
        torch.empty(E + 1, dtype=torch.int32, device="cuda"), torch.empty(E, dtype=torch.int32, device="cuda"),
        torch.empty((T, k), dtype=torch.int32, device="cuda"), torch.empty(rows, dtype=torch.int32, device="cuda"))
    ws = torch.empty(max(1, tessera.permute_workspace_bytes(T, k, E)), dtype=torch.uint8, device="cuda")
    want = tessera.permute(x, ids, E)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got = tessera.permute(x, ids, E, out=out, workspace=ws, stream=side)
    side.synchronize()
    assert got.x_perm is out.x_perm
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    # The raw-int stream form too.
    weights = torch.rand((T, k), device="cuda", generator=g)
    red = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    tessera.unpermute_reduce(want.x_perm, want.row_index, weights, out=red, stream=side.cuda_stream)
    side.synchronize()
    assert torch.equal(red, tessera.unpermute_reduce(want.x_perm, want.row_index, weights))


@gpu
def test_stream_zero_is_the_legacy_default_stream_and_ints_are_not_narrowed(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn((32, 64), device="cuda", generator=g)
    want_w, want_ids = tessera.fused_gate(logits, topk=4)
    w, ids = tessera.fused_gate(logits, topk=4, stream=0)  # cudaStreamLegacy: ordered with the default stream
    torch.cuda.synchronize()
    assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    with pytest.raises(ValueError, match="'num_groups' must fit in 32 bits"):
        tessera.fused_gate(logits, topk=4, num_groups=2**32 + 1, topk_groups=1)


@gpu
def test_generic_torch_stream_and_gemm_fp8_on_a_side_stream(seed):
    # A CUDA torch.Stream (what torch.accelerator hands out) is taken as the same torch.cuda.Stream; gemm_fp8 makes its
    # one group's offsets on the stream it runs on (found in review: they were made on the current stream and read on
    # stream=, unordered).
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn((32, 64), device="cuda", generator=g)
    side = torch.cuda.Stream()
    generic = torch.Stream(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)
    side.wait_stream(torch.cuda.current_stream())
    w, ids = tessera.fused_gate(logits, topk=4, stream=generic)
    side.synchronize()
    want_w, want_ids = tessera.fused_gate(logits, topk=4)
    assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    x = (torch.randn((64, 256), device="cuda", generator=g) * 0.1).to(torch.float8_e4m3fn)
    wt = (torch.randn((128, 256), device="cuda", generator=g) * 0.1).to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    want = tessera.gemm_fp8(x, wt, one, one)
    torch.cuda.synchronize()  # the inputs are ready; side is not ordered after what follows on the current stream
    torch.cuda._sleep(50_000_000)  # the current stream busy: nothing the side GEMM needs may be queued behind this
    got = tessera.gemm_fp8(x, wt, one, one, stream=side)
    side.synchronize()
    assert torch.equal(got, want)
    torch.cuda.synchronize()
