"""Builds, in parallel and before anything is timed, the FlashInfer JIT modules a run will need; otherwise each is
built on its first use, one after the other (gate 16 s, decode 17-18 s each, the tensor-core path's FA2 prefill
modules 80+ s each on 2 cores). Uses FlashInfer 0.7.2's module generators (flashinfer.jit.*), which are not its
public API: anything unexpected turns the prebuild off and the modules are built on first use as before. The specs
must name exactly the modules plan() / the first call will ask for (same dtypes, head dim, flags), or they are built
twice.
"""

import concurrent.futures
import time

from . import common as C


def _specs(cases_by_family, args):
    """[(name, JitSpec)] of the modules this run's FlashInfer peers will load."""
    torch = C.torch
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_decode_module
    from flashinfer.jit.dsv3_optimizations import gen_dsv3_fused_routing_module
    from . import gate

    specs = []
    if any(gate.flashinfer_serves(c.spec) is None for c in cases_by_family.get("gate", [])):
        specs.append(("gate", gen_dsv3_fused_routing_module()))
    decode_cases = [c for c in cases_by_family.get("decode", []) if c.spec["S"] == 1]
    peers = set(args.decode_peers.split(","))
    if decode_cases:
        kv_types = [torch.bfloat16]
        if any(c.spec["format"] == "fp8" for c in decode_cases):
            kv_types.append(C.fp8_dtype())
        for kv in kv_types:
            name = str(kv).replace("torch.", "")
            # the wrapper's plan(): indptr int32, head dim 128, no RoPE / window / soft-cap
            if "flashinfer" in peers:
                specs.append((f"decode {name}", gen_batch_decode_module(
                    torch.bfloat16, kv, torch.bfloat16, torch.int32, 128, 128, 0, False, False)))
            if "flashinfer_tc" in peers:
                # bf16 q: FA2 for either cache (FlashInfer's FA3 wants an fp8 q for fp8 KV); K and V of equal
                # strides run get_batch_prefill_module's primary module
                specs.append((f"decode tc {name}", _gen_batch_prefill_primary_module(
                    "fa2", torch.bfloat16, kv, torch.bfloat16, torch.int32, 128, 128, 0, False, False, False)))
    return specs


def prebuild(cases_by_family, args):
    """Builds the modules concurrently; returns a note for the run (or None when nothing was built)."""
    if args.no_flashinfer or not C.ON_GPU:
        return None
    fi, _ = C.optional_module("flashinfer")
    if fi is None:
        return None
    try:
        specs = _specs(cases_by_family, args)
    except Exception as e:  # noqa: BLE001 - another FlashInfer version: build on first use instead
        return f"flashinfer: no prebuild ({C.short(e)}); modules build on first use"
    if not specs:
        return None
    return build_concurrently(specs, "JIT modules")


def build_concurrently(specs, what, need_lock=False):
    """Builds [(label, JitSpec)] in parallel threads; returns the note for the run (wall time, per-module times,
    failures: a module that failed builds again, and reports its error, when its peer first uses it)."""
    t0 = time.perf_counter()
    done, failed = [], []

    def build(item):
        name, spec = item
        t = time.perf_counter()
        if need_lock:
            spec.build(need_lock=True)
        else:
            spec.build()
        return name, time.perf_counter() - t

    print(f"[flashinfer] building {len(specs)} {what} in parallel: {', '.join(n for n, _ in specs)} ...", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = {pool.submit(build, item): item[0] for item in specs}
        for f in concurrent.futures.as_completed(futures):
            try:
                name, secs = f.result()
                done.append(f"{name} {secs:.0f} s")
            except Exception as e:  # noqa: BLE001 - the peer reports its own failure when it runs
                failed.append(f"{futures[f]} ({C.short(e)})")
    note = f"flashinfer: {what} built before timing, in parallel, {time.perf_counter() - t0:.0f} s wall: " + \
        ", ".join(done)
    if failed:
        note += "; failed: " + ", ".join(failed)
    return note
