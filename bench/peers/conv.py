"""int4 / int8-weight conv2d peer: cuDNN bf16 channels-last (torch.nn.functional.conv2d), next to tessera-bench's
conv2d rows.

Cases: tessera-bench's (bench/conv_cases.cpp): '<geometry>/<x layout>/<format>/<path>' for the op 'conv2d':
  geometry  B<n>_C<ci>_<h>x<w>_<kh>x<kw>[_s<stride>][_p<pad>][_g<groups>]_Co<co>: the issue's four
            (B1_C256_56x56_3x3_p1_Co256, B8_C512_28x28_3x3_p1_Co512, B32_C64_112x112_3x3_s2_p1_Co128,
            B16_C1024_14x14_1x1_Co1024), a depthwise B8_C384_28x28_3x3_p1_g384_Co384 and the RGB stem
            B8_C3_224x224_7x7_s2_p3_Co64
  x layout  nhwc, or nchw (case 1 only: tessera transforms x to NHWC in its workspace; y is NHWC either way)
  format    int4 / int8 codes with a (scale, zero point) pair per 128 (g128) or 64 (g64) values of K = Kh·Kw·Ci_g, or
            per output channel (channel)
  path      the tessera path the case runs (tessera::conv::conv_path_name: linear, implicit_gemm, direct)
tessera's µs is tessera-bench's (a merged run: --with-bench / --bench-json); tessera's conv is not timed through its
Python API here, so a standalone run measures the peer and the ceiling only (ratios "-").

Peer (label "cuDNN")
  torch.nn.functional.conv2d(x, W, None, stride, padding, 1, groups) in bf16 with torch.backends.cudnn.benchmark =
  True (cuDNN times its algorithms on the first call of a shape: a warm-up call, outside the timed region, precedes
  the timing): x [N, Ci, H, W] in channels_last memory (NHWC), on nchw rows a contiguous NCHW x; W a dense bf16
  [Co, Ci_g, Kh, Kw] in channels_last memory, so y is channels_last (NHWC) on every row, as tessera's is (on nchw rows
  torch first copies x to channels_last, as tessera transforms it). Inputs bf16 U(-1, 1), rotating sets where one set
  is under twice the L2 (as in tessera-bench). One measurement per (geometry, x layout), shown on its int4 and int8
  rows (the dense peer has no weight format). For groups = Ci (the depthwise row) torch may route the call to its own
  depthwise kernels rather than cuDNN; the label stays "cuDNN" (it is what F.conv2d runs).
  The peer's rel err (notes): ||y - ref||_F / ||ref||_F over image 0, ref = the float64 conv of the same bf16 inputs.

rel err column: tessera's, from tessera-bench's --check (merged runs with --bench-args=--check: its relative Frobenius
error over the sampled pixel rows against the float64 reference), else "-".

"% ceil": a row is compute-bound when FLOPs / ceiling >= bytes / read bandwidth, else read-bound. The ceiling is the
bf16 GEMM rate torch.matmul reaches on 8192³ in this process (the row 'ceiling/M8192_N8192_K8192', as bench/peers/
linear.py measures it standalone); the read bandwidth tessera-bench's measured read ceiling (merged), else the copy
bandwidth measured here. FLOPs = 2·P·Co·K (P = N·Ho·Wo), bytes = x + y + the prepacked codes and pairs (tessera's,
bench/conv_cases.cpp's rule).
"""

import re

from . import common as C
from .common import Case, Row

OP = "conv2d"
CEILING_OP = "torch_bf16_gemm"  # the ceiling row (this script's only; tessera-bench has none)
# bench/compare.py registers these with bench/peers/merge.py: the tessera-bench ops this family parses, the --op list
# of `--ops conv`, the labels of C++ peers (none), the table's title.
MERGED_OPS = (OP,)
BENCH_OPS = [OP]
CPP_PEER_LABELS = {}
TITLE = "int4 / int8-weight conv2d"
PEERS = ("cudnn",)
LABEL = "cuDNN"

CEILING_DIM = 8192  # bf16 GEMM ceiling: torch.matmul of this cube
CPU_CEILING_DIM = 512  # TESSERA_COMPARE_DEVICE=cpu smoke tests: a small cube (the times mean nothing there)

# bench/conv_cases.cpp's geometries: (n, ci, h, w, co, kh, kw, stride, pad, groups)
GEOMETRIES = {
    "1": (1, 256, 56, 56, 256, 3, 3, 1, 1, 1),
    "2": (8, 512, 28, 28, 512, 3, 3, 1, 1, 1),
    "3": (32, 64, 112, 112, 128, 3, 3, 2, 1, 1),
    "4": (16, 1024, 14, 14, 1024, 1, 1, 1, 0, 1),
    "dw": (8, 384, 28, 28, 384, 3, 3, 1, 1, 384),
    "stem": (8, 3, 224, 224, 64, 7, 7, 2, 3, 1),
}
# Its grid, in its order: (geometry, x layout, bits, block kind: "group" = 128 where it divides K else 64, "channel").
GRID = [
    ("1", "nhwc", 4, "group"), ("1", "nhwc", 8, "group"), ("1", "nchw", 4, "group"),
    ("2", "nhwc", 4, "group"), ("2", "nhwc", 8, "group"),
    ("3", "nhwc", 4, "group"), ("3", "nhwc", 8, "group"),
    ("4", "nhwc", 4, "group"), ("4", "nhwc", 8, "group"),
    ("dw", "nhwc", 4, "channel"), ("dw", "nhwc", 8, "channel"),
    ("stem", "nhwc", 4, "channel"), ("stem", "nhwc", 8, "channel"),
]
# tessera::conv::conv_path_name's names, as a standalone run spells the cases (a merged run takes tessera-bench's).
PATH_NAMES = {"linear": "linear", "implicit_gemm": "implicit_gemm", "direct": "direct"}

_NAME = re.compile(r"^B(\d+)_C(\d+)_(\d+)x(\d+)_(\d+)x(\d+)(?:_s(\d+))?(?:_p(\d+))?(?:_g(\d+))?_Co(\d+)/"
                   r"(nhwc|nchw)/int(4|8)_(g\d+|channel)_zp/(\w+)$")


def _out_size(size, k, stride, pad):
    return (size + 2 * pad - (k - 1) - 1) // stride + 1  # PyTorch's rule, dilation 1 (Python's // floors)


def _expected_path(n, ci, h, w, co, kh, kw, stride, pad, groups):
    """bench/conv_cases.cpp's expected_path (tessera/conv.h's rules)."""
    if kh == kw == 1 and stride == 1 and pad == 0 and groups == 1 and ci % 8 == 0:
        return "linear"
    pixels = n * _out_size(h, kh, stride, pad) * _out_size(w, kw, stride, pad)
    if ((ci // groups) % 64 == 0 and (groups == 1 or (co // groups) % 128 == 0) and pad <= 127 and stride <= 8
            and max(kh, kw) - 1 <= 255 and max(kh, kw) - 1 - pad <= 128 and pixels < (1 << 24)):
        return "implicit_gemm"
    return "direct"


def _geometry_name(n, ci, h, w, co, kh, kw, stride, pad, groups):
    s = f"B{n}_C{ci}_{h}x{w}_{kh}x{kw}"
    s += f"_s{stride}" if stride != 1 else ""
    s += f"_p{pad}" if pad else ""
    s += f"_g{groups}" if groups != 1 else ""
    return s + f"_Co{co}"


def case_name(geometry, layout, bits, block_kind):
    g = GEOMETRIES[geometry]
    n, ci, h, w, co, kh, kw, stride, pad, groups = g
    k = kh * kw * ci // groups
    block = "channel" if block_kind == "channel" else f"g{128 if k % 128 == 0 else 64}"
    return f"{_geometry_name(*g)}/{layout}/int{bits}_{block}_zp/{PATH_NAMES[_expected_path(*g)]}"


def registry():
    """tessera-bench's conv2d cases (every one: its --all list)."""
    return [(OP, case_name(*entry)) for entry in GRID]


def ceiling_name():
    d = CEILING_DIM if C.ON_GPU else CPU_CEILING_DIM
    return f"ceiling/M{d}_N{d}_K{d}"


def parse(op, name):
    if op == CEILING_OP:
        mt = re.match(r"^ceiling/M(\d+)_N(\d+)_K(\d+)$", name)
        return dict(kind="ceiling", m=int(mt.group(1)), n=int(mt.group(2)), k=int(mt.group(3))) if mt else None
    mt = _NAME.match(name)
    if op != OP or not mt:
        return None
    n, ci, h, w, kh, kw = (int(mt.group(i)) for i in range(1, 7))
    stride, pad, groups = int(mt.group(7) or 1), int(mt.group(8) or 0), int(mt.group(9) or 1)
    co, bits = int(mt.group(10)), int(mt.group(12))
    k = kh * kw * ci // groups
    ho, wo = _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)
    block = k if mt.group(13) == "channel" else int(mt.group(13)[1:])
    return dict(kind="conv", n=n, ci=ci, h=h, w=w, co=co, kh=kh, kw=kw, stride=stride, pad=pad, groups=groups,
                layout=mt.group(11), bits=bits, block=block, path=mt.group(14), k=k, ho=ho, wo=wo, pixels=n * ho * wo)


def nbytes(spec):
    """Bytes of one call as tessera-bench counts them: x + y + the prepacked codes and (scale, zero) pairs."""
    if spec["kind"] == "ceiling":
        return 2.0 * (spec["m"] * spec["k"] + spec["n"] * spec["k"] + spec["m"] * spec["n"])
    tile = 64 if spec["bits"] == 4 else 32
    k, block = spec["k"], spec["block"]
    np_ = -(-spec["co"] // 16) * 16
    kp = -(-k // tile) * tile
    blocks = 1 if block == k else kp // block
    codes = np_ * kp * spec["bits"] / 8
    return (codes + 4.0 * np_ * blocks + 2.0 * spec["n"] * spec["h"] * spec["w"] * spec["ci"]
            + 2.0 * spec["pixels"] * spec["co"])


def flops(spec):
    if spec["kind"] == "ceiling":
        return 2.0 * spec["m"] * spec["n"] * spec["k"]
    return 2.0 * spec["pixels"] * spec["co"] * spec["k"]


def keep(case, args):
    """--conv-cases: substrings of the case name (any matches)."""
    subs = [c for c in getattr(args, "conv_cases", "").split(",") if c]
    return not subs or any(s in case.name for s in subs)


def cases_from_args(args):
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry()) if keep(c, args)]


def _peers(args):
    return {p for p in getattr(args, "conv_peers", ",".join(PEERS)).split(",") if p}


# ---- rows -------------------------------------------------------------------------------------------------------


def rows(cases, args):
    """Cases grouped by (geometry, x layout), so that one cuDNN measurement serves the int4 and int8 rows; then the
    bf16 GEMM ceiling row."""
    torch = C.torch
    groups = {}
    for case in cases:
        if case.spec is None or case.spec.get("kind") != "conv" or not keep(case, args):
            continue
        groups.setdefault(case.name.split("/")[0] + "/" + case.spec["layout"], []).append(case)
    if not groups:
        return []
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        out = C.guarded_rows(list(groups.values()), lambda group, gi: _group_rows(group, args, 7000 + 100 * gi))
        name = ceiling_name()
        ceiling = Case(CEILING_OP, name, parse(CEILING_OP, name))
        out += C.guarded_rows([[ceiling]], lambda group, gi: [_ceiling_row(group[0], args, 6900)])
        return out
    finally:
        torch.backends.cudnn.benchmark = saved
        C.empty_cache()


def _random_bf16(shape, gen):
    return C.torch.empty(shape, device=C.DEVICE).uniform_(-1.0, 1.0, generator=gen).bfloat16()


def _cudnn_note():
    torch = C.torch
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (f"{LABEL} = torch.nn.functional.conv2d in bf16, channels_last x (NCHW x on nchw rows) and W, "
            f"cudnn.benchmark on, warm-up first (cuDNN {version or 'not available'}); one measurement per geometry "
            "and x layout, on its int4 and int8 rows")


def _measure_peer(s, args, seed):
    """(times, errors, rel err, notes) of F.conv2d on the dense bf16 equivalent of the case."""
    torch = C.torch
    F = torch.nn.functional
    n, ci, h, w, co, kh, kw = (s[key] for key in ("n", "ci", "h", "w", "co", "kh", "kw"))
    stride, pad, groups = s["stride"], s["pad"], s["groups"]
    ci_g = ci // groups
    x_bytes, w_bytes = 2.0 * n * h * w * ci, 2.0 * co * kh * kw * ci_g
    sets = C.rotating_sets(x_bytes + w_bytes)
    g = C.generator(seed)
    if s["layout"] == "nchw":
        xs = [_random_bf16((n, ci, h, w), g) for _ in range(sets)]  # contiguous NCHW
    else:
        xs = [_random_bf16((n, h, w, ci), g).permute(0, 3, 1, 2) for _ in range(sets)]  # channels_last [N, Ci, H, W]
    ws = [_random_bf16((co, kh, kw, ci_g), g).permute(0, 3, 1, 2) for _ in range(sets)]  # channels_last W
    fns = [(lambda x=x, wt=wt: F.conv2d(x, wt, None, stride, pad, 1, groups)) for x, wt in zip(xs, ws)]
    notes = []
    try:
        y0 = fns[0]()  # cudnn.benchmark: the algorithm search, outside the timed region
        for f in fns[1:]:
            f()
        C.sync()
    except Exception as e:  # noqa: BLE001
        C.sync_quietly()
        return {}, [f"unavailable ({C.short(e)})"], None, notes
    if C.ON_GPU and not y0.is_contiguous(memory_format=torch.channels_last):
        notes.append(f"{LABEL}: its y is not channels_last (strides {tuple(y0.stride())})")
    err = None
    try:
        ref = F.conv2d(xs[0][:1].double(), ws[0].double(), None, stride, pad, 1, groups)
        err = C.rel_error(y0[:1].double(), ref)
        notes.append(f"{LABEL}: rel err {err:.1e} over image 0 against the float64 conv of its bf16 inputs")
        del ref
    except Exception as e:  # noqa: BLE001 - the timing still counts
        notes.append(f"{LABEL}: rel err not computed ({C.short(e)})")
    del y0
    est_us = max(flops(s) / 400e12, nbytes(s) / 3.0e12) * 1e6
    times, errs = C.timed(C.rotating(fns), C.calls_for(est_us, sets), args)
    return times, errs, err, notes


def _group_rows(group, args, seed):
    out = [Row(case.op, case.name, nbytes(case.spec), flops(case.spec)) for case in group]
    if "cudnn" not in _peers(args):
        return out
    times, errs, err, notes = _measure_peer(group[0].spec, args, seed)
    for row in out:
        row.add_peer(LABEL, times, errs, [_cudnn_note()] + notes)
        row.rel_err[LABEL] = err
    return out


def _ceiling_row(case, args, seed):
    torch = C.torch
    s = case.spec
    row = Row(case.op, case.name, nbytes(s), flops(s))
    g = C.generator(seed)
    a, b = _random_bf16((s["m"], s["k"]), g), _random_bf16((s["n"], s["k"]), g)
    y = torch.empty((s["m"], s["n"]), dtype=torch.bfloat16, device=C.DEVICE)
    calls = C.calls_for(flops(s) / 700e12 * 1e6)
    C.run_peer_fn(row, "torch bf16", lambda: torch.matmul(a, b.t(), out=y), calls, args)
    return row


# ---- table ------------------------------------------------------------------------------------------------------


def _ceiling(rows):
    """(TFLOP/s, case name) of the ceiling row: torch.matmul's graph time (eager if its capture failed)."""
    for r in rows:
        if r.op == CEILING_OP:
            _, t, _ = r.headline("torch bf16")
            return (r.flops / (t * 1e-6) / 1e12 if t else None), r.case
    return None, None


def _read_bps(rows, copy_bps):
    """tessera-bench's read ceiling (from any merged row's GB/s and % read BW), else the copy bandwidth here."""
    for r in rows:
        b = r.bench or {}
        if b.get("gbps") and b.get("pct_read_bw"):
            return b["gbps"] * 1e9 * 100.0 / b["pct_read_bw"], "read"
    return copy_bps, "read (copy)"


def _bound(r, ceiling, read_bps, read_label):
    """(bound, % of its ceiling) of one conv row (tessera's time)."""
    if not ceiling:
        return "-", None
    compute_s = r.flops / (ceiling * 1e12)
    read_s = r.bytes / read_bps if read_bps else 0.0
    if compute_s >= read_s:
        tf = r.tflops()
        return "compute", (100.0 * tf / ceiling if tf else None)
    if r.bench is not None and read_label == "read":
        return read_label, r.bench.get("pct_read_bw")
    bw = r.gbps()
    return read_label, (100.0 * bw * 1e9 / read_bps if (bw and read_bps) else None)


def print_family(rows, copy_bps=None):
    """The conv2d table: per case tessera's µs (tessera-bench's), the bound and the % of its ceiling, TFLOP/s, then
    cuDNN's µs and cuDNN / tessera, tessera's rel err (tessera-bench --check) and cuDNN's TFLOP/s."""
    if not rows:
        return
    merged = any(r.bench is not None for r in rows)
    ceiling, ceiling_case = _ceiling(rows)
    read_bps, read_label = _read_bps(rows, copy_bps)
    body_rows = [r for r in rows if r.op != CEILING_OP]
    for r in body_rows:
        err = (r.bench or {}).get("check_error")
        if err is not None and "tessera" not in r.rel_err:
            r.rel_err["tessera"] = err
    labels = C.peer_labels(body_rows)
    head = ["case", "tessera µs", "bound", "% ceil", "TFLOP/s"] + C.peer_head(labels)
    head += [f"{label} TFLOP/s" for label in labels]
    body = []
    eager_marks = False
    for r in body_rows:
        cells = [r.case, C.fmt_us(r.tessera_us("graph") or r.tessera_us("eager"))]
        bound, pct = _bound(r, ceiling, read_bps, read_label)
        cells += [bound, C.fmt_num(pct, ".1f"), C.fmt_num(r.tflops(), ".1f")]
        peer, eager = C.peer_cells(r, labels)
        cells += peer
        for label in labels:
            _, us, _ = r.headline(label)
            cells.append(C.fmt_num(r.flops / (us * 1e-6) / 1e12 if (us and r.flops) else None, ".1f"))
        eager_marks |= eager
        body.append(cells)
    print(f"== {TITLE}")
    print("% ceil: compute-bound rows against the bf16 GEMM ceiling, " +
          (f"{ceiling:.0f} TFLOP/s (torch.matmul {ceiling_case.split('/', 1)[1]} in this process)" if ceiling
           else "not measured in this run") + "; read-bound rows against " +
          ("tessera-bench's measured read ceiling" if merged and read_label == "read"
           else "the copy bandwidth measured here (read (copy))") +
          ("" if merged else "\ntessera µs: tessera-bench's, in a merged run (--with-bench / --bench-json) only") +
          "\nrel err: tessera-bench's --check error of the row (merged runs with --bench-args=--check)")
    C.print_aligned(head, body, text_cols=(0, 2))
    # the peer's description once; its other notes once per (geometry, x layout), the rows it serves
    C.print_row_notes(rows, eager_marks,
                      key=lambda r, text: (None if text.startswith(f"{LABEL} = ") else "/".join(r.case.split("/")[:2]),
                                           text),
                      tag=lambda r: "/".join(r.case.split("/")[:2]) if r.op == OP else r.case, dedup_errors=True)
