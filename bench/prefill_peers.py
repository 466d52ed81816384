#!/usr/bin/env python3
"""Peers of tessera-bench's prefill rows (issue 17), timed in one process: torch SDPA with the cuDNN and the flash
backends (enable_gqa), FlashInfer's FA3 backend, plus a cuBLAS bf16 GEMM (torch.matmul 8192³) as the measured
tensor-core ceiling. Until the prefill op is in bench/compare.py, this script gives the peer columns of
docs/perf/prefill.md; tessera's own rows come from `tessera-bench --op prefill` in the same GPU session.

Cases. The six of bench/prefill_cases.cpp (same names, HQ/HKV/D, lengths and order of the zipf32 lengths: the same
1/rank rounding and the same SplitMix64 shuffle, seed 0x5eed), Sq = Sk per sequence, q/k/v bf16 normals; and the
chunked-prefill case hq32kv8/chunked/L32048/paged64/bf16/causal: one sequence, 2,048 new queries over 32,048 keys (30,000
cached + the 2,048 new), HQ32 HKV8 D128, causal bottom-right aligned (query i at position 30,000 + i).
FLOPs = 4·HQ·D per attended (query, key) pair, "executed-useful" as bench/prefill_cases.cpp's pairs(): per sequence
of n queries over L keys, n·(L - n) + n(n+1)/2 when causal (n² / 2 + n / 2 when L = n), n·L when not. The chunked
case: 4·32·128·2048·(30000 + 2049/2) = 1.04e12.

Peers (labels)
  cudnn, flash     F.scaled_dot_product_attention(q [B, HQ, S, D], k / v [B, HKV, S, D], is_causal, enable_gqa=True)
                   under sdpa_kernel(CUDNN_ATTENTION) / (FLASH_ATTENTION); equal lengths: one batched call, the zipf
                   case: one call per sequence (what a user without a varlen kernel does).
  flashinfer_fa3   flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend="fa3") over
                   packed q [T, HQ, D], k / v [T, HKV, D] (the same values), plan() once outside the timed region
                   (bench/peers/prefill_fi.py has the API as checked against the FlashInfer source).
  chunked case     flashinfer_fa3: BatchPrefillWithPagedKVCacheWrapper(..., backend="fa3") over a 64-token-page
                   cache (NHD; tessera-bench's pool of 504 pages and its shuffled page table, the same draw; last
                   page 48 tokens), causal=True (bottom-right aligned in FlashInfer: prefill_fi.py says where);
                   flashinfer_cudnn: the same wrapper with backend="cudnn" (cuDNN's paged
                   SDPA with its native bottom-right causal mask); cudnn / flash: SDPA on the same dense values
                   [1, H, L, D] with attn_mask=causal_lower_right(2048, 32048) under CUDNN_ATTENTION /
                   FLASH_ATTENTION; cudnn_bias: cuDNN with that mask materialized once as an additive bf16 bias.
                   torch's cuDNN graph only knows a top-left causal mask (set_causal_mask in aten's cudnn/MHA.cpp),
                   so CausalBias under CUDNN_ATTENTION falls to a boolean mask materialized on every call (flash and
                   memory-efficient being disabled by the context): the `kernels` column of the JSON says what ran.
Timing: graph mode (bench/peers/common.py: 2 calls captured into one CUDA graph, median of --reps replays); eager
when a peer's capture fails (marked 'e'). rel err: each peer's output against a float32 reference of sampled query
rows (both ends and the middle of the first and last sequence, every head); > 1e-2 is flagged.

    python3 bench/prefill_peers.py [--json PATH] [--only CASESUBSTR]... [--no-flashinfer] [--dry-run]
"""

import argparse
import importlib.util
import json
import math
import sys
import zlib

from peers import common as C

ZIPF_SEED = 0x5EED  # bench/prefill_cases.cpp: Rng rng(0x5eed) shuffles the zipf32 lengths
CHUNK_CACHED, CHUNK_NEW, CHUNK_PAGE = 30000, 2048, 64
CHECK_LIMIT = 1e-2  # rel err above which a row is flagged


class Case:
    """One prefill problem: per sequence q_lens[i] queries over kv_lens[i] keys (the queries are the last ones),
    page: the paged-cache page size of the chunked case (None: packed varlen)."""

    def __init__(self, name, hq, hkv, d, causal, q_lens, kv_lens=None, page=None):
        self.name, self.hq, self.hkv, self.d, self.causal = name, hq, hkv, d, causal
        self.q_lens = list(q_lens)
        self.kv_lens = list(kv_lens if kv_lens is not None else q_lens)
        self.page = page

    @property
    def chunked(self):
        return self.page is not None

    def pairs(self):
        """Attended (query, key) pairs per head (bench/prefill_cases.cpp's pairs(), with a cached prefix)."""
        total = 0.0
        for n, kv in zip(self.q_lens, self.kv_lens):
            total += float(n) * (kv - n) + 0.5 * n * (n + 1) if self.causal else float(n) * kv
        return total

    def flops(self):
        return 4.0 * self.hq * self.d * self.pairs()

    def pages(self):
        return -(-self.kv_lens[0] // self.page) if self.chunked else 0


def zipf_lengths():
    """bench/prefill_cases.cpp's zipf32 lengths in its order: 65536 / (r · H32) truncated, the rounding to rank 1,
    then a Fisher-Yates shuffle drawing SplitMix64(0x5eed).below(i + 1) for i = 31 .. 1."""
    harmonic = 0.0
    for r in range(1, 33):
        harmonic += 1.0 / r
    lengths = [int(65536.0 / (r * harmonic)) for r in range(1, 33)]
    lengths[0] += 65536 - sum(lengths)
    rng = C.SplitMix64(ZIPF_SEED)
    for i in range(31, 0, -1):
        j = rng.below(i + 1)
        lengths[i], lengths[j] = lengths[j], lengths[i]
    return lengths


def case_seed(op, name, index):
    """bench/harness.cpp's case_seed: FNV-1a over "op/name/", mixed with the set index."""
    h = 0xCBF29CE484222325
    for text in (op, name):
        for byte in (text + "/").encode():
            h = ((h ^ byte) * 0x100000001B3) & C.SplitMix64.MASK
    return h ^ ((0x9E3779B97F4A7C15 * (index + 1)) & C.SplitMix64.MASK)


def page_table(case):
    """(table, pool pages) as bench/prefill_cases.cpp's PrefillCacheCase draws them: a pool of B · pages + 3 pages,
    shuffled by SplitMix64(case_seed("prefill", name + "/pages", 0)) (Fisher-Yates, i = P-1 .. 1), sequence b's
    logical page j on physical page table[b · pages + j] = order[b · pages + j]."""
    pool = len(case.q_lens) * case.pages() + 3
    order = list(range(pool))
    rng = C.SplitMix64(case_seed("prefill", case.name + "/pages", 0))
    for i in range(pool - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order[:len(case.q_lens) * case.pages()], pool


CASES = [
    Case("hq32kv8/B1/S16384/causal", 32, 8, 128, True, [16384]),
    Case("hq32kv8/B1/S4096/causal", 32, 8, 128, True, [4096]),
    Case("hq32kv8/B8/S2048", 32, 8, 128, False, [2048] * 8),
    Case("hq16kv2_d64/B4/S8192/causal", 16, 2, 64, True, [8192] * 4),
    Case("hq16kv2_d256/B4/S8192/causal", 16, 2, 256, True, [8192] * 4),
    Case("hq32kv8/zipf32/T65536/causal", 32, 8, 128, True, zipf_lengths()),
    Case(f"hq32kv8/chunked/L{CHUNK_CACHED + CHUNK_NEW}/paged{CHUNK_PAGE}/bf16/causal", 32, 8, 128, True,
         [CHUNK_NEW], [CHUNK_CACHED + CHUNK_NEW], page=CHUNK_PAGE),
    # Short chunks in a batch (tessera's GQA packing case): 16 sequences, 64 new tokens over 4,096 cached each.
    Case("hq32kv8/chunk64/B16/L4160/paged64/bf16/causal", 32, 8, 128, True, [64] * 16, [4160] * 16, page=64),
]

RAGGED_PEERS = ("cudnn", "flash", "flashinfer_fa3")
CHUNKED_PEERS = ("cudnn", "cudnn_bias", "flash", "flashinfer_fa3", "flashinfer_cudnn")


def peers_of(case, args):
    peers = CHUNKED_PEERS if case.chunked else RAGGED_PEERS
    return [p for p in peers if not (args.no_flashinfer and p.startswith("flashinfer"))]


def selected_cases(args):
    if not args.only:
        return list(CASES)
    return [c for c in CASES if any(s in c.name for s in args.only)]


# ---- dry run ----------------------------------------------------------------------------------------------------


def describe(case):
    d = dict(case=case.name, hq=case.hq, hkv=case.hkv, d=case.d, causal=case.causal, sequences=len(case.q_lens),
             q_tokens=sum(case.q_lens), kv_tokens=sum(case.kv_lens), flops=case.flops())
    if len(set(case.q_lens)) > 1:
        d["q_lens"] = case.q_lens
    if case.chunked:
        table, pool = page_table(case)
        d.update(page_size=case.page, pages=case.pages(), pool_pages=pool,
                 last_page_len=case.kv_lens[0] - (case.pages() - 1) * case.page, page_table_head=table[:8])
    return d


def dry_run(cases, args):
    found = importlib.util.find_spec("flashinfer") is not None
    print(f"dry run: {len(cases)} case(s); no CUDA touched. flashinfer "
          f"{'found on the path (not imported)' if found else 'not found on the path'}"
          f"{' (--no-flashinfer)' if args.no_flashinfer else ''}")
    print(f"{'case':38s} {'HQ':>3s} {'HKV':>3s} {'D':>4s} {'causal':6s} {'seqs':>4s} {'q tok':>7s} {'kv tok':>7s} "
          f"{'FLOPs':>9s}  peers")
    out = []
    for c in cases:
        d = describe(c)
        d["peers"] = peers_of(c, args)
        out.append(d)
        print(f"{c.name:38s} {c.hq:3d} {c.hkv:3d} {c.d:4d} {str(c.causal):6s} {d['sequences']:4d} "
              f"{d['q_tokens']:7d} {d['kv_tokens']:7d} {d['flops']:9.3e}  {', '.join(d['peers'])}")
        if "q_lens" in d:
            print(f"  lengths (bench order): {d['q_lens']}")
        if c.chunked:
            print(f"  {d['pages']} pages of {c.page} (last {d['last_page_len']} tokens) in a pool of {d['pool_pages']}, "
                  f"page table {d['page_table_head']} ...; query i at position {c.kv_lens[0] - c.q_lens[0]} + i")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dry_run": True, "cases": out}, f, indent=1)
    return 0


# ---- GPU run ----------------------------------------------------------------------------------------------------


def time_peer(fn, args):
    """(µs, mode, note or error): graph mode, eager if the capture fails."""
    us, err = C.measure(fn, "graph", 2, args.reps, 2)
    if us is not None:
        return us, "graph", None
    us_e, err_e = C.measure(fn, "eager", 2, args.reps, 2)
    if us_e is not None:
        return us_e, "eager", f"graph capture failed ({err})"
    return None, None, f"graph: {err}; eager: {err_e}"


def kernel_names(fn, top=3):
    """The `top` GPU activities of one call by device time (a check of which kernel a peer really runs)."""
    torch = C.torch
    try:
        from torch.profiler import ProfilerActivity, profile
        C.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            C.sync()
        timed = []
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0)
            if t and t > 0:
                timed.append((t, ev.key))
        timed.sort(reverse=True)
        return [k if len(k) <= 100 else k[:97] + "..." for _, k in timed[:top]]
    except Exception as e:  # noqa: BLE001 - informational only
        C.sync_quietly()
        return [f"(profiler: {C.short(e, 80)})"] if torch is not None else None


class CaseData:
    """The inputs of one case. seqs: per sequence (q [1, HQ, n, D], k, v [1, HKV, L, D]) bf16 (views into the
    batched tensors where the lengths are equal); groups: the SDPA calls' inputs (one batched call, or one per
    sequence)."""

    def __init__(self, case):
        torch = C.torch
        torch.manual_seed(zlib.crc32(case.name.encode()))
        dev, bf16 = "cuda", torch.bfloat16
        if len(set(case.q_lens)) == 1 and len(set(case.kv_lens)) == 1:
            B, n, L = len(case.q_lens), case.q_lens[0], case.kv_lens[0]
            q = torch.randn(B, case.hq, n, case.d, dtype=bf16, device=dev)
            k = torch.randn(B, case.hkv, L, case.d, dtype=bf16, device=dev)
            v = torch.randn(B, case.hkv, L, case.d, dtype=bf16, device=dev)
            self.groups = [(q, k, v)]
            self.seqs = [(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(B)]
            self.batched = True
        else:
            self.seqs = [(torch.randn(1, case.hq, n, case.d, dtype=bf16, device=dev),
                          torch.randn(1, case.hkv, L, case.d, dtype=bf16, device=dev),
                          torch.randn(1, case.hkv, L, case.d, dtype=bf16, device=dev))
                         for n, L in zip(case.q_lens, case.kv_lens)]
            self.groups = self.seqs
            self.batched = False
        self.q_start = [0]
        for n in case.q_lens:
            self.q_start.append(self.q_start[-1] + n)

    def packed(self, which):
        """[sum of lengths, H, D] contiguous: q (0), k (1) or v (2) in FlashInfer's NHD token order."""
        torch = C.torch
        if self.batched:
            x = self.groups[0][which]
            return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()
        return torch.cat([s[which][0].transpose(0, 1) for s in self.seqs]).contiguous()

    def sdpa_getter(self, outs):
        """(sequence, row) -> [HQ, D] of an SDPA peer's outputs (one per group)."""
        if self.batched:
            return lambda s, i: outs[0][s, :, i, :]
        return lambda s, i: outs[s][0, :, i, :]

    def packed_getter(self, out):
        return lambda s, i: out[self.q_start[s] + i]


def samples(case):
    """(sequence, row) pairs of the check: both ends and the middle of the first and the last sequence."""
    picks = []
    for s in dict.fromkeys((0, len(case.q_lens) - 1)):
        n = case.q_lens[s]
        for i in dict.fromkeys((0, n // 2, n - 1)):
            picks.append((s, i))
    return picks


def reference(case, data):
    """{(sequence, row): [HQ, D] float32}: softmax(q·kᵀ / sqrt(D)) · v over the keys row i attends (bottom-right
    causal: keys 0 .. L - n + i), GQA as enable_gqa / FlashInfer map it (query head h reads KV head h // G)."""
    torch = C.torch
    G = case.hq // case.hkv
    scale = 1.0 / math.sqrt(case.d)
    ref = {}
    for s, i in samples(case):
        q, k, v = data.seqs[s]
        n, L = case.q_lens[s], case.kv_lens[s]
        end = (L - n) + i + 1 if case.causal else L
        qq = q[0, :, i, :].float().reshape(case.hkv, G, case.d)
        kk, vv = k[0, :, :end, :].float(), v[0, :, :end, :].float()
        p = torch.softmax(torch.einsum("ngd,nkd->ngk", qq, kk) * scale, dim=-1)
        ref[(s, i)] = torch.einsum("ngk,nkd->ngd", p, vv).reshape(case.hq, case.d)
    return ref


def rel_err(get, ref):
    num = den = 0.0
    for (s, i), r in ref.items():
        num += (get(s, i).float() - r).pow(2).sum().item()
        den += r.pow(2).sum().item()
    return math.sqrt(num / max(den, 1e-30))


class Runner:
    def __init__(self, args, ceiling):
        self.args, self.ceiling = args, ceiling
        self.rows, self.notes = [], []
        self.fi, self.fi_err = (None, "--no-flashinfer") if args.no_flashinfer else C.optional_module("flashinfer")
        self.workspace = None
        self.planned = set()  # (backend, D): the first plan() of each (its JIT load / build) gets a note

    def emit(self, case, peer, us=None, mode=None, error=None, rel=None, kernels=None, note=None):
        rec = {"case": case.name, "peer": peer}
        if us is not None:
            tf = case.flops() / (us * 1e-6) / 1e12
            rec.update(us=us, tflops=tf, pct_ceiling=100.0 * tf / self.ceiling, mode=mode)
        if error:
            rec["error"] = error
        if rel is not None:
            rec["rel_err"] = rel
        if kernels:
            rec["kernels"] = kernels
        if note:
            rec["note"] = note
        self.rows.append(rec)
        if us is None:
            print(f"{case.name:38s} {peer:16s} {'-':>10s} {'-':>8s} {'-':>7s}  {error}", flush=True)
            return
        flag = "" if rel is None else f"{rel:8.1e}" + ("  CHECK FAILED" if not rel <= CHECK_LIMIT else "")
        print(f"{case.name:38s} {peer:16s} {us:9.1f}{'e' if mode == 'eager' else ' '} {rec['tflops']:8.0f} "
              f"{rec['pct_ceiling']:6.1f}% {flag}", flush=True)

    def measure(self, case, peer, fn, get, ref):
        """First call outside the timed region (errors become the row), the check, the kernels, the timing."""
        try:
            outs = fn()
            C.sync()
            rel = rel_err(get(outs), ref)
        except Exception as e:  # noqa: BLE001
            C.sync_quietly()
            self.emit(case, peer, error=f"run failed: {C.short(e)}")
            return
        kernels = None if self.args.no_kernel_names else kernel_names(fn)
        us, mode, msg = time_peer(fn, self.args)
        if us is None:
            self.emit(case, peer, error=msg, rel=rel, kernels=kernels)
        else:
            self.emit(case, peer, us=us, mode=mode, rel=rel, kernels=kernels, note=msg)

    # -- peers --

    def sdpa(self, case, data, ref, peer):
        torch = C.torch
        F = torch.nn.functional
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if peer == "flash" else SDPBackend.CUDNN_ATTENTION
        kwargs = {"enable_gqa": True}
        if case.chunked:
            n, L = case.q_lens[0], case.kv_lens[0]
            if peer == "cudnn_bias":
                keep = torch.ones(n, L, dtype=torch.bool, device="cuda").tril_(diagonal=L - n)
                bias = torch.zeros(1, 1, n, L, dtype=torch.bfloat16, device="cuda")
                bias.masked_fill_(~keep, float("-inf"))
                del keep
                kwargs["attn_mask"] = bias
            else:
                from torch.nn.attention.bias import causal_lower_right
                kwargs["attn_mask"] = causal_lower_right(n, L)
        else:
            kwargs["is_causal"] = case.causal

        def call():
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(q, k, v, **kwargs) for q, k, v in data.groups]
        self.measure(case, peer, call, data.sdpa_getter, ref)
        kwargs.clear()

    def flashinfer(self, case, data, ref, peer):
        if self.fi is None:
            self.emit(case, peer, error=f"unavailable: {self.fi_err}")
            return
        torch = C.torch
        from peers import prefill_fi
        if self.workspace is None:
            self.workspace = torch.zeros((prefill_fi.WORKSPACE_BYTES,), dtype=torch.uint8, device="cuda")
        backend = "cudnn" if peer == "flashinfer_cudnn" else "fa3"
        try:
            if case.chunked:
                fn, out, plan_s = self._paged(prefill_fi, case, data, backend)
            else:
                q, k, v = data.packed(0), data.packed(1), data.packed(2)
                fn, out, plan_s = prefill_fi.ragged_fa3(self.fi, self.workspace, q, k, v, case.q_lens, case.kv_lens,
                                                        case.hq, case.hkv, case.d, case.causal)
        except Exception as e:  # noqa: BLE001
            C.sync_quietly()
            self.emit(case, peer, error=f"{backend} plan failed: {C.short(e)}")
            return
        key = (backend, case.d, case.chunked)
        if key not in self.planned:
            self.planned.add(key)
            self.notes.append(f"flashinfer: the first {backend} {'paged' if case.chunked else 'ragged'} plan() "
                              f"for D{case.d} took {plan_s:.1f} s (outside the timed region; {case.name})")
        self.measure(case, peer, fn, lambda _outs: data.packed_getter(out), ref)

    def _paged(self, prefill_fi, case, data, backend):
        """A chunked case's paged cache (built once per case): tessera-bench's pool and page table (page_table),
        every sequence's dense k / v tokens on its pages, the pool's other pages zero."""
        torch = C.torch
        if getattr(data, "paged_cache", None) is None:
            P, npages = case.page, case.pages()  # every sequence has the same length (its own pages)
            assert len(set(case.kv_lens)) == 1, case.kv_lens
            table, pool = page_table(case)
            table = torch.tensor(table, dtype=torch.int32, device="cuda")

            def to_pages(which):  # sequence b's [1, HKV, L, D] -> its logical page j on physical page table[b, j]
                cache = None
                for b, seq in enumerate(data.seqs):
                    x, L = seq[which], case.kv_lens[b]
                    if cache is None:
                        cache = torch.zeros(pool, P, case.hkv, case.d, dtype=x.dtype, device=x.device)
                    tokens = torch.zeros(npages * P, case.hkv, case.d, dtype=x.dtype, device=x.device)
                    tokens[:L] = x[0].transpose(0, 1)
                    cache[table[b * npages:(b + 1) * npages].long()] = tokens.view(npages, P, case.hkv, case.d)
                return cache
            data.paged_cache = (to_pages(1), to_pages(2), table, data.packed(0))
        k_cache, v_cache, table, q = data.paged_cache
        return prefill_fi.paged(self.fi, self.workspace, backend, q, k_cache, v_cache, table, case.q_lens,
                                case.kv_lens, case.page, case.hq, case.hkv, case.d, case.causal)

    def run_case(self, case):
        peers = peers_of(case, self.args)
        try:
            data = CaseData(case)
            ref = reference(case, data)
        except Exception as e:  # noqa: BLE001
            C.sync_quietly()
            for peer in peers:
                self.emit(case, peer, error=f"setup failed: {C.short(e)}")
            C.empty_cache()
            return
        for peer in peers:
            if peer.startswith("flashinfer"):
                self.flashinfer(case, data, ref, peer)
            else:
                self.sdpa(case, data, ref, peer)
            C.empty_cache()
        del data, ref
        C.empty_cache()


def measure_ceiling(args):
    torch = C.torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    t = C.time_graph(lambda: torch.matmul(a, b, out=out), 5, args.reps, 3)
    return t, 2.0 * 8192 ** 3 / (t * 1e-6) / 1e12  # the operands are freed on return


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", action="append", metavar="CASESUBSTR",
                    help="run the cases whose name contains this (repeatable: any of them)")
    ap.add_argument("--no-flashinfer", action="store_true", help="leave out the FlashInfer peers")
    ap.add_argument("--no-kernel-names", action="store_true",
                    help="skip the one profiled call per peer that records which GPU kernels ran")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and peers; touch no GPU")
    args = ap.parse_args()
    cases = selected_cases(args)
    if not cases:
        print(f"prefill_peers: no case matches {args.only}; the cases: {', '.join(c.name for c in CASES)}",
              file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(cases, args)
    torch = C.torch
    if torch is None or not C.ON_GPU or not torch.cuda.is_available():
        print(f"prefill_peers: needs torch with a CUDA device ({C.TORCH_IMPORT_ERROR or 'no CUDA device'})",
              file=sys.stderr)
        return 2

    t, ceiling = measure_ceiling(args)
    C.empty_cache()
    print(f"cuBLAS bf16 8192^3: {t:.1f} us, {ceiling:.0f} TFLOP/s (the measured ceiling)")
    runner = Runner(args, ceiling)
    runner.rows.append({"case": "gemm_bf16_8192", "peer": "cublas", "us": t, "tflops": ceiling, "pct_ceiling": 100.0,
                        "mode": "graph"})
    if runner.fi is not None:
        from peers import prefill_fi
        dims = [c.d for c in cases if any(p == "flashinfer_fa3" for p in peers_of(c, args))]
        note = prefill_fi.prebuild(dims)
        if note:
            runner.notes.append(note)
    elif not args.no_flashinfer:
        runner.notes.append(f"flashinfer peers unavailable: {runner.fi_err}")

    print(f"{'case':38s} {'peer':16s} {'us':>10s} {'TFLOP/s':>8s} {'% ceil':>7s} {'rel err':>8s}")
    for case in cases:
        runner.run_case(case)
    print("e: eager time (the peer's CUDA-graph capture failed); rel err: sampled rows against a float32 reference")
    for note in list(dict.fromkeys(runner.notes + C.NOTES)):
        print(f"  note  {note}")
    for rec in runner.rows:
        if rec.get("kernels") and rec["case"].startswith("hq32kv8/chunked"):
            print(f"  kernels [{rec['case']} {rec['peer']}] {' | '.join(rec['kernels'])}")
    if args.json:
        fi_version = getattr(runner.fi, "__version__", None) if runner.fi is not None else None
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "flashinfer": fi_version or f"unavailable: {runner.fi_err}", "ceiling_tflops": ceiling,
                       "reps": args.reps, "notes": list(dict.fromkeys(runner.notes + C.NOTES)),
                       "cases": [describe(c) for c in cases], "rows": runner.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
