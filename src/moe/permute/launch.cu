// permute: validation, workspace query and the launches (three, or one for a few copies: config.h).
#include <string>

#include "common/check.h"
#include "common/device_info.h"
#include "common/dispatch.h"
#include "common/validate.h"
#include "moe/permute/config.h"
#include "moe/launch.h"
#include "moe/permute/kernel.cuh"
#include "tessera/moe.h"

namespace tessera::moe {

namespace {

using detail::PermuteConfig;
using detail::PermuteKernelParams;
using detail::QuantMode;

void check_params(const tessera::detail::ArgCheck& check, int64_t num_tokens, int topk, const PermuteParams& p) {
  if (num_tokens < 0) check.fail("num_tokens", "must be >= 0, got " + std::to_string(num_tokens));
  check.in_range(topk, "ids.shape[1] (topk)", 1, detail::kPermuteMaxTopk);
  check.in_range(p.num_experts, "num_experts", 1, detail::kPermuteMaxExperts);
  check.in_range(p.pad_multiple, "pad_multiple", 1, 1 << 16);
  if (p.quant != PermuteQuant::kNone && p.quant != PermuteQuant::kFP8Blockwise &&
      p.quant != PermuteQuant::kFP8PerTensor)
    check.fail("quant", "is not a PermuteQuant value");
  const int64_t rows = num_tokens * topk + int64_t{p.num_experts} * (p.pad_multiple - 1);
  if (rows > INT32_MAX) check.fail("num_tokens", "gives " + std::to_string(rows) + " rows; the row index is int32");
}

PermuteConfig config_for(int64_t num_tokens, int topk, const PermuteParams& p) {
  return detail::select_permute_config(detail::PermuteProblem{num_tokens, topk, p.num_experts, p.pad_multiple});
}

template <typename Elem, QuantMode kQuant>
void launch_scatter(const PermuteKernelParams& kp, cudaStream_t stream) {
  // Column slices give small token counts enough blocks to fill the GPU (a few blocks per SM).
  const int64_t blocks_per_row = (kp.hidden / 8 + 15) / 16;
  const int64_t target_blocks = 2 * static_cast<int64_t>(tessera::detail::current_device_info().num_sms);
  int64_t slices = (target_blocks + kp.num_chunks - 1) / kp.num_chunks;
  slices = slices < 1 ? 1 : (slices > blocks_per_row ? blocks_per_row : slices);
  const dim3 grid(static_cast<unsigned>(kp.num_chunks), static_cast<unsigned>(slices));
  detail::permute_scatter_kernel<Elem, kQuant><<<grid, detail::kScatterThreads, 0, stream>>>(kp);
  TESSERA_CHECK_LAUNCH();
}

}  // namespace

int64_t permute_capacity_rows(int64_t num_tokens, int topk, const PermuteParams& params) {
  const tessera::detail::ArgCheck check("tessera::moe::permute_capacity_rows");
  check_params(check, num_tokens, topk, params);
  return config_for(num_tokens, topk, params).capacity_rows;
}

std::size_t permute_workspace_bytes(int64_t num_tokens, int topk, const PermuteParams& params) {
  const tessera::detail::ArgCheck check("tessera::moe::permute_workspace_bytes");
  check_params(check, num_tokens, topk, params);
  return config_for(num_tokens, topk, params).workspace_bytes;
}

void permute(const TensorView& x, const TensorView& ids, const std::optional<TensorView>& input_scale,
             const PermuteOutputs& out, const Workspace& workspace, const PermuteParams& p, cudaStream_t stream,
             const std::optional<TensorView>& num_tokens) {
  const tessera::detail::ArgCheck check("tessera::moe::permute");
  check.dtype(x, "x", {DType::kBF16, DType::kFP16});
  check.rank(x, "x", 2);
  check.unit_inner_stride(x, "x");
  const int64_t T = x.shape[0], H = x.shape[1];
  if (H % 8 != 0) check.fail("x", "must have a hidden size divisible by 8 (16-byte rows), got " + std::to_string(H));
  if (T > 1 && x.strides[0] < H) check.fail("x", "must have row stride >= hidden size");
  check.aligned(x, "x", 16);
  check.dtype(ids, "ids", {DType::kInt32, DType::kInt64});
  check.rank(ids, "ids", 2);
  check.dim(ids, "ids", 0, T, "num_tokens of x");
  check.contiguous(ids, "ids");
  const int k = static_cast<int>(ids.shape[1]);
  check_params(check, T, k, p);
  const int E = p.num_experts;
  const PermuteConfig cfg = config_for(T, k, p);

  const TensorView& xp = out.x_perm;
  check.rank(xp, "x_perm", 2);
  if (p.quant == PermuteQuant::kNone) check.same_dtype(x, "x", xp, "x_perm");
  else check.dtype(xp, "x_perm", {DType::kFP8E4M3});
  if (xp.shape[0] < cfg.capacity_rows)
    check.fail("x_perm", "must have at least " + std::to_string(cfg.capacity_rows) +
                             " rows (permute_capacity_rows), got " + std::to_string(xp.shape[0]));
  check.dim(xp, "x_perm", 1, H, "hidden size of x");
  check.contiguous(xp, "x_perm");
  // Each lane stores 8 elements at once: 16 bytes of bf16/fp16, 8 bytes of fp8.
  check.aligned(xp, "x_perm", p.quant == PermuteQuant::kNone ? 16 : 8);
  const int64_t num_blocks = (H + kFP8BlockCols - 1) / kFP8BlockCols;
  if (p.quant == PermuteQuant::kFP8Blockwise) {
    if (!out.scales) check.fail("scales", "is required for quant kFP8Blockwise");
    check.dtype(*out.scales, "scales", {DType::kFP32});
    check.rank(*out.scales, "scales", 2);
    check.dim(*out.scales, "scales", 0, xp.shape[0], "rows of x_perm");
    check.dim(*out.scales, "scales", 1, num_blocks, "ceil(hidden / 128)");
  }
  if (p.quant == PermuteQuant::kFP8PerTensor) {
    if (!input_scale) check.fail("input_scale", "is required for quant kFP8PerTensor");
    check.dtype(*input_scale, "input_scale", {DType::kFP32});
    if (input_scale->numel() != 1)
      check.fail("input_scale", "must have 1 element, got shape " + input_scale->shape_str());
  }
  if (num_tokens) check.device_count(*num_tokens, "num_tokens");
  check.dtype(out.expert_offsets, "expert_offsets", {DType::kInt32});
  check.rank(out.expert_offsets, "expert_offsets", 1);
  check.dim(out.expert_offsets, "expert_offsets", 0, int64_t{E} + 1, "num_experts + 1");
  check.contiguous(out.expert_offsets, "expert_offsets");
  check.dtype(out.expert_counts, "expert_counts", {DType::kInt32});
  check.rank(out.expert_counts, "expert_counts", 1);
  check.dim(out.expert_counts, "expert_counts", 0, E, "num_experts");
  check.contiguous(out.expert_counts, "expert_counts");
  check.contiguous_matrix(out.row_index, "row_index", {DType::kInt32}, T, "num_tokens", k, "topk");
  if (out.row_token) {
    check.dtype(*out.row_token, "row_token", {DType::kInt32});
    check.rank(*out.row_token, "row_token", 1);
    check.dim(*out.row_token, "row_token", 0, xp.shape[0], "rows of x_perm");
    check.contiguous(*out.row_token, "row_token");
  }
  if (workspace.bytes < cfg.workspace_bytes)
    check.fail("workspace", "must have at least " + std::to_string(cfg.workspace_bytes) +
                                " bytes (permute_workspace_bytes), got " + std::to_string(workspace.bytes));
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % 16 != 0)
    check.fail("workspace", "must be 16-byte aligned");
  check.no_overlap(x, "x", xp, "x_perm");
  // ids and num_tokens are read by blocks that run while others write the outputs and the workspace (a single pass
  // reads ids in every column slice while the first one writes the index outputs): neither may share their memory.
  {
    const TensorView ws_bytes = TensorView::contiguous(workspace.data, DType::kUInt8,
                                                       {static_cast<int64_t>(cfg.workspace_bytes)}, x.device);
    std::optional<TensorView> read_by_all[2] = {ids, num_tokens};
    const char* names[2] = {"ids", "num_tokens"};
    for (int i = 0; i < 2; ++i) {
      if (!read_by_all[i]) continue;
      const TensorView& r = *read_by_all[i];
      check.no_overlap(r, names[i], xp, "x_perm");
      if (out.scales) check.no_overlap(r, names[i], *out.scales, "scales");
      check.no_overlap(r, names[i], out.expert_offsets, "expert_offsets");
      check.no_overlap(r, names[i], out.expert_counts, "expert_counts");
      check.no_overlap(r, names[i], out.row_index, "row_index");
      if (out.row_token) check.no_overlap(r, names[i], *out.row_token, "row_token");
      check.no_overlap(r, names[i], ws_bytes, "workspace");
    }
  }
  check.on_current_device(x, "x");
  check.on_current_device(ids, "ids");
  check.on_current_device(xp, "x_perm");
  if (p.quant == PermuteQuant::kFP8Blockwise) check.on_current_device(*out.scales, "scales");
  if (p.quant == PermuteQuant::kFP8PerTensor) check.on_current_device(*input_scale, "input_scale");
  check.on_current_device(out.expert_offsets, "expert_offsets");
  check.on_current_device(out.expert_counts, "expert_counts");
  check.on_current_device(out.row_index, "row_index");
  if (out.row_token) check.on_current_device(*out.row_token, "row_token");
  if (num_tokens) check.on_current_device(*num_tokens, "num_tokens");
  // expert_offsets (E + 1 >= 2 elements, so never skipped as empty) is on the current device (checked above): a raw
  // workspace pointer is asked of the driver for that one, an adapter's label trusted.
  check.on_current_device(tessera::detail::workspace_view(workspace, cfg.workspace_bytes, out.expert_offsets.device),
                          "workspace");

  if (T > 0) tessera::detail::require_hopper("tessera::moe::permute");
  detail::launch_permute(x, ids, input_scale, out, workspace, p, stream, num_tokens);
}

namespace detail {

void launch_permute(const TensorView& x, const TensorView& ids, const std::optional<TensorView>& input_scale,
                    const PermuteOutputs& out, const Workspace& workspace, const PermuteParams& p,
                    cudaStream_t stream, const std::optional<TensorView>& num_tokens) {
  const int64_t T = x.shape[0], H = x.shape[1];
  const int k = static_cast<int>(ids.shape[1]);
  const int E = p.num_experts;
  const PermuteConfig cfg = config_for(T, k, p);
  const TensorView& xp = out.x_perm;
  if (T == 0) {  // no copies: every segment is empty
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out.expert_offsets.data, 0, sizeof(int32_t) * (E + 1), stream));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out.expert_counts.data, 0, sizeof(int32_t) * E, stream));
    return;
  }

  auto* ws_bytes = static_cast<char*>(workspace.data);
  PermuteKernelParams kp{};
  kp.x = x.data;
  kp.x_row_stride = T > 1 ? x.strides[0] : H;
  kp.ids = ids.data;
  kp.input_scale = input_scale ? static_cast<const float*>(input_scale->data) : nullptr;
  kp.active_tokens = num_tokens ? static_cast<const int32_t*>(num_tokens->data) : nullptr;
  kp.x_perm = xp.data;
  kp.scales = out.scales ? static_cast<float*>(out.scales->data) : nullptr;
  kp.scale_stride_row = out.scales ? out.scales->strides[0] : 0;
  kp.scale_stride_block = out.scales ? out.scales->strides[1] : 0;
  kp.offsets = static_cast<int32_t*>(out.expert_offsets.data);
  kp.counts = static_cast<int32_t*>(out.expert_counts.data);
  kp.row_index = static_cast<int32_t*>(out.row_index.data);
  kp.row_token = out.row_token ? static_cast<int32_t*>(out.row_token->data) : nullptr;
  kp.counter = reinterpret_cast<unsigned int*>(ws_bytes + cfg.counter_offset);
  kp.totals = reinterpret_cast<int32_t*>(ws_bytes + cfg.totals_offset);
  kp.ids32 = reinterpret_cast<int32_t*>(ws_bytes + cfg.ids_offset);
  kp.hist = reinterpret_cast<int32_t*>(ws_bytes + cfg.hist_offset);
  kp.num_tokens = T;
  kp.hidden = H;
  kp.topk = k;
  kp.num_experts = E;
  kp.pad_multiple = p.pad_multiple;
  kp.tokens_per_chunk = cfg.tokens_per_chunk;
  kp.num_chunks = cfg.num_chunks;
  kp.single_pass = cfg.single_pass ? 1 : 0;
  kp.ids_are_64 = ids.dtype == DType::kInt64 ? 1 : 0;

  if (!cfg.single_pass) {
    const auto chunks = static_cast<unsigned>(cfg.num_chunks);
    if (ids.dtype == DType::kInt32) detail::permute_count_kernel<int32_t><<<chunks, 128, 0, stream>>>(kp);
    else detail::permute_count_kernel<int64_t><<<chunks, 128, 0, stream>>>(kp);
    TESSERA_CHECK_LAUNCH();
    detail::permute_scan_kernel<<<E, detail::kScanThreads, 0, stream>>>(kp);
    TESSERA_CHECK_LAUNCH();
  }
  TESSERA_DISPATCH_HALF(x.dtype, Elem, [&] {
    switch (p.quant) {
      case PermuteQuant::kNone: return launch_scatter<Elem, QuantMode::kNone>(kp, stream);
      case PermuteQuant::kFP8Blockwise: return launch_scatter<Elem, QuantMode::kFP8Blockwise>(kp, stream);
      case PermuteQuant::kFP8PerTensor: return launch_scatter<Elem, QuantMode::kFP8PerTensor>(kp, stream);
    }
  });
}

}  // namespace detail

}  // namespace tessera::moe
