"""Python tests for tessera.attention: attention_decode over every KV format, append_kv, dequantize_kv.

The caches are produced by tessera.append_kv from random bf16/fp16 rows (so the producer is exercised too) and
checked against the quantization rule of include/tessera/attention.h. Decode is then compared with a float64
torch reference computed from the dequantized cache (tessera.dequantize_kv), i.e. from the very values the kernel
reads, so the only errors are the kernel's arithmetic: q and the dequantized K/V in fp16 (quantized formats),
fp32 accumulation and softmax, and the bf16/fp16 output rounding. Every cache slot a sequence does not own is
filled with values 30x larger than the real ones (and spare pages with NaN), so that reading past a length, or
through a wrong page, is an O(1) error. Outputs are poisoned (NaN) first, so an unwritten row fails.

The per-channel key formats ('int8_kchannel', 'int4_kchannel') must be appended in order (rollback by at most 32
positions): their caches are filled by fill_in_order (the slots a sequence does not own keep their poison, random
codes under NaN scales, and the rows appended past a length before the final rollback are 30x), and their
keys are checked bit for bit against the block rule of attention.h computed here in torch (key_block_rule), their
k_residual against the keys it must hold.

Tolerance: relative Frobenius error per sequence <= 5e-3. The bf16 output rounding alone costs about 1e-3
(2^-9 relative per element, uniformly distributed); fp16 operands and probabilities add a few 1e-4. A wrong key,
scale, head or split merge is an O(1) error. lse: |error| <= 1e-3 (1 + |lse|).

GPU tests skip without torch or a CUDA device; the tests at the top run everywhere (the dequantize_kv ones need
torch, not a GPU).
"""

import math

import pytest

import tessera
from _host_capsule import DL_BFLOAT, DL_FLOAT, DL_INT, DL_UINT, HostCapsule

try:
    import torch
except ImportError:  # the no-GPU tests still run
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

TOL = 5e-3
GARBAGE = 30.0  # magnitude of the rows a sequence does not own
FORMATS = ("native", "fp8", "int8", "int4", "int4_group32", "int8_kchannel", "int4_kchannel")
CHANNEL = ("int8_kchannel", "int4_kchannel")  # per-channel key formats
LEVELS = {"int8": 255, "int4": 15, "int4_group32": 15, "int8_kchannel": 255, "int4_kchannel": 15}
INT4 = ("int4", "int4_group32", "int4_kchannel")
KEY_BLOCK = 32  # tokens per key-scale block of the channel formats
RESIDUAL_ROWS = 64  # rows of their k_residual

# name: (format, dtype of q / new rows / native cache, fp8 scale shape 'head' | 'tensor', fp8 cache storage)
FORMAT_CASES = {
    "native_bf16": ("native", "bfloat16", None, None),
    "native_fp16": ("native", "float16", None, None),
    "fp8_head": ("fp8", "bfloat16", "head", "float8"),
    "fp8_tensor_u8": ("fp8", "bfloat16", "tensor", "uint8"),
    "int8": ("int8", "bfloat16", None, None),
    "int4": ("int4", "float16", None, None),
    "int4_group32": ("int4_group32", "bfloat16", None, None),
    "int8_kchannel": ("int8_kchannel", "bfloat16", None, None),
    "int4_kchannel": ("int4_kchannel", "float16", None, None),
}
CHANNEL_CASES = tuple(c for c, spec in FORMAT_CASES.items() if spec[0] in CHANNEL)

# ================================================================================================================
# Tests without a GPU
# ================================================================================================================


def test_top_level_reexports():
    for name in ("attention_decode", "decode_workspace_size", "append_kv", "dequantize_kv"):
        assert getattr(tessera, name) is getattr(tessera.attention, name)
    assert tessera.attention.FORMATS == FORMATS
    assert tessera.attention.MAX_SPLITS == 128
    assert tessera.attention.GROUP_SIZE == 32
    assert tessera.attention.CHANNEL_FORMATS == CHANNEL
    assert tessera.attention.KEY_BLOCK == KEY_BLOCK and tessera._C.key_block == KEY_BLOCK
    assert tessera.attention.KEY_RESIDUAL_ROWS == RESIDUAL_ROWS


@pytest.mark.parametrize("fmt", ["int3", "", None, "FP8", "int4_group64"])
def test_bad_format_raises_value_error(fmt):
    # Checked before any tensor is looked at (and before torch is imported).
    o = object()
    with pytest.raises(ValueError, match="'format'"):
        tessera.attention_decode(o, o, o, o, format=fmt)
    with pytest.raises(ValueError, match="'format'"):
        tessera.decode_workspace_size(o, o, o, format=fmt)
    with pytest.raises(ValueError, match="'format'"):
        tessera.append_kv(o, o, o, o, o, format=fmt)
    with pytest.raises(ValueError, match="'format'"):
        tessera.dequantize_kv(o, o, fmt, 128)


def test_bad_params():
    o = object()
    with pytest.raises(ValueError, match="'window'"):
        tessera.attention_decode(o, o, o, o, window=-1)
    with pytest.raises(ValueError, match="'num_splits'"):
        tessera.attention_decode(o, o, o, o, num_splits=-1)
    with pytest.raises(TypeError, match="'num_splits'"):
        tessera.attention_decode(o, o, o, o, num_splits=1.5)
    with pytest.raises(TypeError, match="'softcap'"):
        tessera.attention_decode(o, o, o, o, softcap="x")
    with pytest.raises(TypeError, match="'softmax_scale'"):
        tessera.decode_workspace_size(o, o, o, softmax_scale=[1.0])
    with pytest.raises(TypeError, match="'balance_splits'"):
        tessera.attention_decode(o, o, o, o, balance_splits="false")
    with pytest.raises(TypeError, match="'balance_splits'"):
        tessera.decode_workspace_size(o, o, o, balance_splits=1)


def test_binding_bad_format():
    with pytest.raises(ValueError, match="'format'"):
        tessera._C.attention_decode(None, None, None, None, None, None, None, None, None, None, "int2", 0.0, 0.0,
                                    0, 0, 0)
    with pytest.raises(ValueError, match="'format'"):
        tessera._C.append_kv(None, None, None, None, None, None, None, None, "bf16", 0)
    with pytest.raises(ValueError, match="'format'"):
        tessera._C.decode_workspace_bytes(None, None, None, None, None, None, "e5m2", 0.0, 0.0, 0, 0)


def test_binding_rejects_non_capsules():
    with pytest.raises(TypeError, match="'q'"):
        tessera._C.attention_decode(object(), None, None, None, None, None, None, None, None, None, "native", 0.0,
                                    0.0, 0, 0, 0)
    with pytest.raises(TypeError, match="'k_new'"):
        tessera._C.append_kv(object(), None, None, None, None, None, None, None, "int8", 0)


def test_binding_host_memory_is_value_error():
    B, HQ, HKV, D, T = 2, 8, 2, 128, 32
    q = HostCapsule((B, HQ, D), DL_BFLOAT, 16)
    k = HostCapsule((B, T, HKV, D), DL_BFLOAT, 16)
    v = HostCapsule((B, T, HKV, D), DL_BFLOAT, 16)
    seqlens = HostCapsule((B,), DL_INT, 32)
    out = HostCapsule((B, HQ, D), DL_BFLOAT, 16)
    with pytest.raises(ValueError):
        tessera._C.attention_decode(q.capsule, k.capsule, v.capsule, None, None, None, seqlens.capsule, out.capsule,
                                    None, None, "native", 0.0, 0.0, 0, 0, 0)
    positions = HostCapsule((B,), DL_INT, 32)
    new = HostCapsule((B, 1, HKV, D), DL_BFLOAT, 16)
    with pytest.raises(ValueError):
        tessera._C.append_kv(new.capsule, new.capsule, positions.capsule, k.capsule, v.capsule, None, None, None,
                             "native", 0)


def test_binding_cache_dtypes_per_format():
    # decode_workspace_bytes with an explicit split count runs every rule on q, the cache and the params without a
    # device, so it shows how the binding labels the cache: uint8 data is e4m3 for 'fp8' only.
    B, HQ, HKV, D, T = 2, 8, 2, 128, 64
    q = HostCapsule((B, HQ, D), DL_BFLOAT, 16)
    k8, v8 = HostCapsule((B, T, HKV, D), DL_UINT, 8), HostCapsule((B, T, HKV, D), DL_UINT, 8)
    fp8_scale = HostCapsule((HKV,), DL_FLOAT, 32)
    fn = tessera._C.decode_workspace_bytes
    assert fn(q.capsule, k8.capsule, v8.capsule, fp8_scale.capsule, fp8_scale.capsule, None, "fp8", 0.0, 0.0, 0,
              1) == 0
    with pytest.raises(ValueError, match="'cache.k' must have dtype"):
        fn(q.capsule, k8.capsule, v8.capsule, None, None, None, "native", 0.0, 0.0, 0, 1)
    pairs = [HostCapsule((B, T, HKV, 2), DL_FLOAT, 16) for _ in range(2)]
    assert fn(q.capsule, k8.capsule, v8.capsule, pairs[0].capsule, pairs[1].capsule, None, "int8", 0.0, 0.0, 0,
              1) == 0
    k4, v4 = HostCapsule((B, T, HKV, D // 2), DL_UINT, 8), HostCapsule((B, T, HKV, D // 2), DL_UINT, 8)
    groups = [HostCapsule((B, T, HKV, 2 * D // 32), DL_FLOAT, 16) for _ in range(2)]
    assert fn(q.capsule, k4.capsule, v4.capsule, groups[0].capsule, groups[1].capsule, None, "int4_group32", 0.0,
              0.0, 0, 1) == 0
    with pytest.raises(ValueError, match="'cache.k_scale'"):  # one pair per row is not int4_group32's shape
        fn(q.capsule, k4.capsule, v4.capsule, pairs[0].capsule, pairs[1].capsule, None, "int4_group32", 0.0, 0.0,
           0, 1)
    with pytest.raises(ValueError, match="'q' must have head dim"):
        bad_q = HostCapsule((B, HQ, 96), DL_BFLOAT, 16)
        fn(bad_q.capsule, k8.capsule, v8.capsule, fp8_scale.capsule, fp8_scale.capsule, None, "fp8", 0.0, 0.0, 0, 1)


@pytest.mark.parametrize("fmt", CHANNEL)
def test_binding_channel_format_scales(fmt):
    # Per-channel keys: k_scale [B, T / 32, HKV, 2 D] (block pairs), v_scale [B, T, HKV, 2] (row pairs). The
    # residual is append_kv's; decode accepts it (and does not read it).
    B, HQ, HKV, D, T = 2, 8, 2, 128, 64
    row = D // 2 if fmt == "int4_kchannel" else D
    q = HostCapsule((B, HQ, D), DL_BFLOAT, 16)
    k, v = HostCapsule((B, T, HKV, row), DL_UINT, 8), HostCapsule((B, T, HKV, row), DL_UINT, 8)
    blocks = HostCapsule((B, T // KEY_BLOCK, HKV, 2 * D), DL_FLOAT, 16)
    pairs = [HostCapsule((B, T, HKV, 2), DL_FLOAT, 16) for _ in range(2)]
    residual = HostCapsule((B, RESIDUAL_ROWS, HKV, D), DL_BFLOAT, 16)
    fn = tessera._C.decode_workspace_bytes
    assert fn(q.capsule, k.capsule, v.capsule, blocks.capsule, pairs[1].capsule, None, fmt, 0.0, 0.0, 0, 1) == 0
    assert fn(q.capsule, k.capsule, v.capsule, blocks.capsule, pairs[1].capsule, None, fmt, 0.0, 0.0, 0, 1,
              k_residual=residual.capsule) == 0
    with pytest.raises(ValueError, match="'cache.k_scale'"):  # row pairs are not the key blocks
        fn(q.capsule, k.capsule, v.capsule, pairs[0].capsule, pairs[1].capsule, None, fmt, 0.0, 0.0, 0, 1)
    with pytest.raises(ValueError, match="'cache.v_scale'"):  # nor are blocks the value pairs
        fn(q.capsule, k.capsule, v.capsule, blocks.capsule, blocks.capsule, None, fmt, 0.0, 0.0, 0, 1)
    # decode ignores the residual of a channel format (it is append_kv's), whatever it is.
    assert fn(q.capsule, k.capsule, v.capsule, blocks.capsule, pairs[1].capsule, None, fmt, 0.0, 0.0, 0, 1,
              k_residual=HostCapsule((B, 3, HKV, D), DL_FLOAT, 32).capsule) == 0
    short = [HostCapsule((B, 48, HKV, row), DL_UINT, 8) for _ in range(2)]  # T_max not a multiple of 32
    short_pairs = HostCapsule((B, 48, HKV, 2), DL_FLOAT, 16)
    short_blocks = HostCapsule((B, 1, HKV, 2 * D), DL_FLOAT, 16)
    with pytest.raises(ValueError, match="32"):
        fn(q.capsule, short[0].capsule, short[1].capsule, short_blocks.capsule, short_pairs.capsule, None, fmt, 0.0,
           0.0, 0, 1)


# ---- dequantize_kv (torch on the CPU) ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", CHANNEL)
def test_binding_append_kv_k_residual_rules(fmt):
    # The C++ validation runs before any device check, so host capsules show its k_residual rules: required by
    # append_kv for a channel format, [B, 64, HKV, D] in k_new's dtype; refused with any other format.
    B, HKV, D, T = 2, 2, 128, 64
    row = D // 2 if fmt == "int4_kchannel" else D
    new, positions = HostCapsule((B, 1, HKV, D), DL_BFLOAT, 16), HostCapsule((B,), DL_INT, 32)
    k, v = HostCapsule((B, T, HKV, row), DL_UINT, 8), HostCapsule((B, T, HKV, row), DL_UINT, 8)
    blocks = HostCapsule((B, T // KEY_BLOCK, HKV, 2 * D), DL_FLOAT, 16)
    pairs = HostCapsule((B, T, HKV, 2), DL_FLOAT, 16)
    fn = tessera._C.append_kv

    def call(residual, fmt=fmt, k=k, v=v, ks=blocks, vs=pairs):
        fn(new.capsule, new.capsule, positions.capsule, k.capsule, v.capsule, ks.capsule, vs.capsule, None, fmt, 0,
           k_residual=residual.capsule if residual is not None else None)

    with pytest.raises(ValueError, match="'cache.k_residual' is required"):
        call(None)
    with pytest.raises(ValueError, match="'cache.k_residual' must have the dtype of 'k_new'"):
        call(HostCapsule((B, RESIDUAL_ROWS, HKV, D), DL_FLOAT, 16))
    with pytest.raises(ValueError, match="'cache.k_residual' must have shape"):
        call(HostCapsule((B, KEY_BLOCK, HKV, D), DL_BFLOAT, 16))
    with pytest.raises(ValueError, match="'k_new' must be in device memory"):  # every rule above passed
        call(HostCapsule((B, RESIDUAL_ROWS, HKV, D), DL_BFLOAT, 16))
    k8, v8 = HostCapsule((B, T, HKV, D), DL_UINT, 8), HostCapsule((B, T, HKV, D), DL_UINT, 8)
    row_pairs = HostCapsule((B, T, HKV, 2), DL_FLOAT, 16)
    with pytest.raises(ValueError, match="'cache.k_residual' must be absent"):
        call(HostCapsule((B, RESIDUAL_ROWS, HKV, D), DL_BFLOAT, 16), fmt="int8", k=k8, v=v8, ks=row_pairs, vs=pairs)


@needs_torch
def test_dequantize_int4_nibble_order():
    # Byte j holds element 2j in bits 0..3 and element 2j+1 in bits 4..7.
    D = 64
    codes = torch.zeros((1, 1, D // 2), dtype=torch.uint8)
    codes[0, 0, 0] = 0x21  # elements 0, 1 = 1, 2
    codes[0, 0, 31] = 0xF0  # elements 62, 63 = 0, 15
    scales = torch.tensor([[[0.5, -1.0]]], dtype=torch.float16)  # value = code * 0.5 - 1
    x = tessera.dequantize_kv(codes, scales, "int4", D, dtype=torch.float64)
    assert x.shape == (1, 1, D) and x.dtype == torch.float64
    assert x[0, 0, :2].tolist() == [-0.5, 0.0]
    assert x[0, 0, 62:].tolist() == [-1.0, 6.5]
    assert bool((x[0, 0, 2:62] == -1.0).all())


@needs_torch
def test_dequantize_int4_group32_pairs():
    D = 128  # 4 groups: elements [32g, 32g + 32) use pair g
    codes = torch.full((2, 3, 1, D // 2), 0x33, dtype=torch.uint8)  # every code 3
    pairs = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.25, -3.0, 4.0, 0.5], dtype=torch.float16)
    scales = pairs.expand(2, 3, 1, 8).clone()
    x = tessera.dequantize_kv(codes, scales, "int4_group32", D)
    assert x.shape == (2, 3, 1, D) and x.dtype == torch.float32
    expected = torch.tensor([3.0, 7.0, -2.25, 12.5]).repeat_interleave(32)
    assert torch.equal(x[1, 2, 0], expected)
    with pytest.raises(ValueError, match="'scales'"):
        tessera.dequantize_kv(codes, scales[..., :2], "int4_group32", D)


@needs_torch
def test_dequantize_int8_and_native():
    D = 64
    codes = torch.arange(D, dtype=torch.uint8).view(1, 1, D) * 4
    scales = torch.tensor([[[0.125, 2.0]]], dtype=torch.float16)
    x = tessera.dequantize_kv(codes, scales, "int8", D, dtype=torch.float64)
    assert torch.equal(x[0, 0], torch.arange(D, dtype=torch.float64) * 0.5 + 2.0)
    with pytest.raises(ValueError, match="'codes'"):
        tessera.dequantize_kv(codes[..., :32], scales, "int8", D)
    native = torch.randn(2, 4, 3, D).to(torch.bfloat16)
    assert torch.equal(tessera.dequantize_kv(native, None, "native", D), native.float())


@needs_torch
@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="needs torch.float8_e4m3fn")
def test_dequantize_fp8_scales():
    D, HKV = 64, 3
    values = torch.randn(5, HKV, D) * 10
    codes = values.to(torch.float8_e4m3fn)
    e4m3 = codes.float()
    per_head = torch.tensor([0.5, 2.0, 0.125])
    x = tessera.dequantize_kv(codes, per_head, "fp8", D)
    assert torch.equal(x, e4m3 * per_head.view(HKV, 1))
    x = tessera.dequantize_kv(codes.view(torch.uint8), torch.tensor([0.25]), "fp8", D)  # uint8 bytes, per tensor
    assert torch.equal(x, e4m3 * 0.25)
    with pytest.raises(ValueError, match="'scales'"):
        tessera.dequantize_kv(codes, torch.ones(2), "fp8", D)


@needs_torch
@pytest.mark.parametrize("fmt", CHANNEL)
def test_dequantize_channel_keys_and_values(fmt, seed):
    # Keys: channel d of token t uses scale [.., t // 32, h, d] and offset [.., t // 32, h, D + d]. Values: one pair
    # per (token, head), as 'int8' / 'int4'. Checked element by element against float64 arithmetic on the CPU.
    g = torch.Generator().manual_seed(seed)
    D, T, HKV, outer = 64, 96, 2, 3
    levels = LEVELS[fmt]
    full = torch.randint(0, levels + 1, (outer, T, HKV, D), generator=g, dtype=torch.uint8)
    codes = full[..., 0::2] | (full[..., 1::2] << 4) if fmt == "int4_kchannel" else full
    blocks = (torch.randn((outer, T // KEY_BLOCK, HKV, 2 * D), generator=g) * 0.1).half()
    x = tessera.dequantize_kv(codes, blocks, fmt, D, dtype=torch.float64)
    assert x.shape == (outer, T, HKV, D) and x.dtype == torch.float64
    b = torch.arange(T) // KEY_BLOCK
    want = full.double() * blocks[:, b, :, :D].double() + blocks[:, b, :, D:].double()
    assert torch.equal(x, want)
    assert x[1, 33, 1, 5].item() == full[1, 33, 1, 5].item() * blocks[1, 1, 1, 5].item() + blocks[1, 1, 1, D + 5].item()
    pairs = (torch.randn((outer, T, HKV, 2), generator=g) * 0.1).half()
    y = tessera.dequantize_kv(codes, pairs, fmt, D, dtype=torch.float64)
    assert torch.equal(y, full.double() * pairs[..., :1].double() + pairs[..., 1:].double())
    with pytest.raises(ValueError, match="'scales'"):  # 40 tokens are not whole blocks
        tessera.dequantize_kv(codes[:, :40], blocks[:, :2], fmt, D)
    with pytest.raises(ValueError, match="'scales'"):
        tessera.dequantize_kv(codes, blocks[..., :D], fmt, D)


# ================================================================================================================
# GPU: caches, their producer and the reference
# ================================================================================================================


def _bytes(t):
    """fp8 tensors as their uint8 bytes (gathers and comparisons on fp8 dtypes are not supported everywhere)."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _bits(t):
    """t's bits as an integer tensor of the same element size (so that NaN poison compares equal)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


class Cache:
    """A KV cache of one format and layout, its scales and (paged) block table; unwritten memory is poisoned.

    page_size 0: contiguous [B, capacity, HKV, row]; else paged [num_pages, page_size, HKV, row] with a random
    block table over B * max_pages of the pages and `spare_pages` pages no sequence owns (left untouched).
    Channel formats: k_scale [B | num_pages, slots / 32, HKV, 2 D] (key blocks), v_scale per row, and k_residual
    [B, 64, HKV, D] in the rows' dtype (NaN: append_kv must only read what it wrote).
    """

    def __init__(self, case, B, HKV, D, capacity, *, page_size=0, spare_pages=3, seed=0):
        self.format, dtype, fp8_scale, fp8_storage = FORMAT_CASES[case]
        self.B, self.HKV, self.D = B, HKV, D
        self.dtype = getattr(torch, dtype)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.paged = page_size > 0
        if self.paged:
            self.page_size = page_size
            self.max_pages = -(-capacity // page_size)
            self.capacity = self.max_pages * page_size
            self.num_pages = B * self.max_pages + spare_pages
            perm = torch.randperm(self.num_pages, device="cuda", generator=self.gen)
            self.block_table = perm[:B * self.max_pages].view(B, self.max_pages).to(torch.int32)
            self.spare = perm[B * self.max_pages:]
            lead = (self.num_pages, page_size)
        else:
            self.capacity = capacity
            self.block_table = None
            lead = (B, capacity)

        fmt = self.format
        self.channel = fmt in CHANNEL
        row = D // 2 if fmt in INT4 else D
        shape = lead + (HKV, row)
        if fmt == "native":
            self.k = torch.full(shape, math.nan, dtype=self.dtype, device="cuda")
        elif fmt == "fp8":
            self.k = torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN
            if fp8_storage == "float8":
                self.k = self.k.view(torch.float8_e4m3fn)
        else:
            self.k = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=self.gen)
        self.v = self.k.clone()

        self.k_scale = self.v_scale = self.k_residual = None
        if self.channel:
            assert lead[1] % KEY_BLOCK == 0, "channel formats need capacity / page size multiples of 32"
            nan = dict(dtype=torch.float16, device="cuda")
            self.k_scale = torch.full((lead[0], lead[1] // KEY_BLOCK, HKV, 2 * D), math.nan, **nan)
            self.v_scale = torch.full(lead + (HKV, 2), math.nan, **nan)
            self.k_residual = torch.full((B, RESIDUAL_ROWS, HKV, D), math.nan, dtype=self.dtype, device="cuda")
        elif fmt in LEVELS:
            groups = D // 32 if fmt == "int4_group32" else 1
            self.k_scale = torch.full(lead + (HKV, 2 * groups), math.nan, dtype=torch.float16, device="cuda")
            self.v_scale = self.k_scale.clone()
        elif fmt == "fp8":
            # Real rows are N(0, 1): |x| / scale stays well below 448; the 30x rows saturate, which is fine.
            n = HKV if fp8_scale == "head" else 1
            self.k_scale = torch.rand(n, device="cuda", generator=self.gen) * 0.02 + 0.02
            self.v_scale = torch.rand(n, device="cuda", generator=self.gen) * 0.02 + 0.02
        self.initial = [_bits(t).clone() for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def kwargs(self):
        return dict(format=self.format, k_scale=self.k_scale, v_scale=self.v_scale, block_table=self.block_table,
                    k_residual=self.k_residual)

    def rows(self, S, scale=1.0):
        """Fresh random new rows [B, S, HKV, D] in the cache's input dtype."""
        x = torch.randn((self.B, S, self.HKV, self.D), device="cuda", generator=self.gen) * scale
        return x.to(self.dtype)

    def append(self, k_new, v_new, positions, **kw):
        pos = torch.tensor(positions, dtype=torch.int32, device="cuda") if isinstance(positions, list) else positions
        tessera.append_kv(k_new, v_new, pos, self.k, self.v, **self.kwargs(), **kw)

    def _pages(self):
        pages = self.block_table.long()
        return pages, (pages >= 0) & (pages < self.num_pages)

    def gather(self, t):
        """t (data or scales, cache layout) as [B, capacity, HKV, X] in token order (paged: via the block table);
        the channel formats' k_scale as [B, capacity / 32, HKV, 2 D]."""
        t = _bytes(t)
        if not self.paged:
            return t
        pages, _ = self._pages()
        g = t[pages.clamp(0, self.num_pages - 1)]  # [B, max_pages, page_size (or page_size / 32), HKV, X]
        return g.reshape(self.B, -1, *t.shape[2:])

    def valid(self):
        """bool [B, capacity]: tokens whose page id is in range (all of them for the contiguous layout)."""
        if not self.paged:
            return torch.ones((self.B, self.capacity), dtype=torch.bool, device="cuda")
        _, ok = self._pages()
        return ok.repeat_interleave(self.page_size, dim=1)

    def _scales(self, s):
        if s is None or self.format == "fp8":
            return s
        return self.gather(s)

    def values(self):
        """(K, V) float64 [B, capacity, HKV, D]: what the cache holds, decoded with tessera.dequantize_kv."""
        return tuple(tessera.dequantize_kv(self.gather(d), self._scales(s), self.format, self.D,
                                           dtype=torch.float64)
                     for d, s in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def check_spare_pages_untouched(self):
        if not self.paged:
            return
        tensors = (self.k, self.v, self.k_scale, self.v_scale) if self.format in LEVELS else (self.k, self.v)
        for now, before in zip(tensors, self.initial):
            assert torch.equal(_bits(now)[self.spare], before[self.spare]), "append_kv wrote into a page no one owns"


def fill(cache, lengths):
    """Fills the cache with three append_kv calls; returns (src_k, src_v) [B, capacity, HKV, D], the rows every
    sequence's first lengths[b] slots must hold.

    1. 30x rows into every slot (positions 0, S = capacity);
    2. real rows into slots [0, max(lengths) - 1), except 30x rows from each sequence's last token on;
    3. one real row per sequence at positions[b] = lengths[b] - 1 (-1 for an empty sequence: skipped).

    The channel formats take their rows in order instead (fill_in_order).
    """
    if cache.channel:
        return fill_in_order(cache, lengths)
    B, cap = cache.B, cache.capacity
    junk_k, junk_v = cache.rows(cap, GARBAGE), cache.rows(cap, GARBAGE)
    cache.append(junk_k, junk_v, [0] * B)
    src_k, src_v = junk_k.clone(), junk_v.clone()
    lmax = max(lengths)
    if lmax > 1:
        rk, rv = cache.rows(lmax - 1), cache.rows(lmax - 1)
        for b, length in enumerate(lengths):
            rk[b, max(length - 1, 0):] *= GARBAGE
            rv[b, max(length - 1, 0):] *= GARBAGE
        cache.append(rk, rv, [0] * B)
        src_k[:, :lmax - 1], src_v[:, :lmax - 1] = rk, rv
    return append_last_rows(cache, lengths, src_k, src_v)


def append_last_rows(cache, lengths, src_k, src_v):
    """Appends one real row per sequence at lengths[b] - 1 (over what is there) and records it in (src_k, src_v),
    which it returns."""
    nk, nv = cache.rows(1), cache.rows(1)
    cache.append(nk, nv, [length - 1 for length in lengths])
    for b, length in enumerate(lengths):
        if length > 0:
            src_k[b, length - 1], src_v[b, length - 1] = nk[b, 0], nv[b, 0]
    return src_k, src_v


def fill_in_order(cache, lengths):
    """The channel formats' fill, within their contract (each sequence's rows in order, rollback by at most 32):
    returns (src_k, src_v) like fill.

    Calls of S = 1..32 rows (random) append at each unfinished sequence's end (the others get position = capacity:
    skipped) until every sequence has rows up to lengths[b] - 1 at least; the rows from position lengths[b] - 1 on
    are 30x. Then one real row per sequence at lengths[b] - 1, a rollback of up to 31 positions over those 30x rows:
    its block must be re-quantized from rows [32 j, lengths[b]) only, the earlier ones taken from k_residual.
    """
    B, cap = cache.B, cache.capacity
    src_k = torch.zeros((B, cap, cache.HKV, cache.D), dtype=cache.dtype, device="cuda")
    src_v = torch.zeros_like(src_k)
    target = [max(length - 1, 0) for length in lengths]
    end = [0] * B
    while any(e < t for e, t in zip(end, target)):
        S = int(torch.randint(1, KEY_BLOCK + 1, (1,), device="cuda", generator=cache.gen))
        rk, rv = cache.rows(S), cache.rows(S)
        positions = []
        for b in range(B):
            if end[b] >= target[b]:
                positions.append(cap)  # at the capacity: skipped, the sequence is unchanged
                continue
            first_junk = target[b] - end[b]
            if first_junk < S:
                rk[b, first_junk:] *= GARBAGE
                rv[b, first_junk:] *= GARBAGE
            n = min(S, cap - end[b])
            src_k[b, end[b]:end[b] + n], src_v[b, end[b]:end[b] + n] = rk[b, :n], rv[b, :n]
            positions.append(end[b])
            end[b] += S
        cache.append(rk, rv, positions)
    return append_last_rows(cache, lengths, src_k, src_v)


def key_block_rule(x, levels):
    """attention.h's per-channel rule for one key block: x [n, HKV, D] (the rows that exist) -> (codes uint8
    [n, HKV, D], scale fp16 [HKV, D], offset fp16 [HKV, D]). fp32 on the CPU: IEEE subtraction and division are
    correctly rounded, and half() rounds to nearest even (saturated by the clamp first)."""
    x = x.float().cpu()
    lo, hi = x.amin(0), x.amax(0)
    scale = ((hi - lo) / levels).clamp(-65504.0, 65504.0).half()
    offset = lo.clamp(-65504.0, 65504.0).half()
    s, o = scale.float(), offset.float()
    codes = torch.where(s != 0, ((x - o) / s).round().clamp(0, levels), torch.zeros_like(x))
    return codes.to(torch.uint8), scale, offset


def check_key_blocks(cache, src_k, b, t0, t1):
    """The channel formats' keys of sequence b after rows [.., t1) were appended (t1: the sequence's end): every
    block meeting [t0, t1) holds key_block_rule of its rows [32 j, min(32 j + 32, t1)) of src_k bit for bit (codes
    and pairs), and k_residual the 16-bit keys of the last 32 positions (slot t % 64)."""
    fmt, D = cache.format, cache.D
    codes = cache.gather(cache.k)[b]
    if fmt in INT4:
        codes = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)
    params = cache.gather(cache.k_scale)[b]
    for j in range(t0 // KEY_BLOCK, (t1 - 1) // KEY_BLOCK + 1):
        r0, r1 = j * KEY_BLOCK, min(j * KEY_BLOCK + KEY_BLOCK, t1)
        want, scale, offset = key_block_rule(src_k[b, r0:r1], LEVELS[fmt])
        got = params[j].cpu()
        where = f"k of sequence {b}, block {j} (tokens [{r0}, {r1}))"
        assert torch.equal(_bits(got[..., :D]), _bits(scale)), f"{where}: scales differ from fp16((max - min) / levels)"
        assert torch.equal(_bits(got[..., D:]), _bits(offset)), f"{where}: offsets differ from fp16(min)"
        bad = codes[r0:r1].cpu() != want
        assert not bool(bad.any()), f"{where}: {int(bad.sum())} codes differ from the rule, first at " \
                                    f"{[int(i) for i in bad.nonzero()[0]]}"
    for t in range(max(0, t1 - KEY_BLOCK), t1):
        assert torch.equal(_bits(cache.k_residual[b, t % RESIDUAL_ROWS]), _bits(src_k[b, t])), \
            f"k_residual of sequence {b}: slot {t % RESIDUAL_ROWS} does not hold the key of position {t}"


def check_stored(cache, src_k, src_v, spans):
    """The cache rows [t0, t1) of sequence b hold src[b, t0:t1], per the quantization rule of attention.h.

    native: exact. fp8: e4m3(x / scale) * scale, within half an e4m3 step (2^-4 relative, 2^-10 * scale for
    subnormals). Integer formats: per group, offset = fp16(min) and scale = fp16((max - min) / levels) to one
    fp16 ulp, and |value - x| <= scale / 2 (+ the fp16 rounding of scale and offset). The channel formats' keys:
    check_key_blocks (bit-exact; t1 must be the sequence's end, src_k valid from t0's block on).
    """
    torch.cuda.synchronize()
    fmt = cache.format
    values = cache.values()
    for which, (src, vals) in enumerate(((src_k, values[0]), (src_v, values[1]))):
        for b, t0, t1 in spans:
            if t1 <= t0:
                continue
            if which == 0 and fmt in CHANNEL:
                check_key_blocks(cache, src, b, t0, t1)
                continue
            x = src[b, t0:t1].double()
            got = vals[b, t0:t1]
            where = f"{'kv'[which]} of sequence {b}, tokens [{t0}, {t1})"
            if fmt == "native":
                assert torch.equal(got, x), f"{where}: native rows differ from the appended ones"
            elif fmt == "fp8":
                scale = (cache.k_scale, cache.v_scale)[which].double()
                scale = scale.view(-1, 1) if scale.numel() > 1 else scale.view(())
                bound = 2.0 ** -4 * x.abs() * (1 + 1e-6) + 2.0 ** -10 * scale + 1e-12
                err = (got - x).abs()
                assert bool((err <= bound).all()), f"{where}: fp8 error {(err - bound).max().item():.3g} over bound"
            else:
                levels = LEVELS[fmt]
                groups = cache.D // 32 if fmt == "int4_group32" else 1
                pairs = cache.gather((cache.k_scale, cache.v_scale)[which])[b, t0:t1].double()
                pairs = pairs.reshape(*pairs.shape[:-1], groups, 2)
                xs = x.reshape(*x.shape[:-1], groups, cache.D // groups)
                lo, hi = xs.amin(-1).float(), xs.amax(-1).float()
                want_offset = lo.half().double()
                want_scale = ((hi - lo) / levels).half().double()
                scale, offset = pairs[..., 0], pairs[..., 1]
                ulp = 2.0 ** -10
                assert bool(((offset - want_offset).abs() <= ulp * want_offset.abs() + 6e-8).all()), \
                    f"{where}: offset is not fp16(min)"
                assert bool(((scale - want_scale).abs() <= ulp * want_scale.abs() + 6e-8).all()), \
                    f"{where}: scale is not fp16((max - min) / {levels})"
                bound = (0.5 * (1 + 1e-3) * scale + ulp * (levels * scale + offset.abs()) + 1e-7).unsqueeze(-1)
                err = (got.reshape(xs.shape) - xs).abs()
                assert bool((err <= bound).all()), \
                    f"{where}: quantization error {(err - bound).max().item():.3g} over scale / 2"


def reference(q, K, V, lengths, valid, softmax_scale=None, softcap=0.0, window=0):
    """float64 decode: (o [B, HQ, D], lse [B, HQ]) over keys [max(0, L - window), L) that sit in valid pages."""
    B, HQ, D = q.shape
    cap, HKV = K.shape[1], K.shape[2]
    G = HQ // HKV
    scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(D)
    q64 = q.double()
    out = torch.zeros((B, HQ, D), dtype=torch.float64, device="cuda")
    lse = torch.full((B, HQ), -math.inf, dtype=torch.float64, device="cuda")
    for b, length in enumerate(lengths):
        L = min(max(length, 0), cap)
        start = max(0, L - window) if window > 0 else 0
        keep = valid[b, start:L]
        k, v = K[b, start:L][keep], V[b, start:L][keep]  # [n, HKV, D]
        if k.shape[0] == 0:
            continue
        s = torch.einsum("hd,nhd->hn", q64[b], k.repeat_interleave(G, dim=1)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        lse[b] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[b][:, None])
        out[b] = torch.einsum("hn,nhd->hd", p, v.repeat_interleave(G, dim=1))
    return out, lse


def check_decode(out, lse, ref, ref_lse, tol=TOL):
    torch.cuda.synchronize()
    assert out.shape == ref.shape
    for b in range(ref.shape[0]):
        got = out[b].double()
        assert bool(torch.isfinite(got).all()), f"sequence {b}: non-finite or unwritten output"
        if bool(torch.isneginf(ref_lse[b]).all()):  # no key: o = 0, lse = -inf
            assert bool((got == 0).all()), f"sequence {b} has no keys: output must be 0"
            if lse is not None:
                assert bool(torch.isneginf(lse[b]).all()), f"sequence {b} has no keys: lse must be -inf"
            continue
        rel = ((got - ref[b]).norm() / ref[b].norm().clamp(min=1e-30)).item()
        assert rel <= tol, f"sequence {b}: relative Frobenius error {rel:.3g}"
        if lse is not None:
            err = (lse[b].double() - ref_lse[b]).abs()
            # The quantized formats compute on fp16-rounded q and dequantized K: each logit moves by up to
            # ~2^-11 of sum|q_d k_d| * scale, which reaches ~1e-2 on these inputs (the C++ test's lse_atol).
            bound = 1e-2 + 1e-3 * ref_lse[b].abs()
            assert bool((err <= bound).all()), f"sequence {b}: lse error {err.max().item():.3g}"


def random_q(cache, HQ, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((cache.B, HQ, cache.D), device="cuda", generator=g).to(cache.dtype)


def poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device="cuda")


def run_and_check(cache, q, lengths, **params):
    """Decode into poisoned out / lse and compare with the reference; returns out."""
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], torch.float32)
    res = tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, **cache.kwargs(), **params)
    assert res is out
    K, V = cache.values()
    ref, ref_lse = reference(q, K, V, lengths, cache.valid(), params.get("softmax_scale"),
                             params.get("softcap", 0.0), params.get("window", 0))
    check_decode(out, lse, ref, ref_lse)
    return out


# ================================================================================================================
# GPU: correctness over formats, layouts and shapes
# ================================================================================================================

LENGTHS = [0, 1, 17, 300]
CAPACITY = 320
SHAPES = {
    # name: (HQ, HKV, D, page_size of the paged layout)
    "gqa4_d128": (8, 2, 128, 16),
    "gqa8_d64": (16, 2, 64, 64),
    "gqa4_d256": (8, 2, 256, 32),
}


def _decode_grid():
    """(case, shape, layout) for test_decode: every combination the format takes (the channel formats need pages of
    at least 32 tokens)."""
    for layout in ("contiguous", "paged"):
        for shape, (_, _, _, page_size) in SHAPES.items():
            for case in FORMAT_CASES:
                if layout == "paged" and case in CHANNEL_CASES and page_size % KEY_BLOCK:
                    continue
                yield case, shape, layout


@gpu
@pytest.mark.parametrize("case,shape,layout", list(_decode_grid()))
def test_decode(case, shape, layout):
    HQ, HKV, D, page_size = SHAPES[shape]
    seed = 100 * list(FORMAT_CASES).index(case) + 10 * list(SHAPES).index(shape) + (layout == "paged")
    cache = Cache(case, len(LENGTHS), HKV, D, CAPACITY, page_size=page_size if layout == "paged" else 0, seed=seed)
    src_k, src_v = fill(cache, LENGTHS)
    check_stored(cache, src_k, src_v, [(b, 0, L) for b, L in enumerate(LENGTHS)])
    cache.check_spare_pages_untouched()

    q = random_q(cache, HQ, seed + 1)
    run_and_check(cache, q, LENGTHS)

    # Allocated by tessera; with return_lse.
    seqlens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    o, lse = tessera.attention_decode(q, cache.k, cache.v, seqlens, return_lse=True, **cache.kwargs())
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    assert lse.shape == (len(LENGTHS), HQ) and lse.dtype == torch.float32
    K, V = cache.values()
    check_decode(o, lse, *reference(q, K, V, LENGTHS, cache.valid()))


@gpu
@pytest.mark.parametrize("case", ["native_bf16", "int8", "int4_group32", "fp8_head", "int4_kchannel"])
@pytest.mark.parametrize("HQ,HKV", [(4, 4), (20, 1), (32, 2), (64, 1)])
def test_decode_group_sizes(case, HQ, HKV):
    # GQA 1 (MHA), and groups over 16 query heads (processed in tiles of 16, with a ragged last tile for 20).
    lengths = [33, 0, 257]
    cache = Cache(case, len(lengths), HKV, 128, 288, page_size=32, seed=HQ * 7 + HKV)
    fill(cache, lengths)
    run_and_check(cache, random_q(cache, HQ, HQ), lengths)


@gpu
@pytest.mark.parametrize("case", ["int8", "native_bf16", "int4"])
def test_num_splits(case):
    lengths = [300, 1, 77, 0, 160]
    HQ, HKV, D = 8, 2, 128
    cache = Cache(case, len(lengths), HKV, D, 304, page_size=16, seed=11)
    fill(cache, lengths)
    q = random_q(cache, HQ, 12)
    kw = cache.kwargs()
    assert tessera.decode_workspace_size(q, cache.k, cache.v, num_splits=1, **kw) == 0
    for num_splits in (0, 1, 2, 5, 19, 128):
        nbytes = tessera.decode_workspace_size(q, cache.k, cache.v, num_splits=num_splits, **kw)
        assert isinstance(nbytes, int) and nbytes >= 0
        if num_splits > 1:
            assert nbytes > 0, f"num_splits={num_splits} needs a workspace for the partial results"
        a = run_and_check(cache, q, lengths, num_splits=num_splits)
        b = run_and_check(cache, q, lengths, num_splits=num_splits)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"num_splits={num_splits}: not deterministic"


@gpu
@pytest.mark.parametrize("case", ["native_bf16", "int4", "int4_kchannel"])
def test_balance_splits_on_skewed_lengths(case):
    # balance_splits: the batch's splits follow the device lengths (one long sequence among short and empty ones
    # gets more than num_splits); the workspace query takes the flag too (a table of 8 bytes per sequence more).
    lengths = [1024, 0, 3, 40, 1024, 1, 700, 0, 33]
    HQ, HKV, D = 8, 2, 128
    cache = Cache(case, len(lengths), HKV, D, 1024, page_size=32, seed=23)
    fill(cache, lengths)
    q = random_q(cache, HQ, 31)
    kw = cache.kwargs()
    for num_splits in (0, 2, 8):
        plain = tessera.decode_workspace_size(q, cache.k, cache.v, num_splits=num_splits, **kw)
        balanced = tessera.decode_workspace_size(q, cache.k, cache.v, num_splits=num_splits, balance_splits=True,
                                                 **kw)
        assert balanced >= plain
        a = run_and_check(cache, q, lengths, num_splits=num_splits, balance_splits=True)
        b = run_and_check(cache, q, lengths, num_splits=num_splits, balance_splits=True)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"num_splits={num_splits}: not deterministic"


@gpu
@pytest.mark.parametrize("case", ["native_bf16", "int8", "int4", "fp8_head", "int8_kchannel"])
@pytest.mark.parametrize("S,HQ,HKV,params", [
    (4, 8, 2, {}),
    (2, 16, 1, dict(num_splits=3)),
    (8, 4, 4, dict(window=5)),
    (3, 20, 2, dict(softcap=10.0, num_splits=1)),
], ids=lambda x: str(x) if not isinstance(x, dict) else "-".join(f"{k}={v}" for k, v in x.items()) or "default")
def test_speculative_tokens(case, S, HQ, HKV, params):
    # q [B, S, HQ, D]: token i of a sequence of length L (its S new tokens included) is a single-token decode over
    # the first L - S + 1 + i keys (the same window): checked token by token against the reference.
    lengths = [0, 1, S - 1, S, 37, 300]
    page_size = KEY_BLOCK if case in CHANNEL_CASES else 16  # the channel formats' pages hold whole key blocks
    cache = Cache(case, len(lengths), HKV, 128, 304, page_size=page_size, seed=31 + S)
    fill(cache, lengths)
    g = torch.Generator(device="cuda").manual_seed(32 + S)
    q = torch.randn((cache.B, S, HQ, cache.D), device="cuda", generator=g).to(cache.dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:-1], torch.float32)
    tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, **cache.kwargs(), **params)
    K, V = cache.values()
    for i in range(S):
        truncated = [max(0, L - S + 1 + i) for L in lengths]
        ref, ref_lse = reference(q[:, i], K, V, truncated, cache.valid(), None, params.get("softcap", 0.0),
                                 params.get("window", 0))
        check_decode(out[:, i], lse[:, i], ref, ref_lse)
    o2, lse2 = tessera.attention_decode(q, cache.k, cache.v, seqlens, return_lse=True, **cache.kwargs(), **params)
    torch.cuda.synchronize()
    assert o2.shape == q.shape and lse2.shape == (cache.B, S, HQ)
    assert torch.equal(o2.view(torch.int16), out.view(torch.int16))


@gpu
@pytest.mark.parametrize("case", ["int4_group32", "fp8_tensor_u8", "native_fp16", "int4_kchannel"])
@pytest.mark.parametrize("params", [
    dict(softmax_scale=0.3),
    dict(softmax_scale=0.3, softcap=5.0),
    dict(window=1),
    dict(window=64),
    dict(window=1000, softcap=30.0),
    dict(window=100, softcap=2.0, softmax_scale=0.05, num_splits=4),
], ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_softcap_window_scale(case, params):
    lengths = [300, 1, 64, 17]
    cache = Cache(case, len(lengths), 2, 128, 320, page_size=64, seed=21)
    fill(cache, lengths)
    run_and_check(cache, random_q(cache, 8, 22), lengths, **params)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_lengths_beyond_capacity_are_clamped(layout):
    cache = Cache("int8", 3, 2, 128, 160, page_size=32 if layout == "paged" else 0, seed=31)
    fill(cache, [160, 5, 160])
    q = random_q(cache, 8, 32)
    # Lengths at or past the capacity attend to all 160 slots; reading past them would hit the next sequence's
    # 30x rows (contiguous) or the next block-table row (paged).
    run_and_check(cache, q, [160 + 1, 5, 2**31 - 1])


@gpu
def test_out_of_range_pages_are_skipped():
    lengths = [40, 50, 300, 20]
    cache = Cache("int4", len(lengths), 2, 128, 320, page_size=16, seed=41)
    fill(cache, lengths)
    bt = cache.block_table
    bt[1, 0] = -1                     # tokens 0..15 of sequence 1
    bt[2, 3] = cache.num_pages        # tokens 48..63 of sequence 2
    bt[2, 18] = 2**31 - 1             # tokens 288..303 of sequence 2
    bt[3, 0] = bt[3, 1] = -7          # every token of sequence 3: o = 0, lse = -inf, like L = 0
    assert int(cache.valid()[3, :20].sum()) == 0
    q = random_q(cache, 8, 42)
    run_and_check(cache, q, lengths)
    run_and_check(cache, q, lengths, num_splits=7)
    # append_kv skips the same slots: nothing lands outside the pages.
    cache.append(cache.rows(cache.capacity), cache.rows(cache.capacity), [0] * len(lengths))
    torch.cuda.synchronize()
    cache.check_spare_pages_untouched()


@gpu
def test_out_reuse_and_lse_options():
    lengths = [17, 0, 130]
    cache = Cache("int8", len(lengths), 2, 64, 160, seed=51)
    fill(cache, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    K, V = cache.values()
    out = poisoned((len(lengths), 16, 64), cache.dtype)
    for seed in (52, 53):  # the same out, twice
        q = random_q(cache, 16, seed)
        res = tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, **cache.kwargs())
        assert res is out
        ref, ref_lse = reference(q, K, V, lengths, cache.valid())
        check_decode(out, None, ref, ref_lse)
    # lse given without return_lse: written, only out returned. return_lse with out given: lse allocated.
    lse = poisoned((len(lengths), 16), torch.float32)
    res = tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, **cache.kwargs())
    assert res is out
    check_decode(out, lse, ref, ref_lse)
    res, lse2 = tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, return_lse=True, **cache.kwargs())
    assert res is out and lse2.shape == (len(lengths), 16)
    check_decode(out, lse2, ref, ref_lse)


@gpu
def test_strided_q_and_out():
    lengths = [9, 200]
    cache = Cache("native_bf16", len(lengths), 2, 128, 256, page_size=16, seed=61)
    fill(cache, lengths)
    wide_q = random_q(cache, 8, 62).repeat(1, 1, 2)
    q = wide_q[..., 64:192]  # rows 16-byte aligned, unit stride along D
    out = poisoned((2, 8, 256), torch.bfloat16)[..., :128]
    lse = poisoned((8, 2), torch.float32).t()  # any strides
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, **cache.kwargs())
    K, V = cache.values()
    check_decode(out, lse, *reference(q, K, V, lengths, cache.valid()))


@gpu
def test_explicit_stream():
    lengths = [5, 129]
    cache = Cache("int4_group32", len(lengths), 1, 128, 160, seed=71)
    fill(cache, lengths)
    q = random_q(cache, 4, 72)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = poisoned(q.shape, q.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # everything above is queued on the current stream
    tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, stream=side, num_splits=3, **cache.kwargs())
    side.synchronize()
    K, V = cache.values()
    check_decode(out, None, *reference(q, K, V, lengths, cache.valid()))


# ================================================================================================================
# GPU: argument errors
# ================================================================================================================


@gpu
def test_errors_are_value_errors_and_write_nothing():
    B, HQ, HKV, T = 2, 8, 2, 32
    seqlens = torch.tensor([3, 4], dtype=torch.int32, device="cuda")

    # Unsupported head dim: the C++ validation's message, naming q.
    D = 96
    q = torch.randn((B, HQ, D), device="cuda").to(torch.bfloat16)
    k = torch.randn((B, T, HKV, D), device="cuda").to(torch.bfloat16)
    out = poisoned((B, HQ, D), torch.bfloat16)
    with pytest.raises(ValueError, match=r"decode.*'q'.*96"):
        tessera.attention_decode(q, k, k.clone(), seqlens, out=out)
    torch.cuda.synchronize()
    assert bool(torch.isnan(out).all()), "a rejected call wrote out"

    D = 128
    q = torch.randn((B, HQ, D), device="cuda").to(torch.bfloat16)
    out = poisoned((B, HQ, D), torch.bfloat16)
    kc = torch.zeros((B, T, HKV, D), dtype=torch.uint8, device="cuda")
    vc = torch.zeros_like(kc)
    scale = torch.ones(1, device="cuda")  # fp8 scales are read-only: k and v may share one
    fp8 = dict(format="fp8", k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="'q' must be a CUDA tensor"):
        tessera.attention_decode(q.cpu(), kc, vc, seqlens, **fp8)
    # k and v in one memory: the C++ validation's message.
    with pytest.raises(ValueError, match="'cache.v'.*overlap"):
        tessera.attention_decode(q, kc, kc, seqlens, out=out, **fp8)
    if hasattr(torch, "float8_e5m2"):
        with pytest.raises(ValueError, match="'k_cache' must be torch.float8_e4m3fn"):
            tessera.attention_decode(q, kc.view(torch.float8_e5m2), vc.view(torch.float8_e5m2), seqlens, out=out,
                                     **fp8)
        pairs = torch.ones((B, T, HKV, 2), dtype=torch.float16, device="cuda")
        with pytest.raises(ValueError, match="'k_cache'.*format='fp8'"):
            tessera.attention_decode(q, kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn), seqlens,
                                     format="int8", k_scale=pairs, v_scale=pairs.clone(), out=out)
        new = torch.zeros((B, 1, HKV, D), dtype=torch.float8_e4m3fn, device="cuda")
        with pytest.raises(ValueError, match="'k_new'"):
            tessera.append_kv(new, new.clone(), seqlens, kc, vc, **fp8)
    # Integer format without its scales.
    with pytest.raises(ValueError, match="'cache.k_scale' is required"):
        tessera.attention_decode(q, kc, vc, seqlens, format="int8", out=out)
    # A workspace smaller than the requested splits need.
    need = tessera.decode_workspace_size(q, kc, vc, num_splits=2, **fp8)
    assert need > 16
    small = torch.empty(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="'workspace' must have at least"):
        tessera.attention_decode(q, kc, vc, seqlens, num_splits=2, workspace=small, out=out, **fp8)
    torch.cuda.synchronize()
    assert bool(torch.isnan(out).all()), "a rejected call wrote out"


# ================================================================================================================
# GPU: CUDA graphs
# ================================================================================================================


def capture_decode_step(cache, positions, k_new, v_new, q, out, lse):
    """One decode step (append k_new / v_new at `positions`, lengths = positions + 1, decode into out / lse) with a
    workspace sized once, run once outside the capture (warm-up) and captured into the returned CUDA graph."""
    seqlens = torch.empty_like(positions)
    kw = cache.kwargs()
    nbytes = tessera.decode_workspace_size(q, cache.k, cache.v, **kw)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None

    def step():
        tessera.append_kv(k_new, v_new, positions, cache.k, cache.v, **kw)
        torch.add(positions, 1, out=seqlens)
        tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, workspace=workspace, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.keep_alive = (seqlens, workspace)  # buffers the graph reads and writes
    return graph


@gpu
@pytest.mark.parametrize("case", ["int4_group32", "fp8_head", "native_bf16", "int8"])
def test_cuda_graph_decode_step(case):
    # One decode step (append the new token's K/V, advance the lengths, decode) captured once with preallocated
    # out, lse and workspace, then replayed with new tokens, positions and queries written into the same buffers.
    # The workspace is sized once: the split count never depends on the lengths.
    B, HQ, HKV, D = 4, 16, 2, 128
    cache = Cache(case, B, HKV, D, 320, page_size=32, seed=81)
    fill(cache, [5, 0, 100, 299])
    positions = torch.tensor([5, 0, 100, 299], dtype=torch.int32, device="cuda")
    k_new, v_new = cache.rows(1), cache.rows(1)
    q = random_q(cache, HQ, 82)
    out = poisoned(q.shape, q.dtype)
    lse = torch.empty((B, HQ), dtype=torch.float32, device="cuda")
    graph = capture_decode_step(cache, positions, k_new, v_new, q, out, lse)

    # The last replay appends past the capacity (skipped) and decodes the clamped full cache.
    for i, pos in enumerate(([5, 0, 100, 299], [6, 319, 17, 0], [1, 2, 3, 400])):
        positions.copy_(torch.tensor(pos, dtype=torch.int32, device="cuda"))
        k_new.copy_(cache.rows(1))
        v_new.copy_(cache.rows(1))
        q.copy_(random_q(cache, HQ, 83 + i))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        lengths = [p + 1 for p in pos]
        check_stored(cache, k_new.expand(B, cache.capacity, HKV, D).clone(),
                     v_new.expand(B, cache.capacity, HKV, D).clone(),
                     [(b, p, p + 1) for b, p in enumerate(pos) if p < cache.capacity])
        K, V = cache.values()
        check_decode(out, lse, *reference(q, K, V, lengths, cache.valid()))
    cache.check_spare_pages_untouched()


# ================================================================================================================
# Per-channel key formats: append order, rollback, k_residual, torch.compile, CUDA graphs
# ================================================================================================================


def _channel_case(fmt):
    return next(c for c in CHANNEL_CASES if FORMAT_CASES[c][0] == fmt)


@needs_torch
def test_channel_ops_pass_k_residual_to_the_operators():
    # Meta tensors (no GPU): the eager entries hand the calls to torch.ops.tessera.*, whose schemas carry k_residual
    # last among the tensors (append_kv writes it: (e!); attention_decode's balance_splits flag follows it), so a
    # dispatch mode sees it in both calls. Calls without it keep working.
    from tessera import _torch_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)
    for name, writes, at in (("append_kv", True, -1), ("attention_decode", False, -2)):
        arguments = getattr(torch.ops.tessera, name).default._schema.arguments
        arg = arguments[at]
        assert arg.name == "k_residual" and arg.default_value is None, name
        assert (arg.alias_info is not None and arg.alias_info.is_write) == writes, name
    flag = torch.ops.tessera.attention_decode.default._schema.arguments[-1]
    assert flag.name == "balance_splits" and flag.default_value is False

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func)] = list(args) + list((kwargs or {}).values())
            return func(*args, **(kwargs or {}))

    B, HQ, HKV, D, pages, page = 3, 8, 2, 128, 10, 32
    meta = dict(device="meta")
    q = torch.empty((B, HQ, D), dtype=torch.bfloat16, **meta)
    kc = torch.empty((pages, page, HKV, D // 2), dtype=torch.uint8, **meta)
    kw = dict(format="int4_kchannel", block_table=torch.empty((B, 3), dtype=torch.int32, **meta),
              k_scale=torch.empty((pages, page // KEY_BLOCK, HKV, 2 * D), dtype=torch.float16, **meta),
              v_scale=torch.empty((pages, page, HKV, 2), dtype=torch.float16, **meta))
    residual = torch.empty((B, RESIDUAL_ROWS, HKV, D), dtype=torch.bfloat16, **meta)
    lengths = torch.empty((B,), dtype=torch.int32, **meta)
    k_new = torch.empty((B, 1, HKV, D), dtype=torch.bfloat16, **meta)
    with Recorder() as mode:
        tessera.append_kv(k_new, k_new, lengths, kc, kc, k_residual=residual, **kw)
        out, lse = tessera.attention_decode(q, kc, kc, lengths, k_residual=residual, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (B, HQ)
    for op in ("tessera.append_kv.default", "tessera.attention_decode.default"):
        assert op in mode.calls, list(mode.calls)
        assert any(isinstance(a, torch.Tensor) and a.shape == residual.shape and a.dtype == residual.dtype
                   for a in mode.calls[op]), f"{op} did not receive k_residual"
    # The previous arity (no k_residual) still calls the operators, and their direct entries (tessera._torch_C).
    old = (k_new, k_new, lengths, kc, kc, kw["k_scale"], kw["v_scale"], kw["block_table"], "int4_kchannel")
    torch.ops.tessera.append_kv(*old)
    tessera._torch_C.append_kv(*old)
    tessera._torch_C.attention_decode(q, kc, kc, kw["k_scale"], kw["v_scale"], kw["block_table"], lengths, out, lse,
                                      None, "int4_kchannel", 0.0, 0.0, 0, 0)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("fmt", CHANNEL)
def test_channel_append_decode_round_trip(fmt, layout, seed):
    # Speculative rounds (S = 4 drafts, a random number accepted: the next append rolls back over the rejected
    # ones), a rollback by the full 32 positions, and one append of 45 rows over three blocks. After every append the
    # keys must be attention.h's block rule bit for bit (key_block_rule, computed here from the appended rows), the
    # values the row rule, k_residual the last keys; decode (without k_residual: it does not read it) is compared
    # with the float64 reference on the dequantized cache.
    B, HQ, HKV, D = 3, 8, 2, 128
    cache = Cache(_channel_case(fmt), B, HKV, D, 256, page_size=KEY_BLOCK if layout == "paged" else 0, seed=seed)
    src_k, src_v = fill_in_order(cache, [40, 0, 95])
    end = [40, 0, 95]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    kw = dict(cache.kwargs(), k_residual=None)

    def append(S, positions):
        rk, rv = cache.rows(S), cache.rows(S)
        cache.append(rk, rv, positions)
        for b, p in enumerate(positions):
            src_k[b, p:p + S], src_v[b, p:p + S] = rk[b], rv[b]
            end[b] = p + S
        check_stored(cache, src_k, src_v, [(b, 0, e) for b, e in enumerate(end)])

    def decode(S):
        q = torch.randn((B, S, HQ, D), device="cuda", generator=g).to(cache.dtype)
        seqlens = torch.tensor(end, dtype=torch.int32, device="cuda")
        out = poisoned(q.shape, q.dtype)
        lse = poisoned(q.shape[:-1], torch.float32)
        tessera.attention_decode(q, cache.k, cache.v, seqlens, out=out, lse=lse, **kw)
        K, V = cache.values()
        for i in range(S):
            ref, ref_lse = reference(q[:, i], K, V, [e - S + 1 + i for e in end], cache.valid())
            check_decode(out[:, i], lse[:, i], ref, ref_lse)

    for _ in range(3):
        start = list(end)
        append(4, start)
        decode(4)
        accepted = torch.randint(0, 5, (B,), device="cuda", generator=g).tolist()
        end = [p + a for p, a in zip(start, accepted)]  # rejected drafts: the next append overwrites them
    start = list(end)
    append(KEY_BLOCK, start)
    append(1, start)  # back by 32
    decode(1)
    append(45, list(end))
    decode(1)


@gpu
def test_channel_compile_fullgraph_matches_eager(seed):
    # append_kv -> attention_decode under torch.compile(fullgraph=True): the same bytes in every cache tensor
    # (k_residual included: the schema marks it written) and the same output as eager, which is checked too.
    fmt = "int4_kchannel"
    lengths = [33, 0, 64]
    cache = Cache(_channel_case(fmt), len(lengths), 2, 128, 128, page_size=KEY_BLOCK, seed=seed)
    src_k, src_v = fill_in_order(cache, lengths)
    q = random_q(cache, 8, seed + 1)
    k_new, v_new = cache.rows(1), cache.rows(1)
    positions = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def chain(q, k_new, v_new, positions, k, v, k_scale, v_scale, k_residual, block_table):
        kw = dict(format=fmt, k_scale=k_scale, v_scale=v_scale, block_table=block_table, k_residual=k_residual)
        tessera.append_kv(k_new, v_new, positions, k, v, **kw)
        return tessera.attention_decode(q, k, v, positions + 1, num_splits=3, return_lse=True, **kw)

    names = ("k", "v", "k_scale", "v_scale", "k_residual")
    state = [getattr(cache, n) for n in names]
    eager_state, compiled_state = [t.clone() for t in state], [t.clone() for t in state]
    out, lse = chain(q, k_new, v_new, positions, *eager_state, cache.block_table)
    got, got_lse = torch.compile(chain, fullgraph=True)(q, k_new, v_new, positions, *compiled_state,
                                                        cache.block_table)
    torch.cuda.synchronize()
    for name, a, b in zip(names, eager_state, compiled_state):
        assert torch.equal(_bits(a), _bits(b)), f"compiled append_kv wrote a different {name}"
    assert not torch.equal(_bits(eager_state[4]), _bits(cache.k_residual)), "append_kv wrote no k_residual"
    assert torch.equal(_bits(got), _bits(out)) and torch.equal(got_lse, lse), "compiled decode differs from eager"
    for t, a in zip(state, eager_state):
        t.copy_(a)
    new_lengths = [n + 1 for n in lengths]
    for b, p in enumerate(lengths):
        src_k[b, p], src_v[b, p] = k_new[b, 0], v_new[b, 0]
    check_stored(cache, src_k, src_v, [(b, 0, n) for b, n in enumerate(new_lengths)])
    K, V = cache.values()
    check_decode(out, lse, *reference(q, K, V, new_lengths, cache.valid()))


@gpu
@pytest.mark.parametrize("fmt", CHANNEL)
def test_channel_append_needs_k_residual(fmt, seed):
    # append_kv with a channel format and no k_residual (or one of another dtype than k_new) is refused, naming it,
    # before anything is written; decode does not need it; other formats refuse one.
    cache = Cache(_channel_case(fmt), 2, 2, 128, 64, seed=seed)
    before = [_bits(t).clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_residual)]
    k_new, v_new = cache.rows(1), cache.rows(1)
    positions = torch.zeros(2, dtype=torch.int32, device="cuda")
    kw = dict(cache.kwargs(), k_residual=None)
    with pytest.raises(ValueError, match="k_residual"):
        tessera.append_kv(k_new, v_new, positions, cache.k, cache.v, **kw)
    with pytest.raises(ValueError, match="k_residual"):  # the checked path (stream=) and the operator
        tessera.append_kv(k_new, v_new, positions, cache.k, cache.v, stream=torch.cuda.current_stream(), **kw)
    other = torch.float16 if cache.dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="k_residual"):
        tessera.append_kv(k_new, v_new, positions, cache.k, cache.v,
                          **dict(kw, k_residual=cache.k_residual.to(other)))
    torch.cuda.synchronize()
    after = [_bits(t) for t in (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_residual)]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "a refused append_kv wrote the cache"
    q = random_q(cache, 4, seed + 1)
    out = tessera.attention_decode(q, cache.k, cache.v, positions, **kw)  # no keys: o = 0
    torch.cuda.synchronize()
    assert bool((out == 0).all())

    plain = Cache("int8", 2, 2, 128, 64, seed=seed + 2)
    with pytest.raises(ValueError, match="k_residual"):
        tessera.append_kv(k_new, v_new, positions, plain.k, plain.v,
                          **dict(plain.kwargs(), k_residual=cache.k_residual))


@gpu
@pytest.mark.parametrize("fmt", CHANNEL)
def test_cuda_graph_channel_decode_step(fmt, seed):
    # test_cuda_graph_decode_step for the channel formats, whose positions must move in order: each replay appends
    # at the sequences' ends, or rolls back a few positions (rejected tokens), never skips ahead.
    B, HQ, HKV, D = 4, 16, 2, 128
    lengths = [5, 0, 100, 299]
    cache = Cache(_channel_case(fmt), B, HKV, D, 320, page_size=KEY_BLOCK, seed=seed)
    src_k, src_v = fill_in_order(cache, lengths)
    positions = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k_new, v_new = cache.rows(1), cache.rows(1)
    q = random_q(cache, HQ, seed + 1)
    out = poisoned(q.shape, q.dtype)
    lse = torch.empty((B, HQ), dtype=torch.float32, device="cuda")
    # The warm-up and the capture both append at `lengths` (the same rows, the same state).
    graph = capture_decode_step(cache, positions, k_new, v_new, q, out, lse)

    for i, pos in enumerate(([5, 0, 100, 299], [6, 1, 101, 300], [3, 0, 98, 301], [4, 1, 99, 302])):
        positions.copy_(torch.tensor(pos, dtype=torch.int32, device="cuda"))
        k_new.copy_(cache.rows(1))
        v_new.copy_(cache.rows(1))
        q.copy_(random_q(cache, HQ, seed + 2 + i))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        for b, p in enumerate(pos):
            src_k[b, p], src_v[b, p] = k_new[b, 0], v_new[b, 0]
        new_lengths = [p + 1 for p in pos]
        check_stored(cache, src_k, src_v, [(b, 0, n) for b, n in enumerate(new_lengths)])
        K, V = cache.values()
        check_decode(out, lse, *reference(q, K, V, new_lengths, cache.valid()))
    cache.check_spare_pages_untouched()
