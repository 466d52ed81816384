"""Attention decode peers: FlashInfer's paged decode (CUDA-core and tensor-core kernels, bf16 and fp8 KV), torch SDPA
(cuDNN and flash backends) on a dense bf16 cache, and flash_attn.flash_attn_with_kvcache when importable.

Cases: tessera-bench's (bench/decode_cases.cpp) '<model>/B<batch>/T<capacity>[/paged<P> | /zipf | /uniform][/S<n>]
[/balanced]/<format>' (/balanced: tessera with balance_splits=True; the peers as without it), D = 128, q/o bf16: hq8kv1 (HQ 8, HKV 1), llama3_8b (HQ 32, HKV 8); the same lengths (skewed ones from
the same seed and generator). Values N(0, 1) bf16, quantized in torch by attention.h's rule (the per-channel key
formats 'int8_kchannel' / 'int4_kchannel': keys per channel over 32-token blocks, values per row); rotating input sets
where a cache is under twice the L2. S<n> cases (several new tokens per sequence) have no Python peer here.

Peers (labels in the table)
  FI, FI tc  flashinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout 'NHD', use_tensor_cores False / True) on
             tessera's own cache in the row's format where FlashInfer has it: bf16 for 'native', e4m3 for 'fp8' (one
             per-tensor k_scale / v_scale, FlashInfer's contract: the cache is re-quantized with the largest per-head
             scale, which is tessera's own cache where HKV = 1); the integer formats run FlashInfer on the bf16 cache
             (it has no integer KV; the per-channel key formats alike). Paged cases pass tessera's block table as FlashInfer's page list; contiguous ones
             view the [B, T, HKV, D] cache as 16-token pages with an identity page list. plan() runs once per case
             outside the timed region (its JIT modules are built before, in parallel: fi_jit.py).
  FI cudnn   (--decode-peers ...,flashinfer_cudnn) the same wrapper with backend='cudnn' (cuDNN's paged SDPA decode
             graph through FlashInfer), bf16 only: the paged cuDNN peer; every format's row gets its bf16 time.
  cuDNN, flash  F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION) / (FLASH_ATTENTION) on a dense
             bf16 cache K/V [B, HKV, L, D], q either [B, HQ, 1, D] with enable_gqa=True or packed [B, HKV, G, D] (the
             faster is kept; the notes say which); variable lengths: K/V cut to the longest sequence with a boolean
             key mask, or unmasked if the backend refuses masks (noted). No paging.
  fa_kvcache flash_attn.flash_attn_with_kvcache (if importable) on tessera's own bf16 cache with cache_seqlens (and
             the block table).
rel err: tessera's output against a float32 torch reference from its dequantized cache; the peers' (in the notes)
against the float32 reference of the bf16 values.
"""

import math
import re
import time
import warnings

from . import common as C
from .common import Case, Row

OP = "decode"
FORMATS = ("native", "fp8", "int8", "int4", "int4_group32", "int8_kchannel", "int4_kchannel")
CHANNEL = ("int8_kchannel", "int4_kchannel")  # keys: fp16 (scale, offset) per channel over blocks of KEY_BLOCK tokens
KEY_BLOCK = 32
MODELS = {"hq8kv1": (8, 1), "llama3_8b": (32, 8)}
LENGTH_SEED = 0xDEC0DE  # skewed lengths: the same seed and generator as bench/decode_cases.cpp
PEERS = ("flashinfer", "flashinfer_tc", "cudnn", "flash", "fa_kvcache", "flashinfer_cudnn")
DEFAULT_PEERS = PEERS[:5]  # flashinfer_cudnn (its cuDNN paged decode graph, bf16 only) on request
FI_LABELS = {"flashinfer": "FI", "flashinfer_tc": "FI tc", "flashinfer_cudnn": "FI cudnn"}
FI_PAGE = 16  # FlashInfer's page size over a contiguous cache
_NAME = re.compile(r"^(hq8kv1|llama3_8b)/B(\d+)/T(\d+)(?:/paged(\d+))?(?:/(zipf|uniform))?(?:/S(\d+))?(/balanced)?/"
                   r"(native|fp8|int8|int4|int4_group32|int8_kchannel|int4_kchannel)$")


def registry():
    """The decode cases of tessera-bench, in its order (S<n> ones included; they get no Python peer)."""
    names = []

    def add(shape, formats):
        names.extend(f"{shape}/{f}" for f in formats)

    paged_formats, bf16_int4 = ("native", "int8", "int4"), ("native", "int4")
    for B in (1, 8, 32, 64, 128, 256, 512):
        add(f"hq8kv1/B{B}/T8192", FORMATS)
    for B in (1, 16, 64):
        add(f"llama3_8b/B{B}/T4096", FORMATS)
    add("llama3_8b/B1/T131072", bf16_int4)
    for P in (16, 64):
        add(f"hq8kv1/B128/T8192/paged{P}", paged_formats)
        for B in (16, 64):
            add(f"llama3_8b/B{B}/T4096/paged{P}", paged_formats)
    balanced = []
    for dist in ("zipf", "uniform"):
        balanced += [f"hq8kv1/B64/T8192/{dist}", f"llama3_8b/B16/T4096/{dist}"]
    balanced += [f"hq8kv1/B{B}/T8192/zipf" for B in (8, 256)]
    for shape in balanced:
        add(shape, bf16_int4)
    balanced += [f"hq8kv1/B{B}/T8192" for B in (8, 64, 128)] + ["llama3_8b/B16/T4096"]
    for shape in balanced:
        add(f"{shape}/balanced", bf16_int4)
    for B in (16, 64):
        add(f"llama3_8b/B{B}/T4096/S4", paged_formats)
    add("hq8kv1/B128/T8192/S2", paged_formats)
    return [(OP, n) for n in names]


def parse(op, name):
    m = _NAME.match(name)
    if op != OP or not m:
        return None
    hq, hkv = MODELS[m.group(1)]
    return dict(shape=name.rsplit("/", 1)[0], B=int(m.group(2)), HQ=hq, HKV=hkv, D=128, T=int(m.group(3)),
                page_size=int(m.group(4) or 0), lengths=m.group(5) or "full", S=int(m.group(6) or 1),
                balanced=m.group(7) is not None, format=m.group(8))


def decode_lengths(kind, batch, capacity, seed=LENGTH_SEED):
    """Tokens per sequence, as bench/decode_cases.cpp draws them: full = capacity; zipf = capacity // rank for
    ranks 1..B in a random order; uniform = 1 + below(capacity)."""
    if kind == "full":
        return [capacity] * batch
    rng = C.SplitMix64(seed)
    if kind == "uniform":
        return [1 + rng.below(capacity) for _ in range(batch)]
    order = list(range(batch))
    for i in range(batch - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    lengths = [0] * batch
    for rank in range(batch):
        lengths[order[rank]] = max(1, capacity // (rank + 1))
    return lengths


def kv_row_bytes(fmt, d):
    return {"native": 2 * d, "fp8": d, "int8": d, "int8_kchannel": d}.get(fmt, d // 2)


def kv_scale_groups(fmt, d):
    """NG: (scale, offset) pairs per (token, head) row; 0 for native and fp8; the per-channel formats: 1, the
    values' pair (their keys' pairs are per 32-token block)."""
    return {"int8": 1, "int4": 1, "int4_group32": d // 32, "int8_kchannel": 1, "int4_kchannel": 1}.get(fmt, 0)


def decode_bytes(s, fmt, lengths):
    """Bytes one call moves, as tessera-bench counts them: the K and V rows (and fp16 scale pairs) of every attended
    token and KV head (the per-channel formats' keys: 4·D bytes per 32-token block attended instead of a pair per
    row), q, o, the lengths, the block-table entries used and the fp8 scales."""
    B, HQ, HKV, D, ps = (s[n] for n in ("B", "HQ", "HKV", "D", "page_size"))
    pairs_per_token = (1 if fmt in CHANNEL else 2) * 4 * kv_scale_groups(fmt, D)
    per_token = HKV * (2 * kv_row_bytes(fmt, D) + pairs_per_token)
    nbytes = sum(lengths) * per_token + 2 * (B * s["S"] * HQ * D * 2) + 4 * B
    if fmt in CHANNEL:
        nbytes += HKV * 4 * D * sum(-(-n // KEY_BLOCK) for n in lengths)
    if ps:
        nbytes += 4 * sum(-(-n // ps) for n in lengths)
    if fmt == "fp8":
        nbytes += 2 * 4 * HKV
    return nbytes


def _chunks(n, per_item, limit=1 << 26):
    """[b0, b1) ranges over a leading dim of n items of per_item elements: at most `limit` elements per range
    (at least one item), to bound the float32 temporaries."""
    step = max(1, limit // max(per_item, 1))
    return [(b, min(n, b + step)) for b in range(0, n, step)]


def _codes_of(torch, xf, lo, hi, levels):
    """attention.h's integer rule over a range: (codes uint8 (int4 not packed), scale fp16, offset fp16); xf float32
    broadcast against lo / hi."""
    scale = ((hi - lo) / levels).clamp_(max=65504.0).half()
    offset = lo.clamp(-65504.0, 65504.0).half()
    s, o = scale.float(), offset.float()
    c = torch.where(s > 0, ((xf - o) / s).round_().clamp_(0, levels), 0.0).to(torch.uint8)
    return c, scale, offset


def _quantize_keys_per_channel(x, fmt):
    """The per-channel formats' keys, every 32-token block full: codes [B, T, HKV, row], scales fp16
    [B, T / 32, HKV, 2 D] (the scale of channel d at d, its offset at D + d)."""
    torch = C.torch
    B, T, HKV, D = x.shape
    levels = 255 if fmt == "int8_kchannel" else 15
    codes = torch.empty((B, T, HKV, kv_row_bytes(fmt, D)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((B, T // KEY_BLOCK, HKV, 2 * D), dtype=torch.float16, device=x.device)
    for b0, b1 in _chunks(B, x[0].numel()):
        xf = x[b0:b1].float().unflatten(1, (T // KEY_BLOCK, KEY_BLOCK))  # [b, blocks, 32, HKV, D]
        c, scale, offset = _codes_of(torch, xf, xf.amin(2, keepdim=True), xf.amax(2, keepdim=True), levels)
        c = c.flatten(1, 2)
        if levels == 15:
            c = c[..., 0::2] | (c[..., 1::2] << 4)
        codes[b0:b1] = c
        scales[b0:b1] = torch.cat((scale, offset), -1).squeeze(2)
    return codes, scales


def quantize_kv(x, fmt, fp8_scale=None, keys=False):
    """bf16 values [B, T, HKV, D] -> (codes, scales) in tessera's cache layout (include/tessera/attention.h).
    native: x itself. fp8: e4m3(x / scale[h]) (saturated), scales = fp8_scale fp32 [HKV]. int8, int4,
    int4_group32: per group lo = min, hi = max, scale = fp16((hi - lo) / levels), offset = fp16(lo),
    code = clamp(rint((x - offset) / scale), 0, levels) or 0 where scale == 0; int4 packs element 2j in the low
    nibble; scales are fp16 (scale, offset) pairs [B, T, HKV, 2 NG]. int8_kchannel, int4_kchannel: the values
    as int8 / int4; with keys=True the same rule per channel over each 32-token block, scales [B, T / 32, HKV, 2 D]."""
    torch = C.torch
    if fmt == "native":
        return x, None
    if fmt in CHANNEL and keys:
        return _quantize_keys_per_channel(x, fmt)
    B, D = x.shape[0], x.shape[-1]
    ranges = _chunks(B, x[0].numel())
    if fmt == "fp8":
        codes = torch.empty(x.shape, dtype=C.fp8_dtype(), device=x.device)
        for b0, b1 in ranges:
            codes[b0:b1] = (x[b0:b1].float() / fp8_scale[:, None]).clamp_(-448.0, 448.0).to(C.fp8_dtype())
        return codes, fp8_scale
    levels = 255 if fmt in ("int8", "int8_kchannel") else 15
    ng = kv_scale_groups(fmt, D)
    codes = torch.empty((*x.shape[:-1], kv_row_bytes(fmt, D)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], 2 * ng), dtype=torch.float16, device=x.device)
    for b0, b1 in ranges:
        xf = x[b0:b1].float().unflatten(-1, (ng, D // ng))
        c, scale, offset = _codes_of(torch, xf, xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True), levels)
        c = c.flatten(-2)
        if levels == 15:
            c = c[..., 0::2] | (c[..., 1::2] << 4)
        codes[b0:b1] = c
        scales[b0:b1] = torch.cat((scale, offset), -1).flatten(-2)
    return codes, scales


def dequantize_kv(codes, scales, fmt, keys=False):
    """float32 values of a logical cache [b, T, HKV, D]: e4m3 * scale[h], or code * scale + offset per group; the
    per-channel formats' keys (keys=True): code * scale[d] + offset[d] of the token's 32-token block."""
    torch = C.torch
    if fmt == "native":
        return codes.float()
    if fmt == "fp8":
        return codes.float() * scales[:, None]
    c = codes if fmt in ("int8", "int8_kchannel") else torch.stack((codes & 15, codes >> 4), -1).flatten(-2)
    if fmt in CHANNEL and keys:
        D = c.shape[-1]
        blocks = scales.float().repeat_interleave(KEY_BLOCK, dim=1)  # [b, T, HKV, 2 D]
        return c.float() * blocks[..., :D] + blocks[..., D:]
    pairs = scales.float().unflatten(-1, (-1, 2))  # [..., NG, 2]
    return (c.float().unflatten(-1, (pairs.shape[-2], -1)) * pairs[..., 0:1] + pairs[..., 1:2]).flatten(-2)


def decode_reference(q, lengths, T, HKV, k_of, v_of):
    """float32 decode: o[b, h] = softmax_t(q[b, h] . K[b, t, h / G] / sqrt(D)) V[b, t, h / G] over t < L[b].
    k_of(b0, b1), v_of(b0, b1): float32 [b1 - b0, T, HKV, D] (the dequantized cache)."""
    torch = C.torch
    B, HQ, D = q.shape
    out = torch.empty((B, HQ, D), dtype=torch.float32, device=q.device)
    for b0, b1 in _chunks(B, T * HKV * D):
        k, v = k_of(b0, b1), v_of(b0, b1)
        n = b1 - b0
        qg = q[b0:b1].float().view(n, HKV, HQ // HKV, D)
        s = torch.einsum("bhgd,bthd->bhgt", qg, k) / math.sqrt(D)
        past = torch.arange(T, device=q.device)[None, :] >= lengths[b0:b1, None].long()
        s.masked_fill_(past[:, None, None, :], float("-inf"))
        out[b0:b1] = torch.einsum("bhgt,bthd->bhgd", s.softmax(-1), v).reshape(n, HQ, D)
    return out


class DecodeInputs:
    """A shape's inputs in `sets` rotating copies: bf16 K and V values [B, T, HKV, D] (standard normal) and q
    [B, HQ, D]; the lengths int32 [B]; for paged cases a block table int32 [B, T / page_size] over a random
    permutation of all B * T / page_size pages (shared by the sets); fp8 scales per set: amax per KV head / 448."""

    def __init__(self, s, sets, seed):
        torch = C.torch
        g = C.generator(seed)
        B, HQ, HKV, D, T = (s[n] for n in ("B", "HQ", "HKV", "D", "T"))
        self.s, self.sets = s, sets
        self.lengths_list = decode_lengths(s["lengths"], B, T)
        self.lengths = torch.tensor(self.lengths_list, dtype=torch.int32, device=C.DEVICE)
        self.max_len = max(self.lengths_list)
        self.q = [torch.randn((B, HQ, D), generator=g, device=C.DEVICE, dtype=torch.bfloat16) for _ in range(sets)]
        self.kv = [tuple(torch.randn((B, T, HKV, D), generator=g, device=C.DEVICE, dtype=torch.bfloat16)
                         for _ in range(2)) for _ in range(sets)]
        self.fp8_scales = [tuple(x.abs().amax(dim=(0, 1, 3)).float() / 448.0 for x in kv) for kv in self.kv]
        self.block_table = None
        if s["page_size"]:
            pages = T // s["page_size"]
            perm = torch.randperm(B * pages, generator=g, device=C.DEVICE)
            self.block_table = perm.view(B, pages).to(torch.int32)

    def paged(self, x, per_page=None):
        """A logical [B, T, HKV, ...] tensor in the paged layout [num_pages, page_size, HKV, ...] (per_page rows a
        page instead of page_size: the per-channel key blocks, page_size / 32)."""
        if self.block_table is None:
            return x
        ps = per_page or self.s["page_size"]
        raw = x.view(C.torch.uint8) if x.element_size() == 1 else x  # index_put has no fp8 kernels
        out = C.torch.empty((self.block_table.numel(), ps, *x.shape[2:]), dtype=raw.dtype, device=x.device)
        out[self.block_table.flatten().long()] = raw.reshape(-1, ps, *x.shape[2:])
        return out.view(x.dtype)

    def cache(self, fmt, st, fp8_scales=None):
        """Set st in format fmt: dict(k, v, k_scale, v_scale) in tessera's layout (paged where the case is) and
        logical = ((k codes, k scales), (v codes, v scales)) in the contiguous layout, for the reference."""
        scales = fp8_scales or self.fp8_scales[st]
        logical = tuple(quantize_kv(x, fmt, sc, keys=i == 0) for i, (x, sc) in enumerate(zip(self.kv[st], scales)))
        (kq, ks), (vq, vs) = logical
        if fmt != "fp8" and ks is not None:
            per_page = self.s["page_size"] // KEY_BLOCK if fmt in CHANNEL else None
            ks, vs = self.paged(ks, per_page), self.paged(vs)
        return dict(k=self.paged(kq), v=self.paged(vq), k_scale=ks, v_scale=vs, logical=logical)

    def reference(self, logical, fmt):
        """The float32 reference output of set 0 for a logical cache in format fmt."""
        (kq, ks), (vq, vs) = logical

        def deq(codes, scales, keys):
            return lambda b0, b1: dequantize_kv(codes[b0:b1], scales if fmt == "fp8" or scales is None
                                                else scales[b0:b1], fmt, keys)
        return decode_reference(self.q[0], self.lengths, self.s["T"], self.s["HKV"], deq(kq, ks, True),
                                deq(vq, vs, False))


# ---- peers ------------------------------------------------------------------------------------------------------


def _sdpa_peer(backend, label, data, dense, calls, args, ref):
    """torch SDPA on one backend; the faster of q [B, HQ, 1, D] with enable_gqa=True and q packed as [B, HKV, G, D]
    (the G query heads of a KV head as its G query rows: the same result, each K/V head read once). Variable
    lengths: K/V padded to the longest sequence with a boolean key mask; where the backend refuses the mask,
    unmasked (timing only). Returns (times, notes, errors)."""
    torch = C.torch
    F = torch.nn.functional
    from torch.nn.attention import sdpa_kernel

    B, HQ, D = data.q[0].shape
    HKV = data.s["HKV"]
    variable = any(n != data.max_len for n in data.lengths_list)
    mask = None
    if variable:
        mask = (torch.arange(data.max_len, device=C.DEVICE)[None, :] < data.lengths[:, None].long())[:, None, None, :]

    def variant(form, st, m):
        q, (k4, v4) = data.q[st], dense[st]
        if form == "enable_gqa":
            return lambda: F.scaled_dot_product_attention(q.view(B, HQ, 1, D), k4, v4, attn_mask=m, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q.view(B, HKV, HQ // HKV, D), k4, v4, attn_mask=m)

    candidates, notes = [], []
    for m in ([mask, None] if variable else [None]):
        for form in ("enable_gqa", "packed"):
            fns = [variant(form, st, m) for st in range(len(dense))]
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SDPA warns once per refusing kernel; the note says it
                try:
                    y = fns[0]()
                    C.sync()
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{label}: {form}{' with mask' if m is not None else ''} refused: {C.short(e)}")
                    C.sync_quietly()
                    continue
                err = C.rel_error(y.reshape(B, HQ, D), ref) if (m is not None or not variable) else None
                times, errors = C.timed(C.rotating(fns), calls, args)
            candidates.append(dict(form=form, masked=m is not None, times=times, errors=errors, err=err))
        if candidates:
            break  # a masked run is preferred; unmasked only when no form takes the mask
    ok = [c for c in candidates if c["times"].get("graph") or c["times"].get("eager")]
    if not ok:
        return {}, notes, [f"{label}: unavailable"] + [f"{label} {c['form']} {e}" for c in candidates
                                                      for e in c["errors"]]
    best = min(ok, key=lambda c: c["times"].get("graph") or c["times"]["eager"])
    how = "q [B, HQ, 1, D], enable_gqa=True" if best["form"] == "enable_gqa" else "q packed as [B, HKV, G, D]"
    tried = ", ".join(f"{c['form']} {C.fmt_us(c['times'].get('graph'))}" for c in candidates)
    notes.append(f"{label}: {how} (graph µs: {tried}), dense contiguous bf16 cache")
    if variable:
        notes.append(f"{label}: K/V padded to the longest sequence ({data.max_len} tokens) " +
                     ("with a boolean key mask" if best["masked"] else
                      "WITHOUT a mask (refused): timing only, the output is not the decode result"))
    if best["err"] is not None:
        notes.append(f"{label}: rel err {best['err']:.1e}")
    return best["times"], notes, [f"{label} {e}" for e in best["errors"]]


def _fa_kvcache_peer(data, native, calls, args, ref):
    """flash_attn.flash_attn_with_kvcache on tessera's own bf16 cache. Returns (times, notes, errors)."""
    fa, _ = C.optional_module("flash_attn")
    if fa is None:  # named once under the tables
        return None, [], []
    B, HQ, D = data.q[0].shape

    def call(st):
        q, c = data.q[st], native[st]
        return lambda: fa.flash_attn_with_kvcache(q.view(B, 1, HQ, D), c["k"], c["v"], cache_seqlens=data.lengths,
                                                  block_table=data.block_table)
    fns = [call(st) for st in range(len(native))]
    try:
        y = fns[0]()
        C.sync()
    except Exception as e:  # noqa: BLE001
        C.sync_quietly()
        return {}, [], [f"fa_kvcache: unavailable ({C.short(e)})"]
    times, errs = C.timed(C.rotating(fns), calls, args)
    return times, [f"fa_kvcache: rel err {C.rel_error(y.reshape(B, HQ, D), ref):.1e}"], [f"fa_kvcache {e}" for e in errs]


_FI_PLANNED = set()  # FlashInfer variants planned once already (their first plan() JIT-builds the kernels)


def _fi_pages(data):
    """FlashInfer's page list for this case: (page size, indptr cpu int32 [B+1], indices int32, last_page_len cpu
    int32 [B]) and a function viewing a tessera cache tensor as FlashInfer's NHD pages."""
    torch = C.torch
    s = data.s
    B, T = s["B"], s["T"]
    ps = s["page_size"] or FI_PAGE
    pages = [-(-n // ps) for n in data.lengths_list]
    indptr = torch.tensor([0] + list(_cumsum(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(data.lengths_list, pages)], dtype=torch.int32)
    if s["page_size"]:
        table = data.block_table
        view = lambda x: x  # noqa: E731 - tessera's paged layout is FlashInfer's NHD
    else:
        table = torch.arange(B * (T // ps), dtype=torch.int32, device=C.DEVICE).view(B, T // ps)
        view = lambda x: x.reshape(B * (T // ps), ps, *x.shape[2:])  # noqa: E731
    indices = torch.cat([table[b, :p] for b, p in enumerate(pages)]).contiguous()
    return ps, indptr, indices, last, view


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _fi_peer(data, kv_sets, kv_dtype, scales, peer, calls, args, ref):
    """FlashInfer's paged decode wrapper on kv_sets [(k, v)] (tessera layout) with per-set (k_scale, v_scale) floats
    or None. Returns (times, notes, errors)."""
    label = FI_LABELS[peer]
    fi, _ = C.optional_module("flashinfer")
    if fi is None:  # named once under the tables
        return None, [], []
    torch = C.torch
    s = data.s
    B, HQ, HKV, D = s["B"], s["HQ"], s["HKV"], s["D"]
    try:
        ps, indptr, indices, last, view = _fi_pages(data)
        workspace = torch.zeros((128 << 20,), dtype=torch.uint8, device=C.DEVICE)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=peer == "flashinfer_tc",
                                                        backend="cudnn" if peer == "flashinfer_cudnn" else "auto")
        t0 = time.perf_counter()
        wrapper.plan(indptr, indices, last, HQ, HKV, D, ps, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                     o_data_type=torch.bfloat16)
        C.sync()
        plan_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        C.sync_quietly()
        return {}, [], [f"{label}: plan failed ({C.short(e)})"]
    notes = []
    variant = (peer, str(kv_dtype))
    if variant not in _FI_PLANNED:
        _FI_PLANNED.add(variant)
        C.NOTES.append(f"flashinfer: the first plan() of decode {label} {str(kv_dtype).replace('torch.', '')} took "
                       f"{plan_s:.1f} s (its JIT build, outside the timed region; {data.s['shape']})")
    out = torch.empty((B, HQ, D), dtype=torch.bfloat16, device=C.DEVICE)

    def call(st):
        q, (k, v) = data.q[st], kv_sets[st]
        ks, vs = scales[st] if scales else (None, None)
        cache = (view(k), view(v))
        return lambda: wrapper.run(q, cache, k_scale=ks, v_scale=vs, out=out)
    fns = [call(st) for st in range(len(kv_sets))]
    try:
        fns[0]()
        C.sync()
        err = C.rel_error(out, ref)
    except Exception as e:  # noqa: BLE001
        C.sync_quietly()
        return {}, notes, [f"{label}: run failed ({C.short(e)})"]
    times, errs = C.timed(C.rotating(fns), calls, args)
    del workspace
    pages = f"{ps}-token pages" + ("" if s["page_size"] else " over the contiguous cache (identity page list)")
    notes.append(f"{label}: {str(kv_dtype).replace('torch.', '')} cache, {pages}, rel err {err:.1e}")
    return times, notes, [f"{label} {e}" for e in errs]


# ---- rows -------------------------------------------------------------------------------------------------------


def rows(cases, args):
    """Cases grouped by shape (the name without its format): one set of inputs and one run of the bf16 peers per
    shape, then tessera (and the fp8 FlashInfer peers) per format."""
    groups = {}
    for case in cases:
        groups.setdefault(case.spec["shape"], []).append(case)
    out, timed = [], []
    for group in groups.values():
        if group[0].spec["S"] > 1:
            for case in group:
                r = Row(case.op, case.name)
                r.notes.append("no Python peer for several new tokens per sequence (S > 1)")
                out.append(r)
        else:
            timed.append(group)
    return C.guarded_rows(timed, lambda group, si: shape_rows(group, args, 2000 + si)) + out


def shape_rows(group, args, seed):
    torch = C.torch
    s = group[0].spec
    peers = [p for p in args.decode_peers.split(",") if p]
    if args.no_flashinfer:
        peers = [p for p in peers if not p.startswith("flashinfer")]
    lengths = decode_lengths(s["lengths"], s["B"], s["T"])
    fmts = [c.spec["format"] for c in group]
    nbytes = {f: decode_bytes(s, f, lengths) for f in ("native", *fmts)}
    sets = {f: C.rotating_sets(nbytes[f]) for f in nbytes}
    data = DecodeInputs(s, max(sets.values()), seed)
    rows = {c.spec["format"]: Row(c.op, c.name, nbytes[c.spec["format"]], 4.0 * s["HQ"] * s["D"] * sum(lengths))
            for c in group}

    # bf16 peers, once per shape, on the native cache; their reference is the native format's.
    n_peer = sets["native"]
    peer_calls = C.calls_for(nbytes["native"] / 3e12 * 1e6, n_peer)
    native = [data.cache("native", st) for st in range(n_peer)]
    ref_native = data.reference(native[0]["logical"], "native")
    shared = {}  # label -> (times, notes, errors)
    for peer in peers:
        if peer in FI_LABELS:
            res = _fi_peer(data, [(c["k"], c["v"]) for c in native], torch.bfloat16, None, peer,
                           peer_calls, args, ref_native)
            label = FI_LABELS[peer]
        elif peer == "fa_kvcache":
            res, label = _fa_kvcache_peer(data, native, peer_calls, args, ref_native), "fa_kvcache"
        elif peer in ("cudnn", "flash"):
            if not C.ON_GPU:
                continue
            from torch.nn.attention import SDPBackend
            backend = SDPBackend.CUDNN_ATTENTION if peer == "cudnn" else SDPBackend.FLASH_ATTENTION
            label = "cuDNN" if peer == "cudnn" else "flash"
            dense = [tuple(x.transpose(1, 2)[:, :, :data.max_len].contiguous() for x in data.kv[st])
                     for st in range(n_peer)]
            res = _sdpa_peer(backend, label, data, dense, peer_calls, args, ref_native)
            del dense
        else:
            raise ValueError(f"unknown --decode-peers item {peer!r} (expected {', '.join(PEERS)})")
        shared[label] = res
    del native
    C.empty_cache()

    for fmt, row in rows.items():
        for label, (times, notes, errors) in shared.items():
            if label in ("FI", "FI tc") and fmt == "fp8":
                continue  # measured on the fp8 cache below
            if times is not None:
                row.add_peer(label, times, errors, notes)
            else:
                row.notes += notes
        if fmt not in ("native", "fp8") and any(label.startswith("FI") for label in shared):
            row.notes.append("FI: no integer KV format in FlashInfer: its bf16 cache")
        try:
            decode_tessera(args, data, row, fmt, sets[fmt])
        except Exception as e:  # noqa: BLE001
            row.errors.append(f"tessera: {C.short(e)}")
            C.sync_quietly()
        if fmt == "fp8":
            fi_fp8(args, data, row, [p for p in peers if p in ("flashinfer", "flashinfer_tc")], sets["fp8"], ref_native)
        C.empty_cache()
    if s["page_size"]:
        for row in rows.values():
            row.notes.append("cuDNN / flash read a dense contiguous cache (no paging); FI and fa_kvcache get the "
                             "same block table as tessera")
    return list(rows.values())


def fi_fp8(args, data, row, fi_peers, n_sets, ref_native):
    """FlashInfer on an e4m3 cache with one scale per tensor (the largest of tessera's per-head scales)."""
    if not fi_peers:
        return
    kv_sets, scales = [], []
    for st in range(n_sets):
        ks, vs = (sc.max().expand_as(sc).contiguous() for sc in data.fp8_scales[st])
        c = data.cache("fp8", st, fp8_scales=(ks, vs))
        kv_sets.append((c["k"], c["v"]))
        scales.append((ks[0].item(), vs[0].item()))
        del c["logical"]
    calls = C.calls_for(row.bytes / 3e12 * 1e6, n_sets)
    for peer in fi_peers:
        times, notes, errors = _fi_peer(data, kv_sets, C.fp8_dtype(), scales, peer, calls, args,
                                        ref_native)
        label = FI_LABELS[peer]
        if times is not None:
            row.add_peer(label, times, errors, notes)
        else:
            row.notes += notes
    if data.s["HKV"] > 1:
        row.notes.append("FI fp8: one scale per tensor (FlashInfer's k_scale / v_scale), tessera one per KV head")
    del kv_sets


def decode_tessera(args, data, row, fmt, n_sets):
    """Times tessera.attention_decode in fmt on n_sets rotating caches and measures its error on set 0."""
    torch = C.torch
    if C.tessera is None:
        raise RuntimeError(C.TESSERA_IMPORT_ERROR)
    caches = [data.cache(fmt, st) for st in range(n_sets)]
    q0 = data.q[0]
    out = torch.empty_like(q0)

    def kwargs(c):
        return dict(format=fmt, k_scale=c["k_scale"], v_scale=c["v_scale"], block_table=data.block_table,
                    balance_splits=data.s.get("balanced", False))

    ws_bytes = C.tessera.decode_workspace_size(q0, caches[0]["k"], caches[0]["v"], **kwargs(caches[0]))
    workspace = torch.empty((ws_bytes,), dtype=torch.uint8, device=C.DEVICE) if ws_bytes else None

    def call(st):
        q, c = data.q[st], caches[st]
        return lambda: C.tessera.attention_decode(q, c["k"], c["v"], data.lengths, out=out, workspace=workspace,
                                                  **kwargs(c))
    fns = [call(st) for st in range(n_sets)]
    out.fill_(float("nan"))
    fns[0]()
    C.sync()
    row.rel_err["tessera"] = C.rel_error(out, data.reference(caches[0]["logical"], fmt))
    if fmt == "fp8":
        row.notes.append("tessera fp8: per-KV-head fp32 scales (amax / 448)")
    for c in caches:
        del c["logical"]  # the timed loop does not need them
    row.tessera, errs = C.timed(C.rotating(fns), C.calls_for(row.bytes / 3e12 * 1e6, n_sets), args)
    row.errors += [f"tessera {e}" for e in errs]
    if n_sets > 1:
        row.notes.append(f"tessera {fmt}: {n_sets} rotating input sets (L2)")


def cases_from_args(args):
    """Standalone runs: the registry (S<n> cases aside) filtered by --decode-cases / --decode-formats."""
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry())
            if c.spec["S"] == 1 and keep(c, args)]


def keep(case, args):
    subs = [c for c in args.decode_cases.split(",") if c]
    formats = [f for f in args.decode_formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"unknown --decode-formats item {f!r} (expected {', '.join(FORMATS)})")
    return (not subs or any(x in case.name for x in subs)) and case.spec["format"] in formats
