"""Shared pieces of bench/compare.py's peers: imports, timing, the copy ceiling, rotating input sets, the row model
and the tables.

Timing (the same for tessera and every peer, all in this one process):
  eager  `calls` back-to-back calls between two CUDA events, after `warmup` calls; median over `reps` samples.
  graph  `calls` calls captured into one CUDA graph; median over `reps` replays, divided by `calls`.
Inputs rotate over `sets` copies where one set is under twice the L2 (tessera-bench's rule, bench/harness.cpp), so
a repeated call does not read the cache that its predecessor left warm; `calls` is then a multiple of `sets`.

TESSERA_COMPARE_DEVICE=cpu runs the peers on the CPU with wall-clock timing, "graph" mode being plain calls: a smoke
test of the script itself (shapes, parsing, tables, JSON) on a machine without a GPU; its times mean nothing.
"""

import math
import os
import statistics
import time

try:
    import torch
    TORCH_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - --help works without torch; the driver reports it
    torch = None
    TORCH_IMPORT_ERROR = f"import torch failed: {type(e).__name__}: {e}"

try:
    import tessera
    TESSERA_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report whatever went wrong, keep benchmarking the peers
    tessera = None
    TESSERA_IMPORT_ERROR = f"import tessera failed: {type(e).__name__}: {e}"

DEVICE = os.environ.get("TESSERA_COMPARE_DEVICE", "cuda")
ON_GPU = DEVICE != "cpu"

_OPTIONAL = {}
NOTES = []  # run-wide notes (peer libraries' first-use build times, ...), printed once after the tables


def optional_module(name):
    """(module, None) or (None, why not): a peer library imported once, on first use. A missing peer is a note in
    the table, never an error."""
    if name not in _OPTIONAL:
        try:
            _OPTIONAL[name] = (__import__(name), None)
        except Exception as e:  # noqa: BLE001 - not installed, or installed without its dependencies
            _OPTIONAL[name] = (None, f"{name} not importable ({short(e)})")
    return _OPTIONAL[name]


def short(e, limit=200):
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def sync_quietly():
    """After a failed call: wait for the queue; a sticky device error shows up in the later rows, not here."""
    try:
        sync()
    except Exception:  # noqa: BLE001
        pass


def empty_cache():
    if ON_GPU:
        torch.cuda.empty_cache()


def guarded_rows(groups, make_rows):
    """make_rows(group, index) -> Rows, for each group (a list of cases that share inputs); a group whose setup
    raises becomes one error row per case, so that one broken case never hides the others."""
    out = []
    for index, group in enumerate(groups):
        try:
            out += make_rows(group, index)
        except Exception as e:  # noqa: BLE001
            for case in group:
                r = Row(case.op, case.name)
                r.errors.append(f"setup: {short(e)}")
                out.append(r)
            sync_quietly()
        empty_cache()
    return out


def fp8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ---- timing -----------------------------------------------------------------------------------------------------


def _time_cpu(fn, calls, reps, warmup):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(1, min(reps, 3))):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


def _event_median(run, work, reps):
    """Median over `reps` samples of run() between two CUDA events, in us per unit of `work`."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / work)
    return statistics.median(samples)


def time_eager(fn, calls, reps, warmup):
    if not ON_GPU:
        return _time_cpu(fn, calls, reps, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(calls):
            fn()

    return _event_median(run, calls, reps)


def time_graph(fn, calls, reps, warmup):
    if not ON_GPU:
        return _time_cpu(fn, calls, reps, warmup)  # the smoke test walks the graph-mode paths with plain calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    try:
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        return _event_median(graph.replay, calls, reps)
    finally:
        del graph
        torch.cuda.empty_cache()


def measure(fn, mode, calls, reps, warmup):
    """(µs, None) or (None, error text)."""
    try:
        if mode == "graph":
            return time_graph(fn, calls, reps, warmup), None
        return time_eager(fn, calls, reps, warmup), None
    except Exception as e:  # noqa: BLE001
        sync_quietly()
        return None, short(e)


def timed(fn, calls, args, modes=("eager", "graph")):
    """{mode: µs | None} and the error texts of fn in each mode. With args.graph_first (merged runs, where the
    tables use graph times only) eager is measured only when the graph capture failed."""
    if getattr(args, "graph_first", False):
        modes = ("graph", "eager")
    times, errors = {}, []
    for mode in modes:
        if mode == "eager" and getattr(args, "graph_first", False) and times.get("graph"):
            continue
        t, err = measure(fn, mode, calls, args.reps, args.warmup)
        times[mode] = t
        if err:
            errors.append(f"{mode}: {err}")
    return times, errors


def copy_bandwidth(reps=20):
    """The copy ceiling as tessera-bench measures it: a device-to-device copy of 1 GiB (512 MiB if that does not
    fit), (bytes read + bytes written) / median time. Returns (bytes per second, bytes of one copy)."""
    if not ON_GPU:
        return None, 0
    for nbytes in (1 << 30, 1 << 29):
        try:
            src = torch.ones((nbytes,), dtype=torch.uint8, device=DEVICE)
            dst = torch.empty_like(src)
            us = time_eager(lambda: dst.copy_(src), 1, reps, 3)
        except RuntimeError:  # out of memory
            continue
        finally:
            torch.cuda.empty_cache()
        return 2 * nbytes / (us * 1e-6), nbytes
    return None, 0


def l2_bytes():
    if not ON_GPU:
        return 50 << 20
    dev = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(dev, "L2_cache_size", 0) or 50 << 20  # older torch: assume H100's 50 MiB


def rotating_sets(input_bytes, cap=32):
    """Input sets whose rotation exceeds twice the L2 (bench/harness.cpp's rotating_sets), at most cap."""
    return max(1, min(cap, int(2 * l2_bytes() // max(input_bytes, 1)) + 1))


def calls_for(est_us, sets=1, target_us=1500.0, most=50):
    """Calls per timed sample: about target_us of work (1..most), then a multiple of the rotating sets."""
    calls = max(1, min(most, int(math.ceil(target_us / (max(est_us, 0.0) + 5.0)))))
    return -(-calls // sets) * sets


def rotating(fns):
    """One callable that runs fns[0], fns[1], ... in turn (input sets rotate across calls and graph captures)."""
    if len(fns) == 1:
        return fns[0]
    state = [0]

    def fn():
        f = fns[state[0] % len(fns)]
        state[0] += 1
        return f()
    return fn


def rel_error(got, ref):
    """||got - ref||_F / ||ref||_F (NaN in got shows up as NaN)."""
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


class SplitMix64:
    """tessera-bench's Rng (bench/harness.h), so both benchmarks draw the same group sizes and lengths."""

    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.state = seed & self.MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n


# ---- rows -------------------------------------------------------------------------------------------------------


class Case:
    """A case of tessera-bench (op and case name exactly as bench/*_cases.cpp registers them) and the family's
    parsed description of it."""

    def __init__(self, op, name, spec):
        self.op, self.name, self.spec = op, name, spec

    def __repr__(self):
        return f"{self.op} {self.name}"


class Row:
    """One tessera case against its peers. Times are per-call µs by mode ('eager', 'graph'); peers[label] holds the
    peer's times; bench is tessera-bench's JSON row for the case when the run merges one (its µs is then the
    tessera time the ratios use; the tessera µs measured here is a cross-check)."""

    def __init__(self, op, case, nbytes=0.0, flops=0.0):
        self.op, self.case, self.bytes, self.flops = op, case, float(nbytes), float(flops)
        self.tessera = {}  # mode -> µs | None, through tessera's Python API, in this process
        self.peers = {}  # label -> {mode -> µs | None}
        self.rel_err = {}  # "tessera" | label -> relative error against the family's reference
        self.errors, self.notes = [], []
        self.bench = None  # tessera-bench row (dict) or None

    def add_peer(self, label, times, errors=(), notes=()):
        self.peers[label] = dict(times)
        self.errors += [f"{label} {e}" for e in errors]
        self.notes += list(notes)

    def tessera_us(self, mode="graph"):
        """The tessera time ratios divide by: tessera-bench's (graph / stream) when merged, else this process's."""
        if self.bench is not None:
            key = "graph_us" if mode == "graph" else "stream_us"
            return self.bench.get(key)
        return self.tessera.get(mode)

    def ratio(self, label, mode="graph"):
        """peer µs / tessera µs of one mode (> 1: tessera is faster); None where either is missing."""
        t, p = self.tessera_us(mode), self.peers.get(label, {}).get(mode)
        return p / t if (t and p) else None

    def headline(self, label):
        """(mode, peer µs, ratio): graph where the peer has a graph time, else eager (vs tessera eager/stream)."""
        times = self.peers.get(label, {})
        for mode in ("graph", "eager"):
            if times.get(mode):
                return mode, times[mode], self.ratio(label, mode)
        return None, None, None

    def gbps(self):
        t = self.tessera_us("graph") or self.tessera_us("eager")
        return self.bytes / (t * 1e-6) / 1e9 if (t and self.bytes) else None

    def tflops(self):
        t = self.tessera_us("graph") or self.tessera_us("eager")
        return self.flops / (t * 1e-6) / 1e12 if (t and self.flops) else None

    def as_dict(self):
        peers = {}
        for label, times in self.peers.items():
            peers[label] = dict(us=times, peer_over_tessera={m: self.ratio(label, m) for m in ("eager", "graph")})
        d = dict(op=self.op, case=self.case, bytes=self.bytes, flops=self.flops, tessera_us=self.tessera,
                 gbps=self.gbps(), tflops=self.tflops(), peers=peers, rel_err=self.rel_err, errors=self.errors,
                 notes=list(dict.fromkeys(self.notes)))
        if self.bench is not None:
            d["bench"] = {k: self.bench.get(k) for k in ("us", "mode", "graph_us", "stream_us", "gbps", "pct_copy_bw",
                                                           "pct_read_bw", "tflops", "check", "error", "unsupported")}
        return d


# ---- tables -----------------------------------------------------------------------------------------------------


def fmt_us(t):
    if t is None:
        return "-"
    return f"{t:.2f}" if t < 100 else f"{t:.1f}"


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}"


def fmt_err(v):
    return "-" if v is None else f"{v:.1e}"


def fmt_num(v, spec):
    return "-" if v is None else format(v, spec)


def print_aligned(head, body, text_cols=(0,)):
    """A " | "-separated table: columns in text_cols left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return " | ".join(c.ljust(w) if i in text_cols else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for cells in body:
        print(line(cells))


def peer_labels(rows):
    labels = []
    for r in rows:
        for label in r.peers:
            if label not in labels:
                labels.append(label)
    return labels



def tessera_head(merged):
    """The header cells of tessera's times: its µs (tessera-bench's when merged), and this process's when merged."""
    return ["tessera µs"] + (["py µs"] if merged else [])


def tessera_cells(r, merged):
    """Row r's cells under tessera_head(merged)."""
    cells = [fmt_us(r.tessera_us("graph") or r.tessera_us("eager"))]
    if merged:
        cells.append(fmt_us(r.tessera.get("graph") or r.tessera.get("eager")))
    return cells


def peer_cells(r, labels):
    """Row r's cells under peer_head(labels): each peer's time and ratio (blank where it did not run), then tessera's
    rel err; and whether any peer time is eager ("e")."""
    cells, eager = [], False
    for label in labels:
        if label not in r.peers:
            cells += ["", ""]
            continue
        mode, us, ratio = r.headline(label)
        mark = "e" if mode == "eager" else ""
        eager |= bool(mark)
        cells += [fmt_us(us) + mark, fmt_ratio(ratio)]
    return cells + [fmt_err(r.rel_err.get("tessera"))], eager

def print_family(title, rows, copy_bps=None, metric="gbps"):
    """One family's table: a row per case; tessera's µs (tessera-bench's when merged, and this process's), its
    GB/s or TFLOP/s and % of a ceiling, then per peer its µs and peer/tessera; then the notes and errors."""
    if not rows:
        return
    merged = any(r.bench is not None for r in rows)
    labels = peer_labels(rows)
    head = ["case"] + (["op"] if len({r.op for r in rows}) > 1 else [])
    head += tessera_head(merged)
    head += ["TFLOP/s"] if metric == "tflops" else ["GB/s", "% copy" if not merged else "% ceil"]
    head += peer_head(labels)
    body = []
    eager_marks = False
    for r in rows:
        cells = [r.case] + ([r.op] if "op" in head else []) + tessera_cells(r, merged)
        if metric == "tflops":
            cells.append(fmt_num(r.tflops(), ".1f"))
        else:
            bw = r.gbps()
            cells.append(fmt_num(bw, ".0f"))
            if r.bench is not None:
                # decode reads far more than it writes: its ceiling is the read stream; the rest: the copy
                pct = r.bench.get("pct_read_bw") if r.op == "decode" else r.bench.get("pct_copy_bw")
                cells.append(fmt_num(pct, ".1f"))
            else:
                cells.append(fmt_num(100 * bw * 1e9 / copy_bps if (bw and copy_bps) else None, ".1f"))
        peer, eager = peer_cells(r, labels)
        cells += peer
        eager_marks |= eager
        body.append(cells)
    print(f"== {title}")
    print_aligned(head, body, text_cols=(0, 1) if "op" in head else (0,))

    # decode rows of one shape (its formats) share their peers' notes: each is printed once, under the shape
    def where(r):
        return r.case.rsplit("/", 1)[0] if r.op == "decode" else r.case

    print_row_notes(rows, eager_marks, key=lambda r, text: (where(r), text),
                    tag=lambda r: where(r) + (" | " + r.op if "op" in head else ""), dedup_errors=True)


def peer_head(labels):
    """The header cells after tessera's own: per peer its µs and peer / tessera, then tessera's rel err."""
    return [cell for label in labels for cell in (f"{label} µs", "x")] + ["rel err"]


def print_row_notes(rows, eager_marks, key, tag, dedup_errors):
    """A family table's footer: the eager-capture mark, then each row's notes and errors under "[tag(row)]"; a note
    (an error too when dedup_errors) is printed once per key(row, text); then an empty line."""
    if eager_marks:
        print("  e: this peer's CUDA-graph capture failed: its eager time against tessera's eager (stream) time")
    seen = set()
    for r in rows:
        for kind, texts in (("note ", r.notes), ("error", r.errors)):
            for text in dict.fromkeys(texts):
                k = key(r, text)
                if k in seen and (kind == "note " or dedup_errors):
                    continue
                seen.add(k)
                print(f"  {kind} [{tag(r)}] {text}")
    print()


def run_tessera_fn(row, make_fn, calls, args):
    """Times tessera (fn from make_fn(), called once first so argument errors read clearly) into row.tessera."""
    if tessera is None:
        row.errors.append(f"tessera: {TESSERA_IMPORT_ERROR}")
        return None
    try:
        fn = make_fn()
        fn()
        sync()
    except Exception as e:  # noqa: BLE001
        row.errors.append(f"tessera: {short(e)}")
        sync_quietly()
        return None
    row.tessera, errs = timed(fn, calls, args)
    row.errors += [f"tessera {e}" for e in errs]
    return fn


def run_peer_fn(row, label, fn, calls, args, first_call=True):
    """Times one peer into row.peers[label]; a peer that fails its first call is recorded as unavailable."""
    if first_call:
        try:
            fn()
            sync()
        except Exception as e:  # noqa: BLE001
            sync_quietly()
            row.peers[label] = {}
            row.errors.append(f"{label}: unavailable ({short(e)})")
            return False
    times, errs = timed(fn, calls, args)
    row.add_peer(label, times, errs)
    return True


def print_legend(merged):
    print("x = peer µs / tessera µs, CUDA-graph times of both (> 1: tessera is faster)")
    if merged:
        print("tessera µs = tessera-bench's graph time (its --json); py µs = tessera through its Python API in this "
              "process, next to\nthe peers (a cross-check of the two harnesses); % ceil = % of tessera-bench's "
              "read-stream bandwidth (decode)\nor of its copy bandwidth (the others); cuBLASLt = tessera-bench's C++ "
              "peer row of the same case")
    else:
        print("% copy = GB/s against the device-to-device copy measured at the start")
    print("rel err = ||tessera - reference||_F / ||reference||_F (the family's reference: see its notes)\n")
