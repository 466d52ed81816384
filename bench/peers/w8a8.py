"""W8A8 peers: torch._int_mm (int8 x int8 -> int32, cuBLASLt) next to tessera's gemm_w8a8, torch.matmul in bf16 next
to the layer (quantize + GEMM), and the per-block quantizer written in torch ops next to tessera's quantize_per_block.

Cases: tessera-bench's (bench/w8a8_cases.cpp):
  w8a8_quantize  'M<m>_K<k>/<g128 | per_token>/bf16'               bf16 x, asymmetric per (row, block)
  gemm_w8a8      '<shape>/N<n>_K<k>/M<m>/<per_channel | g128 | g64 | g32>'  asymmetric activations per token or per
                 block, symmetric weights per output channel or per block; bf16 y
  linear_w8a8    the same names: quantize_per_block(x) + gemm_w8a8, bf16 x -> bf16 y
tessera-bench's own peer rows join a merged run: memcpy_d2d ("memcpy", a device-to-device copy of the quantizer's
bytes), cublaslt_int8_gemm ("cuBLASLt int8", int32 out), cublaslt_bf16_gemm ("cuBLASLt bf16").

Inputs (rotating sets where one set is under twice the L2, as in tessera-bench): x bf16 N(0, 1) times 2^U(-2, 2)
per 128 consecutive elements, W bf16 U(-1, 1) times 2^U(-1, 1) per output channel; the int8 peers' operands are
uniform random int8.

Peers (labels in the table)
  tessera        tessera.w8a8 (python/tessera/w8a8.py): quantize_per_block(x, block, symmetric) for x (asymmetric) and
                 W (symmetric with code sums, outside the timed region), gemm_w8a8(a, w, out=y, workspace=ws),
                 linear_w8a8(x, w, out=y, a_out=..., workspace=ws) (else the two calls); x's codes without sums (the
                 weights have no zero points), outputs and workspace preallocated (empty_blocks, workspace_bytes) as
                 tessera-bench's cases have theirs. Keyword arguments a function's signature lacks are left out, so
                 an older or newer tessera.w8a8 still runs; without the module the rows say so and the peers run.
  torch._int_mm  torch._int_mm(a int8 [M, K], w int8 [N, K].t()) -> int32 [M, N]: the same cuBLASLt TN int8 GEMM as
                 tessera-bench's cuBLASLt int8 row, with no scales (the bare int32 product W8A8 adds its promotion and
                 epilogue to), W passed as the transposed view (a contiguous copy of W.t() takes a much slower path).
                 Its CUDA kernel wants K, N multiples of 8 (checked here; every shape has them) and has refused M <= 16
                 ("self.size(0) needs to be greater than 16"): such an M is tried as is, then on A zero-padded to 32
                 rows as its callers do, noted in the row.
  torch bf16     torch.matmul(x, W.t(), out=y) with a dense bf16 W (linear_w8a8 rows).
  torch          w8a8_quantize rows: the quantizer in torch ops (amin / amax per block, the reference's fp32 steps,
                 torch.round = round half to even); --compile adds torch.compile of it.
rel err: gemm / linear rows: ||y - ref||_F / ||ref||_F over the first min(M, 64) rows and 4096 output channels, ref =
float64 product of the dequantized operands when tessera's quantized operands expose codes / scale / zero (then it
measures the GEMM alone, as tessera-bench's --check does), else of the unquantized x and W (then it includes the int8
quantization error, ~5e-3 on these inputs; the note says which); torch._int_mm: its int32 against the exact float64
product.
quantize rows: the dequantized tessera codes against x; the codes' agreement with the torch peer in the notes.

"% ceil": each row's bound and ceiling: gemm / linear rows are compute-bound when 2·M·N·K / peak exceeds bytes / read
bandwidth (peak: the dense int8 peak, 1979 TOPS on H100 / H200 SXM, --w8a8-peak-tops), else read-bound (tessera-
bench's measured read ceiling; a standalone run: the copy bandwidth measured here); quantize rows against the copy
ceiling (their bytes are read + written).
"""

import functools
import inspect
import re

from . import common as C
from .common import Case, Row

QUANT_OP, GEMM_OP, LINEAR_OP = "w8a8_quantize", "gemm_w8a8", "linear_w8a8"
COPY_PEER_OP, INT8_PEER_OP, BF16_PEER_OP = "memcpy_d2d", "cublaslt_int8_gemm", "cublaslt_bf16_gemm"
# bench/compare.py registers these with bench/peers/merge.py: the tessera-bench ops this family parses, the --op list
# of `--ops w8a8`, the labels of the C++ peers, the table's title.
MERGED_OPS = (QUANT_OP, GEMM_OP, LINEAR_OP)
BENCH_OPS = [QUANT_OP, COPY_PEER_OP, GEMM_OP, INT8_PEER_OP, LINEAR_OP, BF16_PEER_OP]
CPP_PEER_LABELS = {COPY_PEER_OP: "memcpy", INT8_PEER_OP: "cuBLASLt int8", BF16_PEER_OP: "cuBLASLt bf16"}
TITLE = "W8A8 (int8 activations x int8 weights)"
PEERS = ("torch",)

PEAK_TOPS = 1979.0  # dense int8 tensor-core peak, H100 / H200 SXM
ERROR_ROWS = 64
ERROR_CHANNELS = 4096  # output channels the rel err compares (the first ones): bounds the float64 weight copy
INT_MM_MIN_M = 17  # torch._int_mm: M > 16
INT_MM_PAD_M = 32

# bench/w8a8_cases.cpp's lists, in its order.
QUANT_GRID = [(4096, 4096, "g128"), (4096, 4096, "per_token"), (16, 4096, "g128"), (1, 16384, "per_token")]
GEMM_GRID = [  # (shape, N, K, M, format)
    ("square", 4096, 4096, 4096, "per_channel"), ("square", 4096, 4096, 2048, "per_channel"),
    ("square", 8192, 8192, 8192, "per_channel"),
    ("llama3_8b_gate_up", 14336, 4096, 1, "per_channel"), ("llama3_8b_gate_up", 14336, 4096, 16, "per_channel"),
    ("llama3_8b_gate_up", 14336, 4096, 64, "per_channel"), ("llama3_8b_gate_up", 14336, 4096, 256, "per_channel"),
    ("square", 4096, 4096, 4096, "g128"), ("llama3_8b_gate_up", 14336, 4096, 16, "g128"),
    ("square", 4096, 4096, 4096, "g64"), ("square", 4096, 4096, 4096, "g32"),
]
LINEAR_GRID = [
    ("square", 4096, 4096, 4096, "per_channel"), ("llama3_8b_gate_up", 14336, 4096, 16, "per_channel"),
    ("square", 4096, 4096, 4096, "g128"), ("llama3_8b_gate_up", 14336, 4096, 16, "g128"),
]
_QUANT_NAME = re.compile(r"^M(\d+)_K(\d+)/(g32|g64|g128|per_token)/bf16$")
_GEMM_NAME = re.compile(r"^(\w+)/N(\d+)_K(\d+)/M(\d+)/(per_channel|g32|g64|g128)$")


def _block(fmt, k):
    return k if fmt in ("per_token", "per_channel") else int(fmt[1:])


def registry():
    """tessera-bench's W8A8 cases (every one: its --all list)."""
    out = [(QUANT_OP, f"M{m}_K{k}/{f}/bf16") for m, k, f in QUANT_GRID]
    out += [(GEMM_OP, f"{s}/N{n}_K{k}/M{m}/{f}") for s, n, k, m, f in GEMM_GRID]
    out += [(LINEAR_OP, f"{s}/N{n}_K{k}/M{m}/{f}") for s, n, k, m, f in LINEAR_GRID]
    return out


def parse(op, name):
    if op == QUANT_OP:
        mt = _QUANT_NAME.match(name)
        if not mt:
            return None
        m, k = int(mt.group(1)), int(mt.group(2))
        return dict(kind="quantize", m=m, k=k, fmt=mt.group(3), block=_block(mt.group(3), k))
    if op in (GEMM_OP, LINEAR_OP):
        mt = _GEMM_NAME.match(name)
        if not mt:
            return None
        n, k, m = int(mt.group(2)), int(mt.group(3)), int(mt.group(4))
        return dict(kind="gemm" if op == GEMM_OP else "linear", shape=mt.group(1), n=n, k=k, m=m, fmt=mt.group(5),
                    block=_block(mt.group(5), k))
    return None


def nbytes(spec):
    """Bytes of one call as tessera-bench counts them (bench/w8a8_cases.cpp's header)."""
    m, k, blocks = spec["m"], spec["k"], spec["k"] // spec["block"]
    a = m * k + 8.0 * m * blocks  # codes + scale and zero planes
    if spec["kind"] == "quantize":
        return 2.0 * m * k + a
    n = spec["n"]
    w = n * k + 8.0 * n * blocks  # codes + scale and sum planes
    if spec["kind"] == "gemm":
        return a + w + 2.0 * m * n
    return 2.0 * m * k + 2.0 * a + w + 2.0 * m * n


def flops(spec):
    return 0.0 if spec["kind"] == "quantize" else 2.0 * spec["m"] * spec["n"] * spec["k"]


def keep(case, args):
    subs = [c for c in getattr(args, "w8a8_cases", "").split(",") if c]
    return not subs or any(s in case.name for s in subs)


def cases_from_args(args):
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry()) if keep(c, args)]


def _peers(args):
    return {p for p in getattr(args, "w8a8_peers", ",".join(PEERS)).split(",") if p}


# ---- tessera.w8a8, called defensively (its Python layer is newer than this script) -----------------------------

_API = {}


def _api():
    """(tessera.w8a8 module, None) or (None, why not)."""
    if "mod" not in _API:
        mod, why = None, None
        if C.tessera is None:
            why = C.TESSERA_IMPORT_ERROR
        else:
            try:
                import importlib
                mod = importlib.import_module("tessera.w8a8")
                missing = [f for f in ("quantize_per_block", "gemm_w8a8") if not hasattr(mod, f)]
                if missing:
                    mod, why = None, f"tessera.w8a8 has no {', '.join(missing)}"
            except Exception as e:  # noqa: BLE001
                why = f"tessera.w8a8 not available ({C.short(e)}): python/tessera/w8a8.py not built / installed yet"
        _API["mod"], _API["why"] = mod, why
    return _API["mod"], _API["why"]


def _bind(fn, **optional):
    """fn with those of the optional keyword arguments its signature accepts, bound once (inspecting a signature costs
    microseconds: never inside a timed call)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: positional arguments only
        return fn
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        optional = {k: v for k, v in optional.items() if k in params}
    return functools.partial(fn, **optional) if optional else fn


def _field(q, name, index):
    """A field of tessera's quantized operand (tessera.w8a8.Int8Blocks: codes, scale, zero, sums, block): an
    attribute, a dict key, or a tuple position."""
    if hasattr(q, name):
        return getattr(q, name)
    if isinstance(q, dict):
        return q.get(name)
    if isinstance(q, (tuple, list)):
        return q[index] if index < len(q) else None
    return None


def _preallocated(tw, rows, k, block, symmetric, sums):
    """tessera.w8a8.empty_blocks(...) for out= / a_out= (no allocation in the timed calls, as tessera-bench's cases
    write into buffers of their own), or None where the module has no such helper."""
    make = getattr(tw, "empty_blocks", None)
    if make is None:
        return None
    try:
        return make(rows, k, block, symmetric=symmetric, sums=sums)
    except Exception:  # noqa: BLE001 - another signature: let the op allocate
        return None


def _workspace(tw, m, qw):
    """A device workspace of tessera.w8a8.workspace_bytes(m, w) bytes (None when it needs none or cannot say)."""
    query = getattr(tw, "workspace_bytes", None)
    if query is None:
        return None
    try:
        nb = int(query(m, qw))
    except Exception:  # noqa: BLE001 - the op allocates through torch's caching allocator instead
        return None
    return C.torch.empty((nb,), dtype=C.torch.uint8, device=C.DEVICE) if nb else None


def _dequantized(q, rows, k, block):
    """float64 [rows, K] from tessera's quantized operand (codes [R, K], scale / zero [K / block, >= R]), or None when
    it does not expose them in that form."""
    torch = C.torch
    codes, scale, zero = _field(q, "codes", 0), _field(q, "scale", 1), _field(q, "zero", 2)
    blocks = k // block
    if not (torch.is_tensor(codes) and torch.is_tensor(scale)) or codes.dim() != 2 or codes.shape[1] != k:
        return None
    if scale.dim() != 2 or scale.shape[0] != blocks or scale.shape[1] < rows:
        return None
    s = scale[:, :rows].t().double().repeat_interleave(block, dim=1)
    z = (zero[:, :rows].t().double().repeat_interleave(block, dim=1) if torch.is_tensor(zero) else 0.0)
    return s * (codes[:rows].double() - z)


# ---- inputs -----------------------------------------------------------------------------------------------------


def _activations(m, k, gen):
    torch = C.torch
    x = torch.randn((m, k), device=C.DEVICE, generator=gen)
    mag = torch.exp2(torch.empty((m * k + 127) // 128, device=C.DEVICE).uniform_(-2.0, 2.0, generator=gen))
    return (x.flatten() * mag.repeat_interleave(128)[: m * k]).view(m, k).bfloat16()


def _weights(n, k, gen):
    torch = C.torch
    w = torch.empty((n, k), device=C.DEVICE).uniform_(-1.0, 1.0, generator=gen)
    return (w * torch.exp2(torch.empty((n, 1), device=C.DEVICE).uniform_(-1.0, 1.0, generator=gen))).bfloat16()


def _int8(shape, gen):
    return C.torch.randint(-128, 128, shape, dtype=C.torch.int8, device=C.DEVICE, generator=gen)


def torch_quantize(x, block):
    """The asymmetric per-(row, block) quantizer of tessera/w8a8.h in torch ops (each op one fp32 rounding, as the
    reference): codes int8 [M, K], scale and zero fp32 [M, K / block]."""
    torch = C.torch
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    lo, hi = xb.amin(dim=-1).clamp(max=0.0), xb.amax(dim=-1).clamp(min=0.0)
    s = (hi - lo) / 255.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    inv = 1.0 / s
    z = torch.clamp(torch.round(-128.0 - lo * inv), -128.0, 127.0)
    q = torch.clamp(torch.round(xb * inv.unsqueeze(-1)) + z.unsqueeze(-1), -128.0, 127.0)
    return q.to(torch.int8).view(m, k), s, z


# ---- rows -------------------------------------------------------------------------------------------------------


def rows(cases, args):
    cases = [c for c in cases if keep(c, args)]
    try:
        return C.guarded_rows([[c] for c in cases], lambda group, gi: [_case_row(group[0], args, 5000 + 100 * gi)])
    finally:
        C.empty_cache()


def _case_row(case, args, seed):
    s = case.spec
    row = Row(case.op, case.name, nbytes(s), flops(s))
    if s["kind"] == "quantize":
        _quantize_row(row, s, args, seed)
    else:
        _gemm_row(row, s, args, seed)
    return row


def _quantize_row(row, s, args, seed):
    m, k, block = s["m"], s["k"], s["block"]
    sets = C.rotating_sets(2.0 * m * k)
    g = C.generator(seed)
    xs = [_activations(m, k, g) for _ in range(sets)]
    calls = C.calls_for(nbytes(s) / 3.0e12 * 1e6, sets)
    tw, why = _api()
    got = None
    if tw is None:
        row.errors.append(f"tessera: {why}")
    else:
        # tessera-bench's w8a8_quantize: asymmetric, no code sums, into preallocated buffers
        quantize = _bind(tw.quantize_per_block, symmetric=False, sums=False,
                         out=_preallocated(tw, m, k, block, symmetric=False, sums=False))

        def make_fn():
            return C.rotating([(lambda x=x: quantize(x, block)) for x in xs])

        if C.run_tessera_fn(row, make_fn, calls, args) is not None:
            got = quantize(xs[0], block)
            deq = _dequantized(got, m, k, block)
            if deq is not None:
                row.rel_err["tessera"] = C.rel_error(deq, xs[0].double())
                row.notes.append("rel err: tessera's dequantized codes against x (the int8 quantization error)")
    if "torch" in _peers(args):
        fns = [(lambda x=x: torch_quantize(x, block)) for x in xs]
        if C.run_peer_fn(row, "torch", C.rotating(fns), calls, args):
            codes = _field(got, "codes", 0) if got is not None else None
            if C.torch.is_tensor(codes) and tuple(codes.shape) == (m, k):
                differ = int((codes != torch_quantize(xs[0], block)[0]).sum().item())
                row.notes.append(f"tessera's codes {'equal' if differ == 0 else 'differ from'} the torch peer's"
                                 + (f" ({differ} of {m * k})" if differ else ""))
        if getattr(args, "compile", False):
            try:
                compiled = C.torch.compile(lambda x: torch_quantize(x, block), mode="default", dynamic=False)
                C.run_peer_fn(row, "torch.compile", C.rotating([(lambda x=x: compiled(x)) for x in xs]), calls, args)
            except Exception as e:  # noqa: BLE001
                row.errors.append(f"torch.compile: {C.short(e)}")


def _gemm_row(row, s, args, seed):
    torch = C.torch
    m, n, k, block = s["m"], s["n"], s["k"], s["block"]
    layer = s["kind"] == "linear"
    peers = _peers(args)
    est_us = max(flops(s) / 900e12, nbytes(s) / 3.5e12) * 1e6
    sets = C.rotating_sets(2.0 * m * k + n * k)
    g = C.generator(seed)
    xs = [_activations(m, k, g) for _ in range(sets)]
    ws = [_weights(n, k, g) for _ in range(sets)]
    calls = C.calls_for(est_us, sets)

    tw, why = _api()
    if tw is None:
        row.errors.append(f"tessera: {why}")
    else:
        y = torch.empty((m, n), dtype=torch.bfloat16, device=C.DEVICE)
        state = {}

        # activations asymmetric without code sums (the weights are symmetric: the GEMM reads no ΣAq)
        quantize_a = _bind(tw.quantize_per_block, symmetric=False, sums=False)

        def make_fn():
            quantize_w = _bind(tw.quantize_per_block, symmetric=True, sums=True)
            qws = [quantize_w(w, block) for w in ws]
            workspace = _workspace(tw, m, qws[0])
            gemm = _bind(tw.gemm_w8a8, out=y, workspace=workspace)
            if layer and hasattr(tw, "linear_w8a8"):
                layer_fn = _bind(tw.linear_w8a8, symmetric=False, out=y, workspace=workspace,
                                 a_out=_preallocated(tw, m, k, block, symmetric=False, sums=False))
                fns = [(lambda x=x, qw=qw: layer_fn(x, qw)) for x, qw in zip(xs, qws)]
                state["how"] = "tessera.w8a8.linear_w8a8"
            elif layer:
                fns = [(lambda x=x, qw=qw: gemm(quantize_a(x, block), qw)) for x, qw in zip(xs, qws)]
                state["how"] = "tessera.w8a8.quantize_per_block + gemm_w8a8 (no linear_w8a8)"
            else:
                qas = [quantize_a(x, block) for x in xs]
                fns = [(lambda qa=qa, qw=qw: gemm(qa, qw)) for qa, qw in zip(qas, qws)]
                state["qa"] = qas[0]
                state["how"] = "tessera.w8a8.gemm_w8a8 on operands quantized once, outside the timed region"
            state["qw"] = qws[0]
            state["fn0"] = fns[0]
            return C.rotating(fns)

        if C.run_tessera_fn(row, make_fn, calls, args) is not None:
            row.notes.append(f"tessera: {state['how']}")
            y.fill_(float("nan"))
            out = state["fn0"]()
            got = out if torch.is_tensor(out) and out.shape == (m, n) else y
            r, nc = min(m, ERROR_ROWS), min(n, ERROR_CHANNELS)
            qa = state.get("qa")
            if qa is None:
                qa = quantize_a(xs[0], block)
            a64, w64 = _dequantized(qa, r, k, block), _dequantized(state["qw"], nc, k, block)
            if a64 is not None and w64 is not None:
                row.rel_err["tessera"] = C.rel_error(got[:r, :nc].double(), a64 @ w64.t())
                row.notes.append("rel err: against the float64 product of tessera's dequantized operands")
            else:
                row.rel_err["tessera"] = C.rel_error(got[:r, :nc].double(),
                                                     xs[0][:r].double() @ ws[0][:nc].double().t())
                row.notes.append("rel err: against the unquantized x @ W.T (tessera.w8a8's operands expose no "
                                 "codes / scale / zero): includes the int8 quantization error")
            del a64, w64

    if "torch" not in peers:
        return
    if layer:
        yd = torch.empty((m, n), dtype=torch.bfloat16, device=C.DEVICE)
        fns = [(lambda x=x, w=w: torch.matmul(x, w.t(), out=yd)) for x, w in zip(xs, ws)]
        if C.run_peer_fn(row, "torch bf16", C.rotating(fns), calls, args):
            fns[0]()
            r = min(m, ERROR_ROWS)
            row.rel_err["torch bf16"] = C.rel_error(yd[:r].double(), xs[0][:r].double() @ ws[0].double().t())
        return
    _int_mm_peer(row, m, n, k, args, seed, calls)


def _int_mm_peer(row, m, n, k, args, seed, calls):
    torch = C.torch
    if not hasattr(torch, "_int_mm"):
        row.notes.append(f"torch._int_mm: n/a (torch {torch.__version__} has none)")
        return
    if k % 8 or n % 8:
        row.notes.append(f"torch._int_mm: n/a (needs K and N multiples of 8, got K={k} N={n})")
        return
    sets = C.rotating_sets(1.0 * n * k + m * k)
    g = C.generator(seed + 1)
    a_sets = [_int8((m, k), g) for _ in range(sets)]
    w_sets = [_int8((n, k), g) for _ in range(sets)]

    def fns_for(m_run, use_out):
        padded = [a if m_run == m else torch.cat([a, a.new_zeros((m_run - m, k))]) for a in a_sets]
        if use_out:
            outs = torch.empty((m_run, n), dtype=torch.int32, device=C.DEVICE)
            return [(lambda a=a, w=w: torch._int_mm(a, w.t(), out=outs)) for a, w in zip(padded, w_sets)]
        return [(lambda a=a, w=w: torch._int_mm(a, w.t())) for a, w in zip(padded, w_sets)]

    # Unpadded first; torch's M > 16 rule (where this torch still has it) is met by padding A, as its callers do.
    # out= keeps the allocator out of the timed region; a torch without _int_mm.out runs without it.
    tries = [(m, True), (m, False)]
    if m < INT_MM_MIN_M:
        tries += [(INT_MM_PAD_M, True), (INT_MM_PAD_M, False)]
    fns, refusals = None, []
    for m_run, use_out in tries:
        candidate = fns_for(m_run, use_out)
        try:
            candidate[0]()
            C.sync()
            fns = candidate
            break
        except Exception as e:  # noqa: BLE001
            C.sync_quietly()
            refusals.append(f"M={m_run}{' out=' if use_out else ''}: {C.short(e, 80)}")
    if fns is None:
        row.peers["torch._int_mm"] = {}
        row.errors.append(f"torch._int_mm: unavailable ({'; '.join(refusals)})")
        return
    if m_run != m:
        row.notes.append(f"torch._int_mm: refuses M={m} ({refusals[0]}); timed with A zero-padded to {m_run} rows "
                         "(what its callers do)")
    if C.run_peer_fn(row, "torch._int_mm", C.rotating(fns), calls, args, first_call=False):
        out = fns[0]()
        r = min(m, ERROR_ROWS)
        err = C.rel_error(out[:r].double(), a_sets[0][:r].double() @ w_sets[0].double().t())
        row.rel_err["torch._int_mm"] = err
        row.notes.append(f"torch._int_mm: int32 = int8 [M, K] @ int8 [N, K].t() (cuBLASLt), rel err {err:.1e} "
                         "against the exact product")


# ---- table ------------------------------------------------------------------------------------------------------


def _read_bps(rows, copy_bps):
    """tessera-bench's read ceiling (from any merged row's GB/s and % read BW), else the copy bandwidth here."""
    for r in rows:
        b = r.bench or {}
        if b.get("gbps") and b.get("pct_read_bw"):
            return b["gbps"] * 1e9 * 100.0 / b["pct_read_bw"], "read"
    return copy_bps, "read (copy)"


def print_family(rows, copy_bps=None, peak_tops=PEAK_TOPS):
    """The W8A8 tables, one per op (quantize, GEMM, layer): per case tessera's µs (tessera-bench's when merged, and
    this process's), the bound and the % of its ceiling, TOPS and GB/s, then per peer µs and peer / tessera, and
    tessera's rel err."""
    if not rows:
        return
    merged = any(r.bench is not None for r in rows)
    read_bps, read_label = _read_bps(rows, copy_bps)
    print(f"== {TITLE}")
    print(f"% ceil: compute-bound rows against the dense int8 peak ({peak_tops:.0f} TOPS); read-bound rows against " +
          ("tessera-bench's measured read ceiling" if merged and read_label == "read"
           else "the copy bandwidth measured here (read (copy))") +
          "; quantize rows against the copy ceiling. TOPS = 2·M·N·K / time\n")
    ops = list(MERGED_OPS) + sorted({r.op for r in rows} - set(MERGED_OPS))
    for op in ops:
        op_rows = [r for r in rows if r.op == op]
        if op_rows:
            _print_op(op, op_rows, merged, copy_bps, read_bps, read_label, peak_tops)


def _bound(r, spec, copy_bps, read_bps, read_label, peak_tops):
    """(bound, % of its ceiling) of one row."""
    tops, bw = r.tflops(), r.gbps()
    if spec is None:
        return "-", None
    if spec["kind"] == "quantize":
        if r.bench is not None:
            return "copy", r.bench.get("pct_copy_bw")
        return "copy", (100.0 * bw * 1e9 / copy_bps if (bw and copy_bps) else None)
    compute_s = r.flops / (peak_tops * 1e12)
    read_s = r.bytes / read_bps if read_bps else 0.0
    if compute_s >= read_s:
        return "compute", (100.0 * tops / peak_tops if tops else None)
    if r.bench is not None:
        return read_label, r.bench.get("pct_read_bw")
    return read_label, (100.0 * bw * 1e9 / read_bps if (bw and read_bps) else None)


def _print_op(op, rows, merged, copy_bps, read_bps, read_label, peak_tops):
    labels = C.peer_labels(rows)
    head = ["case"] + C.tessera_head(merged) + ["bound", "% ceil", "TOPS", "GB/s"]
    head += C.peer_head(labels)
    body = []
    eager_marks = False
    for r in rows:
        cells = [r.case] + C.tessera_cells(r, merged)
        bound, pct = _bound(r, parse(r.op, r.case), copy_bps, read_bps, read_label, peak_tops)
        cells += [bound, C.fmt_num(pct, ".1f"), C.fmt_num(r.tflops(), ".0f"), C.fmt_num(r.gbps(), ".0f")]
        peer, eager = C.peer_cells(r, labels)
        cells += peer
        eager_marks |= eager
        body.append(cells)
    print(f"-- {op}")
    C.print_aligned(head, body, text_cols=(0, 3 if merged else 2))
    # tessera-bench's peer-row note reads the same on every row: printed once
    C.print_row_notes(rows, eager_marks,
                      key=lambda r, text: (None, text) if "C++ peer" in text else (r.case, text),
                      tag=lambda r: r.case, dedup_errors=True)
