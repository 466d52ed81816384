#!/usr/bin/env python3
"""Decode-output error of KV-cache key formats on keys with outlier channels (issue 16, part 1), on the CPU.

For each key format, the keys are quantized as the format would store them, dequantized, and one decode step
(every query head against L cached tokens) is computed in float64; the error is the relative Frobenius norm of the
output o against the same step on the unquantized cache. Values are quantized per token in the format's family
(their own error is reported apart: "V only"), as the issue asks ("values keep per-token scales").

Existing formats reproduce tessera's quantizers (src/reference/attention_reference.cpp: quantize_group): integer
codes with an fp16 (scale, offset) pair per row or per group of 32, min/max asymmetric, round half to even;
fp8 e4m3 with one fp32 scale per KV head (amax / 448). Candidate formats:
  kivi/B   per-channel int4 (or int8) keys (KIVI): an fp16 (scale, offset) per channel over each block of B
           tokens; a sequence's last partial block is held unquantized (the issue's "held at higher precision").
           tessera's int8_kchannel / int4_kchannel use B = 32 with per-row int8 / int4 values; they quantize a
           partial last block over the rows it has, which this study does not model (no partial block when L is
           a multiple of 32, as by default).
  had+F    keys and queries multiplied by the same normalized Hadamard matrix H (H Hᵀ = I, so q·k is unchanged),
           then the rotated keys stored in format F.

Distributions (N(0, 1) everywhere unless said):
  gauss     q, k, v ~ N(0, 1).
  outlier   docs/perf/decode.md's: 3 of the D key channels scaled by 20.
  biased    what published key statistics show (KIVI, Liu et al. 2024, fig. 2; KVQuant, Hooper et al. 2024,
            fig. 2: a few key channels carry large magnitudes with a consistent sign and offset across tokens,
            the others vary per channel): k[t, c] = mu_c + s_c z, mu_c ~ N(0, 0.5²), s_c ~ lognormal(0, 0.5), and 4
            heavy channels with mu = ±12 and s = 3; queries share the channel scales s_c (the heavy channels
            matter to the scores, as in a real layer), so attention is peaked rather than flat.

  python3 tools/kv_error_study.py [--seeds 3] [--tokens 1024] [--head-dim 128] [--markdown]
"""
import argparse

import numpy as np


def fp16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def quantize_groups(x, group, bits, axis=-1):
    """tessera's integer format: per group of `group` elements along `axis`, fp16 scale=(hi-lo)/levels and
    offset=lo, codes rint((x - offset) / scale) clamped to [0, levels]; returns the dequantized values."""
    levels = (1 << bits) - 1
    x = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    shape = x.shape
    n = shape[-1]
    assert n % group == 0, (n, group)
    g = x.reshape(shape[:-1] + (n // group, group))
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = fp16((hi - lo) / np.float32(levels)).astype(np.float32)
    offset = fp16(lo).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.rint((g - offset) / scale)
    c = np.where(scale == 0, 0.0, np.clip(np.nan_to_num(c, nan=0.0), 0, levels))
    out = (c.astype(np.float64) * scale.astype(np.float64) + offset.astype(np.float64)).reshape(shape)
    return np.moveaxis(out, -1, axis)


def e4m3(x):
    """Round to the nearest fp8 e4m3 value (saturating at ±448), ties to even."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    e = np.floor(np.log2(np.maximum(a, 2.0**-9)))
    e = np.clip(e, -6, 8)  # normal exponents; below 2^-6 the subnormal step 2^-9
    step = 2.0 ** (e - 3)
    r = np.rint(a / step) * step
    return np.sign(x) * np.minimum(r, 448.0)


def hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    assert h.shape[0] == d, "head_dim must be a power of two"
    return h / np.sqrt(d)


# ---- formats: keys [HKV, L, D] -> dequantized keys; values per token in the same family -------------------------

def k_native(k):
    return fp16(k)


def k_fp8(k):
    amax = np.abs(k).max(axis=(1, 2), keepdims=True)
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
    return e4m3(k / s) * s


def k_int(bits, group):
    return lambda k: quantize_groups(k, group or k.shape[-1], bits)


def k_kivi(bits, block):
    def f(k):
        hkv, L, d = k.shape
        full = L // block * block
        out = np.array(k, dtype=np.float64)
        if full:
            blocks = k[:, :full].reshape(hkv, full // block, block, d)
            out[:, :full] = quantize_groups(blocks, block, bits, axis=2).reshape(hkv, full, d)
        out[:, full:] = fp16(k[:, full:])  # the partial last block: held in 16 bits until it fills
        return out
    return f


FORMATS = [
    # name, key quantizer, value quantizer, rotated
    ("bf16/fp16", k_native, k_native, False),
    ("fp8 e4m3, per head", k_fp8, k_fp8, False),
    ("int8, per row", k_int(8, 0), k_int(8, 0), False),
    ("int4, per row", k_int(4, 0), k_int(4, 0), False),
    ("int4, groups of 32", k_int(4, 32), k_int(4, 32), False),
    ("kivi int4, blocks of 16", k_kivi(4, 16), k_int(4, 32), False),
    ("kivi int4, blocks of 32", k_kivi(4, 32), k_int(4, 32), False),
    ("kivi int4, blocks of 32, V per row", k_kivi(4, 32), k_int(4, 0), False),  # as int4_kchannel stores them
    ("kivi int4, blocks of 64", k_kivi(4, 64), k_int(4, 32), False),
    ("kivi int4, blocks of 128", k_kivi(4, 128), k_int(4, 32), False),
    ("kivi int8, blocks of 32", k_kivi(8, 32), k_int(8, 0), False),  # as int8_kchannel stores them (kKeyBlock 32)
    ("kivi int8, blocks of 64", k_kivi(8, 64), k_int(8, 0), False),
    ("had + fp8 e4m3", k_fp8, k_fp8, True),
    ("had + int8, per row", k_int(8, 0), k_int(8, 0), True),
    ("had + int4, per row", k_int(4, 0), k_int(4, 0), True),
    ("had + int4, groups of 32", k_int(4, 32), k_int(4, 32), True),
    ("had + kivi int4, blocks of 32", k_kivi(4, 32), k_int(4, 32), True),
]


def make_data(dist, rng, hq, hkv, L, d):
    q = rng.standard_normal((hq, d))
    k = rng.standard_normal((hkv, L, d))
    v = rng.standard_normal((hkv, L, d))
    if dist == "outlier":
        ch = rng.choice(d, 3, replace=False)
        k[:, :, ch] *= 20.0
    elif dist == "biased":
        mu = rng.normal(0.0, 0.5, d)
        s = rng.lognormal(0.0, 0.5, d)
        heavy = rng.choice(d, 4, replace=False)
        mu[heavy] = 12.0 * rng.choice([-1.0, 1.0], 4)
        s[heavy] = 3.0
        k = mu + s * k
        q = q * s / np.sqrt(np.mean(s * s))
    return q, k, v


def decode(q, k, v):
    """o[h] = softmax(q_h · K_g / sqrt(D)) V_g for every query head, GQA group g = h / (HQ / HKV)."""
    hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    o = np.empty((hq, v.shape[-1]))
    for h in range(hq):
        kk, vv = k[h // g], v[h // g]
        s = kk @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max())
        o[h] = p @ vv / p.sum()
    return o


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    args = ap.parse_args()
    dists = ["gauss", "outlier", "biased"]
    h = hadamard(args.head_dim)
    rows = []
    for name, fk, fv, rotated in FORMATS:
        cells = []
        for dist in dists:
            both, konly = [], []
            for seed in range(args.seeds):
                rng = np.random.default_rng(1000 * seed + dists.index(dist))
                q, k, v = make_data(dist, rng, args.hq, args.hkv, args.tokens, args.head_dim)
                o = decode(q, k, v)
                qq, kk = (q @ h.T, k @ h.T) if rotated else (q, k)
                kq = fk(kk)
                konly.append(rel(decode(qq, kq, v), o))
                both.append(rel(decode(qq, kq, fv(v)), o))
            cells.append((max(konly), max(both)))
        rows.append((name, cells))
    print(f"relative Frobenius error of o, worst of {args.seeds} seeds; D {args.head_dim}, L {args.tokens}, "
          f"HQ/HKV {args.hq}/{args.hkv}; each cell: K only / K and V quantized")
    print()
    print("| key format | " + " | ".join(dists) + " |")
    print("|---|" + "---|" * len(dists))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(f"{a:.2e} / {b:.2e}" for a, b in cells) + " |")


if __name__ == "__main__":
    main()
