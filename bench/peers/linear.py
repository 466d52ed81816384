"""Weight-only quantized linear peers: cuBLAS bf16 (torch.matmul on a dense bf16 weight) and tinygemm
(torch._weight_int4pack_mm), next to tessera.linear.linear.

Cases: tessera-bench's (bench/linear_cases.cpp): '<shape>/N<n>_K<k>/M<m>/<format>' for the op 'linear', shapes
llama3_8b_gate_up N14336 K4096, llama3_8b_down N4096 K14336, llama3_8b_attn N4096 K4096, dsv3_like N7168 K2048,
formats int4_g128 / int8_g128 / int4_channel (one block per output channel) with w = q·scale + offset, and
int4_g128_zp with GPTQ / AWQ zero points, w = (q − zero)·scale; M in 1 .. 8192. Plus the ceiling row
'ceiling/M8192_N8192_K8192' of tessera-bench's op cublaslt_bf16_linear (a bf16 GEMM 8192³): the denominator of the
compute-bound rows' "% ceil". tessera-bench's own peer rows (cublaslt_bf16_linear, one per linear case name) join a
merged run as "cuBLASLt".

Inputs (per weight format, shared by every M of a shape; rotating sets where one set is under twice the L2, as in
tessera-bench): codes uniform over [0, 2^bits), scale U(0.001, 0.02), offset U(-0.1, 0.1) or an integer zero point
uniform over [0, 2^bits), the parameters rounded to bf16 (the values tessera's layout stores); x bf16 U(-1, 1).

Peers (labels in the table)
  tessera     tessera.linear.linear(x, packed, out=y, workspace=ws) with packed = tessera.linear.prepack(q).cuda()
              (host prepack once, outside the timed region): the "py µs" cross-check of a merged run.
  torch bf16  torch.matmul(x, W.t(), out=y) with a dense bf16 W [N, K] (cuBLAS; the issue's bf16 cuBLAS peer), the
              same time on every format's row of a (shape, M); on the ceiling row, torch.matmul 8192³.
  tinygemm    torch._weight_int4pack_mm(x, W_packed, group, scales_and_zeros) (int4 formats with a group of 32 .. 256
              only: not int8, not per-channel): W_packed = torch._convert_weight_to_int4pack(uint8 [N, K/2] with the
              even k in the high nibble, inner_k_tiles=8), scales_and_zeros bf16 [K/group, N, 2] of (scale, zero)
              with tinygemm's w = (q − 8)·scale + zero, i.e. zero = offset + 8·scale, or (8 − zero point)·scale.
rel err: ||y − ref||_F / ||ref||_F over the first min(M, 64) rows, ref = float64 x @ W.T of the weight each ran on
(the quantized one, from the stored bf16 parameters, for tessera and tinygemm; the dense one for torch bf16); the
peers' errors are in the notes.

"% ceil": M < 256 is bound by the weight read: tessera-bench's % of its measured read ceiling (bytes: codes +
parameters + x + y; a standalone run: % of the copy bandwidth measured here); M >= 256 by the tensor cores: tessera's
TFLOP/s as a % of the ceiling row's (tessera-bench's cuBLASLt 8192³, or torch.matmul 8192³ when standalone).
"""

import re

from . import common as C
from .common import Case, Row

OP = "linear"
CPP_PEER_OP = "cublaslt_bf16_linear"
# bench/compare.py registers these with bench/peers/merge.py: the tessera-bench ops this family parses (of the peer
# op only the ceiling row), the --op list of `--ops linear`, the label of the C++ peer, the table's title.
MERGED_OPS = (OP, CPP_PEER_OP)
BENCH_OPS = [OP, CPP_PEER_OP]
CPP_PEER_LABELS = {CPP_PEER_OP: "cuBLASLt"}
TITLE = "weight-only quantized linear"
PEERS = ("torch", "tinygemm")

CEILING = "ceiling/M8192_N8192_K8192"
COMPUTE_BOUND_M = 256  # from this M on, the "% ceil" column is against the bf16 GEMM ceiling
ERROR_ROWS = 64  # rows of y the rel err compares
TINYGEMM_GROUPS = (32, 64, 128, 256)
TINYGEMM_INNER_K_TILES = 8

SHAPES = {"llama3_8b_gate_up": (14336, 4096), "llama3_8b_down": (4096, 14336), "llama3_8b_attn": (4096, 4096),
          "dsv3_like": (7168, 2048)}
FORMATS = {  # name -> (bits, block (0: per output channel), zero_mode)
    "int4_g128": (4, 128, "offset"),
    "int8_g128": (8, 128, "offset"),
    "int4_channel": (4, 0, "offset"),
    "int4_g128_zp": (4, 128, "zero_point"),
}
EVERY_M = (1, 4, 16, 64, 256, 2048, 8192)
# bench/linear_cases.cpp's grid, in its order: (shape, format, M values).
GRID = [
    ("llama3_8b_gate_up", "int4_g128", EVERY_M), ("llama3_8b_gate_up", "int8_g128", EVERY_M),
    ("llama3_8b_gate_up", "int4_channel", (1, 16, 64, 2048)), ("llama3_8b_gate_up", "int4_g128_zp", (1, 16, 2048)),
    ("llama3_8b_down", "int4_g128", EVERY_M), ("llama3_8b_down", "int8_g128", (1, 2048)),
    ("llama3_8b_down", "int4_channel", (1,)),
    ("llama3_8b_attn", "int4_g128", EVERY_M), ("llama3_8b_attn", "int8_g128", (1, 2048)),
    ("llama3_8b_attn", "int4_channel", (1,)),
    ("dsv3_like", "int4_g128", EVERY_M), ("dsv3_like", "int8_g128", (1, 2048)), ("dsv3_like", "int4_channel", (1,)),
]
_NAME = re.compile(r"^(\w+)/N(\d+)_K(\d+)/M(\d+)/(int4_g128|int8_g128|int4_channel|int4_g128_zp)$")


def case_name(shape, fmt, m):
    n, k = SHAPES[shape]
    return f"{shape}/N{n}_K{k}/M{m}/{fmt}"


def registry():
    """tessera-bench's linear cases (every one: its --all list), then the ceiling row."""
    return [(OP, case_name(s, f, m)) for s, f, ms in GRID for m in ms] + [(CPP_PEER_OP, CEILING)]


def parse(op, name):
    if op == CPP_PEER_OP:
        return dict(kind="ceiling", m=8192, n=8192, k=8192) if name == CEILING else None
    mt = _NAME.match(name)
    if op != OP or not mt:
        return None
    bits, block, zero_mode = FORMATS[mt.group(5)]
    n, k = int(mt.group(2)), int(mt.group(3))
    return dict(kind="linear", shape=mt.group(1), n=n, k=k, m=int(mt.group(4)), fmt=mt.group(5), bits=bits,
                block=block or k, zero_mode=zero_mode)


def nbytes(spec):
    """Bytes of one call as tessera-bench counts them: codes + (scale, p) pairs + x + y."""
    n, k, m = spec["n"], spec["k"], spec["m"]
    if spec["kind"] == "ceiling":
        return 2.0 * (n * k + m * k + m * n)
    return n * k * spec["bits"] / 8 + 4.0 * n * (k // spec["block"]) + 2.0 * m * k + 2.0 * m * n


def flops(spec):
    return 2.0 * spec["m"] * spec["n"] * spec["k"]


def keep(case, args):
    """--linear-cases (substrings of the case name); the ceiling row is always kept (the % ceil needs it)."""
    subs = [c for c in getattr(args, "linear_cases", "").split(",") if c]
    return case.spec["kind"] == "ceiling" or not subs or any(s in case.name for s in subs)


def cases_from_args(args):
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry()) if keep(c, args)]


def _peers(args):
    return {p for p in getattr(args, "linear_peers", ",".join(PEERS)).split(",") if p}


# ---- inputs -----------------------------------------------------------------------------------------------------


class WeightSet:
    """One random quantized weight in the canonical form on the GPU (codes [N, K] uint8, scale / p [N, K / block] as
    the bf16-rounded values in float32), tessera's packed copy of it, and tinygemm's (where it applies)."""

    def __init__(self, spec, gen, peers):
        torch = C.torch
        n, k, bits, block = spec["n"], spec["k"], spec["bits"], spec["block"]
        nb = k // block
        dev = C.DEVICE
        self.block, self.zero_mode = block, spec["zero_mode"]
        self.codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, device=dev, generator=gen)
        self.scale = torch.empty((n, nb), device=dev).uniform_(0.001, 0.02, generator=gen).bfloat16().float()
        if self.zero_mode == "offset":
            self.second = torch.empty((n, nb), device=dev).uniform_(-0.1, 0.1, generator=gen).bfloat16().float()
        else:
            self.second = torch.randint(0, 1 << bits, (n, nb), device=dev, generator=gen).float()
        self.packed, self.tessera_error = None, None
        if C.tessera is not None:
            try:
                tl = C.tessera.linear
                zp = self.zero_mode == "zero_point"
                q = tl.QuantizedLinearWeight(
                    codes=self.codes.cpu(), scale=self.scale.cpu(),
                    offset=(-self.second * self.scale if zp else self.second).cpu(),
                    zero=self.second.to(torch.uint8).cpu() if zp else None, k_perm=None, n=n, k=k, bits=bits,
                    block=block, zero_mode=self.zero_mode)
                self.packed = tl.prepack(q, compute_dtype=torch.bfloat16).cuda()
            except Exception as e:  # noqa: BLE001 - the peers still run
                self.tessera_error = C.short(e)
        self.tinygemm = None
        if "tinygemm" in peers and bits == 4 and block in TINYGEMM_GROUPS:
            packed_u8 = ((self.codes[:, 0::2] << 4) | self.codes[:, 1::2]).contiguous()  # even k: high nibble
            self.tinygemm = torch._convert_weight_to_int4pack(packed_u8, TINYGEMM_INNER_K_TILES)
            zero = self.second + 8.0 * self.scale if self.zero_mode == "offset" else (8.0 - self.second) * self.scale
            self.scales_and_zeros = torch.stack([self.scale.t(), zero.t()], dim=-1).bfloat16().contiguous()

    def dequantized(self):
        """W [N, K] in float64 from the stored values (bf16 parameters), as tessera and the reference read them."""
        s = self.scale.double().repeat_interleave(self.block, dim=1)
        p = self.second.double().repeat_interleave(self.block, dim=1)
        q = self.codes.double()
        return q * s + p if self.zero_mode == "offset" else (q - p) * s


_WEIGHTS = {}  # (shape, format) -> [WeightSet]: kept while that shape's and format's cases run
_DENSE = {}  # (n, k) -> [bf16 W [N, K]]
_TORCH_BF16 = {}  # (n, k, m) -> (times, errors, rel err): one measurement for every format's row


def _weight_sets(spec, count, seed, peers):
    key = (spec["shape"], spec["fmt"])
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        C.empty_cache()
        _WEIGHTS[key] = []
    sets = _WEIGHTS[key]
    while len(sets) < count:
        sets.append(WeightSet(spec, C.generator(seed + 7919 * len(sets)), peers))
    return sets[:count]


def _random_bf16(shape, gen):
    return C.torch.empty(shape, device=C.DEVICE).uniform_(-1.0, 1.0, generator=gen).bfloat16()


def _dense_sets(n, k, count, seed):
    key = (n, k)
    if key not in _DENSE:
        _DENSE.clear()
        C.empty_cache()
        _DENSE[key] = []
    sets = _DENSE[key]
    while len(sets) < count:
        sets.append(_random_bf16((n, k), C.generator(seed + 104729 * len(sets))))
    return sets[:count]


def _rel_err(y, x, w64):
    r = min(x.shape[0], ERROR_ROWS)
    return C.rel_error(y[:r].double(), x[:r].double() @ w64.t())


# ---- rows -------------------------------------------------------------------------------------------------------


def rows(cases, args):
    """Cases grouped by (shape, format), so that one format's weights serve every M; the ceiling row alone."""
    groups = {}
    for case in cases:
        if not keep(case, args):
            continue
        s = case.spec
        key = ("ceiling",) if s["kind"] == "ceiling" else (s["shape"], s["fmt"])
        groups.setdefault(key, []).append(case)
    try:
        return C.guarded_rows(list(groups.values()), lambda group, gi: _group_rows(group, args, 3000 + 100 * gi))
    finally:
        _WEIGHTS.clear()
        _DENSE.clear()
        _TORCH_BF16.clear()
        C.empty_cache()


def _group_rows(group, args, seed):
    if group[0].spec["kind"] == "ceiling":
        return [_ceiling_row(group[0], args, seed)]
    return [_case_row(case, args, seed) for case in group]


def _ceiling_row(case, args, seed):
    torch = C.torch
    s = case.spec
    row = Row(case.op, case.name, nbytes(s), flops(s))
    g = C.generator(seed)
    a, b = _random_bf16((s["m"], s["k"]), g), _random_bf16((s["n"], s["k"]), g)
    y = torch.empty((s["m"], s["n"]), dtype=torch.bfloat16, device=C.DEVICE)
    calls = C.calls_for(flops(s) / 700e12 * 1e6)
    C.run_peer_fn(row, "torch bf16", lambda: torch.matmul(a, b.t(), out=y), calls, args)
    row.notes.append("the bf16 GEMM ceiling of the '% ceil' column (M >= 256): tessera µs = tessera-bench's "
                     "cuBLASLt 8192³ row when merged; torch bf16 = torch.matmul 8192³ here")
    return row


def _case_row(case, args, seed):
    torch = C.torch
    s = case.spec
    n, k, m = s["n"], s["k"], s["m"]
    peers = _peers(args)
    row = Row(case.op, case.name, nbytes(s), flops(s))
    est_us = max(flops(s) / 600e12, nbytes(s) / 3.5e12) * 1e6

    # tessera and tinygemm on the same quantized weights; x rotates with them.
    sets = C.rotating_sets(n * k * s["bits"] / 8 + 2.0 * m * k)
    weights = _weight_sets(s, sets, seed, peers)
    g = C.generator(seed + 1)
    xs = [_random_bf16((m, k), g) for _ in range(sets)]
    w64 = weights[0].dequantized()
    calls = C.calls_for(est_us, sets)

    y = torch.empty((m, n), dtype=torch.bfloat16, device=C.DEVICE)
    if weights[0].tessera_error:
        row.errors.append(f"tessera: prepack: {weights[0].tessera_error}")
    elif C.tessera is not None:
        tl = C.tessera.linear

        def make_fn():
            ws_bytes = tl.workspace_bytes(m, weights[0].packed, torch.bfloat16)
            ws = torch.empty((ws_bytes,), dtype=torch.uint8, device=C.DEVICE) if ws_bytes else None
            return C.rotating([(lambda x=x, w=w: tl.linear(x, w.packed, out=y, workspace=ws))
                               for x, w in zip(xs, weights)])

        if C.run_tessera_fn(row, make_fn, calls, args) is not None:
            y.fill_(float("nan"))
            tl.linear(xs[0], weights[0].packed, out=y)
            row.rel_err["tessera"] = _rel_err(y, xs[0], w64)
    else:
        row.errors.append(f"tessera: {C.TESSERA_IMPORT_ERROR}")

    if "tinygemm" in peers:
        if weights[0].tinygemm is None:
            row.notes.append(f"tinygemm: n/a (int4 with a group of {'/'.join(map(str, TINYGEMM_GROUPS))} only)")
        elif not hasattr(torch, "_weight_int4pack_mm"):
            row.notes.append(f"tinygemm: n/a (torch {torch.__version__} has no _weight_int4pack_mm)")
        else:
            block = s["block"]
            fns = [(lambda x=x, w=w: torch._weight_int4pack_mm(x, w.tinygemm, block, w.scales_and_zeros))
                   for x, w in zip(xs, weights)]
            if C.run_peer_fn(row, "tinygemm", C.rotating(fns), calls, args):
                err = _rel_err(fns[0](), xs[0], w64)
                row.rel_err["tinygemm"] = err
                row.notes.append(f"tinygemm: rel err {err:.1e} vs the float64 reference (its zero is rounded to "
                                 "bf16 from offset + 8·scale)")
    del w64

    if "torch" in peers:
        key = (n, k, m)
        if key not in _TORCH_BF16:
            dense_sets = C.rotating_sets(2.0 * n * k + 2.0 * m * k)
            dense = _dense_sets(n, k, dense_sets, seed + 2)
            gx = C.generator(seed + 3)
            dxs = [_random_bf16((m, k), gx) for _ in range(dense_sets)]
            yd = torch.empty((m, n), dtype=torch.bfloat16, device=C.DEVICE)
            fns = [(lambda x=x, w=w: torch.matmul(x, w.t(), out=yd)) for x, w in zip(dxs, dense)]
            dense_us = max(flops(s) / 600e12, (2.0 * n * k + 2.0 * m * (k + n)) / 3.5e12) * 1e6
            try:
                fns[0]()
                err = _rel_err(yd, dxs[0], dense[0].double())
                times, errs = C.timed(C.rotating(fns), C.calls_for(dense_us, dense_sets), args)
            except Exception as e:  # noqa: BLE001 - the other peers' columns still count
                C.sync_quietly()
                times, errs, err = {}, [f"unavailable ({C.short(e)})"], None
            _TORCH_BF16[key] = (times, errs, err)
        times, errs, err = _TORCH_BF16[key]
        row.add_peer("torch bf16", times, errs)
        row.rel_err["torch bf16"] = err
        row.notes.append("torch bf16 = torch.matmul(x, W.t()) with a dense bf16 W [N, K] (cuBLAS), the same "
                         "measurement on every format's row" + (f"; rel err {err:.1e}" if err is not None else ""))
    return row


# ---- table ------------------------------------------------------------------------------------------------------


def _ceiling_tflops(rows):
    """TFLOP/s of the ceiling row: tessera-bench's cuBLASLt time when merged, else torch.matmul's here."""
    for r in rows:
        if r.op == CPP_PEER_OP and r.case == CEILING:
            t = r.tessera_us("graph") or r.tessera_us("eager")
            if not t:
                _, t, _ = r.headline("torch bf16")
            return r.flops / (t * 1e-6) / 1e12 if t else None
    return None


def print_family(rows, copy_bps=None):
    """The linear table: per case tessera's µs (tessera-bench's when merged, and this process's), the bound, the % of
    that bound's ceiling, TFLOP/s, then per peer µs and peer / tessera, and tessera's rel err."""
    if not rows:
        return
    merged = any(r.bench is not None for r in rows)
    ceiling = _ceiling_tflops(rows)
    labels = C.peer_labels(rows)
    head = ["case"] + C.tessera_head(merged) + ["bound", "% ceil", "TFLOP/s"]
    head += C.peer_head(labels)
    body = []
    eager_marks = False
    for r in rows:
        ceiling_row = r.op == CPP_PEER_OP
        spec = parse(r.op, r.case)
        cells = [r.case + (" [cuBLASLt]" if ceiling_row and merged else "")] + C.tessera_cells(r, merged)
        pct, bound = None, "-"
        tflops = r.tflops()
        if ceiling_row:
            bound, pct, tflops = "compute", (100.0 if ceiling else None), ceiling
        elif spec is not None and spec["m"] >= COMPUTE_BOUND_M:
            bound = "compute"
            pct = 100.0 * tflops / ceiling if (tflops and ceiling) else None
        elif spec is not None:
            bound = "read"
            if r.bench is not None:
                pct = r.bench.get("pct_read_bw")
            else:
                bw = r.gbps()
                bound = "read (copy)"
                pct = 100.0 * bw * 1e9 / copy_bps if (bw and copy_bps) else None
        cells += [bound, C.fmt_num(pct, ".1f"), C.fmt_num(tflops, ".1f")]
        peer, eager = C.peer_cells(r, labels)
        cells += peer
        eager_marks |= eager
        body.append(cells)
    print(f"== {TITLE}")
    print(f"% ceil: read-bound rows (M < {COMPUTE_BOUND_M}) against " +
          ("tessera-bench's measured read ceiling" if merged else "the copy bandwidth measured here (read (copy))") +
          "; compute-bound rows against the bf16 GEMM ceiling row, " +
          (f"{ceiling:.0f} TFLOP/s" if ceiling else "not measured in this run"))
    C.print_aligned(head, body, text_cols=(0, 3 if merged else 2))
    # the shared torch bf16 / tinygemm notes are printed once per (shape, M) / format
    C.print_row_notes(rows, eager_marks,
                      key=lambda r, text: (r.case.rsplit("/", 1)[0], text) if text.startswith("torch bf16")
                      else (None, text),
                      tag=lambda r: r.case, dedup_errors=False)
