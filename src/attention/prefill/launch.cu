// Prefill: the launcher (tensor maps, kernel arguments, head-dim and dtype dispatch).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "attention/prefill/kernel.cuh"
#include "attention/prefill/problem.h"
#include "common/check.h"
#include "common/occupancy.h"
#include "common/tensor_map.h"
#include "tessera/error.h"

namespace tessera::attention::detail {

namespace {

template <int kD, bool kFP16, KVFormat kFormat>
void launch_prefill_kernel(const PrefillArgs& args, dim3 grid, cudaStream_t stream) {
  auto kernel = prefill_kernel<kD, kFP16, kFormat>;
  constexpr int kSmem = PrefillTile<kD, kFormat != KVFormat::kNative>::kBytes;
  // Raises the dynamic shared-memory limit (once per device); the answer itself is not needed.
  (void)::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kPrefillThreads, kSmem);
  kernel<<<grid, kPrefillThreads, kSmem, stream>>>(args);
  TESSERA_CHECK_LAUNCH();
}

// fp16 tensor-core operands (kFP16), or bf16; kFormat other than kNative: K / V from a quantized cache (fp16
// operands).
template <bool kFP16, KVFormat kFormat>
void launch_by_dim(const PrefillArgs& args, int head_dim, dim3 grid, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_prefill_kernel<64, kFP16, kFormat>(args, grid, stream);
    case 128: return launch_prefill_kernel<128, kFP16, kFormat>(args, grid, stream);
    case 256: return launch_prefill_kernel<256, kFP16, kFormat>(args, grid, stream);
    default: throw Error("tessera::attention::prefill: no kernel for head_dim " + std::to_string(head_dim));
  }
}

}  // namespace

void launch_prefill(const PrefillProblem& pb, cudaStream_t stream) {
  if (pb.batch == 0 || pb.num_q_heads == 0 || pb.total_q == 0 || pb.max_seqlen_q == 0) return;
  using ::tessera::detail::make_tensor_map_sw128;
  using ::tessera::detail::TmaElement;
  PrefillArgs a;
  const int64_t D = pb.head_dim;
  const bool packed = pb.cu_seqlens_q != nullptr;
  const int64_t maps_batch = packed ? 1 : pb.batch;
  // Maps over (D, tokens, heads, batch); packed: a batch of one, whose stride (never applied) repeats the head
  // stride so that the driver sees a valid one.
  // A tile's query rows: 128 tokens of one head, or (GQA packing) 128 / G tokens of each of a KV head's G heads, one
  // box that lands them head after head.
  const PrefillRows rows_q = prefill_rows(pb);
  static_assert(kPrefillBlockM == 128, "prefill_rows (problem.h) fills 128-row tiles");
  a.q_map = make_tensor_map_sw128(pb.q, TmaElement::kBF16, D, pb.total_q, pb.num_q_heads, maps_batch,
                                  pb.q_stride_token, pb.q_stride_head, packed ? pb.q_stride_head : pb.q_stride_batch,
                                  rows_q.tokens, rows_q.heads);
  a.q_tokens = rows_q.tokens;
  a.q_heads = rows_q.heads;
  const int bn = prefill_block_n(pb.head_dim);
  const bool quant = pb.cache_seqlens != nullptr && pb.cache.format != KVFormat::kNative;
  if (pb.cache_seqlens != nullptr) {
    // The decode cache (strides in bytes there): boxes of one tile, or of one page piece when paged.
    const CacheDesc& c = pb.cache;
    const int64_t rows = c.paged ? c.page_size : c.capacity, rows_box = c.paged ? std::min(c.page_size, bn) : bn;
    a.cache_seqlens = pb.cache_seqlens;
    if (c.paged) {
      a.block_table = c.block_table;
      a.block_table_stride = c.block_table_stride;
      a.max_pages = c.max_pages;
      a.log2_page_size = c.log2_page_size;
      a.page_rows = static_cast<int>(rows_box);
    }
    if (!quant) {  // kNative: rows of q's dtype, swizzled as the wgmma operands
      const auto cache_map = [&](const uint8_t* data) {
        return make_tensor_map_sw128(data, TmaElement::kBF16, D, rows, c.num_kv_heads, c.num_pages,
                                     c.stride_token / 2, c.stride_head / 2, c.stride_outer / 2,
                                     static_cast<int>(rows_box));
      };
      a.k_map = cache_map(c.k);
      a.v_map = cache_map(c.v);
    } else {  // code rows as bytes (no swizzle: the producer warpgroup converts them), and their scales
      const auto code_map = [&](const uint8_t* data) {
        const int64_t dims[4] = {c.row_bytes, rows, c.num_kv_heads, c.num_pages};
        const int64_t strides[3] = {c.stride_token, c.stride_head, c.stride_outer};
        const int box[4] = {c.row_bytes, static_cast<int>(rows_box), 1, 1};
        return ::tessera::detail::make_tensor_map_u8(data, 4, dims, strides, box, 0,
                                                     ::tessera::detail::L2Promotion::k256B);
      };
      a.k_map = code_map(c.k);
      a.v_map = code_map(c.v);
      PrefillQuant& qt = a.quant;
      qt.row_bytes = c.row_bytes;
      qt.k_scale = c.k_scale;
      qt.v_scale = c.v_scale;
      qt.s_outer = c.scale_stride_outer;
      qt.s_token = c.scale_stride_token;
      qt.s_head = c.scale_stride_head;
      qt.kc_outer = c.kc_stride_outer;
      qt.kc_block = c.kc_stride_block;
      qt.kc_head = c.kc_stride_head;
      qt.k_fp8 = c.k_fp8_scale;
      qt.v_fp8 = c.v_fp8_scale;
      qt.fp8_per_head = c.fp8_per_head;
      qt.num_outer = c.num_pages;
      a.q_bf16 = !pb.fp16;
    }
  } else if (pb.total_k == 0) {
    // No keys at all (k and v empty, perhaps null): every row gets o = 0, lse = -inf and nothing reads these maps,
    // which span one row of q only so that the driver sees a valid address.
    a.k_map = a.v_map = make_tensor_map_sw128(pb.q, TmaElement::kBF16, D, 1, 1, 1, pb.q_stride_token,
                                              pb.q_stride_head, pb.q_stride_head, bn);
  } else {
    a.k_map = make_tensor_map_sw128(pb.k, TmaElement::kBF16, D, pb.total_k, pb.num_kv_heads, maps_batch,
                                    pb.k_stride_token, pb.k_stride_head, packed ? pb.k_stride_head : pb.k_stride_batch,
                                    bn);
    a.v_map = make_tensor_map_sw128(pb.v, TmaElement::kBF16, D, pb.total_k, pb.num_kv_heads, maps_batch,
                                    pb.v_stride_token, pb.v_stride_head, packed ? pb.v_stride_head : pb.v_stride_batch,
                                    bn);
  }
  a.o = pb.o;
  a.o_stride_token = pb.o_stride_token;
  a.o_stride_head = pb.o_stride_head;
  a.o_stride_batch = pb.o_stride_batch;
  a.lse = pb.lse;
  a.lse_stride_token = pb.lse_stride_token;
  a.lse_stride_head = pb.lse_stride_head;
  a.lse_stride_batch = pb.lse_stride_batch;
  a.cu_seqlens_q = pb.cu_seqlens_q;
  a.cu_seqlens_k = pb.cu_seqlens_k;
  a.total_q = pb.total_q;
  a.total_k = static_cast<int>(pb.total_k);
  a.group = pb.num_q_heads / pb.num_kv_heads;
  a.num_m_blocks = static_cast<int>((int64_t{pb.max_seqlen_q} + rows_q.tokens - 1) / rows_q.tokens);
  constexpr float kLog2e = 1.4426950408889634f;
  if (pb.softcap > 0.0f) {
    a.scale_log2 = pb.softmax_scale / pb.softcap;
    a.softcap_log2 = pb.softcap * kLog2e;
  } else {
    a.scale_log2 = pb.softmax_scale * kLog2e;
    a.softcap_log2 = 0.0f;
  }
  // A window of at least the keys' extent excludes nothing (p - j < Sk <= window): it becomes 0, which also keeps
  // the kernel's int32 window arithmetic from wrapping for windows near INT32_MAX.
  a.window = pb.window >= pb.total_k ? 0 : pb.window;
  a.causal = pb.causal;
  const dim3 grid(static_cast<unsigned>(a.num_m_blocks), static_cast<unsigned>(pb.num_q_heads / rows_q.heads),
                  static_cast<unsigned>(pb.batch));
  if (!quant) {
    if (pb.fp16)
      launch_by_dim<true, KVFormat::kNative>(a, pb.head_dim, grid, stream);
    else
      launch_by_dim<false, KVFormat::kNative>(a, pb.head_dim, grid, stream);
    return;
  }
  switch (pb.cache.format) {
    case KVFormat::kFP8: return launch_by_dim<true, KVFormat::kFP8>(a, pb.head_dim, grid, stream);
    case KVFormat::kInt8: return launch_by_dim<true, KVFormat::kInt8>(a, pb.head_dim, grid, stream);
    case KVFormat::kInt4: return launch_by_dim<true, KVFormat::kInt4>(a, pb.head_dim, grid, stream);
    case KVFormat::kInt4Group32: return launch_by_dim<true, KVFormat::kInt4Group32>(a, pb.head_dim, grid, stream);
    case KVFormat::kInt8KChannel: return launch_by_dim<true, KVFormat::kInt8KChannel>(a, pb.head_dim, grid, stream);
    case KVFormat::kInt4KChannel: return launch_by_dim<true, KVFormat::kInt4KChannel>(a, pb.head_dim, grid, stream);
    default:
      throw Error("tessera::attention::prefill: no kernel for KV format " +
                  std::to_string(static_cast<int>(pb.cache.format)));
  }
}

}  // namespace tessera::attention::detail
