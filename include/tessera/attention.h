// tessera — attention decode over a low-precision KV cache, the cache's producer side, and prefill (public).
//
// decode: one new query token per sequence attends to that sequence's cached keys and values.
//   o[b, h, :] = Σ_t softmax_t(s[b, h, t]) · V[b, t, h / G, :]      (G = HQ / HKV query heads per KV head)
//   s[b, h, t] = softmax_scale · q[b, h, :] · K[b, t, h / G, :]      (then softcap · tanh(s / softcap) if softcap > 0)
//   over the keys t in [max(0, L - window), L), L = min(cache_seqlens[b], cache capacity) (window 0 = all).
//   L counts the current token: append its K and V first (append_kv below), then decode with the new lengths.
//   L == 0: o is zero and lse is -inf.
//   lse[b, h] = log Σ_t exp(s[b, h, t]) (natural log), optional.
//   Several new tokens per sequence (speculative decoding, q [B, S, HQ, D], S <= kDecodeMaxNewTokens): token i sits
//   at position L - S + i and attends causally, to the keys t in [max(0, L - S + 1 + i - window), L - S + 1 + i).
//   Append all S tokens' K and V first; a token with no key left (L - S + 1 + i <= 0) gets o = 0 and lse = -inf.
// append_kv: quantizes new K/V rows (bf16/fp16) into the cache format and writes them at given positions.
// prefill / prefill_varlen: every query of a sequence attends to that sequence's keys (below the KV cache section;
//   docs/ops/attention_prefill.md).
//
// The ops run asynchronously on the given stream, never synchronize the host (lengths and page tables are read on
// the device only), never allocate, and can be captured in a CUDA graph. Arguments are validated before anything
// is launched; a violation throws tessera::Error naming the op and the argument. See docs/ops/attention_decode.md.
//
// ---- KV cache layout ---------------------------------------------------------------------------------------
// Data (k and v, the same shape each):
//   contiguous: [B, T_max, HKV, row_bytes]        paged: [num_pages, page_size, HKV, row_bytes]
//   with a block table int32 [B, max_pages]: token t of sequence b lives in page block_table[b, t / page_size],
//   slot t % page_size. page_size is a power of two in [16, 256]. Capacity: T_max, or max_pages · page_size.
//   A row (one token, one KV head) is D values, stored densely, 16-byte aligned:
//     kNative  D × bf16|fp16 (the dtype of q)                   row_bytes = 2·D
//     kFP8     D × fp8 e4m3                                     row_bytes = D
//     kInt8    D × uint8 codes                                  row_bytes = D
//     kInt4, kInt4Group32: D/2 bytes, byte j = code of element 2j in bits 0..3, element 2j+1 in bits 4..7
//                                                               row_bytes = D/2      (dtype kUInt8 or kInt4x2)
//   The last dim is unit-stride; every other stride (bytes) is a multiple of 16, the base 16-byte aligned.
// Scales (integer formats): k_scale and v_scale, fp16, shaped like the data with the last dim 2·NG:
//   [B, T_max, HKV, 2·NG] or [num_pages, page_size, HKV, 2·NG], pairs (scale, offset) per group of elements,
//   NG = 1 (kInt8, kInt4: one pair per row) or D/32 (kInt4Group32: elements [32g, 32g+32) use pair g).
//   Last dim unit-stride, other strides multiples of 2 elements (4 bytes), base 4-byte aligned.
//   Element value = code · scale + offset (codes unsigned: 0..255 for int8, 0..15 for int4).
// Per-channel key formats (kInt8KChannel, kInt4KChannel; KIVI-style, docs/perf/decode.md): the key rows hold int8 /
//   int4 codes as kInt8 / kInt4 rows do, but their scales are per channel over blocks of kKeyBlock = 32 tokens:
//   k_scale fp16 [B, T_max / 32, HKV, 2·D] or [num_pages, page_size / 32, HKV, 2·D]; element [.., j, h, d] is the
//   scale and [.., j, h, D + d] the offset of channel d over the tokens (slots) [32j, 32j + 32) of that sequence
//   (page). T_max (contiguous) and page_size (paged) must be multiples of 32. Last dim unit-stride, other strides
//   multiples of 8 elements (16 bytes), base 16-byte aligned. Key element value = code · scale[d] + offset[d].
//   Values keep per-(token, head) pairs: v_scale as for kInt8 / kInt4 (NG = 1).
//   k_residual (these formats only, required by append_kv, not read by decode): [B, 2·kKeyBlock, HKV, D] in the
//   dtype of k_new, unit stride along D, other strides multiples of 8 elements, base 16-byte aligned: slot t % 64 of
//   row b holds the 16-bit key of position t of the sequence at batch index b, for the positions (below the
//   capacity) of the last two blocks an append wrote into, so that append_kv can re-quantize a block that is not
//   yet full from its exact rows. Row b belongs to the sequence in batch slot b: an engine that moves sequences
//   between batch slots moves their residual rows with them (a sequence resumed mid-block without its residual
//   cannot re-quantize its partial block exactly; restart it on the block boundary, i.e. re-append the block).
// Scales (kFP8): fp32 [1] (per tensor) or [HKV] (per KV head); element value = e4m3 value · scale.
// Rows are stored apart from their scales so that every data row is a whole number of 16-byte vectors.
//
// ---- Quantization (append_kv; the reference defines the same) ----------------------------------------------
// Integer formats, per group x[0..n) of one (token, head) row, with levels = 255 (int8) or 15 (int4), in fp32:
//   lo = min x, hi = max x, scale = fp16((hi - lo) / levels), offset = fp16(lo)   (fp16 round-to-nearest-even,
//   saturated to ±65504); code = clamp(rint((x - offset) / scale), 0, levels), or 0 where scale == 0.
//   Values must lie within the fp16 range for these formats to represent them.
// Per-channel keys: the same rule per channel d over the rows of one 32-token block that exist when the block is
//   written: append_kv (re)writes block j of a sequence from the rows [32j, e), e = min(32j + 32, last position
//   written + 1), taking rows before the first new one from k_residual. So a block's scales always cover exactly
//   its rows appended so far, and every row's codes are re-derived from its 16-bit key whenever its block changes.
//   Contract (device values, not validated): a sequence's rows are appended in order (positions[b] never skips
//   ahead of its end); positions[b] may go back (speculative decoding rejects draft tokens) by at most 32 positions
//   from the furthest end the sequence has reached, so that the rows it reads back are still in k_residual; a call
//   that starts on a block boundary reads no earlier row and restarts that count (a new sequence may start over at
//   0 in a reused batch slot). An append rewrites
//   the codes of the earlier rows of its block, so pages shared by several sequences must be shared in whole blocks.
//   Decode multiplies the query by the channel scales in fp16: q · scale must stay within ±65504.
// kFP8: code = e4m3(x / scale), round-to-nearest-even, saturated to ±448 (NaN stays NaN).
// kNative: copied (the new rows must have the cache's dtype).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "tessera/tensor.h"

namespace tessera::attention {

enum class KVFormat : int {
  kNative = 0,       // bf16 or fp16, the dtype of q
  kFP8 = 1,          // fp8 e4m3 with an fp32 scale per tensor or per KV head
  kInt8 = 2,         // uint8 codes, fp16 (scale, offset) per (token, head)
  kInt4 = 3,         // 4-bit codes, fp16 (scale, offset) per (token, head)
  kInt4Group32 = 4,  // 4-bit codes, fp16 (scale, offset) per 32 elements of a (token, head) row
  kInt8KChannel = 5, // keys: uint8 codes, fp16 (scale, offset) per channel over 32-token blocks; values as kInt8
  kInt4KChannel = 6, // keys: 4-bit codes, fp16 (scale, offset) per channel over 32-token blocks; values as kInt4
};

const char* kv_format_name(KVFormat format);

struct KVCache {
  KVFormat format = KVFormat::kNative;
  TensorView k;                             // data, see above
  TensorView v;                             // same shape, dtype and strides as k
  std::optional<TensorView> k_scale;        // integer formats and kFP8; absent for kNative
  std::optional<TensorView> v_scale;
  std::optional<TensorView> block_table;    // int32 [B, max_pages]; present = paged layout
  std::optional<TensorView> k_residual;     // per-channel key formats: 16-bit keys of the last two blocks written
};

inline constexpr int kDecodeMaxSplits = 128;
inline constexpr int kDecodeMaxNewTokens = 8;  // S, new query tokens per sequence in one decode call

struct DecodeParams {
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(D)
  float softcap = 0.0f;        // > 0: logits become softcap · tanh(s / softcap)
  int window = 0;              // > 0: attend to the last `window` keys only
  // Split count for the sequence dimension: 0 = chosen from B·HKV, the SM count and the cache capacity;
  // otherwise the number to use (1..kDecodeMaxSplits). Never depends on the device lengths.
  int num_splits = 0;
  // Length-balanced splits (2..512 sequences, a split count of at least 2): the B·num_splits splits of the batch go to
  // the sequences by their device lengths, planned on the device by every CTA (a long sequence among short ones gets
  // up to max(num_splits, 32)); off: each sequence gets num_splits. Faster where lengths differ widely (H200, hq8kv1
  // B 64 with Zipf lengths: bf16 2.5x, int4 1.3x; B 256 int4 2.3x), slower by 2-14 % where they are equal
  // (docs/perf/decode.md, v18). The workspace grows by 8 bytes per sequence.
  bool balance_splits = false;
};

// Elements (D values) per group of kInt4Group32.
inline constexpr int kInt4GroupSize = 32;
// Tokens per key-scale block of the per-channel key formats, and the rows of their 16-bit residual.
inline constexpr int kKeyBlock = 32;
inline constexpr int kKeyResidualRows = 2 * kKeyBlock;
// The per-channel key formats (kInt8KChannel, kInt4KChannel): k_scale per channel and key block, a k_residual.
constexpr bool kv_key_per_channel(KVFormat format) {
  return format == KVFormat::kInt8KChannel || format == KVFormat::kInt4KChannel;
}

// Device workspace decode needs for this call (any contents, 16-byte aligned); 0 when one split suffices.
// Depends only on shapes, the device and params, never on device values, so it can be sized once for a graph.
std::size_t decode_workspace_bytes(const TensorView& q, const KVCache& cache, const DecodeParams& params = {});

// q [B, HQ, D] or [B, S, HQ, D] (1 <= S <= kDecodeMaxNewTokens) bf16|fp16, unit stride along D, 16-byte aligned
// rows; HQ a multiple of HKV; D ∈ {64, 128, 256}. cache_seqlens int32 [B] on the device (the length including the
// S new tokens). o shaped like q, same dtype, unit stride along D. lse fp32 [B, HQ] or [B, S, HQ] (any strides) or
// none.
void decode(const TensorView& q, const KVCache& cache, const TensorView& cache_seqlens, const TensorView& o,
            const std::optional<TensorView>& lse, const Workspace& workspace, const DecodeParams& params,
            cudaStream_t stream);

// Writes k_new[b, i] and v_new[b, i] ([B, S, HKV, D] bf16|fp16, unit stride along D) at positions
// positions[b] + i (int32 [B] on the device), i < S, quantized as described above. Positions at or beyond the
// capacity, negative ones, and (paged) pages outside [0, num_pages) are skipped: nothing out of bounds is
// written. cache_seqlens are not updated. For kFP8 the scales are inputs; for the integer formats outputs.
// Contract (not validated: device values): no two written rows of one call may land on the same slot (the same
// sequence row, or the same (page, slot) when block tables share a page); rows are written in no defined order and
// a row's codes and scales are separate stores. The inputs, positions and block table are read on `stream`: write
// them in stream order before the call (a pageable cudaMemcpy on the legacy stream does not order a non-blocking
// stream and may return before its copy lands).
void append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& positions, const KVCache& cache,
               cudaStream_t stream);

// ---- prefill ------------------------------------------------------------------------------------------------
// A sequence with Sq queries and Sk keys: query i sits at position p = Sk - Sq + i (bottom-right aligned, as
// FlashAttention does) and attends to the keys j in [0, Sk) with
//   j <= p              when causal,
//   p - j < window      when window > 0 (window counts the query's own position, as decode's does; FlashAttention's
//                       window_size_left is window - 1),
//   s[i, j] = softmax_scale · q[i] · k[j] (then softcap · tanh(s / softcap) if softcap > 0), G = HQ / HKV query
//   heads per KV head (query head h reads KV head h / G),
//   o[i] = Σ_j softmax_j(s[i, j]) · v[j], lse[i] = log Σ_j exp(s[i, j]) (natural log), optional.
// A query with no key (Sk = 0, or causal with p < 0) gets o = 0 and lse = -inf. No workspace, no allocation, no host
// synchronization: both forms can be captured in a CUDA graph.
struct PrefillParams {
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(D); must be >= 0
  float softcap = 0.0f;        // > 0: logits become softcap · tanh(s / softcap)
  int window = 0;              // > 0: a query attends to the keys j with p - j < window only
  bool causal = false;         // bottom-right aligned (above)
  // GQA packing: -1 chooses; 0 gives each tile 128 tokens of one query head; 1 gives it the HQ / HKV query heads of
  // one KV head, 128 / (HQ / HKV) tokens each, so they share every K / V tile (fewer tiles when queries are short:
  // chunked prefill of a few tokens). The result does not depend on it. 1 needs HQ / HKV <= 128.
  int pack_gqa = -1;
};

// Plain batch: q [B, Sq, HQ, D], k and v [B, Sk, HKV, D], bf16|fp16 (one dtype), unit stride along D, the other
// strides multiples of 16 bytes, 16-byte aligned; D ∈ {64, 128, 256}; HQ a multiple of HKV; Sq <= Sk when causal.
// o like q (same dtype and shape, strides multiples of 4 bytes); lse fp32 [B, Sq, HQ] (any strides) or none.
void prefill(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
             const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream);

// Packed variable-length batch (the layout engines use): q [total_q, HQ, D], k and v [total_k, HKV, D] with the
// rules above; cu_seqlens_q, cu_seqlens_k int32 [B + 1] on the device: sequence b owns q rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and k / v rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]). max_seqlen_q: a
// host bound on every sequence's query count, used only to size the grid (query rows past it are not computed).
// o like q, lse fp32 [total_q, HQ] or none. Device values are never read by the host, so they are not validated:
// cu_seqlens must start at 0 and not decrease, and end at most at total_q / total_k (rows past cu_seqlens_q[B] are
// not written: q may be sized for a graph's largest batch), with Sq <= Sk for causal rows to have keys. Whatever
// they hold, nothing outside q, k, v, o and lse is read or written.
void prefill_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
                    const TensorView& cu_seqlens_k, int64_t max_seqlen_q, const TensorView& o,
                    const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream);

// Chunked prefill over the decode KV cache (the cache of decode and append_kv above, contiguous or paged): q
// [total_q, HQ, D] packed as for prefill_varlen with cu_seqlens_q and max_seqlen_q; sequence b's Sq queries are
// its last Sq positions: with L = min(cache_seqlens[b], capacity) keys in the cache (cache_seqlens int32 [B] on the
// device, the length including the new tokens, whose K and V append_kv wrote first), query i sits at position
// L - Sq + i and attends to the cached keys by the rules above (Sk = L; causal attends to the prefix and, causally,
// to the new tokens). o and lse as for prefill_varlen. Every cache format: kNative (rows of q's dtype) runs on
// q's tensor-core type; the quantized formats are dequantized tile by tile in shared memory to fp16 (code · scale +
// offset in one fp16 fma; fp8 exactly, its scales applied to S and O), and q runs in fp16 for them (bf16 q saturated
// to fp16's range). Device values are not validated; whatever cache_seqlens and the block table hold, nothing
// outside the tensors is read or written (pages outside [0, num_pages) read as zeros).
void prefill_with_cache(const TensorView& q, const TensorView& cu_seqlens_q, int64_t max_seqlen_q,
                        const KVCache& cache, const TensorView& cache_seqlens, const TensorView& o,
                        const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream);

}  // namespace tessera::attention
