"""tessera.attention — attention prefill, and decode over a low-precision KV cache with its producer (append_kv).

Thin wrappers over the PyTorch operators torch.ops.tessera.attention_prefill / attention_prefill_varlen /
attention_prefill_with_cache / attention_decode / append_kv (the C++ library, include/tessera/attention.h; user
docs docs/ops/attention_prefill.md and docs/ops/attention_decode.md).

* ``prefill`` / ``prefill_varlen``: every query of a prompt attends to its sequence's keys and values (bf16/fp16,
  D in {64, 128, 256}, GQA, causal bottom-right aligned, sliding window, softcap, lse), over a plain batch
  q [B, Sq, HQ, D] or a packed variable-length batch q [total_q, HQ, D] with int32 cu_seqlens on the device (the
  layout engines use). No workspace.
* ``prefill_with_cache``: chunked prefill over the decode KV cache (every format, contiguous or paged): a packed batch
  of new queries, each sequence's last Sq positions, attends to its cached keys and values.
* ``attention_decode``: one new query token per sequence (or up to 8, causal) attends to its cached keys and values
  (GQA, softcap, sliding window, split-K over the sequence), for the KV formats
  'native' (bf16/fp16), 'fp8' (e4m3 + fp32 scale per tensor or per KV head), 'int8', 'int4' (fp16
  (scale, offset) per token and head), 'int4_group32' (fp16 (scale, offset) per 32 elements), and the per-channel
  key formats 'int8_kchannel' / 'int4_kchannel' (keys with fp16 (scale, offset) per channel over blocks of 32
  tokens, KIVI-style; values as 'int8' / 'int4'; append_kv keeps the keys of the last two blocks it wrote per
  sequence in 16 bits in ``k_residual``).
* ``append_kv``: quantizes new K/V rows into the cache at given positions (the only producer tessera ships).
* ``decode_workspace_size``: bytes of workspace attention_decode needs (depends on shapes, device and params only).
* ``dequantize_kv``: the cache format's decoding rule in pure torch, for tests and debugging.

Like tessera.moe and tessera.gemm, the ops accept torch tensors (or ``__dlpack__`` producers), run
asynchronously on the current CUDA stream of q's (k_new's) device unless ``stream=`` is given, never synchronize,
and raise ValueError naming the op and the argument for invalid arguments (messages from the C++ validation use
the names of the C++ API: the KVCache fields, ``o`` for out, ``params.softcap`` ...), and RuntimeError for CUDA or
device errors. fp8 caches may be torch.float8_e4m3fn or torch.uint8 (the e4m3 bytes). Integer-format caches are
torch.uint8 (int4: two codes per byte, last dim D/2).

append_kv, attention_decode and decode_workspace_size take ``k_residual=`` (None by default): the per-channel key
formats' 16-bit key residual, which append_kv requires for them (and updates), attention_decode and
decode_workspace_size accept and do not read, and the other formats refuse. The rules are the C++ validation's
(messages name 'cache.k_residual'); this layer only passes the tensor on.

prefill, prefill_varlen, prefill_with_cache and attention_decode allocate out and lse with torch when they are not
given, and attention_decode's operator allocates the workspace (through torch's caching allocator, on the stream it
runs on) when none is given and the split needs one. Both are safe under torch.cuda.graph capture (torch's graph
memory pool) and torch.compile. To capture with no allocation at all, pass preallocated ``out`` (and ``lse``), and
for decode a ``workspace`` of ``decode_workspace_size(...)`` bytes; the size never depends on the sequence lengths,
so one workspace serves every replay. prefill needs no workspace, and the lengths of prefill_varlen (cu_seqlens) and
prefill_with_cache (cu_seqlens_q, cache_seqlens) are read on the device only: a captured call replays with whatever
lengths the buffers hold.
"""

from . import _C
from ._dlpack import (FALLBACK, FP8_DTYPES, as_optional_tensor, as_tensor, cuda_device_of, fast_entry, launch,
                      stream_arg, to_capsule, torch_module, torch_ops)
from .moe import _choice, _int, _rank

__all__ = [
    "FORMATS",
    "append_kv",
    "attention_decode",
    "decode_workspace_size",
    "dequantize_kv",
    "prefill",
    "prefill_varlen",
    "prefill_with_cache",
]

FORMATS = ("native", "fp8", "int8", "int4", "int4_group32", "int8_kchannel", "int4_kchannel")
CHANNEL_FORMATS = ("int8_kchannel", "int4_kchannel")  # per-channel key scales over blocks of KEY_BLOCK tokens
MAX_SPLITS = _C.decode_max_splits  # 128
GROUP_SIZE = _C.int4_group_size  # 32: elements per (scale, offset) pair of 'int4_group32'
KEY_BLOCK = _C.key_block  # 32: tokens per key-scale block of the per-channel key formats
KEY_RESIDUAL_ROWS = _C.key_residual_rows  # 64: rows of their k_residual [B, 64, HKV, D]

_INT4 = ("int4", "int4_group32", "int4_kchannel")


# ---- argument handling ---------------------------------------------------------------------------------------


def _is_fp8(t):
    return t.dtype in FP8_DTYPES  # a tuple lookup: cheaper than is_floating_point() and element_size()


def _not_fp8(op, arg, t):
    # An fp8 tensor would reach C++ as a uint8 view (to_capsule) and be read as something else, or be refused
    # with a message that says uint8.
    if _is_fp8(t):
        raise ValueError(f"{op}: '{arg}' must be torch.bfloat16 or torch.float16, got {t.dtype}")


def _cache_data(torch, op, arg, t, format):
    """The dtype check C++ cannot do: which fp8 dtype a uint8 view came from (see _dlpack.to_capsule)."""
    if format == "fp8":
        e4m3 = getattr(torch, "float8_e4m3fn", None)
        if t.dtype != torch.uint8 and (e4m3 is None or t.dtype != e4m3):
            raise ValueError(
                f"{op}: '{arg}' must be torch.float8_e4m3fn or torch.uint8 (e4m3 bytes) for format='fp8', "
                f"got {t.dtype}")
    elif _is_fp8(t):
        raise ValueError(f"{op}: '{arg}' is {t.dtype}, which only format='fp8' accepts (format={format!r})")


def _float(op, arg, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: '{arg}' must be a number, got {type(value).__name__}") from None


def _params(op, softmax_scale, softcap, window, num_splits):
    """(softmax_scale, softcap, window, num_splits) as the binding takes them; None softmax_scale = 0 = 1/sqrt(D)."""
    scale = 0.0 if softmax_scale is None else _float(op, "softmax_scale", softmax_scale)
    # A window at or past the cache's capacity (< 2^31) is no window: clamped to 2^31 - 1, the same meaning, so that
    # the queries' 32-bit binding takes any window the op takes.
    window = min(_int(op, "window", window, 0), (1 << 31) - 1)
    return (scale, _float(op, "softcap", softcap), window, _int(op, "num_splits", num_splits, 0))


def _flag(op, arg, value):
    """A bool argument (Python's or numpy's), refused otherwise: a string like "false" would be true."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{op}: '{arg}' must be a bool, got {type(value).__name__}")


def _on_device(torch, device, fn):
    """Runs fn() with `device` current (the workspace query reads the current device's SM count)."""
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device.index):
            return fn()
    return fn()


class _Cache:
    """The KV cache arguments as torch tensors, checked for what only Python can see."""

    def __init__(self, torch, op, format, k_cache, v_cache, k_scale, v_scale, block_table, k_residual):
        self.format = format
        self.k = as_tensor(k_cache, op, "k_cache")
        self.v = as_tensor(v_cache, op, "v_cache")
        _cache_data(torch, op, "k_cache", self.k, format)
        _cache_data(torch, op, "v_cache", self.v, format)
        self.k_scale = as_optional_tensor(k_scale, op, "k_scale")
        self.v_scale = as_optional_tensor(v_scale, op, "v_scale")
        self.block_table = as_optional_tensor(block_table, op, "block_table")
        self.k_residual = as_optional_tensor(k_residual, op, "k_residual")

    def capsules(self):
        """The capsules of the binding's positional cache arguments (k_residual is its keyword)."""
        return (to_capsule(self.k), to_capsule(self.v), to_capsule(self.k_scale), to_capsule(self.v_scale),
                to_capsule(self.block_table))


def _cache_tensors(op, k_cache, v_cache, k_scale, v_scale, block_table):
    """The cache arguments as torch tensors, in the operators' order (the eager path; dtype rules are the
    operator's). k_residual travels apart: it is the operators' last argument."""
    return (as_tensor(k_cache, op, "k_cache"), as_tensor(v_cache, op, "v_cache"),
            as_optional_tensor(k_scale, op, "k_scale"), as_optional_tensor(v_scale, op, "v_scale"),
            as_optional_tensor(block_table, op, "block_table"))


def _decode_query(op, format, q, softmax_scale, softcap, window, num_splits):
    """The checks both decode entry points start with: format and params, then q (a CUDA tensor, not fp8)."""
    _choice(op, "format", format, FORMATS)
    params = _params(op, softmax_scale, softcap, window, num_splits)
    torch = torch_module()
    q = as_tensor(q, op, "q")
    _not_fp8(op, "q", q)
    return torch, q, cuda_device_of(q, op, "q"), params


def _workspace_bytes(cache, q, params, balance_splits):
    return _C.decode_workspace_bytes(to_capsule(q), *cache.capsules(), cache.format, *params,
                                     k_residual=to_capsule(cache.k_residual), balance_splits=balance_splits)


# ---- ops -------------------------------------------------------------------------------------------------------


def decode_workspace_size(q, k_cache, v_cache, *, format="native", k_scale=None, v_scale=None, block_table=None,
                          k_residual=None, softmax_scale=None, softcap=0.0, window=0, num_splits=0,
                          balance_splits=False, out=None, lse=None, return_lse=False, workspace=None, stream=None):
    """Bytes of device workspace attention_decode needs for these arguments (0 when one split suffices).

    Depends only on the shapes, the device (its SM count) and the params (num_splits above all), never on the
    sequence lengths or any device value: size a workspace once and reuse it for every call and graph replay with
    these shapes. Takes the same arguments as attention_decode (cache_seqlens excepted); out, lse, return_lse,
    workspace and stream are accepted so that one keyword dict serves both calls, and are ignored.
    """
    op = "tessera.decode_workspace_size"
    balance = _flag(op, "balance_splits", balance_splits)
    torch, q, device, params = _decode_query(op, format, q, softmax_scale, softcap, window, num_splits)
    cache = _Cache(torch, op, format, k_cache, v_cache, k_scale, v_scale, block_table, k_residual)
    return int(_on_device(torch, device, lambda: _workspace_bytes(cache, q, params, balance)))


def attention_decode(q, k_cache, v_cache, cache_seqlens, *, format="native", k_scale=None, v_scale=None,
                     block_table=None, k_residual=None, softmax_scale=None, softcap=0.0, window=0, num_splits=0,
                     balance_splits=False, out=None, lse=None, return_lse=False, workspace=None, stream=None):
    """Decode attention: o[b, h] = softmax_t(softmax_scale * q[b, h] . K[b, t, h // G]) @ V[b, t, h // G].

    Over the keys t in [max(0, L - window), L) with L = min(cache_seqlens[b], capacity) (window 0: all keys);
    G = HQ / HKV query heads share a KV head. With softcap > 0 the logits become softcap * tanh(s / softcap).
    L = 0 gives o = 0 and lse = -inf. L counts the current token: append its K/V first (append_kv).
    Speculative decoding: q [B, S, HQ, D] holds S <= 8 new tokens per sequence (all appended, L counts them);
    token i sits at position L - S + i and attends causally to the keys [max(0, L - S + 1 + i - window),
    L - S + 1 + i); a token with no key gets o = 0 and lse = -inf.

    q              [B, HQ, D] or [B, S, HQ, D] bf16 | fp16, unit stride along D, 16-byte aligned rows;
                   D in {64, 128, 256}; HQ a multiple of HKV.
    k_cache, v_cache  contiguous [B, T_max, HKV, row] or paged [num_pages, page_size, HKV, row]:
                   'native': q's dtype, row = D; 'fp8': float8_e4m3fn or uint8, row = D; 'int8', 'int8_kchannel':
                   uint8, row = D; 'int4', 'int4_group32', 'int4_kchannel': uint8, row = D/2 (byte j: element 2j
                   in bits 0..3, 2j+1 in 4..7). Channel formats: T_max and page_size multiples of 32.
    cache_seqlens  int32 [B] on the device (read on the device only; lengths beyond the capacity are clamped).
    format         'native' | 'fp8' | 'int8' | 'int4' | 'int4_group32' | 'int8_kchannel' | 'int4_kchannel'.
    k_scale, v_scale  integer formats: fp16 [..., HKV, 2*NG] shaped like the data, (scale, offset) pairs,
                   NG = 1 ('int8', 'int4') or D/32 ('int4_group32'). 'fp8': fp32 [1] or [HKV]. 'native': None.
                   'int8_kchannel', 'int4_kchannel': k_scale fp16 [B, T_max / 32, HKV, 2*D] (or [num_pages,
                   page_size / 32, HKV, 2*D]): scale of channel d over the 32 tokens of a block at d, its offset
                   at D + d; v_scale as for 'int8' / 'int4' (one pair per token and head).
    k_residual     the channel formats' 16-bit key residual (see append_kv); accepted and not read here.
    block_table    int32 [B, max_pages] for the paged layout (page ids outside [0, num_pages): tokens skipped),
                   None for the contiguous one.
    softmax_scale  None (or 0): 1/sqrt(D).   softcap  0: off.   window  0: all keys.
    num_splits     0: chosen from the shapes and the SM count; else 1..128 splits of the sequence.
    balance_splits  True: with 2..512 sequences and 2 or more splits, the B * num_splits splits go to the sequences
                   by their device lengths (a long sequence among short ones gets up to max(num_splits, 32)),
                   planned on the device; faster where lengths differ widely, 2-14 % slower where they are equal
                   (docs/ops/attention_decode.md). Pass the same value to decode_workspace_size.
    out            shaped like q, of q's dtype, to write into (default: allocated with torch.empty).
    lse            fp32 [B, HQ] ([B, S, HQ] for a 4-D q) to write log-sum-exp into (natural log); allocated when
                   return_lse and None.
    workspace      device tensor of at least decode_workspace_size(...) bytes (any dtype, contiguous); allocated
                   when None and needed. Pass it (and out) preallocated when capturing a CUDA graph.
    stream         None: the current CUDA stream of q's device; else a torch.cuda.Stream or a raw cudaStream_t.
    Returns out, or (out, lse) when return_lse.
    """
    balance_splits = _flag("tessera.attention_decode", "balance_splits", balance_splits)
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.attention_decode_eager(q, k_cache, v_cache, cache_seqlens, k_scale, v_scale, block_table, out,
                                                lse, return_lse, workspace, format, softmax_scale, softcap, window,
                                                num_splits, k_residual, balance_splits)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _attention_decode_checked(q, k_cache, v_cache, cache_seqlens, format, k_scale, v_scale, block_table,
                                     softmax_scale, softcap, window, num_splits, out, lse, return_lse, workspace,
                                     k_residual, stream, balance_splits)


def _attention_decode_checked(q, k_cache, v_cache, cache_seqlens, format, k_scale, v_scale, block_table, softmax_scale,
                              softcap, window, num_splits, out, lse, return_lse, workspace, k_residual, stream,
                              balance_splits):
    """attention_decode's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.attention_decode"
    torch, q, device, params = _decode_query(op, format, q, softmax_scale, softcap, window, num_splits)
    if q.dim() not in (3, 4):
        raise ValueError(f"{op}: 'q' must be [B, HQ, D] or [B, S, HQ, D] (S new tokens per sequence), "
                         f"got shape {list(q.shape)}")
    # The cache's dtype rules are checked by the operator (python/src/torch_ops.cpp), with these messages.
    cache = _cache_tensors(op, k_cache, v_cache, k_scale, v_scale, block_table)
    k_residual = as_optional_tensor(k_residual, op, "k_residual")
    cache_seqlens = as_tensor(cache_seqlens, op, "cache_seqlens")
    if out is not None:
        out = as_tensor(out, op, "out")
        _not_fp8(op, "out", out)
    lse = as_optional_tensor(lse, op, "lse")
    workspace = as_optional_tensor(workspace, op, "workspace")

    ops = torch_ops()

    def run():
        o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=device)
        m = lse
        if m is None and return_lse:
            m = torch.empty(q.shape[:-1], dtype=torch.float32, device=device)
        # A workspace not given is allocated by the operator, on the stream it runs on, when the split needs one.
        ops.attention_decode(q, *cache, cache_seqlens, o, m, workspace, format, *params, k_residual, balance_splits)
        return (o, m) if return_lse else o

    return run() if stream is None else launch(stream_arg(op, stream, device), run)



def append_kv(k_new, v_new, positions, k_cache, v_cache, *, format="native", k_scale=None, v_scale=None,
              block_table=None, k_residual=None, stream=None):
    """Writes k_new[b, i] and v_new[b, i] into the cache at token positions[b] + i, quantized to its format.

    k_new, v_new   [B, S, HKV, D] bf16 | fp16, unit stride along D ('native': the cache's dtype).
    positions      int32 [B] on the device. Slots at or beyond the capacity, negative ones, and (paged) pages
                   outside [0, num_pages) are skipped: nothing out of bounds is written.
    k_cache, v_cache, format, block_table  as in attention_decode.
    k_scale, v_scale  integer formats: outputs, the (scale, offset) pairs of the written rows
                   (scale = fp16((max - min) / levels), offset = fp16(min) per group; levels 255 or 15).
                   'fp8': inputs, fp32 [1] or [HKV]; codes = e4m3(x / scale), saturated to +-448.
                   'int8_kchannel', 'int4_kchannel': k_scale [.., slots / 32, HKV, 2*D] holds per-channel pairs
                   over each 32-token block (scale = fp16((max - min) / levels), offset = fp16(min) over the
                   block's rows appended so far); v_scale per-row pairs as for 'int8' / 'int4'.
    k_residual     'int8_kchannel', 'int4_kchannel' only, and required there: [B, 64, HKV, D] in k_new's dtype,
                   unit stride along D, read and written: slot t % 64 holds the 16-bit key of position t of
                   sequence b for the positions of the last two blocks written. A block that is not full yet is
                   re-quantized from its exact keys at every append into it. Contract (not validated): each
                   sequence's rows are appended in order, never skipping ahead of its end; positions[b] may go back
                   (rejected speculative tokens) by at most 32 from the furthest end the sequence has reached.
                   docs/ops/attention_decode.md has the details.
    cache_seqlens are not updated (the caller advances them).
    stream         None: the current CUDA stream of k_new's device; else a torch.cuda.Stream or a raw int.
    Returns None.
    """
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            entry.append_kv_eager(k_new, v_new, positions, k_cache, v_cache, k_scale, v_scale, block_table, format,
                                  k_residual)
            return None
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    _append_kv_checked(k_new, v_new, positions, k_cache, v_cache, format, k_scale, v_scale, block_table, k_residual,
                       stream)


def _append_kv_checked(k_new, v_new, positions, k_cache, v_cache, format, k_scale, v_scale, block_table, k_residual,
                       stream):
    """append_kv's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.append_kv"
    _choice(op, "format", format, FORMATS)

    torch_module()  # ImportError naming torch when it is missing
    k_new = as_tensor(k_new, op, "k_new")
    v_new = as_tensor(v_new, op, "v_new")
    _not_fp8(op, "k_new", k_new)
    _not_fp8(op, "v_new", v_new)
    if not k_new.is_cuda:
        cuda_device_of(k_new, op, "k_new")
    positions = as_tensor(positions, op, "positions")
    cache = _cache_tensors(op, k_cache, v_cache, k_scale, v_scale, block_table)
    k_residual = as_optional_tensor(k_residual, op, "k_residual")

    ops = torch_ops()
    if stream is None:
        ops.append_kv(k_new, v_new, positions, *cache, format, k_residual)
    else:
        launch(stream_arg(op, stream, k_new.device),
               lambda: ops.append_kv(k_new, v_new, positions, *cache, format, k_residual))


# ---- prefill ----------------------------------------------------------------------------------------------------


def _prefill_params(op, softmax_scale, softcap, window, causal):
    """(softmax_scale, softcap, window, causal) as the operators take them; None softmax_scale = 0 = 1/sqrt(D)."""
    scale = 0.0 if softmax_scale is None else _float(op, "softmax_scale", softmax_scale)
    return scale, _float(op, "softcap", softcap), _int(op, "window", window, 0), bool(causal)


def _prefill_query(op, q, rank, what):
    """q as a CUDA torch tensor of the form's rank (checked before anything is allocated), and its device."""
    torch = torch_module()
    q = as_tensor(q, op, "q")
    device = cuda_device_of(q, op, "q")
    _rank(op, "q", q, rank, what)
    return torch, q, device


def _prefill_run(torch, op, device, q, out, lse, return_lse, stream, call):
    """Allocates out (like q) and lse (fp32, q's shape without D) when not given, then call(o, lse); returns out, or
    (out, lse) when return_lse."""
    if out is not None:
        out = as_tensor(out, op, "out")
    lse = as_optional_tensor(lse, op, "lse")

    def run():
        o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=device)
        m = lse
        if m is None and return_lse:
            m = torch.empty(q.shape[:-1], dtype=torch.float32, device=device)
        call(o, m)
        return (o, m) if return_lse else o

    return run() if stream is None else launch(stream_arg(op, stream, device), run)


def prefill(q, k, v, *, causal=False, softmax_scale=0.0, softcap=0.0, window=0, out=None, lse=None,
            return_lse=False, stream=None):
    """Prefill attention over a plain batch: every query of a sequence attends to that sequence's keys.

    Sequence b has Sq queries and Sk keys; query i sits at position p = Sk - Sq + i (bottom-right aligned, as
    FlashAttention does) and attends to the keys j in [0, Sk) with j <= p when causal, and p - j < window when
    window > 0 (the window counts the query's own position: FlashAttention's window_size_left is window - 1):
        s[i, j] = softmax_scale * q[i] . k[j]       (then softcap * tanh(s / softcap) if softcap > 0)
        o[i] = sum_j softmax_j(s[i, j]) v[j],        lse[i] = log sum_j exp(s[i, j])   (natural log)
    Query head h reads KV head h // (HQ / HKV) (GQA). A query with no key (Sk = 0, or causal with p < 0, which the
    Sq <= Sk rule below excludes) gets o = 0 and lse = -inf.

    q              [B, Sq, HQ, D] bf16 | fp16; unit stride along D, other strides multiples of 16 bytes, 16-byte
                   aligned; D in {64, 128, 256}; HQ a multiple of HKV.
    k, v           [B, Sk, HKV, D], q's dtype, the same rules (e.g. head ranges of one fused qkv buffer).
    causal         bottom-right aligned; needs Sq <= Sk.
    softmax_scale  0 (or None): 1/sqrt(D).   softcap  0: off.   window  0: every key.
    out            [B, Sq, HQ, D] of q's dtype (strides multiples of 4 bytes) to write into (default: allocated).
    lse            fp32 [B, Sq, HQ] (any strides) to write log-sum-exp into; allocated when return_lse and None.
    stream         None: the current CUDA stream of q's device; else a torch.cuda.Stream or a raw cudaStream_t.
    Returns out, or (out, lse) when return_lse. Allocates nothing else (no workspace) and never synchronizes.
    """
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.attention_prefill_eager(q, k, v, out, lse, return_lse, softmax_scale, softcap, window,
                                                 causal)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _prefill_checked(q, k, v, causal, softmax_scale, softcap, window, out, lse, return_lse, stream)


def _prefill_checked(q, k, v, causal, softmax_scale, softcap, window, out, lse, return_lse, stream):
    """prefill's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.prefill"
    params = _prefill_params(op, softmax_scale, softcap, window, causal)
    torch, q, device = _prefill_query(op, q, 4, "[B, Sq, HQ, D]")
    k = as_tensor(k, op, "k")
    v = as_tensor(v, op, "v")
    ops = torch_ops()
    return _prefill_run(torch, op, device, q, out, lse, return_lse, stream,
                        lambda o, m: ops.attention_prefill(q, k, v, o, m, *params))


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, causal=False, softmax_scale=0.0,
                   softcap=0.0, window=0, out=None, lse=None, return_lse=False, stream=None):
    """Prefill attention over a packed variable-length batch (the layout engines use); semantics as prefill.

    q              [total_q, HQ, D] bf16 | fp16 (rules as prefill's q).
    k, v           [total_k, HKV, D], q's dtype.
    cu_seqlens_q, cu_seqlens_k  int32 [B + 1] on the device: sequence b owns q rows [cu_seqlens_q[b],
                   cu_seqlens_q[b + 1]) and k / v rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
    max_seqlen_q   a host bound (int >= 0) on every sequence's query count; it only sizes the grid (query rows past
                   it are not computed).
    causal, softmax_scale, softcap, window, stream  as prefill.
    out            [total_q, HQ, D] of q's dtype (default: allocated); lse fp32 [total_q, HQ] (any strides).
    Returns out, or (out, lse) when return_lse.

    The lengths are device values, never read by the host, so they are not validated: cu_seqlens must start at 0,
    not decrease, and end at most at total_q / total_k (q, k, v may be sized for a CUDA graph's largest batch: rows
    past cu_seqlens_q[B] are not written), with Sq <= Sk for the causal rows to have keys. Whatever they hold,
    nothing outside q, k, v, out and lse is read or written.
    """
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.attention_prefill_varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, lse,
                                                        return_lse, softmax_scale, softcap, window, causal)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _prefill_varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, softcap,
                                   window, out, lse, return_lse, stream)


def _prefill_varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, softcap, window,
                            out, lse, return_lse, stream):
    """prefill_varlen's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.prefill_varlen"
    max_seqlen_q = _int(op, "max_seqlen_q", max_seqlen_q, 0)
    params = _prefill_params(op, softmax_scale, softcap, window, causal)
    torch, q, device = _prefill_query(op, q, 3, "[total_q, HQ, D]")
    k = as_tensor(k, op, "k")
    v = as_tensor(v, op, "v")
    cu_seqlens_q = as_tensor(cu_seqlens_q, op, "cu_seqlens_q")
    cu_seqlens_k = as_tensor(cu_seqlens_k, op, "cu_seqlens_k")
    ops = torch_ops()
    return _prefill_run(torch, op, device, q, out, lse, return_lse, stream,
                        lambda o, m: ops.attention_prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  o, m, *params))


def prefill_with_cache(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache, cache_seqlens, *, format="native",
                       k_scale=None, v_scale=None, block_table=None, k_residual=None, causal=False, softmax_scale=0.0,
                       softcap=0.0, window=0, out=None, lse=None, return_lse=False, stream=None):
    """Chunked prefill over the decode KV cache: the new queries of each sequence attend to its cached keys.

    Sequence b has L = min(cache_seqlens[b], capacity) keys in the cache, the new tokens included (write their K and
    V with append_kv first); its Sq = cu_seqlens_q[b + 1] - cu_seqlens_q[b] queries are its last Sq positions,
    L - Sq .. L - 1, with prefill's semantics for Sk = L: causal attends to the whole cached prefix and, causally, to
    the new tokens; window, softcap and softmax_scale as prefill.

    q              [total_q, HQ, D] bf16 | fp16 (rules as prefill_varlen's q); HQ a multiple of the cache's HKV.
    cu_seqlens_q   int32 [B + 1] on the device (as prefill_varlen's); B is the cache's batch.
    max_seqlen_q   a host bound (int >= 0) on every sequence's query count; it only sizes the grid.
    k_cache, v_cache, format, k_scale, v_scale, block_table  as in attention_decode (every format; 'native' rows of
                   q's dtype). The quantized formats are dequantized tile by tile in shared memory to fp16, and q runs
                   in fp16 for them (a bf16 q saturated to fp16's range); out is q's dtype.
    k_residual     the channel formats' 16-bit key residual (see append_kv); accepted and not read here.
    cache_seqlens  int32 [B] on the device: each sequence's length including the new tokens (lengths beyond the
                   capacity are clamped).
    causal, softmax_scale, softcap, window, stream  as prefill.
    out            [total_q, HQ, D] of q's dtype (default: allocated); lse fp32 [total_q, HQ] (any strides).
    Returns out, or (out, lse) when return_lse. Allocates nothing else (no workspace) and never synchronizes.

    cu_seqlens_q, cache_seqlens and the block table are device values, never read by the host, so they are not
    validated; whatever they hold, nothing outside the tensors is read or written (pages outside [0, num_pages)
    read as zeros).
    """
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.attention_prefill_with_cache_eager(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache,
                                                            cache_seqlens, k_scale, v_scale, block_table, out, lse,
                                                            return_lse, format, softmax_scale, softcap, window,
                                                            causal, k_residual)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _prefill_with_cache_checked(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache, cache_seqlens, format,
                                       k_scale, v_scale, block_table, k_residual, causal, softmax_scale, softcap,
                                       window, out, lse, return_lse, stream)


def _prefill_with_cache_checked(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache, cache_seqlens, format, k_scale,
                                v_scale, block_table, k_residual, causal, softmax_scale, softcap, window, out, lse,
                                return_lse, stream):
    """prefill_with_cache's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.prefill_with_cache"
    _choice(op, "format", format, FORMATS)
    max_seqlen_q = _int(op, "max_seqlen_q", max_seqlen_q, 0)
    params = _prefill_params(op, softmax_scale, softcap, window, causal)
    torch, q, device = _prefill_query(op, q, 3, "[total_q, HQ, D]")
    # The cache's dtype rules are checked by the operator (python/src/torch_ops.cpp), as for attention_decode.
    cache = _cache_tensors(op, k_cache, v_cache, k_scale, v_scale, block_table)
    k_residual = as_optional_tensor(k_residual, op, "k_residual")
    cu_seqlens_q = as_tensor(cu_seqlens_q, op, "cu_seqlens_q")
    cache_seqlens = as_tensor(cache_seqlens, op, "cache_seqlens")
    ops = torch_ops()
    return _prefill_run(torch, op, device, q, out, lse, return_lse, stream,
                        lambda o, m: ops.attention_prefill_with_cache(q, cu_seqlens_q, max_seqlen_q, *cache,
                                                                      cache_seqlens, o, m, format, *params,
                                                                      k_residual))


# ---- pure-torch decoding of the cache formats -----------------------------------------------------------------


def _unpack_int4(torch, codes):
    """uint8 [..., D/2] -> uint8 [..., D]: element 2j from bits 0..3 of byte j, element 2j+1 from bits 4..7."""
    low = codes & 0x0F
    high = codes >> 4
    return torch.stack((low, high), dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize_kv(codes, scales, format, head_dim, *, dtype=None):
    """The values a cache holds, per include/tessera/attention.h; a torch function for tests and debugging.

    codes     cache data [..., HKV, row] (contiguous or paged layout, or any slice that keeps the last two dims):
              'native' bf16/fp16 (row = D); 'fp8' float8_e4m3fn or uint8 e4m3 bytes (row = D); 'int8',
              'int8_kchannel' uint8 (row = D); 'int4', 'int4_group32', 'int4_kchannel' uint8 (row = D/2, low
              nibble = even element).
    scales    integer formats: fp16 [..., HKV, 2*NG] matching codes' leading dims, pairs (scale, offset);
              NG = 1, or D/32 for 'int4_group32' (elements [32g, 32g+32) use pair g).
              'int8_kchannel', 'int4_kchannel': the shape says which tensor codes are. Values: [..., HKV, 2]
              as for 'int8' / 'int4'. Keys: codes [..., T, HKV, row] with T a multiple of 32 counted from a
              block boundary (a whole contiguous cache or pages) and scales the k_scale blocks
              [..., T / 32, HKV, 2*D]: channel d of token t uses scale [.., t // 32, h, d] and offset
              [.., t // 32, h, D + d].
              'fp8': fp32 [1] (per tensor) or [HKV] (per KV head), or a Python number. 'native': ignored.
    head_dim  D.
    dtype     result dtype (default torch.float32); the arithmetic runs in it.
    Returns [..., HKV, D]: code * scale + offset (integer formats), e4m3 value * scale ('fp8'), or the values.
    These are the exact values the cache encodes; the decode kernel converts them to fp16 (for the quantized
    formats) before its tensor-core products.
    """
    op = "tessera.dequantize_kv"
    _choice(op, "format", format, FORMATS)
    head_dim = _int(op, "head_dim", head_dim, 1)
    torch = torch_module()
    dtype = torch.float32 if dtype is None else dtype
    codes = as_tensor(codes, op, "codes")
    if codes.dim() < 2:
        raise ValueError(f"{op}: 'codes' must be [..., HKV, row], got shape {list(codes.shape)}")
    int4 = format in _INT4
    row = head_dim // 2 if int4 else head_dim
    if (int4 and head_dim % 2) or codes.shape[-1] != row:
        raise ValueError(f"{op}: 'codes' must have last dim {row} for format={format!r} and head_dim {head_dim}, "
                         f"got shape {list(codes.shape)}")

    if format == "native":
        return codes.to(dtype)

    if format == "fp8":
        e4m3 = getattr(torch, "float8_e4m3fn", None)
        if e4m3 is None:
            raise ValueError(f"{op}: format='fp8' needs a torch with float8_e4m3fn")
        if codes.dtype == torch.uint8:
            codes = codes.view(e4m3)
        elif codes.dtype != e4m3:
            raise ValueError(f"{op}: 'codes' must be torch.float8_e4m3fn or torch.uint8, got {codes.dtype}")
        values = codes.to(torch.float32).to(dtype)  # e4m3 -> fp32 is exact (and supported everywhere)
        if not isinstance(scales, torch.Tensor):
            return values * _float(op, "scales", scales)
        s = scales.to(device=codes.device, dtype=dtype)
        heads = codes.shape[-2]
        if s.numel() == 1:
            return values * s.reshape(())
        if s.numel() != heads:
            raise ValueError(f"{op}: fp8 'scales' must have 1 or {heads} (HKV) elements, got shape "
                             f"{list(scales.shape)}")
        return values * s.reshape(heads, 1)

    if codes.dtype != torch.uint8:
        raise ValueError(f"{op}: 'codes' must be torch.uint8 for format={format!r}, got {codes.dtype}")
    if format == "int4_group32":
        if head_dim % GROUP_SIZE:
            raise ValueError(f"{op}: head_dim must be a multiple of {GROUP_SIZE} for 'int4_group32', got {head_dim}")
        groups = head_dim // GROUP_SIZE
    else:
        groups = 1
    scales = as_tensor(scales, op, "scales")
    expected = tuple(codes.shape[:-1]) + (2 * groups,)
    if format in CHANNEL_FORMATS and tuple(scales.shape) != expected:
        return _dequantize_keys(torch, op, codes, scales, format, head_dim, dtype, expected)
    if tuple(scales.shape) != expected:
        raise ValueError(f"{op}: 'scales' must have shape {list(expected)} for format={format!r}, got "
                         f"{list(scales.shape)}")
    values = _unpack_int4(torch, codes) if int4 else codes
    values = values.to(dtype).reshape(*codes.shape[:-1], groups, head_dim // groups)
    pairs = scales.to(device=codes.device, dtype=dtype).reshape(*codes.shape[:-1], groups, 2)
    out = values * pairs[..., 0:1] + pairs[..., 1:2]
    return out.reshape(*codes.shape[:-1], head_dim)


def _dequantize_keys(torch, op, codes, scales, format, head_dim, dtype, row_shape):
    """Keys of a per-channel format: codes [..., T, HKV, row], scales [..., T / 32, HKV, 2*D] (see dequantize_kv)."""
    lead = tuple(codes.shape[:-3])
    tokens = codes.shape[-3] if codes.dim() >= 3 else 0
    heads = codes.shape[-2]
    blocks = tuple(lead) + (tokens // KEY_BLOCK, heads, 2 * head_dim)
    if codes.dim() < 3 or tokens % KEY_BLOCK or tuple(scales.shape) != blocks:
        key_shape = (f"{list(blocks)} (keys: codes [..., T, HKV, row] with T a multiple of {KEY_BLOCK})"
                     if codes.dim() >= 3 and tokens % KEY_BLOCK == 0 else
                     f"[..., T / {KEY_BLOCK}, HKV, {2 * head_dim}] for keys with T a multiple of {KEY_BLOCK}")
        raise ValueError(f"{op}: 'scales' must have shape {list(row_shape)} (values) or {key_shape} for "
                         f"format={format!r}, got {list(scales.shape)} with codes {list(codes.shape)}")
    values = _unpack_int4(torch, codes) if format in _INT4 else codes
    values = values.to(dtype).reshape(*lead, tokens // KEY_BLOCK, KEY_BLOCK, heads, head_dim)
    pairs = scales.to(device=codes.device, dtype=dtype).unsqueeze(-3)  # [..., T / 32, 1, HKV, 2*D]
    out = values * pairs[..., :head_dim] + pairs[..., head_dim:]
    return out.reshape(*lead, tokens, heads, head_dim)
