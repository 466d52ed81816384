"""FlashInfer peers of bench/prefill_peers.py: the batch-prefill wrappers with backend='fa3' (FlashAttention-3 on
SM90) over packed varlen q/k/v (ragged) or a paged cache, and backend='cudnn' over the same paged cache.

Checked against FlashInfer 0.7.2.post1 (.fi/flashinfer-site.tar.xz, flashinfer/prefill.py):
  BatchPrefillWithRaggedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", ..., backend="fa3")      (l. 4778)
    .plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, ...,
          causal=False, ..., q_data_type="float16", kv_data_type=None, o_data_type=None, ...)            (l. 5022)
    .run(q [nnz_qo, HQ, D], k [nnz_kv, HKV, D], v, *, out=None, ...)                                     (l. 5881)
  BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", ..., backend="fa3")      (l. 2672)
    .plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
          head_dim_qk, page_size, ..., causal=False, ..., q_data_type, kv_data_type, o_data_type, ...)   (l. 3215)
    .run(q, paged_kv_cache: (k_cache, v_cache) each [num_pages, page_size, HKV, D] for NHD, *, out=None) (l. 4027)
plan() reads the indptrs on the host (qo_indptr.to("cpu"), l. 3443 / 5241), so they are passed as CPU int32 tensors;
the page indices go to the device. The FA3 module is chosen by (q, kv, o dtypes, the indptr dtype, head dims, no
RoPE / window / soft-cap): get_batch_prefill_module("fa3", ...) (l. 535) -> jit.attention.modules.
gen_batch_prefill_module, one module per head dim that holds every mask mode (causal is a run-time argument,
MaskMode) and both the ragged and the paged kernels. The paged run() allocates its output with torch.zeros when
`out` is None (l. 4358): a memset in the timed region, so every call here passes a preallocated `out`.

Causal alignment: FlashInfer's causal mask is bottom-right aligned when qo_len < kv_len. The SM90 (FA3) mainloop
masks kv_idx >= qo_idx + 1 + kv_len - qo_len (data/include/flashinfer/attention/hopper/mainloop_mma.cuh,
col_limit_right, l. 94 and l. 162), i.e. query i sits at position kv_len - qo_len + i; the wrapper docstrings build
the equivalent custom mask with torch.tril(..., diagonal=kv_len - qo_len) (prefill.py l. 2638, 4743). The cuDNN backend
passes causal as use_causal_mask_bottom_right (flashinfer/cudnn/prefill.py l. 677, 971).
"""

import time

from . import common as C
from . import fi_jit

WORKSPACE_BYTES = 128 << 20  # the wrappers' recommended float workspace


def fa3_module_specs(head_dims):
    """[(label, JitSpec)]: the FA3 batch-prefill modules plan() will ask for (bf16 q/kv/o, int32 indptrs)."""
    torch = C.torch
    from flashinfer.jit.attention.modules import gen_batch_prefill_module

    specs = []
    for d in sorted(set(head_dims)):
        # the same arguments as the wrappers' get_module_args (prefill.py l. 3681 / 5633): dtypes, indptr dtype,
        # head_dim_qk, head_dim_vo, PosEncodingMode.NONE, no sliding window, no soft-cap, no fp16 QK reduction
        specs.append((f"fa3 D{d}", gen_batch_prefill_module(
            "fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, d, d, 0, False, False, False)))
    return specs


def prebuild(head_dims):
    """Builds the FA3 modules of these head dims concurrently, before anything is timed. Returns a note, or None.
    Anything unexpected (another FlashInfer version, a build error) leaves the build to the first plan()."""
    if not C.ON_GPU or not head_dims:
        return None
    fi, _ = C.optional_module("flashinfer")
    if fi is None:
        return None
    try:
        specs = [(name, spec) for name, spec in fa3_module_specs(head_dims) if not _compiled(spec)]
    except Exception as e:  # noqa: BLE001
        return f"flashinfer: no prebuild ({C.short(e)}); the FA3 modules build on their first plan()"
    if not specs:
        return "flashinfer: the FA3 modules were already in the JIT cache"
    return fi_jit.build_concurrently(specs, "FA3 JIT modules", need_lock=True)


def _compiled(spec):
    try:
        return bool(spec.is_compiled)
    except Exception:  # noqa: BLE001
        return False


def indptr(counts):
    """CPU int32 [len(counts) + 1] prefix sums (plan() reads them on the host)."""
    torch = C.torch
    out = [0]
    for n in counts:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def ragged_fa3(fi, workspace, q, k, v, q_lens, kv_lens, hq, hkv, d, causal):
    """FA3 over packed q [sum q_lens, HQ, D], k / v [sum kv_lens, HKV, D]. Returns (fn, out, plan seconds): fn()
    writes out [sum q_lens, HQ, D]. plan() raises here (not later) if FA3 cannot serve the problem."""
    torch = C.torch
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend="fa3")
    t0 = time.perf_counter()
    wrapper.plan(indptr(q_lens), indptr(kv_lens), hq, hkv, d, causal=causal,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    C.sync()
    plan_s = time.perf_counter() - t0
    out = torch.empty((q.shape[0], hq, d), dtype=torch.bfloat16, device=q.device)

    def fn():
        return wrapper.run(q, k, v, out=out)
    fn.wrapper = wrapper  # keeps the plan alive with the callable
    return fn, out, plan_s


def paged(fi, workspace, backend, q, k_cache, v_cache, page_list, q_lens, kv_lens, page_size, hq, hkv, d, causal):
    """Sequences of q_lens queries (q [sum of q_lens, HQ, D], in order) over a paged cache (k_cache, v_cache)
    [num_pages, page_size, HKV, D] (NHD): sequence b's kv_lens[b] tokens on its ceil(kv_lens[b] / page_size) pages,
    listed in page_list (device int32, sequence after sequence, each in logical order). backend 'fa3' or 'cudnn'.
    Returns (fn, out, plan seconds)."""
    torch = C.torch
    pages = [-(-L // page_size) for L in kv_lens]
    assert sum(pages) == int(page_list.numel()), (pages, page_list.numel())
    last = [L - (p - 1) * page_size for L, p in zip(kv_lens, pages)]  # 1 <= last <= page_size
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
    t0 = time.perf_counter()
    # causal=True with qo_len < kv_len is bottom-right aligned in FlashInfer: query i attends keys 0 .. kv_len -
    # qo_len + i (FA3: hopper/mainloop_mma.cuh col_limit_right; cuDNN: use_causal_mask_bottom_right; module doc)
    wrapper.plan(indptr(q_lens), indptr(pages), page_list, torch.tensor(last, dtype=torch.int32),
                 hq, hkv, d, page_size, causal=causal,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    C.sync()
    plan_s = time.perf_counter() - t0
    out = torch.empty((q.shape[0], hq, d), dtype=torch.bfloat16, device=q.device)
    cache = (k_cache, v_cache)

    def fn():
        return wrapper.run(q, cache, out=out)
    fn.wrapper = wrapper
    return fn, out, plan_s
