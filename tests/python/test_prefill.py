"""Python tests for tessera.prefill / tessera.prefill_varlen / tessera.prefill_with_cache
(torch.ops.tessera.attention_prefill[_varlen|_with_cache], and the DLPack entries
tessera.dlpack.attention_prefill[_varlen|_with_cache]).

Semantics (include/tessera/attention.h, docs/ops/attention_prefill.md): query i of a sequence with Sq queries and
Sk keys sits at p = Sk - Sq + i (bottom-right aligned) and attends to the keys j with j <= p (causal) and
p - j < window (window > 0); logits softmax_scale * q . k, then softcap * tanh(s / softcap); lse is the natural
log-sum-exp; a query without keys gets o = 0 and lse = -inf. The GPU tests compare with a float64 torch reference
(`reference`, per sequence) computed from the very bf16/fp16 inputs the kernel reads. Outputs are poisoned (NaN)
before every call, so an unwritten row fails, and rows the op must not write (past cu_seqlens_q[B]) must keep the
poison.

Tolerance: relative Frobenius error per sequence (over its rows that have keys) <= 5e-3, no (token, head) row above
2e-2; lse within 1e-2 + 1e-3 |lse|. The bf16 rounding of the probabilities and of o alone is about 2e-3; a wrong
key, mask, head or length is an O(1) error.

Random inputs come from the `seed` fixture (TESSERA_SEED, see conftest.py), named in a failing test's report. The
tests at the top run without a GPU (the schemas, fake-tensor shape inference, torch.compile tracing on meta tensors,
argument errors, the C++ validation through host-memory DLPack capsules); the GPU tests skip without torch or a
CUDA device.
"""

import inspect
import math

import pytest

import tessera
from _host_capsule import DL_BFLOAT, DL_FLOAT, DL_INT, DL_UINT, HostCapsule
from _dispatch_record import recording_mode

try:
    import torch
except ImportError:  # the no-GPU tests without torch still run
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

TOL = 5e-3  # relative Frobenius error per sequence
ROW_TOL = 2e-2  # relative error of any one (token, head) row
DEVICE = "cuda"
OPS = ("attention_prefill", "attention_prefill_varlen")


def _ops_available():
    from tessera import _torch_ops

    return _torch_ops.available(), _torch_ops.load_error


def _needs_kernels():
    ok, why = _ops_available()
    if not ok:
        pytest.skip(why)


# ================================================================================================================
# Without a GPU: registration, signatures, argument errors
# ================================================================================================================


def test_exports():
    for name in ("prefill", "prefill_varlen"):
        assert getattr(tessera, name) is getattr(tessera.attention, name)
        assert name in tessera.__all__ and name in tessera.attention.__all__
    import tessera.dlpack as td

    for name in OPS:
        assert getattr(td, name) is getattr(tessera._C, name)
        assert name in td.__all__


def test_signatures():
    keywords = {"causal": False, "softmax_scale": 0.0, "softcap": 0.0, "window": 0, "out": None, "lse": None,
                "return_lse": False, "stream": None}
    for fn, positional in ((tessera.prefill, ["q", "k", "v"]),
                           (tessera.prefill_varlen, ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q"])):
        params = inspect.signature(fn).parameters
        assert [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == positional, fn.__name__
        for name, default in keywords.items():
            assert params[name].kind == params[name].KEYWORD_ONLY, f"{fn.__name__}: {name}"
            assert params[name].default == default, f"{fn.__name__}: {name}"


def test_bad_params():
    # Checked before any tensor is looked at (and before torch is needed).
    o = object()
    with pytest.raises(ValueError, match="'window'"):
        tessera.prefill(o, o, o, window=-1)
    with pytest.raises(ValueError, match="'window'"):
        tessera.prefill_varlen(o, o, o, o, o, 8, window=-5)
    with pytest.raises(ValueError, match="'max_seqlen_q'"):
        tessera.prefill_varlen(o, o, o, o, o, -1)
    with pytest.raises(TypeError, match="'max_seqlen_q'"):
        tessera.prefill_varlen(o, o, o, o, o, 2.5)
    with pytest.raises(TypeError, match="'window'"):
        tessera.prefill(o, o, o, window=1.5)
    with pytest.raises(TypeError, match="'softcap'"):
        tessera.prefill(o, o, o, softcap="x")
    with pytest.raises(TypeError, match="'softmax_scale'"):
        tessera.prefill_varlen(o, o, o, o, o, 8, softmax_scale=[1.0])


# ---- tessera._C (the DLPack path): the C++ validation runs before any device check --------------------------

B_, S_, HQ_, HKV_, D_ = 2, 5, 8, 2, 128


def _plain_capsules(B=B_, Sq=S_, Sk=S_, HQ=HQ_, HKV=HKV_, D=D_, q=(DL_BFLOAT, 16), kv=(DL_BFLOAT, 16),
                    o=(DL_BFLOAT, 16), lse=(DL_FLOAT, 32), o_shape=None):
    """Host-memory capsules of a plain batch (HostCapsule objects: keep them alive during the call)."""
    tensors = [HostCapsule((B, Sq, HQ, D), *q), HostCapsule((B, Sk, HKV, D), *kv), HostCapsule((B, Sk, HKV, D), *kv),
               HostCapsule(o_shape or (B, Sq, HQ, D), *o)]
    tensors.append(HostCapsule((B, Sq, HQ), *lse) if lse is not None else None)
    return tensors


def _call_plain(tensors, softmax_scale=0.0, softcap=0.0, window=0, causal=False):
    caps = [t.capsule if t is not None else None for t in tensors]
    tessera._C.attention_prefill(*caps, softmax_scale, softcap, window, causal, 0)


def _varlen_capsules(total_q=10, total_k=12, entries=3, cu_q=(DL_INT, 32), cu_k=(DL_INT, 32), k_entries=None,
                     D=D_):
    return [HostCapsule((total_q, HQ_, D), DL_BFLOAT, 16), HostCapsule((total_k, HKV_, D), DL_BFLOAT, 16),
            HostCapsule((total_k, HKV_, D), DL_BFLOAT, 16), HostCapsule((entries,), *cu_q),
            HostCapsule((k_entries or entries,), *cu_k), HostCapsule((total_q, HQ_, D), DL_BFLOAT, 16),
            HostCapsule((total_q, HQ_), DL_FLOAT, 32)]


def _call_varlen(tensors, max_seqlen_q=4, softmax_scale=0.0, softcap=0.0, window=0, causal=True):
    q, k, v, cu_q, cu_k, o, lse = [t.capsule for t in tensors]
    tessera._C.attention_prefill_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, o, lse, softmax_scale, softcap, window,
                                        causal, 0)


PLAIN_ERRORS = [
    ("head_dim", dict(D=96), {}, r"prefill: 'q' must have head dim D \(dim 3\) of 64, 128 or 256, got 96"),
    ("groups", dict(HQ=5, HKV=2), {}, r"'k' must have a number of heads .* divides q's 5"),
    ("dtype", dict(q=(DL_FLOAT, 32), kv=(DL_FLOAT, 32), o=(DL_FLOAT, 32)), {}, r"'q' must have dtype"),
    ("kv_dtype", dict(kv=(DL_FLOAT, 16)), {}, r"'k' must have the dtype of 'q'"),
    ("causal_sq_gt_sk", dict(Sq=6, Sk=5), dict(causal=True), r"'q' must have Sq <= Sk when causal"),
    ("out_dtype", dict(o=(DL_FLOAT, 16)), {}, r"'o' must have the dtype of 'q'"),
    ("out_shape", dict(o_shape=(B_, S_, HQ_, 64)), {}, r"'o' must have shape"),
    ("lse_dtype", dict(lse=(DL_BFLOAT, 16)), {}, r"'lse' must have dtype fp32"),
    ("softcap", {}, dict(softcap=-1.0), r"'params.softcap' must be finite and >= 0"),
    ("softcap_inf", {}, dict(softcap=math.inf), r"'params.softcap'"),
    ("softmax_scale", {}, dict(softmax_scale=math.nan), r"'params.softmax_scale' must be finite"),
    ("window", {}, dict(window=-1), r"'params.window' must be >= 0"),
    ("valid_until_the_device_check", {}, dict(causal=True, window=3, softcap=30.0),
     r"'q' must be in device memory"),
    # Sq > Sk is fine without the causal mask (queries see every key).
    ("sq_gt_sk_not_causal", dict(Sq=6, Sk=5), {}, r"'q' must be in device memory"),
]


@pytest.mark.parametrize("case,tensors,params,message", PLAIN_ERRORS, ids=[c[0] for c in PLAIN_ERRORS])
def test_binding_plain_validation(case, tensors, params, message):
    with pytest.raises(ValueError, match=message):
        _call_plain(_plain_capsules(**tensors), **params)


VARLEN_ERRORS = [
    ("cu_dtype", dict(cu_q=(DL_INT, 64)), {}, r"prefill_varlen: 'cu_seqlens_q' must have dtype int32"),
    ("cu_k_dtype", dict(cu_k=(DL_FLOAT, 32)), {}, r"'cu_seqlens_k' must have dtype int32"),
    ("cu_entries", dict(k_entries=4), {}, r"'cu_seqlens_k' must have shape \[B \+ 1\] = \[3\]"),
    ("cu_empty", dict(entries=0, k_entries=0), {}, r"'cu_seqlens_q' must be int32 \[B \+ 1\] with B >= 0"),
    ("max_seqlen_q", {}, dict(max_seqlen_q=-1), r"'max_seqlen_q' must be >= 0"),
    ("head_dim", dict(D=32), {}, r"'q' must have head dim"),
    ("window", {}, dict(window=-2), r"'params.window'"),
    # Causal with more q rows than k rows is not an argument error here: the lengths are device values.
    ("valid_until_the_device_check", dict(total_q=40, total_k=12), {}, r"'q' must be in device memory"),
]


@pytest.mark.parametrize("case,tensors,params,message", VARLEN_ERRORS, ids=[c[0] for c in VARLEN_ERRORS])
def test_binding_varlen_validation(case, tensors, params, message):
    with pytest.raises(ValueError, match=message):
        _call_varlen(_varlen_capsules(**tensors), **params)


def test_binding_empty_batch_needs_no_device():
    # Nothing to compute: validated, then nothing launched (no device is asked for).
    _call_plain(_plain_capsules(B=0))
    _call_plain(_plain_capsules(B=3, Sq=0, Sk=0), causal=True)


def test_binding_rejects_non_capsules():
    with pytest.raises(TypeError, match="'q'"):
        tessera._C.attention_prefill(object(), None, None, None, None, 0.0, 0.0, 0, False, 0)
    with pytest.raises(TypeError, match="'q'"):
        tessera._C.attention_prefill_varlen(object(), None, None, None, None, 0, None, None, 0.0, 0.0, 0, False, 0)


# ---- the PyTorch operators: schemas, fake tensors, tracing (meta tensors: no GPU) -------------------------------


@needs_torch
def test_schemas_mark_what_they_write():
    from tessera import _torch_ops

    expected = {
        "attention_prefill": ["q", "k", "v", "out", "lse", "softmax_scale", "softcap", "window", "causal"],
        "attention_prefill_varlen": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "out", "lse",
                                     "softmax_scale", "softcap", "window", "causal"],
    }
    for name, args in expected.items():
        assert name in _torch_ops.OPS
        schema = getattr(torch.ops.tessera, name).default._schema
        assert [a.name for a in schema.arguments] == args, name
        assert len(schema.returns) == 0, name
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == {"out", "lse"}, name
        types = {a.name: str(a.type) for a in schema.arguments}
        assert types["lse"] == "Optional[Tensor]" and types["out"] == "Tensor", name
        assert (types["softmax_scale"], types["softcap"], types["window"], types["causal"]) == (
            "float", "float", "int", "bool"), name
        if "max_seqlen_q" in types:
            assert types["max_seqlen_q"] == "int"


@needs_torch
def test_schemas_have_cuda_kernels_and_direct_entries():
    _needs_kernels()
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{name}", "CUDA"), name
        assert hasattr(tessera._torch_C, name) and hasattr(tessera._torch_C, name + "_eager"), name


def _meta(shape, dtype=None):
    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_meta_tensors_give_shapes(dtype):
    # Meta tensors reach the operators' fake implementation (the eager entries hand them to torch.ops.tessera); the
    # torch layer allocates out like q and lse as fp32 q.shape[:-1].
    _needs_kernels()
    dt = getattr(torch, dtype)
    B, Sq, Sk, HQ, HKV, D = 2, 5, 7, 8, 2, 128
    q, k = _meta((B, Sq, HQ, D), dt), _meta((B, Sk, HKV, D), dt)
    out = tessera.prefill(q, k, k, causal=True)
    assert out.shape == q.shape and out.dtype == dt and out.is_meta
    out, lse = tessera.prefill(q, k, k, window=3, return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, Sq, HQ) and lse.dtype == torch.float32
    given = _meta((B, Sq, HQ, D), dt)
    assert tessera.prefill(q, k, k, out=given) is given

    qp, kp, cu = _meta((12, HQ, D), dt), _meta((30, HKV, D), dt), _meta((4,), torch.int32)
    out, lse = tessera.prefill_varlen(qp, kp, kp, cu, cu, 6, causal=True, return_lse=True)
    assert out.shape == qp.shape and out.dtype == dt and lse.shape == (12, HQ) and lse.dtype == torch.float32
    lse_given = _meta((12, HQ), torch.float32)
    res = tessera.prefill_varlen(qp, kp, kp, cu, cu, 6, lse=lse_given)  # lse written, only out returned
    assert isinstance(res, torch.Tensor) and res.shape == qp.shape
    res, got_lse = tessera.prefill_varlen(qp, kp, kp, cu, cu, 6, lse=lse_given, return_lse=True)
    assert got_lse is lse_given


@needs_torch
def test_meta_argument_errors_name_the_argument():
    # The checks the torch layer (and the eager entries) make before allocating: rank, max_seqlen_q, window.
    _needs_kernels()
    q4, k4, q3, k3 = _meta((2, 5, 8, 128)), _meta((2, 5, 2, 128)), _meta((10, 8, 128)), _meta((10, 2, 128))
    cu = _meta((3,), torch.int32)
    with pytest.raises(ValueError, match=r"'q' must have rank 4 \[B, Sq, HQ, D\]"):
        tessera.prefill(q3, k3, k3)
    with pytest.raises(ValueError, match=r"'q' must have rank 3 \[total_q, HQ, D\]"):
        tessera.prefill_varlen(q4, k4, k4, cu, cu, 5)
    with pytest.raises(ValueError, match="'max_seqlen_q' must be >= 0"):
        tessera.prefill_varlen(q3, k3, k3, cu, cu, -1)
    with pytest.raises(ValueError, match="'window' must be >= 0"):
        tessera.prefill(q4, k4, k4, window=-1)
    with pytest.raises(ValueError, match="'q' must be a CUDA tensor"):  # host tensors: named, never launched
        tessera.prefill(torch.zeros((2, 5, 8, 128), dtype=torch.bfloat16), k4, k4)
    with pytest.raises(ValueError, match="'q' must be a CUDA tensor"):
        tessera.prefill_varlen(torch.zeros((10, 8, 128), dtype=torch.bfloat16), k3, k3, cu, cu, 5)


@needs_torch
def test_dispatch_modes_and_fake_tensors_see_the_operators():
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with recording_mode() as mode:
        tessera.prefill(_meta((1, 4, 4, 64)), _meta((1, 9, 2, 64)), _meta((1, 9, 2, 64)), causal=True)
        cu = _meta((2,), torch.int32)
        tessera.prefill_varlen(_meta((4, 4, 64)), _meta((9, 2, 64)), _meta((9, 2, 64)), cu, cu, 4)
    assert "tessera.attention_prefill.default" in mode.calls, mode.calls
    assert "tessera.attention_prefill_varlen.default" in mode.calls, mode.calls

    with FakeTensorMode():  # fake CUDA tensors: shapes without a GPU
        q = torch.empty((3, 16, 8, 256), dtype=torch.float16, device="cuda")
        k = torch.empty((3, 40, 1, 256), dtype=torch.float16, device="cuda")
        out, lse = tessera.prefill(q, k, k, causal=True, return_lse=True)
        assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (3, 16, 8)
        qp = torch.empty((48, 8, 256), dtype=torch.float16, device="cuda")
        cu = torch.empty((4,), dtype=torch.int32, device="cuda")
        out, lse = tessera.prefill_varlen(qp, k.view(120, 1, 256), k.view(120, 1, 256), cu, cu, 16,
                                          return_lse=True)
        assert out.shape == qp.shape and lse.shape == (48, 8) and lse.dtype == torch.float32


@needs_torch
def test_symbolic_tracing_sees_the_operators():
    # make_fx with dynamic shapes (what AOT autograd and export use): the torch layer allocates with symbolic sizes.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        cuda = dict(device="cuda", dtype=torch.bfloat16)
        args = (torch.empty((2, 16, 8, 128), **cuda), torch.empty((2, 24, 2, 128), **cuda),
                torch.empty((40, 8, 128), **cuda), torch.empty((64, 2, 128), **cuda),
                torch.empty((3,), dtype=torch.int32, device="cuda"))

    def attend(q, k, qp, kp, cu):
        o = tessera.prefill(q, k, k, causal=True)
        op, lse = tessera.prefill_varlen(qp, kp, kp, cu, cu, 32, window=8, return_lse=True)
        return o, op, lse

    graph = make_fx(attend, tracing_mode="symbolic")(*args)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.attention_prefill.default", "tessera.attention_prefill_varlen.default"], traced


@needs_torch
def test_dynamo_traces_both_wrappers_in_one_graph():
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors, so the torch layer's checked path is traced whole without a GPU. The GPU test below compiles and runs.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, qp, kp, vp, cu_q, cu_k):
            o = tessera.prefill(q, k, v, causal=True, softcap=30.0)
            op, lse = tessera.prefill_varlen(qp, kp, vp, cu_q, cu_k, 16, window=4, return_lse=True)
            return o, op, lse

    with FakeTensorMode():
        c = dict(device="cuda", dtype=torch.bfloat16)
        cu = torch.empty((3,), dtype=torch.int32, device="cuda")
        args = (torch.empty((2, 16, 8, 64), **c), torch.empty((2, 20, 2, 64), **c), torch.empty((2, 20, 2, 64), **c),
                torch.empty((32, 8, 64), **c), torch.empty((40, 2, 64), **c), torch.empty((40, 2, 64), **c), cu, cu)
        program = torch.export.export(Attend(), args, strict=True)
    traced = [str(n.target) for n in program.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.attention_prefill.default", "tessera.attention_prefill_varlen.default"], traced
    output = next(n for n in program.graph.nodes if n.op == "output")
    shapes = [tuple(node.meta["val"].shape) for node in output.args[0]]
    assert shapes == [(2, 16, 8, 64), (32, 8, 64), (32, 8)], shapes


@needs_torch
def test_opcheck_on_meta_tensors():
    # torch.library.opcheck: schema (mutations as declared), fake implementation, autograd registration, AOT
    # dispatch with dynamic shapes. Meta tensors exercise everything but the kernel (the GPU test runs it).
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    q, k = _meta((2, 8, 4, 64)), _meta((2, 12, 2, 64))
    torch.library.opcheck(torch.ops.tessera.attention_prefill.default,
                          (q, k, k, _meta(q.shape), _meta((2, 8, 4), torch.float32), 0.0, 0.0, 0, True))
    qp, kp, cu = _meta((16, 4, 64)), _meta((24, 2, 64)), _meta((3,), torch.int32)
    torch.library.opcheck(torch.ops.tessera.attention_prefill_varlen.default,
                          (qp, kp, kp, cu, cu, 8, _meta(qp.shape), None, 0.25, 5.0, 3, False))


# ---- prefill_with_cache (chunked prefill over the decode KV cache): the same checks, without a GPU --------------

CACHE_OP = "attention_prefill_with_cache"


def test_with_cache_export_and_signature():
    assert tessera.prefill_with_cache is tessera.attention.prefill_with_cache
    assert "prefill_with_cache" in tessera.__all__ and "prefill_with_cache" in tessera.attention.__all__
    params = inspect.signature(tessera.prefill_with_cache).parameters
    assert [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == [
        "q", "cu_seqlens_q", "max_seqlen_q", "k_cache", "v_cache", "cache_seqlens"]
    keywords = {"format": "native", "k_scale": None, "v_scale": None, "block_table": None, "k_residual": None,
                "causal": False, "softmax_scale": 0.0, "softcap": 0.0, "window": 0, "out": None, "lse": None,
                "return_lse": False, "stream": None}
    for name, default in keywords.items():
        assert params[name].kind == params[name].KEYWORD_ONLY, name
        assert params[name].default == default, name


def test_with_cache_bad_params():
    # Checked before any tensor is looked at (and before torch is needed).
    o = object()
    with pytest.raises(ValueError, match="'format'"):
        tessera.prefill_with_cache(o, o, 8, o, o, o, format="int2")
    with pytest.raises(ValueError, match="'max_seqlen_q'"):
        tessera.prefill_with_cache(o, o, -1, o, o, o)
    with pytest.raises(TypeError, match="'max_seqlen_q'"):
        tessera.prefill_with_cache(o, o, 2.5, o, o, o)
    with pytest.raises(ValueError, match="'window'"):
        tessera.prefill_with_cache(o, o, 8, o, o, o, window=-1)
    with pytest.raises(TypeError, match="'softcap'"):
        tessera.prefill_with_cache(o, o, 8, o, o, o, softcap="x")


# ---- tessera.dlpack.attention_prefill_with_cache (tessera._C): the C++ validation through host-memory capsules ----

# The operator's schema order, with the DLPack entries' raw stream before k_residual (as attention_decode's).
CACHE_DLPACK_ARGS = ["q", "cu_seqlens_q", "max_seqlen_q", "k_cache", "v_cache", "k_scale", "v_scale", "block_table",
                     "cache_seqlens", "out", "lse", "format", "softmax_scale", "softcap", "window", "causal", "stream",
                     "k_residual"]


def test_with_cache_dlpack_export():
    import tessera.dlpack as td

    assert td.attention_prefill_with_cache is tessera._C.attention_prefill_with_cache
    assert CACHE_OP in td.__all__
    # Every argument by name: the names are accepted (a TypeError otherwise), and the format is parsed first.
    kwargs = dict.fromkeys(CACHE_DLPACK_ARGS)
    kwargs.update(max_seqlen_q=0, format="int2", softmax_scale=0.0, softcap=0.0, window=0, causal=False, stream=0)
    with pytest.raises(ValueError, match=r"tessera\.attention_prefill_with_cache: 'format'"):
        td.attention_prefill_with_cache(**kwargs)
    del kwargs["k_residual"]  # optional, None by default
    with pytest.raises(ValueError, match="'format'"):
        td.attention_prefill_with_cache(**kwargs)


def _cache_capsules(total_q=10, entries=3, q_shape=None, cu_q=(DL_INT, 32), seqlens=(DL_INT, 32),
                    seqlen_entries=None, T=64, kv=(DL_BFLOAT, 16)):
    """Host-memory capsules of a contiguous cache call: q, cu_seqlens_q, k_cache, v_cache, cache_seqlens, out, lse
    (HostCapsule objects: keep them alive during the call)."""
    B = max(entries - 1, 0)  # (a cu_seqlens_q of no entries still meets a cache of no sequences)
    return [HostCapsule(q_shape or (total_q, HQ_, D_), DL_BFLOAT, 16), HostCapsule((entries,), *cu_q),
            HostCapsule((B, T, HKV_, D_), *kv), HostCapsule((B, T, HKV_, D_), *kv),
            HostCapsule((B if seqlen_entries is None else seqlen_entries,), *seqlens),
            HostCapsule((total_q, HQ_, D_), DL_BFLOAT, 16), HostCapsule((total_q, HQ_), DL_FLOAT, 32)]


def _call_cache(tensors, max_seqlen_q=4, format="native", k_scale=None, v_scale=None, softmax_scale=0.0,
                softcap=0.0, window=0, causal=True):
    import tessera.dlpack as td

    q, cu_q, k, v, seqlens, o, lse = [t.capsule for t in tensors]
    scales = [s.capsule if s is not None else None for s in (k_scale, v_scale)]
    td.attention_prefill_with_cache(q, cu_q, max_seqlen_q, k, v, *scales, None, seqlens, o, lse, format,
                                    softmax_scale, softcap, window, causal, 0)


CACHE_ERRORS = [
    ("format", {}, dict(format="int2"), r"tessera\.attention_prefill_with_cache: 'format' must be 'native'"),
    ("q_rank", dict(q_shape=(1, 10, HQ_, D_)), {},
     r"prefill_with_cache: 'q' must have rank 3 \(\[total_q, HQ, D\]\), got rank 4"),
    ("head_dim", dict(q_shape=(10, HQ_, 96)), {}, r"'q' must have head dim D \(dim 2\) of 64, 128 or 256, got 96"),
    ("max_seqlen_q", {}, dict(max_seqlen_q=-1), r"'max_seqlen_q' must be >= 0, got -1"),
    ("cu_dtype", dict(cu_q=(DL_INT, 64)), {}, r"'cu_seqlens_q' must have dtype int32"),
    ("cu_empty", dict(entries=0), {}, r"'cu_seqlens_q' must be int32 \[B \+ 1\] with B >= 0"),
    ("seqlens_dtype", dict(seqlens=(DL_FLOAT, 32)), {}, r"'cache_seqlens' must have dtype int32"),
    ("seqlens_entries", dict(seqlen_entries=3), {}, r"'cache_seqlens' must have shape \[B\] = \[2\]"),
    ("native_cache_dtype", dict(kv=(DL_UINT, 8)), {}, r"'cache.k' must have dtype bf16 \| fp16, got uint8"),
    ("fp8_scales", dict(kv=(DL_UINT, 8)), dict(format="fp8"), r"'cache.k_scale' is required for fp8 caches"),
    ("window", {}, dict(window=-2), r"'params.window' must be >= 0"),
    ("softcap", {}, dict(softcap=-1.0), r"'params.softcap' must be finite and >= 0"),
    ("valid_until_the_device_check", {}, dict(causal=True, window=3, softcap=30.0), r"must be in device memory"),
]


@pytest.mark.parametrize("case,tensors,params,message", CACHE_ERRORS, ids=[c[0] for c in CACHE_ERRORS])
def test_with_cache_binding_validation(case, tensors, params, message):
    with pytest.raises(ValueError, match=message):
        _call_cache(_cache_capsules(**tensors), **params)


def test_with_cache_binding_reads_uint8_as_fp8():
    # With format 'fp8' the binding labels uint8 cache data e4m3 (as attention_decode's does): valid until the
    # device check. With 'native' the same data is a dtype error (above).
    scale = HostCapsule((HKV_,), DL_FLOAT, 32)
    with pytest.raises(ValueError, match="'cache.k' must be in device memory"):
        _call_cache(_cache_capsules(kv=(DL_UINT, 8)), format="fp8", k_scale=scale, v_scale=scale)


def test_with_cache_binding_rejects_non_capsules():
    import tessera.dlpack as td

    with pytest.raises(TypeError, match="'q'"):
        td.attention_prefill_with_cache(object(), None, 0, None, None, None, None, None, None, None, None, "native",
                                        0.0, 0.0, 0, False, 0)
    q, cu_q = HostCapsule((10, HQ_, D_), DL_BFLOAT, 16), HostCapsule((3,), DL_INT, 32)
    with pytest.raises(TypeError, match="'k_cache'"):
        td.attention_prefill_with_cache(q.capsule, cu_q.capsule, 0, object(), None, None, None, None, None, None,
                                        None, "native", 0.0, 0.0, 0, False, 0)


@needs_torch
def test_with_cache_schema_marks_what_it_writes():
    from tessera import _torch_ops

    assert CACHE_OP in _torch_ops.OPS
    schema = getattr(torch.ops.tessera, CACHE_OP).default._schema
    assert [a.name for a in schema.arguments] == [
        "q", "cu_seqlens_q", "max_seqlen_q", "k_cache", "v_cache", "k_scale", "v_scale", "block_table",
        "cache_seqlens", "out", "lse", "format", "softmax_scale", "softcap", "window", "causal", "k_residual"]
    assert len(schema.returns) == 0
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "lse"}
    types = {a.name: str(a.type) for a in schema.arguments}
    assert (types["out"], types["lse"], types["k_scale"], types["block_table"], types["k_residual"]) == (
        "Tensor", "Optional[Tensor]", "Optional[Tensor]", "Optional[Tensor]", "Optional[Tensor]")
    assert (types["max_seqlen_q"], types["format"], types["softmax_scale"], types["softcap"], types["window"],
            types["causal"]) == ("int", "str", "float", "float", "int", "bool")
    k_residual = schema.arguments[-1]
    assert k_residual.has_default_value() and k_residual.default_value is None


@needs_torch
def test_with_cache_kernel_and_direct_entries():
    _needs_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tessera::{CACHE_OP}", "CUDA")
    assert hasattr(tessera._torch_C, CACHE_OP) and hasattr(tessera._torch_C, CACHE_OP + "_eager")


def _meta_cache(fmt="native", B=3, T=64, HKV=2, D=128, page_size=0, dtype=None):
    """Meta cache tensors as keyword arguments of prefill_with_cache (contiguous, or paged with B * 2 pages)."""
    lead = (B * 2, page_size) if page_size else (B, T)
    if fmt == "native":
        kc = _meta(lead + (HKV, D), dtype)
        kw = dict(format=fmt)
    else:  # 'int8': uint8 codes, fp16 (scale, offset) per row and head
        kc = _meta(lead + (HKV, D), torch.uint8)
        kw = dict(format=fmt, k_scale=_meta(lead + (HKV, 2), torch.float16),
                  v_scale=_meta(lead + (HKV, 2), torch.float16))
    if page_size:
        kw["block_table"] = _meta((B, 2), torch.int32)
    return kc, kc, kw


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_with_cache_meta_tensors_give_shapes(dtype):
    _needs_kernels()
    dt = getattr(torch, dtype)
    HQ, D = 8, 128
    q, cu, lengths = _meta((12, HQ, D), dt), _meta((4,), torch.int32), _meta((3,), torch.int32)
    kc, vc, kw = _meta_cache(dtype=dt)
    out = tessera.prefill_with_cache(q, cu, 6, kc, vc, lengths, causal=True, **kw)
    assert out.shape == q.shape and out.dtype == dt and out.is_meta
    kc, vc, kw = _meta_cache("int8", page_size=32)
    out, lse = tessera.prefill_with_cache(q, cu, 6, kc, vc, lengths, window=3, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == dt and lse.shape == (12, HQ) and lse.dtype == torch.float32
    given, lse_given = _meta(q.shape, dt), _meta((12, HQ), torch.float32)
    res = tessera.prefill_with_cache(q, cu, 6, kc, vc, lengths, out=given, lse=lse_given, **kw)
    assert res is given
    res, got_lse = tessera.prefill_with_cache(q, cu, 6, kc, vc, lengths, lse=lse_given, return_lse=True, **kw)
    assert got_lse is lse_given and res.shape == q.shape


@needs_torch
def test_with_cache_meta_argument_errors_name_the_argument():
    _needs_kernels()
    q3, q4, cu, lengths = _meta((10, 8, 128)), _meta((2, 5, 8, 128)), _meta((3,), torch.int32), _meta((2,),
                                                                                                     torch.int32)
    kc, vc, kw = _meta_cache(B=2)
    with pytest.raises(ValueError, match=r"prefill_with_cache: 'q' must have rank 3 \[total_q, HQ, D\]"):
        tessera.prefill_with_cache(q4, cu, 5, kc, vc, lengths, **kw)
    with pytest.raises(ValueError, match="'max_seqlen_q' must be >= 0"):
        tessera.prefill_with_cache(q3, cu, -1, kc, vc, lengths, **kw)
    with pytest.raises(ValueError, match="'window' must be >= 0"):
        tessera.prefill_with_cache(q3, cu, 5, kc, vc, lengths, window=-1, **kw)
    with pytest.raises(ValueError, match="'format'"):
        tessera.prefill_with_cache(q3, cu, 5, kc, vc, lengths, format="int3")
    with pytest.raises(ValueError, match="'q' must be a CUDA tensor"):  # host tensors: named, never launched
        tessera.prefill_with_cache(torch.zeros((10, 8, 128), dtype=torch.bfloat16), cu, 5, kc, vc, lengths, **kw)


@needs_torch
def test_with_cache_dispatch_modes_and_fake_tensors():
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with recording_mode() as mode:
        kc, vc, kw = _meta_cache("int8", B=1, D=64, page_size=64)
        tessera.prefill_with_cache(_meta((4, 4, 64)), _meta((2,), torch.int32), 4, kc, vc, _meta((1,), torch.int32),
                                   **kw)
    assert f"tessera.{CACHE_OP}.default" in mode.calls, mode.calls

    with FakeTensorMode():  # fake CUDA tensors: shapes without a GPU
        c = dict(device="cuda", dtype=torch.float16)
        q = torch.empty((48, 8, 256), **c)
        kc = torch.empty((6, 64, 1, 256), **c)
        cu = torch.empty((4,), dtype=torch.int32, device="cuda")
        bt = torch.empty((3, 2), dtype=torch.int32, device="cuda")
        lengths = torch.empty((3,), dtype=torch.int32, device="cuda")
        out, lse = tessera.prefill_with_cache(q, cu, 16, kc, kc, lengths, block_table=bt, causal=True,
                                              return_lse=True)
        assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (48, 8)
        assert lse.dtype == torch.float32


@needs_torch
def test_with_cache_traced_by_dynamo_and_make_fx():
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def attend(q, cu, kc, vc, ks, vs, bt, lengths):
        return tessera.prefill_with_cache(q, cu, 16, kc, vc, lengths, format="int8", k_scale=ks, v_scale=vs,
                                          block_table=bt, causal=True, softcap=30.0, return_lse=True)

    class Attend(torch.nn.Module):
        def forward(self, *args):
            return attend(*args)

    def inputs():
        i32 = dict(dtype=torch.int32, device="cuda")
        return (torch.empty((32, 8, 128), dtype=torch.bfloat16, device="cuda"), torch.empty((3,), **i32),
                torch.empty((6, 64, 2, 128), dtype=torch.uint8, device="cuda"),
                torch.empty((6, 64, 2, 128), dtype=torch.uint8, device="cuda"),
                torch.empty((6, 64, 2, 2), dtype=torch.float16, device="cuda"),
                torch.empty((6, 64, 2, 2), dtype=torch.float16, device="cuda"), torch.empty((2, 3), **i32),
                torch.empty((2,), **i32))

    with FakeTensorMode():
        program = torch.export.export(Attend(), inputs(), strict=True)
    traced = [str(n.target) for n in program.graph.nodes if "tessera" in str(n.target)]
    assert traced == [f"tessera.{CACHE_OP}.default"], traced
    output = next(n for n in program.graph.nodes if n.op == "output")
    assert [tuple(node.meta["val"].shape) for node in output.args[0]] == [(32, 8, 128), (32, 8)]

    with FakeTensorMode(shape_env=ShapeEnv()):
        args = inputs()
    graph = make_fx(attend, tracing_mode="symbolic")(*args)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == [f"tessera.{CACHE_OP}.default"], traced


@needs_torch
def test_with_cache_opcheck_on_meta_tensors():
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    q, cu, lengths = _meta((16, 4, 64)), _meta((3,), torch.int32), _meta((2,), torch.int32)
    kc = _meta((2, 32, 2, 64))
    torch.library.opcheck(getattr(torch.ops.tessera, CACHE_OP).default,
                          (q, cu, 8, kc, kc, None, None, None, lengths, _meta(q.shape),
                           _meta((16, 4), torch.float32), "native", 0.0, 0.0, 0, True))
    kq, sc, bt = _meta((5, 32, 2, 64), torch.uint8), _meta((5, 32, 2, 2), torch.float16), _meta((2, 2), torch.int32)
    torch.library.opcheck(getattr(torch.ops.tessera, CACHE_OP).default,
                          (q, cu, 8, kq, kq, sc, sc, bt, lengths, _meta(q.shape), None, "int8", 0.25, 5.0, 3, False,
                           None))


# ================================================================================================================
# Reference and checks (GPU tests)
# ================================================================================================================


def _cumsum(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def reference(q, k, v, cu_q, cu_k, *, causal=False, softmax_scale=0.0, softcap=0.0, window=0):
    """float64 prefill of a packed batch: (o [total_q, HQ, D], lse [total_q, HQ]); rows past cu_q[-1], and rows
    without keys, hold o = 0 and lse = -inf. cu_q, cu_k: Python lists of B + 1 offsets."""
    total_q, HQ, D = q.shape
    G = HQ // k.shape[1]
    scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(D)
    o = torch.zeros((total_q, HQ, D), dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, HQ), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        Sq, Sk = q1 - q0, k1 - k0
        if Sq == 0 or Sk == 0:
            continue
        qs = q[q0:q1].double()  # [Sq, HQ, D]
        ks = k[k0:k1].double().repeat_interleave(G, dim=1)  # [Sk, HQ, D]: query head h reads KV head h // G
        vs = v[k0:k1].double().repeat_interleave(G, dim=1)
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # [HQ, Sq, Sk]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        p = (Sk - Sq + torch.arange(Sq, device=q.device))[:, None]  # each query's position, bottom-right aligned
        j = torch.arange(Sk, device=q.device)[None, :]
        keep = torch.ones((Sq, Sk), dtype=torch.bool, device=q.device)
        if causal:
            keep &= j <= p
        if window > 0:
            keep &= p - j < window
        s = s.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # [HQ, Sq]; -inf for a row without keys
        prob = torch.where(keep, torch.exp(s - row_lse[..., None]), 0.0)  # a row without keys: all 0 (no NaN)
        o[q0:q1] = torch.einsum("hij,jhd->ihd", prob, vs)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return o, lse


def check(out, lse, ref, ref_lse, cu_q, what=""):
    """out [rows, HQ, D] / lse [rows, HQ] (or None) against the reference, sequence by sequence (cu_q: list)."""
    _sync()
    assert out.shape == ref.shape, f"{what}out shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    for b in range(len(cu_q) - 1):
        r0, r1 = cu_q[b], cu_q[b + 1]
        if r0 == r1:
            continue
        where = f"{what}sequence {b} (rows {r0}..{r1})"
        got, want = out[r0:r1].double(), ref[r0:r1]
        assert bool(torch.isfinite(got).all()), f"{where}: non-finite or unwritten output"
        empty = torch.isneginf(ref_lse[r0:r1])  # [Sq, HQ]: (token, head) rows without keys
        assert bool((got[empty] == 0).all()), f"{where}: rows without keys must be 0"
        if lse is not None:
            got_lse = lse[r0:r1].double()
            assert bool(torch.isneginf(got_lse[empty]).all()), f"{where}: rows without keys must have lse -inf"
        rows = ~empty
        if not bool(rows.any()):
            continue
        g, w = got[rows], want[rows]  # [n, D]
        rel = ((g - w).norm() / w.norm().clamp(min=1e-30)).item()
        assert rel <= TOL, f"{where}: relative Frobenius error {rel:.3g}"
        row_rel = ((g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)).max().item()
        assert row_rel <= ROW_TOL, f"{where}: a row's relative error {row_rel:.3g}"
        if lse is not None:
            err = (got_lse[rows] - ref_lse[r0:r1][rows]).abs()
            bound = 1e-2 + 1e-3 * ref_lse[r0:r1][rows].abs()
            assert bool((err <= bound).all()), f"{where}: lse error {err.max().item():.3g}"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(g, shape, dtype, sigma=1.0):
    return (torch.randn(shape, device=DEVICE, generator=g) * sigma).to(dtype)


def poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device=DEVICE)


def packed_inputs(g, sq, sk, HQ, HKV, D, dtype, spare_q=0, spare_k=0):
    """q [sum(sq) + spare_q, HQ, D], k, v [sum(sk) + spare_k, HKV, D] and the cu_seqlens (device tensors and
    lists); keys 1.5x wider than queries, as the C++ test draws them."""
    cu_q, cu_k = _cumsum(sq), _cumsum(sk)
    q = randn(g, (cu_q[-1] + spare_q, HQ, D), dtype)
    k = randn(g, (cu_k[-1] + spare_k, HKV, D), dtype, 1.5)
    v = randn(g, (cu_k[-1] + spare_k, HKV, D), dtype)
    return q, k, v, cu_q, cu_k


def device_offsets(cu):
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def run_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=None, **params):
    """prefill_varlen into poisoned out / lse, checked against the reference; returns (out, lse)."""
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:-1], torch.float32)
    bound = max_seqlen_q if max_seqlen_q is not None else max([b - a for a, b in zip(cu_q, cu_q[1:])] + [0])
    res = tessera.prefill_varlen(q, k, v, device_offsets(cu_q), device_offsets(cu_k), bound, out=out, lse=lse,
                                 **params)
    assert res is out
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, **params)
    check(out, lse, ref, ref_lse, cu_q, f"{params} ")
    tail = cu_q[-1]  # rows past cu_seqlens_q[B] are not written
    assert bool(torch.isnan(out[tail:]).all() and torch.isnan(lse[tail:]).all()), "rows past cu_seqlens_q[B] written"
    return out, lse


def run_plain(q, k, v, **params):
    """prefill on a plain batch into poisoned out / lse, checked against the reference of its packed form."""
    B, Sq, HQ, D = q.shape
    Sk, HKV = k.shape[1], k.shape[2]
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:-1], torch.float32)
    assert tessera.prefill(q, k, v, out=out, lse=lse, **params) is out
    cu_q, cu_k = _cumsum([Sq] * B), _cumsum([Sk] * B)
    ref, ref_lse = reference(q.reshape(B * Sq, HQ, D), k.reshape(B * Sk, HKV, D), v.reshape(B * Sk, HKV, D), cu_q,
                             cu_k, **params)
    check(out.reshape(B * Sq, HQ, D), lse.reshape(B * Sq, HQ), ref, ref_lse, cu_q, f"{params} ")
    return out, lse


# ================================================================================================================
# GPU: correctness
# ================================================================================================================

DTYPES = ("bfloat16", "float16")
GROUPS = [(8, 2), (5, 1)]  # (HQ, HKV): GQA 4, and 5 query heads on one KV head
# (Sq, Sk) per sequence: lengths 0 and 1, an empty sequence, Sq < Sk and Sq = Sk across tile edges, a sequence
# without keys.
VARLEN_SQ = [1, 0, 17, 130, 0, 65, 3, 1]
VARLEN_SK = [1, 9, 40, 130, 0, 200, 0, 300]


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("HQ,HKV", GROUPS, ids=lambda x: str(x))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_varlen(dtype, D, HQ, HKV, causal, seed):
    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, VARLEN_SQ, VARLEN_SK, HQ, HKV, D, getattr(torch, dtype))
    run_varlen(q, k, v, cu_q, cu_k, causal=causal)


# (B, Sq, Sk) of the plain batch: lengths 1 and 0, an empty batch, Sq = Sk and Sq < Sk; Sq > Sk without the causal
# mask (validated: causal needs Sq <= Sk). Sk = 0 has its own test below.
PLAIN_SHAPES = {True: [(3, 1, 1), (2, 77, 77), (2, 50, 300), (1, 0, 16), (0, 4, 4)],
                False: [(3, 1, 1), (2, 77, 77), (2, 130, 20), (1, 0, 16), (0, 4, 4)]}


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("HQ,HKV", GROUPS, ids=lambda x: str(x))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_plain(dtype, D, HQ, HKV, causal, seed):
    g = _generator(seed)
    dt = getattr(torch, dtype)
    for B, Sq, Sk in PLAIN_SHAPES[causal]:
        q = randn(g, (B, Sq, HQ, D), dt)
        k, v = randn(g, (B, Sk, HKV, D), dt, 1.5), randn(g, (B, Sk, HKV, D), dt)
        run_plain(q, k, v, causal=causal)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_batch_without_keys(dtype, seed):
    # Sk = 0 (k and v empty, not causal): every query has no key, so o = 0 and lse = -inf.
    g = _generator(seed)
    dt = getattr(torch, dtype)
    run_plain(randn(g, (2, 4, 8, 128), dt), randn(g, (2, 0, 2, 128), dt), randn(g, (2, 0, 2, 128), dt))
    run_plain(randn(g, (1, 3, 4, 64), dt), randn(g, (1, 0, 4, 64), dt), randn(g, (1, 0, 4, 64), dt), window=2)


PARAMS = [
    dict(window=1),
    dict(window=1, causal=True),
    dict(window=37, causal=True),
    dict(window=100),
    dict(softcap=5.0),
    dict(softcap=30.0, causal=True, window=64),
    dict(softmax_scale=0.3),
    dict(softmax_scale=0.05, softcap=2.0, window=17, causal=True),
]


@gpu
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_softcap_scale(dtype, params, seed):
    g = _generator(seed)
    dt = getattr(torch, dtype)
    run_varlen(*packed_inputs(g, [300, 1, 0, 129], [1000, 1, 5, 700], 16, 2, 128, dt), **params)
    run_plain(randn(g, (2, 64, 8, 64), dt), randn(g, (2, 200, 2, 64), dt, 1.5), randn(g, (2, 200, 2, 64), dt),
              **params)


@gpu
def test_causal_rows_before_the_first_key(seed):
    # Varlen lengths are not validated: a causal sequence with Sq > Sk has Sq - Sk queries at p < 0, which see no
    # key (o = 0, lse = -inf); the others attend as usual.
    g = _generator(seed)
    run_varlen(*packed_inputs(g, [6, 40, 3], [3, 10, 3], 8, 2, 128, torch.bfloat16), causal=True)
    run_varlen(*packed_inputs(g, [6, 40], [3, 10], 8, 2, 64, torch.float16), causal=True, window=4)


@gpu
def test_rows_past_the_lengths_are_not_written(seed):
    # q, k, v and out sized for a larger batch than cu_seqlens describes (a CUDA graph's buffers): the rows past
    # cu_seqlens_q[B] keep their contents; max_seqlen_q may be any bound at or above the longest sequence.
    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, [50, 0, 7], [80, 4, 7], 8, 2, 128, torch.bfloat16, spare_q=90,
                                        spare_k=33)
    run_varlen(q, k, v, cu_q, cu_k, causal=True)
    run_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=q.shape[0], causal=True)
    run_varlen(q, k, v, [0, 0], [0, 0])  # one empty sequence: nothing is written


@gpu
def test_outputs_allocated_given_and_strided(seed):
    g = _generator(seed)
    dt = torch.bfloat16
    sq, sk = [33, 1, 90], [33, 64, 200]
    q, k, v, cu_q, cu_k = packed_inputs(g, sq, sk, 8, 2, 128, dt)
    cq, ck = device_offsets(cu_q), device_offsets(cu_k)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal=True)

    # Allocated: out like q, lse fp32 [total_q, HQ] with return_lse; deterministic.
    out, lse = tessera.prefill_varlen(q, k, v, cq, ck, 90, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == dt and out.device == q.device
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    check(out, lse, ref, ref_lse, cu_q, "allocated: ")
    again = tessera.prefill_varlen(q, k, v, cq, ck, 90, causal=True)
    _sync()
    assert torch.equal(again.view(torch.int16), out.view(torch.int16)), "two calls differ"

    # out given: returned as is; lse given without return_lse: written, only out returned; return_lse with only
    # out given: lse allocated.
    given = poisoned(q.shape, dt)
    given_lse = poisoned(q.shape[:-1], torch.float32)
    assert tessera.prefill_varlen(q, k, v, cq, ck, 90, causal=True, out=given, lse=given_lse) is given
    check(given, given_lse, ref, ref_lse, cu_q, "given: ")
    given.fill_(math.nan)
    res, new_lse = tessera.prefill_varlen(q, k, v, cq, ck, 90, causal=True, out=given, return_lse=True)
    assert res is given and new_lse.shape == q.shape[:-1]
    check(given, new_lse, ref, ref_lse, cu_q, "return_lse with out: ")

    # Strided: q, k, v as head ranges of one fused qkv buffer (sq == sk per sequence), out with padded rows, lse
    # transposed.
    sq = sk = [40, 0, 129]
    cu = _cumsum(sq)
    HQ, HKV, D = 8, 2, 64
    qkv = randn(g, (cu[-1], HQ + 2 * HKV, D), dt)
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    out = poisoned((cu[-1], HQ, D + 8), dt)[..., :D]
    lse = poisoned((HQ, cu[-1]), torch.float32).t()
    tessera.prefill_varlen(q, k, v, device_offsets(cu), device_offsets(cu), 129, causal=True, out=out, lse=lse)
    check(out, lse, *reference(q, k, v, cu, cu, causal=True), cu, "strided: ")

    # The plain batch from a fused [B, S, 3, H, D] buffer (MHA).
    qkv = randn(g, (2, 70, 3, 4, 128), torch.float16)
    run_plain(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


@gpu
def test_explicit_stream(seed):
    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, [20, 100], [20, 150], 8, 2, 128, torch.bfloat16)
    cq, ck = device_offsets(cu_q), device_offsets(cu_k)
    out = poisoned(q.shape, q.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are queued on the current stream
    tessera.prefill_varlen(q, k, v, cq, ck, 100, causal=True, out=out, stream=side)
    qb = randn(g, (2, 30, 8, 128), torch.bfloat16)
    kb, vb = randn(g, (2, 30, 2, 128), torch.bfloat16), randn(g, (2, 30, 2, 128), torch.bfloat16)
    side.wait_stream(torch.cuda.current_stream())
    ob = tessera.prefill(qb, kb, vb, stream=side.cuda_stream)  # a raw cudaStream_t; out allocated on that stream
    side.synchronize()
    check(out, None, *reference(q, k, v, cu_q, cu_k, causal=True), cu_q)
    torch.cuda.current_stream().wait_stream(side)
    check(ob.reshape(60, 8, 128), None, *reference(qb.reshape(60, 8, 128), kb.reshape(60, 2, 128),
                                                    vb.reshape(60, 2, 128), [0, 30, 60], [0, 30, 60]), [0, 30, 60])


@gpu
def test_dlpack_entry_points_match_the_torch_path(seed):
    # tessera.dlpack (tessera._C): any __dlpack__ producer, preallocated outputs, the stream as a raw int.
    import tessera.dlpack as td

    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, [64, 0, 17], [64, 3, 100], 8, 2, 128, torch.float16)
    cq, ck = device_offsets(cu_q), device_offsets(cu_k)
    want, want_lse = tessera.prefill_varlen(q, k, v, cq, ck, 64, causal=True, window=20, return_lse=True)
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:-1], torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    _sync()
    td.attention_prefill_varlen(q, k, v, cq, ck, 64, out, lse, 0.0, 0.0, 20, True, stream)
    qb, kb = randn(g, (2, 16, 8, 64), torch.bfloat16), randn(g, (2, 48, 2, 64), torch.bfloat16)
    want_b = tessera.prefill(qb, kb, kb, causal=True, softcap=10.0)
    out_b = poisoned(qb.shape, qb.dtype)
    _sync()
    td.attention_prefill(qb, kb, kb, out_b, None, 0.0, 10.0, 0, True, stream)
    _sync()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)) and torch.equal(lse, want_lse)
    assert torch.equal(out_b.view(torch.int16), want_b.view(torch.int16))


@gpu
def test_errors_are_value_errors_and_write_nothing():
    dt = torch.bfloat16
    out = poisoned((20, 8, 128), dt)
    q, k = torch.randn((20, 8, 128), device="cuda").to(dt), torch.randn((30, 2, 128), device="cuda").to(dt)
    cu = device_offsets([0, 20])
    cu_k = device_offsets([0, 30])
    with pytest.raises(ValueError, match=r"prefill_varlen: 'q' must have head dim"):
        tessera.prefill_varlen(q[..., :96], k[..., :96], k[..., :96], cu, cu_k, 20, out=out[..., :96])
    with pytest.raises(ValueError, match="'cu_seqlens_q' must have dtype int32"):
        tessera.prefill_varlen(q, k, k.clone(), cu.long(), cu_k, 20, out=out)
    with pytest.raises(ValueError, match="'lse' must have dtype fp32"):
        tessera.prefill_varlen(q, k, k.clone(), cu, cu_k, 20, out=out, lse=torch.empty((20, 8), dtype=dt,
                                                                                        device="cuda"))
    with pytest.raises(ValueError, match="'v' must have the dtype of 'q'"):
        tessera.prefill_varlen(q, k, k.half(), cu, cu_k, 20, out=out)
    with pytest.raises(ValueError, match="'o' must not overlap 'q'"):  # out in q's memory
        tessera.prefill_varlen(q, k, k.clone(), cu, cu_k, 20, out=q)
    with pytest.raises(ValueError, match="'params.softcap'"):
        tessera.prefill_varlen(q, k, k.clone(), cu, cu_k, 20, out=out, softcap=-1.0)
    with pytest.raises(ValueError, match="'q' must be a CUDA tensor"):
        tessera.prefill_varlen(q.cpu(), k, k.clone(), cu, cu_k, 20, out=out)
    with pytest.raises(ValueError, match="'q' must have Sq <= Sk when causal"):
        tessera.prefill(q.view(1, 20, 8, 128), k[:10].view(1, 10, 2, 128), k[10:20].view(1, 10, 2, 128),
                        out=out.view(1, 20, 8, 128), causal=True)
    _sync()
    assert bool(torch.isnan(out).all()), "a rejected call wrote out"


@gpu
def test_opcheck_on_the_gpu(seed):
    # opcheck with real tensors also runs the kernel and checks that it writes only what the schema declares.
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, [16, 0, 40], [32, 5, 40], 8, 2, 64, torch.bfloat16)
    torch.library.opcheck(torch.ops.tessera.attention_prefill_varlen.default,
                          (q, k, v, device_offsets(cu_q), device_offsets(cu_k), 40, poisoned(q.shape, q.dtype),
                           poisoned(q.shape[:-1], torch.float32), 0.0, 0.0, 0, True))
    qb, kb = randn(g, (2, 24, 8, 128), torch.float16), randn(g, (2, 40, 2, 128), torch.float16)
    torch.library.opcheck(torch.ops.tessera.attention_prefill.default,
                          (qb, kb, kb.clone(), poisoned(qb.shape, qb.dtype), None, 0.0, 20.0, 9, False))


# ================================================================================================================
# GPU: torch.compile and CUDA graphs
# ================================================================================================================


@gpu
def test_compile_fullgraph_matches_eager(seed):
    g = _generator(seed)
    q, k, v, cu_q, cu_k = packed_inputs(g, [77, 0, 1, 200], [100, 3, 1, 200], 8, 2, 128, torch.bfloat16)
    qb, kb, vb = (randn(g, (2, 64, 5, 64), torch.float16), randn(g, (2, 80, 1, 64), torch.float16),
                  randn(g, (2, 80, 1, 64), torch.float16))
    cq, ck = device_offsets(cu_q), device_offsets(cu_k)

    def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, qb, kb, vb):
        o, lse = tessera.prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 200, causal=True, window=50,
                                        return_lse=True)
        ob = tessera.prefill(qb, kb, vb, causal=True, softcap=20.0)
        return o, lse, ob

    o, lse, ob = attend(q, k, v, cq, ck, qb, kb, vb)
    got, got_lse, got_b = torch.compile(attend, fullgraph=True)(q, k, v, cq, ck, qb, kb, vb)
    _sync()
    assert torch.equal(got.view(torch.int16), o.view(torch.int16)) and torch.equal(got_lse, lse), \
        "compiled prefill_varlen differs from eager"
    assert torch.equal(got_b.view(torch.int16), ob.view(torch.int16)), "compiled prefill differs from eager"
    check(o, lse, *reference(q, k, v, cu_q, cu_k, causal=True, window=50), cu_q)
    check(ob.reshape(128, 5, 64), None, *reference(qb.reshape(128, 5, 64), kb.reshape(160, 1, 64),
                                                    vb.reshape(160, 1, 64), [0, 64, 128], [0, 80, 160], causal=True,
                                                    softcap=20.0), [0, 64, 128])


@gpu
def test_cuda_graph_replays_new_lengths(seed):
    # One capture of prefill_varlen over buffers sized for the largest batch (400 query rows, 600 key rows,
    # max_seqlen_q 400), with preallocated out and lse (the op allocates nothing: no workspace), replayed with new
    # cu_seqlens values and new q / k / v written in place. Each replay matches the reference of its lengths, and
    # the rows past cu_seqlens_q[B] keep their poison.
    HQ, HKV, D, B = 8, 2, 128, 4
    rows_q, rows_k, bound = 400, 600, 400
    g = _generator(seed)
    dt = torch.bfloat16
    q, k, v = randn(g, (rows_q, HQ, D), dt), randn(g, (rows_k, HKV, D), dt, 1.5), randn(g, (rows_k, HKV, D), dt)
    cu_q, cu_k = device_offsets(_cumsum([100] * B)), device_offsets(_cumsum([150] * B))
    out, lse = poisoned(q.shape, dt), poisoned(q.shape[:-1], torch.float32)

    def step():
        tessera.prefill_varlen(q, k, v, cu_q, cu_k, bound, causal=True, out=out, lse=lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        step()  # warm-up outside the capture
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "prefill allocated memory"
    torch.cuda.current_stream().wait_stream(side)
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    lengths = [([100] * 4, [150] * 4),  # the captured lengths
               ([0, 1, 250, 30], [5, 1, 400, 30]),  # ends below the buffers' rows; an empty sequence
               ([64, 0, 0, 1], [64, 0, 7, 300]),
               ([0, 0, 0, 0], [0, 0, 0, 0])]  # nothing to compute: nothing written
    # And random cut points: sq <= sk per sequence (causal), totals within the buffers (left_k >= left_q throughout,
    # so every later sequence can still have sk >= sq).
    left_q, left_k, sq, sk = rows_q, rows_k, [], []
    for _ in range(B):
        n = int(torch.randint(0, left_q + 1, (1,), device=DEVICE, generator=g))
        m = n + int(torch.randint(0, left_k - left_q + 1, (1,), device=DEVICE, generator=g))
        sq.append(n)
        sk.append(m)
        left_q, left_k = left_q - n, left_k - m
    assert sum(sq) <= rows_q and sum(sk) <= rows_k and all(n <= m for n, m in zip(sq, sk))
    lengths.append((sq, sk))
    for round_, (sq, sk) in enumerate(lengths):
        cq, ck = _cumsum(sq), _cumsum(sk)
        cu_q.copy_(device_offsets(cq))
        cu_k.copy_(device_offsets(ck))
        q.copy_(randn(g, q.shape, dt))
        k.copy_(randn(g, k.shape, dt, 1.5))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        _sync()
        check(out, lse, *reference(q, k, v, cq, ck, causal=True), cq, f"replay {round_} {sq} {sk}: ")
        assert bool(torch.isnan(out[cq[-1]:]).all() and torch.isnan(lse[cq[-1]:]).all()), \
            f"replay {round_}: rows past cu_seqlens_q[B] written"


# ================================================================================================================
# GPU: prefill_with_cache (chunked prefill over the decode KV cache)
# ================================================================================================================
# Sequence b's rows src[b, :L] sit in the cache (written directly, or by append_kv for a quantized format); its Sq
# queries are positions L - Sq .. L - 1. The reference is prefill's over the packed rows src[b, :L] (Sk = L, bottom-
# right aligned), which is exactly that placement. Unwritten cache memory is NaN: slots past L must not reach out.

# (Sq, cache_seqlens) per sequence: one query over a long prefix, a chunk across tile edges, Sq = L (no prefix), an
# empty chunk over a cached prefix, an empty sequence, a length past the capacity (clamped to it).
CACHE_SQ = [1, 70, 33, 0, 0, 20]
CACHE_LEN = [257, 200, 33, 40, 0, 400]
CACHE_CAPACITY = 320  # a multiple of every page size below


def cache_layout(g, B, capacity, page_size):
    """(block_table, num_pages) of a paged layout (pages in a random order, two pages no sequence owns), or
    (None, 0) for the contiguous one (page_size 0)."""
    if not page_size:
        return None, 0
    max_pages = capacity // page_size
    num_pages = B * max_pages + 2
    perm = torch.randperm(num_pages, device=DEVICE, generator=g)
    return perm[:B * max_pages].view(B, max_pages).to(torch.int32), num_pages


def to_cache_layout(rows, block_table, num_pages, page_size, fill):
    """rows [B, capacity, ...] in token order as the cache's memory: itself (contiguous), or [num_pages, page_size,
    ...] with token t of sequence b in page block_table[b, t // page_size], slot t % page_size (others `fill`)."""
    if block_table is None:
        return rows
    B = rows.shape[0]
    paged = torch.full((num_pages, page_size) + tuple(rows.shape[2:]), fill, dtype=rows.dtype, device=DEVICE)
    paged[block_table.long()] = rows.reshape(B, -1, page_size, *rows.shape[2:])
    return paged


def cache_queries(g, sq, lengths, capacity, HQ, D, dtype):
    """q [sum(sq), HQ, D], cu_seqlens_q (list) and the clamped lengths L (list)."""
    L = [min(n, capacity) for n in lengths]
    assert all(s <= n for s, n in zip(sq, L)), "a sequence's queries are among its cached positions"
    cu_q = _cumsum(sq)
    return randn(g, (cu_q[-1], HQ, D), dtype), cu_q, L


def cache_reference(q, K, V, cu_q, L, **params):
    """The float64 reference with k / v the first L[b] rows of K[b], V[b] ([B, capacity, HKV, D])."""
    k = torch.cat([K[b, :n] for b, n in enumerate(L)])
    v = torch.cat([V[b, :n] for b, n in enumerate(L)])
    return reference(q, k, v, cu_q, _cumsum(L), **params)


def run_with_cache(q, cu_q, L, lengths, k_cache, v_cache, K, V, **kw):
    """prefill_with_cache into poisoned out / lse (cache_seqlens = lengths), checked against cache_reference."""
    params = {name: kw[name] for name in ("causal", "softmax_scale", "softcap", "window") if name in kw}
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:-1], torch.float32)
    bound = max([b - a for a, b in zip(cu_q, cu_q[1:])] + [0])
    res = tessera.prefill_with_cache(q, device_offsets(cu_q), bound, k_cache, v_cache, device_offsets(lengths),
                                     out=out, lse=lse, **kw)
    assert res is out
    check(out, lse, *cache_reference(q, K, V, cu_q, L, **params), cu_q, f"{kw.get('format', 'native')} {params} ")
    return out, lse


CACHE_PARAMS = [dict(causal=True), dict(causal=False), dict(causal=True, window=37, softcap=30.0),
                dict(softmax_scale=0.05, window=100)]


@gpu
@pytest.mark.parametrize("params", CACHE_PARAMS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("page_size", [0, 64], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_native_cache(dtype, D, page_size, params, seed):
    g = _generator(seed)
    dt = getattr(torch, dtype)
    B, HQ, HKV, cap = len(CACHE_SQ), 8, 2, CACHE_CAPACITY
    q, cu_q, L = cache_queries(g, CACHE_SQ, CACHE_LEN, cap, HQ, D, dt)
    # The rows each sequence owns, NaN past its length: the cache's unwritten memory.
    K, V = randn(g, (B, cap, HKV, D), dt, 1.5), randn(g, (B, cap, HKV, D), dt)
    for b, n in enumerate(L):
        K[b, n:], V[b, n:] = math.nan, math.nan
    block_table, num_pages = cache_layout(g, B, cap, page_size)
    k_cache = to_cache_layout(K, block_table, num_pages, page_size, math.nan)
    v_cache = to_cache_layout(V, block_table, num_pages, page_size, math.nan)
    run_with_cache(q, cu_q, L, CACHE_LEN, k_cache, v_cache, K, V, block_table=block_table, **params)


@gpu
@pytest.mark.parametrize("page_size", [0, 32], ids=["contiguous", "paged32"])
def test_prefill_with_int8_cache(page_size, seed):
    # An int8 cache written by append_kv (all of max(L) rows of every sequence at position 0); the reference reads
    # the values the cache encodes (tessera.dequantize_kv, float64): the kernel's fp16 dequantization and fp16 q stay
    # within the bf16 tolerance of it.
    g = _generator(seed)
    dt = torch.bfloat16
    B, HQ, HKV, D, cap = len(CACHE_SQ), 8, 2, 128, CACHE_CAPACITY
    q, cu_q, L = cache_queries(g, CACHE_SQ, CACHE_LEN, cap, HQ, D, dt)
    block_table, num_pages = cache_layout(g, B, cap, page_size)
    lead = (num_pages, page_size) if page_size else (B, cap)
    k_cache = torch.randint(0, 256, lead + (HKV, D), dtype=torch.uint8, device=DEVICE, generator=g)
    v_cache = k_cache.clone()
    k_scale = torch.full(lead + (HKV, 2), math.nan, dtype=torch.float16, device=DEVICE)
    v_scale = k_scale.clone()
    cache = dict(format="int8", k_scale=k_scale, v_scale=v_scale, block_table=block_table)
    lmax = max(L)
    k_new, v_new = randn(g, (B, lmax, HKV, D), dt, 1.5), randn(g, (B, lmax, HKV, D), dt)
    tessera.append_kv(k_new, v_new, device_offsets([0] * B), k_cache, v_cache, **cache)

    def values(codes, scales):  # [B, capacity, HKV, D] float64 in token order
        if block_table is not None:
            pages = block_table.long()
            codes, scales = (t[pages].reshape(B, cap, *t.shape[2:]) for t in (codes, scales))
        return tessera.dequantize_kv(codes, scales, "int8", D, dtype=torch.float64)

    K, V = values(k_cache, k_scale), values(v_cache, v_scale)
    for params in (dict(causal=True), dict(causal=True, window=50, softcap=20.0), dict(causal=False)):
        run_with_cache(q, cu_q, L, CACHE_LEN, k_cache, v_cache, K, V, **cache, **params)


@gpu
def test_prefill_with_cache_allocates_and_matches_prefill_varlen(seed):
    # out / lse allocated like prefill_varlen's; over a native cache holding the very rows, the result agrees with
    # prefill_varlen's over the packed prefixes as k / v (within rounding: the two may tile differently).
    g = _generator(seed)
    dt = torch.float16
    B, HQ, HKV, D, cap = 3, 8, 2, 128, 256
    sq, lengths = [16, 100, 1], [16, 256, 90]
    q, cu_q, L = cache_queries(g, sq, lengths, cap, HQ, D, dt)
    K, V = randn(g, (B, cap, HKV, D), dt, 1.5), randn(g, (B, cap, HKV, D), dt)
    cq = device_offsets(cu_q)
    out, lse = tessera.prefill_with_cache(q, cq, 100, K, V, device_offsets(lengths), causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == dt and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    check(out, lse, *cache_reference(q, K.double(), V.double(), cu_q, L, causal=True), cu_q)
    k = torch.cat([K[b, :n] for b, n in enumerate(L)])
    v = torch.cat([V[b, :n] for b, n in enumerate(L)])
    want, want_lse = tessera.prefill_varlen(q, k, v, cq, device_offsets(_cumsum(L)), 100, causal=True,
                                            return_lse=True)
    _sync()
    diff = (out.double() - want.double()).abs().max().item()
    assert diff <= 2e-2, f"prefill_with_cache and prefill_varlen differ by {diff:.3g}"
