"""One run of tessera-bench and the Python peers on the same case names, merged into one table.

tessera-bench runs first, alone on the GPU, with --json; its rows (op, case, graph / stream µs, GB/s, % of the copy
and read ceilings, TFLOP/s, its own C++ peers such as the cuBLASLt loops) choose the cases. The Python peers then
run those cases in this process, next to tessera called through its Python API (a cross-check of the two
harnesses), and every ratio divides a peer's time by tessera-bench's time of the same mode (graph unless a capture
failed).
"""

import json
import os
import shlex
import subprocess
import tempfile

from . import common as C
from . import decode, gate, gemm, permute
from .common import Case, Row

FAMILIES = {  # tessera op -> (family key, module)
    "fused_gate": ("gate", gate),
    "permute": ("permute", permute),
    "unpermute_reduce": ("unpermute", permute),
    "grouped_gemm_fp8": ("gemm", gemm),
    "grouped_gemm_fp8_masked": ("gemm", gemm),
    "grouped_gemm_bf16": ("gemm", gemm),
    "grouped_gemm_bf16_masked": ("gemm", gemm),
    "decode": ("decode", decode),
}
BENCH_OPS = {  # --ops item -> tessera-bench --op names (exact), C++ peers included
    "gate": ["fused_gate"],
    "permute": ["permute"],
    "unpermute": ["unpermute_reduce"],
    "gemm": ["grouped_gemm_fp8", "grouped_gemm_fp8_masked", "grouped_gemm_bf16", "grouped_gemm_bf16_masked",
             "cublaslt_fp8_loop", "cublaslt_bf16_loop"],
    "decode": ["decode"],
}
CPP_PEER_LABELS = {"cublaslt_fp8_loop": "cuBLASLt", "cublaslt_bf16_loop": "cuBLASLt"}
TITLES = dict(gate="fused_gate", permute="permute", unpermute="unpermute_reduce", gemm="grouped GEMM",
              decode="attention decode", other="tessera-bench rows without a Python peer")


def run_bench(path, args, all_ops):
    """Runs tessera-bench with --json; returns its parsed JSON. Raises RuntimeError when it produced none."""
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
    except OSError as e:
        raise RuntimeError(f"cannot run tessera-bench at {path!r}: {C.short(e)}") from e
    if args.save_bench_json:
        out = args.save_bench_json
    else:
        fd, out = tempfile.mkstemp(prefix="tessera-bench-", suffix=".json")
        os.close(fd)
    cmd = [path, "--json", out]
    if args.all:
        if "--all" in usage:
            cmd.append("--all")
    if not all_ops:
        cmd += ["--op", ",".join(op for o in args.ops_list for op in BENCH_OPS[o])]
    cmd += shlex.split(args.bench_args or "")
    print(f"$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    rc = subprocess.run(cmd).returncode
    print(flush=True)
    if rc not in (0, 1) or not os.path.exists(out) or not os.path.getsize(out):
        raise RuntimeError(f"tessera-bench exited with {rc} and wrote no JSON (command above)")
    with open(out) as f:
        data = json.load(f)
    if not args.save_bench_json:
        os.unlink(out)
    data["command"] = cmd
    data["exit_code"] = rc
    data["has_headline_subset"] = "--all" in usage
    return data


def cases_of(bench, args):
    """(family key -> [Case]) for the Python peers, and the tessera-bench rows in order."""
    by_family = {}
    for r in bench["rows"]:
        fam = FAMILIES.get(r["op"])
        if fam is None:
            continue
        key, module = fam
        if key not in args.ops_list:
            continue
        spec = module.parse(r["op"], r["case"])
        if spec is None:
            continue
        case = Case(r["op"], r["case"], spec)
        if not _kept(key, case, args):
            continue
        by_family.setdefault(key, []).append(case)
    return by_family


def _kept(key, case, args):
    if key == "gemm":
        return gemm.keep(case, args)
    if key == "decode":
        return decode.keep(case, args)
    if key == "gate":
        tokens = {int(t) for t in args.gate_tokens.split(",") if t.strip()}
        return not tokens or case.spec["T"] in tokens
    if key in ("permute", "unpermute"):
        return not args.tokens or case.spec["T"] == args.tokens
    return True


def merge(bench, results, ops_list):
    """Attaches tessera-bench's rows (and its C++ peers) to the Python rows; returns (family key -> [Row]) in
    tessera-bench's order, with a Row (no peers) for every tessera-bench row that has none here."""
    by_key = {(r.op, r.case): r for rows in results.values() for r in rows}
    cpp_peer_rows = [r for r in bench["rows"] if r.get("peer_of")]
    out = {}
    for b in bench["rows"]:
        if b.get("peer_of"):
            continue
        key = FAMILIES.get(b["op"], ("other", None))[0]
        if key not in ops_list and not (key == "other" and len(ops_list) == len(BENCH_OPS)):
            continue  # --ops left this family out
        row = by_key.get((b["op"], b["case"]))
        if row is None:
            row = Row(b["op"], b["case"], b.get("bytes") or 0.0, b.get("flops") or 0.0)
            if key != "other":
                row.notes.append("not run here (filtered out, or a case this script does not parse)")
            else:
                row.notes.append("no Python peer for this op")
            if key != "other":
                key = "other"
        row.bytes = b.get("bytes") or row.bytes
        row.flops = b.get("flops") or row.flops
        row.bench = b
        if b.get("error"):
            row.errors.append(f"tessera-bench: {b['error']}")
        if b.get("check") == "FAIL":
            row.errors.append(f"tessera-bench check FAIL: {b.get('check_message')}")
        for p in cpp_peer_rows:
            if p["case"] != b["case"] or b["op"] not in p["peer_of"]:
                continue
            label = CPP_PEER_LABELS.get(p["op"], p["op"])
            if p.get("unsupported"):
                row.notes.append(f"{label}: n/a ({p['unsupported']})")
                continue
            row.peers[label] = {"graph": p.get("graph_us"), "eager": p.get("stream_us")}
            row.notes.append(f"{label}: tessera-bench's C++ peer {p['op']} (same case, same harness)")
            if p.get("error"):
                row.errors.append(f"{label} (tessera-bench): {p['error']}")
        out.setdefault(key, []).append(row)
    # Python rows tessera-bench has no row for (a family that failed as a whole reports in one such row)
    attached = {id(r) for rows in out.values() for r in rows}
    for key, rows in results.items():
        for r in rows:
            if id(r) not in attached:
                out.setdefault(key, []).append(r)
    return out
