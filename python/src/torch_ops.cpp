// tessera._torch_C: tessera's ops as PyTorch operators (namespace "tessera", dispatch key CUDA), and the same
// functions bound directly for the torch layer's eager calls.
//
// The schemas and fake implementations are defined once, in Python (python/tessera/_torch_ops.py), and this
// library only implements them. The kernels take at::Tensor directly (no DLPack capsule per argument), run on
// PyTorch's current CUDA stream of the first tensor's device, and mutate their output arguments, which the schemas
// mark with (a!). Optional workspaces that are not given are allocated here through PyTorch's caching allocator
// (stream-ordered, and capturable in CUDA graphs).
//
// Errors: tessera's argument errors become c10::ValueError (Python ValueError), CUDA and device errors
// c10::Error (Python RuntimeError), each with tessera's message and no source location; on the direct entries the
// module's translator (options.h: translate_errors) maps them to the same Python types.
//
// fp8: the torch layer hands fp8 tensors over as torch.float8_e4m3fn; uint8 is accepted wherever the argument can
// only hold e4m3 bytes (permute's quantized x_perm, the fp8 GEMM operands, an 'fp8' KV cache, the MoE layer's fp8
// weights), as in tessera._C.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/attention.h"
#include "tessera/conv.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/linear.h"
#include "tessera/moe.h"
#include "tessera/moe_layer.h"
#include "tessera/tensor.h"
#include "tessera/w8a8.h"

#include "options.h"
#include "fastcall.h"

namespace {

using tessera::DType;
using tessera::TensorView;
namespace ta = tessera::attention;

const c10::SourceLocation kNoLocation{"tessera", "", 0};

using tessera::python::fail;
using tessera::python::gemm_options;
using tessera::python::int8_blocks_of;
using tessera::python::parse_group_score;
using tessera::python::parse_kv_format;
using tessera::python::parse_quant;
using tessera::python::parse_scale_mode;
using tessera::python::parse_scoring;

// A schema int (int64) as the C++ API's int: out-of-range values are argument errors, never wrapped.
int narrow(int64_t v, const char* op, const char* arg) {
  if (v < INT32_MIN || v > INT32_MAX) fail(op, arg, "must fit in 32 bits, got " + std::to_string(v));
  return static_cast<int>(v);
}

DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    case at::kFloat: return DType::kFP32;
    case at::kFloat8_e4m3fn: return DType::kFP8E4M3;
    case at::kFloat8_e5m2: return DType::kFP8E5M2;
    case at::kChar: return DType::kInt8;
    case at::kByte: return DType::kUInt8;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    default: fail(op, arg, std::string("has a dtype tessera does not take: ") + c10::toString(t.scalar_type()));
  }
}

TensorView view_of(const at::Tensor& t, const char* op, const char* arg) {
  TensorView v;
  const int64_t rank = t.dim();
  if (rank > TensorView::kMaxRank)
    fail(op, arg, "has rank " + std::to_string(rank) + "; tessera takes at most " +
                      std::to_string(TensorView::kMaxRank));
  // Fake, meta and subclass tensors (a Python dispatch key) carry no memory to launch on; they belong on
  // torch.ops.tessera.*, whose fake implementation handles them.
  if (!t.has_storage() || t.key_set().has(c10::DispatchKey::Python) || t.is_meta())
    fail(op, arg, "is a fake, meta or subclass tensor; call torch.ops.tessera." +
                      std::string(std::strchr(op, '.') != nullptr ? std::strchr(op, '.') + 1 : op) +
                      " (or trace under torch.compile) instead of the eager entry point");
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, op, arg);
  v.rank = static_cast<int>(rank);
  for (int64_t d = 0; d < rank; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  v.device = t.is_cuda() ? t.get_device() : TensorView::kHostDevice;
  v.device_verified = t.is_cuda() && t.has_storage();  // torch's CUDA storage is device memory of t.device()
  return v;
}

std::optional<TensorView> optional_view_of(const std::optional<at::Tensor>& t, const char* op, const char* arg) {
  if (!t.has_value()) return std::nullopt;
  return view_of(*t, op, arg);
}

// Any of torch's fp8 dtypes.
bool is_float8(const at::Tensor& t) {
  const auto st = t.scalar_type();
  return st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2 || st == at::kFloat8_e4m3fnuz || st == at::kFloat8_e5m2fnuz;
}

// An operand that can only hold fp8 e4m3: uint8 bytes are read as e4m3.

TensorView fp8_view_of(const at::Tensor& t, const char* op, const char* arg) {
  TensorView v = view_of(t, op, arg);
  if (v.dtype == DType::kUInt8) v.dtype = DType::kFP8E4M3;
  return v;
}

tessera::Workspace workspace_of(const std::optional<at::Tensor>& t, const char* op) {
  tessera::Workspace ws;
  if (!t.has_value()) return ws;
  if (!t->is_contiguous()) fail(op, "workspace", "must be contiguous");
  if (!t->is_cuda()) fail(op, "workspace", "must be a CUDA tensor, got one on " + t->device().str());
  ws.data = t->data_ptr();
  ws.bytes = static_cast<std::size_t>(t->nbytes());
  // torch's CUDA storage is device memory of t's device (as view_of labels tensors): the ops ask the driver nothing.
  ws.device_verified = t->has_storage();
  ws.device = t->get_device();
  return ws;
}

// The device every op runs on: the first tensor's. A CPU tensor there is an argument error, named.
c10::Device device_of(const at::Tensor& t, const char* op, const char* arg) {
  if (!t.is_cuda()) fail(op, arg, "must be a CUDA tensor, got a tensor on device '" + t.device().str() + "'");
  return t.device();
}

// A workspace allocated here when the caller gave none and the op needs one (on the current stream).
std::optional<at::Tensor> workspace_or_new(const std::optional<at::Tensor>& given, std::size_t bytes,
                                           c10::Device device) {
  if (given.has_value() || bytes == 0) return given;
  return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
}

// Runs body(stream) with the device current, on PyTorch's current stream of that device. The usual call finds it
// current already and takes no guard: c10's guard asks the runtime for the device twice more and sets it back on
// exit (3-6 % of the samples of an eager call in a py-spy profile on an H200 machine; docs/perf/host_overhead.md).
template <typename Body>
void run_on(c10::Device device, Body&& body) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device.index()) return body(stream);
  const c10::DeviceGuard guard(device);
  body(stream);
}

// ---- MoE routing ---------------------------------------------------------------------------------------------


void fused_gate(const at::Tensor& logits, const std::optional<at::Tensor>& bias, const at::Tensor& weights,
                const at::Tensor& ids, int64_t topk, int64_t num_groups, int64_t topk_groups, std::string_view scoring,
                std::string_view group_score, bool renormalize, double routed_scaling_factor,
                int64_t num_shared_experts, double shared_expert_weight) {
  constexpr const char* op = "tessera.fused_gate";
  {
    tessera::moe::GateParams p;
    p.topk = narrow(topk, op, "topk");
    p.num_groups = narrow(num_groups, op, "num_groups");
    p.topk_groups = narrow(topk_groups, op, "topk_groups");
    p.scoring = parse_scoring(scoring, op);
    p.group_score = parse_group_score(group_score, op);
    p.renormalize = renormalize;
    p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
    p.num_shared_experts = narrow(num_shared_experts, op, "num_shared_experts");
    p.shared_expert_weight = static_cast<float>(shared_expert_weight);
    const c10::Device device = device_of(logits, op, "logits");
    const TensorView lv = view_of(logits, op, "logits");
    const auto bv = optional_view_of(bias, op, "bias");
    const TensorView wv = view_of(weights, op, "weights");
    const TensorView iv = view_of(ids, op, "ids");
    run_on(device, [&](cudaStream_t s) { tessera::moe::fused_gate(lv, bv, wv, iv, p, s); });
  }
}

void permute(const at::Tensor& x, const at::Tensor& ids, const std::optional<at::Tensor>& input_scale,
             const at::Tensor& x_perm, const std::optional<at::Tensor>& scales, const at::Tensor& expert_offsets,
             const at::Tensor& expert_counts, const at::Tensor& row_index, const std::optional<at::Tensor>& row_token,
             const std::optional<at::Tensor>& workspace, int64_t num_experts, int64_t pad_multiple,
             std::string_view quant) {
  constexpr const char* op = "tessera.permute";
  {
    tessera::moe::PermuteParams params;
    params.num_experts = narrow(num_experts, op, "num_experts");
    params.pad_multiple = narrow(pad_multiple, op, "pad_multiple");
    params.quant = parse_quant(quant, op);
    const c10::Device device = device_of(x, op, "x");
    const TensorView xv = view_of(x, op, "x");
    const TensorView idv = view_of(ids, op, "ids");
    const auto isv = optional_view_of(input_scale, op, "input_scale");
    tessera::moe::PermuteOutputs out;
    out.x_perm = params.quant == tessera::moe::PermuteQuant::kNone ? view_of(x_perm, op, "x_perm")
                                                                   : fp8_view_of(x_perm, op, "x_perm");
    out.scales = optional_view_of(scales, op, "scales");
    out.expert_offsets = view_of(expert_offsets, op, "expert_offsets");
    out.expert_counts = view_of(expert_counts, op, "expert_counts");
    out.row_index = view_of(row_index, op, "row_index");
    out.row_token = optional_view_of(row_token, op, "row_token");
    const int64_t topk = ids.dim() == 2 ? ids.size(1) : 0;
    // The size query validates nothing the op does not validate again; a bad shape is reported by the op.
    const std::size_t need = workspace.has_value() || topk <= 0 || topk > INT32_MAX
                                 ? 0
                                 : tessera::moe::permute_workspace_bytes(ids.size(0), static_cast<int>(topk), params);
    run_on(device, [&](cudaStream_t s) {
      const auto ws = workspace_or_new(workspace, need, device);
      tessera::moe::permute(xv, idv, isv, out, workspace_of(ws, op), params, s);
    });
  }
}

void unpermute_reduce(const at::Tensor& y_perm, const at::Tensor& row_index, const at::Tensor& weights,
                      const std::optional<at::Tensor>& residual, const at::Tensor& out, double routed_scale) {
  constexpr const char* op = "tessera.unpermute_reduce";
  {
    const c10::Device device = device_of(y_perm, op, "y_perm");
    const TensorView yv = view_of(y_perm, op, "y_perm");
    const TensorView rv = view_of(row_index, op, "row_index");
    const TensorView wv = view_of(weights, op, "weights");
    const auto resv = optional_view_of(residual, op, "residual");
    const TensorView ov = view_of(out, op, "out");
    run_on(device, [&](cudaStream_t s) {
      tessera::moe::unpermute_reduce(yv, rv, wv, resv, ov, static_cast<float>(routed_scale), s);
    });
  }
}

// ---- grouped GEMM ----------------------------------------------------------------------------------------------

std::size_t gemm_workspace_need(const at::Tensor& w) {
  return w.dim() == 3 ? tessera::gemm::grouped_gemm_workspace_bytes(w.size(0), w.size(1), w.size(2)) : 0;
}

void grouped_gemm_fp8_common(const char* op, bool masked, const char* rows_arg, const at::Tensor& x,
                             const at::Tensor& w, const at::Tensor& group_rows, const at::Tensor& x_scale,
                             const at::Tensor& w_scale, const at::Tensor& y, const std::optional<at::Tensor>& workspace,
                             std::string_view scale_mode, int64_t expected_m) {
  {
    tessera::gemm::FP8Scales scales;
    scales.mode = parse_scale_mode(scale_mode, op);
    const c10::Device device = device_of(x, op, "x");
    const TensorView xv = fp8_view_of(x, op, "x");
    const TensorView wv = fp8_view_of(w, op, "w");
    const TensorView rv = view_of(group_rows, op, rows_arg);
    scales.x_scale = view_of(x_scale, op, "x_scale");
    scales.w_scale = view_of(w_scale, op, "w_scale");
    const TensorView yv = view_of(y, op, "y");
    const auto options = gemm_options(expected_m);
    run_on(device, [&](cudaStream_t s) {
      const auto ws = workspace_or_new(workspace, gemm_workspace_need(w), device);
      if (masked)
        tessera::gemm::grouped_gemm_fp8_masked(xv, wv, rv, scales, yv, workspace_of(ws, op), s, options);
      else
        tessera::gemm::grouped_gemm_fp8(xv, wv, rv, scales, yv, workspace_of(ws, op), s, options);
    });
  }
}

void grouped_gemm_bf16_common(const char* op, bool masked, const char* rows_arg, const at::Tensor& x,
                              const at::Tensor& w, const at::Tensor& group_rows, const at::Tensor& y,
                              const std::optional<at::Tensor>& workspace, int64_t expected_m) {
  {
    const c10::Device device = device_of(x, op, "x");
    const TensorView xv = view_of(x, op, "x");
    const TensorView wv = view_of(w, op, "w");
    const TensorView rv = view_of(group_rows, op, rows_arg);
    const TensorView yv = view_of(y, op, "y");
    const auto options = gemm_options(expected_m);
    run_on(device, [&](cudaStream_t s) {
      const auto ws = workspace_or_new(workspace, gemm_workspace_need(w), device);
      if (masked)
        tessera::gemm::grouped_gemm_bf16_masked(xv, wv, rv, yv, workspace_of(ws, op), s, options);
      else
        tessera::gemm::grouped_gemm_bf16(xv, wv, rv, yv, workspace_of(ws, op), s, options);
    });
  }
}

void grouped_gemm_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets, const at::Tensor& x_scale,
                      const at::Tensor& w_scale, const at::Tensor& y, const std::optional<at::Tensor>& workspace,
                      std::string_view scale_mode, int64_t expected_m) {
  grouped_gemm_fp8_common("tessera.grouped_gemm_fp8", false, "offsets", x, w, offsets, x_scale, w_scale, y, workspace,
                          scale_mode, expected_m);
}

void grouped_gemm_fp8_masked(const at::Tensor& x, const at::Tensor& w, const at::Tensor& masked_m,
                             const at::Tensor& x_scale, const at::Tensor& w_scale, const at::Tensor& y,
                             const std::optional<at::Tensor>& workspace, std::string_view scale_mode,
                             int64_t expected_m) {
  grouped_gemm_fp8_common("tessera.grouped_gemm_fp8_masked", true, "masked_m", x, w, masked_m, x_scale, w_scale, y,
                          workspace, scale_mode, expected_m);
}

void grouped_gemm_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets, const at::Tensor& y,
                       const std::optional<at::Tensor>& workspace, int64_t expected_m) {
  grouped_gemm_bf16_common("tessera.grouped_gemm_bf16", false, "offsets", x, w, offsets, y, workspace, expected_m);
}

void grouped_gemm_bf16_masked(const at::Tensor& x, const at::Tensor& w, const at::Tensor& masked_m,
                              const at::Tensor& y, const std::optional<at::Tensor>& workspace, int64_t expected_m) {
  grouped_gemm_bf16_common("tessera.grouped_gemm_bf16_masked", true, "masked_m", x, w, masked_m, y, workspace,
                           expected_m);
}

// ---- attention decode --------------------------------------------------------------------------------------------


// The cache of both ops. k_residual (the per-channel key formats' 16-bit keys) is passed on as given: whether it is
// required, read or refused is the C++ validation's rule (append_kv needs it for those formats, decode ignores it).
ta::KVCache kv_cache_of(const char* op, std::string_view format, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_residual) {
  ta::KVCache cache;
  cache.format = parse_kv_format(format, op);
  const bool fp8 = cache.format == ta::KVFormat::kFP8;
  // The fp8 dtype rules of the torch layer: 'fp8' takes e4m3 (or its uint8 bytes), and no other format an fp8
  // tensor (the C++ validation would name the dtype but not the format that would take it).
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{k, "k_cache"}, {v, "v_cache"}}) {
    const at::ScalarType st = t.scalar_type();
    const bool is_fp8 = is_float8(t);
    if (fp8 && st != at::kFloat8_e4m3fn && st != at::kByte)
      fail(op, arg, std::string("must be torch.float8_e4m3fn or torch.uint8 (e4m3 bytes) for format='fp8', got ") +
                        c10::toString(st));
    if (!fp8 && is_fp8)
      fail(op, arg, std::string("is ") + c10::toString(st) + ", which only format='fp8' accepts (format='" +
                        std::string(format) + "')");
  }
  cache.k = fp8 ? fp8_view_of(k, op, "k_cache") : view_of(k, op, "k_cache");
  cache.v = fp8 ? fp8_view_of(v, op, "v_cache") : view_of(v, op, "v_cache");
  cache.k_scale = optional_view_of(k_scale, op, "k_scale");
  cache.v_scale = optional_view_of(v_scale, op, "v_scale");
  cache.block_table = optional_view_of(block_table, op, "block_table");
  cache.k_residual = optional_view_of(k_residual, op, "k_residual");
  return cache;
}

void attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                      const std::optional<at::Tensor>& block_table, const at::Tensor& cache_seqlens,
                      const at::Tensor& out, const std::optional<at::Tensor>& lse,
                      const std::optional<at::Tensor>& workspace, std::string_view format, double softmax_scale,
                      double softcap, int64_t window, int64_t num_splits,
                      const std::optional<at::Tensor>& k_residual, bool balance_splits) {
  constexpr const char* op = "tessera.attention_decode";
  {
    ta::DecodeParams params;
    params.softmax_scale = static_cast<float>(softmax_scale);
    params.softcap = static_cast<float>(softcap);
    params.window = narrow(window, op, "window");
    params.num_splits = narrow(num_splits, op, "num_splits");
    params.balance_splits = balance_splits;
    const c10::Device device = device_of(q, op, "q");
    const ta::KVCache cache = kv_cache_of(op, format, k_cache, v_cache, k_scale, v_scale, block_table, k_residual);
    const TensorView qv = view_of(q, op, "q");
    const TensorView sv = view_of(cache_seqlens, op, "cache_seqlens");
    const TensorView ov = view_of(out, op, "out");
    const auto lv = optional_view_of(lse, op, "lse");
    run_on(device, [&](cudaStream_t s) {
      // The size depends on the device (SM count), so it is asked with the device current.
      const std::size_t need = workspace.has_value() ? 0 : ta::decode_workspace_bytes(qv, cache, params);
      const auto ws = workspace_or_new(workspace, need, device);
      ta::decode(qv, cache, sv, ov, lv, workspace_of(ws, op), params, s);
    });
  }
}

void append_kv(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& positions,
               const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& block_table,
               std::string_view format, const std::optional<at::Tensor>& k_residual) {
  constexpr const char* op = "tessera.append_kv";
  {
    const c10::Device device = device_of(k_new, op, "k_new");
    const ta::KVCache cache = kv_cache_of(op, format, k_cache, v_cache, k_scale, v_scale, block_table, k_residual);
    const TensorView kv = view_of(k_new, op, "k_new");
    const TensorView vv = view_of(v_new, op, "v_new");
    const TensorView pv = view_of(positions, op, "positions");
    run_on(device, [&](cudaStream_t s) { ta::append_kv(kv, vv, pv, cache, s); });
  }
}

// ---- attention prefill -------------------------------------------------------------------------------------------
// Both forms write out (and lse) and nothing else: no workspace, so nothing is allocated here. The sequence lengths
// of the varlen form (cu_seqlens_q / _k) are device values, read on the device only.

ta::PrefillParams prefill_params(const char* op, double softmax_scale, double softcap, int64_t window, bool causal) {
  return tessera::python::prefill_params(static_cast<float>(softmax_scale), static_cast<float>(softcap),
                                         narrow(window, op, "window"), causal);
}

void attention_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                       const std::optional<at::Tensor>& lse, double softmax_scale, double softcap, int64_t window,
                       bool causal) {
  constexpr const char* op = "tessera.attention_prefill";
  const ta::PrefillParams params = prefill_params(op, softmax_scale, softcap, window, causal);
  const c10::Device device = device_of(q, op, "q");
  const TensorView qv = view_of(q, op, "q");
  const TensorView kv = view_of(k, op, "k");
  const TensorView vv = view_of(v, op, "v");
  const TensorView ov = view_of(out, op, "out");
  const auto lv = optional_view_of(lse, op, "lse");
  run_on(device, [&](cudaStream_t s) { ta::prefill(qv, kv, vv, ov, lv, params, s); });
}

void attention_prefill_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                              const at::Tensor& out, const std::optional<at::Tensor>& lse, double softmax_scale,
                              double softcap, int64_t window, bool causal) {
  constexpr const char* op = "tessera.attention_prefill_varlen";
  const ta::PrefillParams params = prefill_params(op, softmax_scale, softcap, window, causal);
  const c10::Device device = device_of(q, op, "q");
  const TensorView qv = view_of(q, op, "q");
  const TensorView kv = view_of(k, op, "k");
  const TensorView vv = view_of(v, op, "v");
  const TensorView cqv = view_of(cu_seqlens_q, op, "cu_seqlens_q");
  const TensorView ckv = view_of(cu_seqlens_k, op, "cu_seqlens_k");
  const TensorView ov = view_of(out, op, "out");
  const auto lv = optional_view_of(lse, op, "lse");
  run_on(device, [&](cudaStream_t s) {
    ta::prefill_varlen(qv, kv, vv, cqv, ckv, max_seqlen_q, ov, lv, params, s);
  });
}

// Chunked prefill over the decode KV cache: the cache arguments as attention_decode takes them (kv_cache_of), the
// rest as attention_prefill_varlen's. cache_seqlens and the block table are device values, read on the device only.
void attention_prefill_with_cache(const at::Tensor& q, const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  const std::optional<at::Tensor>& block_table, const at::Tensor& cache_seqlens,
                                  const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                  std::string_view format, double softmax_scale, double softcap, int64_t window,
                                  bool causal, const std::optional<at::Tensor>& k_residual) {
  constexpr const char* op = "tessera.attention_prefill_with_cache";
  const ta::PrefillParams params = prefill_params(op, softmax_scale, softcap, window, causal);
  const c10::Device device = device_of(q, op, "q");
  const ta::KVCache cache = kv_cache_of(op, format, k_cache, v_cache, k_scale, v_scale, block_table, k_residual);
  const TensorView qv = view_of(q, op, "q");
  const TensorView cqv = view_of(cu_seqlens_q, op, "cu_seqlens_q");
  const TensorView sv = view_of(cache_seqlens, op, "cache_seqlens");
  const TensorView ov = view_of(out, op, "out");
  const auto lv = optional_view_of(lse, op, "lse");
  run_on(device, [&](cudaStream_t s) {
    ta::prefill_with_cache(qv, cqv, max_seqlen_q, cache, sv, ov, lv, params, s);
  });
}

// ---- weight-only quantized linear --------------------------------------------------------------------------------
// The prepacked weight travels as its three tensors (codes, params, k_perm or None) and its constants, zero_mode by
// name. A workspace not given is allocated here, sized for x's rows (asked with the device current).

namespace tl = tessera::linear;

// The linear / conv epilogue: bias (absent: none) and clamp bounds.
tl::LinearEpilogue epilogue_of(const std::optional<at::Tensor>& bias, double clamp_min, double clamp_max,
                               const char* op) {
  tl::LinearEpilogue e;
  if (bias.has_value()) e.bias = view_of(*bias, op, "bias");
  e.clamp_min = static_cast<float>(clamp_min);
  e.clamp_max = static_cast<float>(clamp_max);
  return e;
}

void linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
            const std::optional<at::Tensor>& k_perm, const std::optional<at::Tensor>& bias, const at::Tensor& y,
            const std::optional<at::Tensor>& workspace, int64_t n, int64_t k, int64_t bits, int64_t block,
            std::string_view zero_mode, double clamp_min, double clamp_max) {
  constexpr const char* op = "tessera.linear";
  tl::LinearWeight w;
  w.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  w.n = n;
  w.k = k;
  w.bits = narrow(bits, op, "bits");
  w.block = block;
  const c10::Device device = device_of(x, op, "x");
  const TensorView xv = view_of(x, op, "x");
  w.codes = view_of(codes, op, "codes");
  w.params = view_of(params, op, "params");
  if (k_perm.has_value()) w.k_perm = view_of(*k_perm, op, "k_perm");
  const tl::LinearEpilogue epilogue = epilogue_of(bias, clamp_min, clamp_max, op);
  const TensorView yv = view_of(y, op, "y");
  run_on(device, [&](cudaStream_t s) {
    // The size query (a closed-form bound) validates nothing the op does not validate again; an x of another rank is
    // reported by the op.
    const std::size_t need = workspace.has_value() || xv.rank != 2 ? 0 : tl::linear_workspace_bytes(xv.shape[0], w, xv.dtype);
    const auto ws = workspace_or_new(workspace, need, device);
    tl::linear(xv, w, yv, epilogue, workspace_of(ws, op), s);
  });
}

// ---- conv2d (int4 / int8 weights) ------------------------------------------------------------------------------
// The weight travels as linear's prepacked tensors (codes, params; a conv weight has no k_perm) with its constants
// and the kernel's kh, kw; the geometry as ints and the layouts by name ('NHWC' | 'NCHW'). x and y are contiguous in
// their layouts (the torch layer passes a channels_last tensor as its NHWC view). A workspace not given is allocated
// here, sized by conv2d_workspace_bytes for x's shape (asked with the device current).

namespace tc = tessera::conv;

void conv2d(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
            const std::optional<at::Tensor>& bias, const at::Tensor& y, const std::optional<at::Tensor>& workspace,
            int64_t n, int64_t k, int64_t bits, int64_t block, std::string_view zero_mode, int64_t kh, int64_t kw,
            int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w,
            int64_t groups, std::string_view x_layout, std::string_view y_layout, double clamp_min, double clamp_max) {
  constexpr const char* op = "tessera.conv2d";
  const tc::Conv2dParams p = tessera::python::conv2d_params(op, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups,
                                                            x_layout, y_layout);
  tc::ConvWeight w;
  w.w.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  w.w.n = n;
  w.w.k = k;
  w.w.bits = narrow(bits, op, "bits");
  w.w.block = block;
  w.kh = kh;
  w.kw = kw;
  const c10::Device device = device_of(x, op, "x");
  const TensorView xv = view_of(x, op, "x");
  w.w.codes = view_of(codes, op, "codes");
  w.w.params = view_of(params, op, "params");
  const tl::LinearEpilogue epilogue = epilogue_of(bias, clamp_min, clamp_max, op);
  const TensorView yv = view_of(y, op, "y");
  run_on(device, [&](cudaStream_t s) {
    std::size_t need = 0;
    if (!workspace.has_value() && xv.rank == 4) {
      // The query validates what the op validates (but the tensors); an argument it refuses is left to the op, whose
      // message names it as the op's.
      const bool nhwc = p.x_layout == tc::Layout::kNHWC;
      try {
        need = tc::conv2d_workspace_bytes(xv.shape[0], xv.shape[nhwc ? 1 : 2], xv.shape[nhwc ? 2 : 3], w, p, xv.dtype);
      } catch (const tessera::CudaError&) {
        throw;
      } catch (const tessera::Error&) {
        need = 0;
      }
    }
    const auto ws = workspace_or_new(workspace, need, device);
    tc::conv2d(xv, w, yv, p, epilogue, workspace_of(ws, op), s);
  });
}

// ---- W8A8 --------------------------------------------------------------------------------------------------------
// The quantized operands travel as their four tensors (codes, scale, zero or None, sums or None) and the block, the
// planes as the torch layer allocates them (int8_blocks_of in options.h narrows them, as for tessera._C). A
// workspace not given is allocated here, sized for a's rows.

void w8a8_quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& sums, int64_t block) {
  constexpr const char* op = "tessera.w8a8_quantize";
  const c10::Device device = device_of(x, op, "x");
  const TensorView xv = view_of(x, op, "x");
  const tl::Int8BlockTensor out = int8_blocks_of(op, "", codes, scale, zero, sums, block, view_of, optional_view_of);
  run_on(device, [&](cudaStream_t s) { tl::quantize_per_block(xv, out, s); });
}

// The GEMM reads a parameter plane [K / block, rows] by TMA in whole rows of its row stride ld: its storage must
// reach the end of the last row's ld, not only of its rows (a strided view of a tight buffer would be read past
// its end). The C++ API cannot see an allocation's size and documents the rule (include/tessera/w8a8.h).
void check_plane_storage(const at::Tensor* t, const char* op, const char* arg) {
  if (t == nullptr || t->dim() != 2 || !t->has_storage() || t->is_meta() || t->size(0) == 0 || t->stride(0) <= 0)
    return;
  const int64_t need = (t->storage_offset() + t->size(0) * t->stride(0)) * t->element_size();
  const auto have = static_cast<int64_t>(t->storage().nbytes());
  if (have < need)
    fail(op, arg,
         "must have storage for all its " + std::to_string(t->size(0)) + " rows of ld = " +
             std::to_string(t->stride(0)) + " elements (the kernel reads whole rows): " + std::to_string(need) +
             " bytes from the storage's start, got " + std::to_string(have));
}

void gemm_w8a8(const at::Tensor& a_codes, const at::Tensor& a_scale, const std::optional<at::Tensor>& a_zero,
               const std::optional<at::Tensor>& a_sums, const at::Tensor& w_codes, const at::Tensor& w_scale,
               const std::optional<at::Tensor>& w_zero, const std::optional<at::Tensor>& w_sums,
               const std::optional<at::Tensor>& bias, const at::Tensor& y, const std::optional<at::Tensor>& workspace,
               int64_t block, double clamp_min, double clamp_max, double out_scale) {
  constexpr const char* op = "tessera.gemm_w8a8";
  const auto ptr = [](const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  const std::pair<const at::Tensor*, const char*> planes[] = {  // pointers: no tensor copied
      {&a_scale, "a_scale"}, {ptr(a_zero), "a_zero"}, {ptr(a_sums), "a_sums"},
      {&w_scale, "w_scale"}, {ptr(w_zero), "w_zero"}, {ptr(w_sums), "w_sums"}};
  for (const auto& [t, name] : planes) check_plane_storage(t, op, name);
  const c10::Device device = device_of(a_codes, op, "a_codes");
  const tl::Int8BlockTensor a =
      int8_blocks_of(op, "a_", a_codes, a_scale, a_zero, a_sums, block, view_of, optional_view_of);
  const tl::Int8BlockTensor w =
      int8_blocks_of(op, "w_", w_codes, w_scale, w_zero, w_sums, block, view_of, optional_view_of);
  tl::W8A8Epilogue epilogue;
  if (bias.has_value()) epilogue.bias = view_of(*bias, op, "bias");
  epilogue.clamp_min = static_cast<float>(clamp_min);
  epilogue.clamp_max = static_cast<float>(clamp_max);
  epilogue.out_scale = static_cast<float>(out_scale);
  const TensorView yv = view_of(y, op, "y");
  run_on(device, [&](cudaStream_t s) {
    std::size_t need = 0;
    if (!workspace.has_value() && a.codes.rank == 2 && w.codes.rank == 2) {
      // A shape the query refuses is left to the op, whose message names the argument as the op's, not the query's.
      try {
        need = tl::gemm_w8a8_workspace_bytes(a.codes.shape[0], w.codes.shape[0], w.codes.shape[1], block);
      } catch (const tessera::CudaError&) {
        throw;
      } catch (const tessera::Error&) {
        need = 0;
      }
    }
    const auto ws = workspace_or_new(workspace, need, device);
    tl::gemm_w8a8(a, w, yv, epilogue, workspace_of(ws, op), s);
  });
}

// ---- MoE layer -----------------------------------------------------------------------------------------------
// The config travels as its constants (tessera.moe_layer.MoeLayerConfig's fields in order, the enums by name) plus
// max_tokens, from which the plan is rebuilt (moe_layer_plan validates the constants and sizes the workspace, asked
// with the device current); the weights as their six tensors (scales absent where the format has none; fp8 weights
// float8_e4m3fn or their uint8 bytes). A workspace not given is allocated here with the plan's size.

namespace tm = tessera::moe;

// The op on a plan: views of the tensors, the workspace (allocated here when not given), the launches on stream s of
// the current device.
void run_moe_layer(const tm::MoeLayerPlan& plan, const at::Tensor& x, const at::Tensor& router_logits,
                   const std::optional<at::Tensor>& correction_bias, const std::optional<at::Tensor>& residual,
                   const std::optional<at::Tensor>& num_tokens, const at::Tensor& w13, const at::Tensor& w2,
                   const std::optional<at::Tensor>& w13_scale, const std::optional<at::Tensor>& w2_scale,
                   const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                   const at::Tensor& y, const std::optional<at::Tensor>& workspace, c10::Device device,
                   cudaStream_t s) {
  constexpr const char* op = "tessera.moe_layer";
  tm::MoeLayerInputs in;
  tm::MoeLayerWeights w;
  tessera::python::moe_layer_views(op, plan.config.format, x, router_logits, correction_bias, residual, num_tokens,
                                   w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, view_of, optional_view_of,
                                   fp8_view_of, in, w);
  const TensorView yv = view_of(y, op, "y");
  const auto ws = workspace_or_new(workspace, plan.workspace_bytes, device);
  tm::moe_layer(plan, in, w, yv, workspace_of(ws, op), s);
}

void moe_layer(const at::Tensor& x, const at::Tensor& router_logits, const std::optional<at::Tensor>& correction_bias,
               const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& num_tokens,
               const at::Tensor& w13, const at::Tensor& w2, const std::optional<at::Tensor>& w13_scale,
               const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& a13_scale,
               const std::optional<at::Tensor>& a2_scale, const at::Tensor& y,
               const std::optional<at::Tensor>& workspace, int64_t hidden, int64_t intermediate, int64_t num_experts,
               int64_t topk, int64_t num_groups, int64_t topk_groups, std::string_view scoring,
               std::string_view group_score, bool renormalize, double routed_scaling_factor, int64_t num_shared_experts,
               double shared_expert_weight, std::string_view format, int64_t max_tokens) {
  constexpr const char* op = "tessera.moe_layer";
  const tm::MoeLayerConfig config = tessera::python::moe_layer_config(
      op, hidden, intermediate, num_experts, topk, num_groups, topk_groups, scoring, group_score, renormalize,
      routed_scaling_factor, num_shared_experts, shared_expert_weight, format);
  const c10::Device device = device_of(x, op, "x");
  run_on(device, [&](cudaStream_t s) {
    run_moe_layer(tm::moe_layer_plan(config, max_tokens), x, router_logits, correction_bias, residual, num_tokens,
                  w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, y, workspace, device, s);
  });
}

// A tensor the direct entry cannot launch on, but the dispatcher can route: a fake, meta or subclass tensor (the
// Python key: FakeTensor, DTensor, ...) or one wrapped by functorch (vmap, grad). Plain CPU tensors stay on the
// direct path, which names them as argument errors.
bool needs_dispatcher(const at::Tensor& t) {
  const c10::DispatchKeySet keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::FuncTorchBatched) ||
         keys.has(c10::DispatchKey::FuncTorchGradWrapper) || keys.has(c10::DispatchKey::Functionalize) ||
         t.is_meta();
}
bool needs_dispatcher(const std::optional<at::Tensor>& t) { return t.has_value() && needs_dispatcher(*t); }
template <typename T>
bool needs_dispatcher(const T&) {
  return false;
}

// ---- eager conveniences (bound for Python only) ----------------------------------------------------------------
// Each takes the torch layer's arguments in its order, checks what it needs before allocating (with the torch
// layer's messages), allocates the outputs that were not given on the first tensor's device and current stream, and
// calls the op's entry (which routes to the dispatcher where needed). They are bound as METH_FASTCALL functions
// (fastcall.h): a TypeError with pybind11's phrase means an argument could not be converted and nothing ran, and the
// torch layer then takes its checked path.

// The eager entries read concrete sizes to allocate; symbolic ones (make_fx / AOT tracing with dynamic shapes)
// belong on the torch layer's checked path, which allocates with torch. The message carries pybind's own phrase for
// an argument it cannot convert, the one the torch layer falls back on (_dlpack.FALLBACK).
void no_symbolic_sizes(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      throw pybind11::type_error("tessera: incompatible function arguments (symbolic sizes)");
}

// The torch layer's int rule: >= minimum, else ValueError naming the argument.
void at_least(int64_t v, int64_t minimum, const char* op, const char* arg) {
  if (v < minimum) fail(op, arg, "must be >= " + std::to_string(minimum) + ", got " + std::to_string(v));
}

// A shape as the torch layer's messages print it: "[2, 3]".
std::string sizes_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t d = 0; d < sizes.size(); ++d) s += (d ? ", " : "") + std::to_string(sizes[d]);
  return s + "]";
}

// The torch layer's rank rule, with its message.
void rank_is(const at::Tensor& t, int64_t rank, const char* what, const char* op, const char* arg) {
  if (t.dim() == rank) return;
  fail(op, arg, "must have rank " + std::to_string(rank) + " " + what + ", got shape " + sizes_str(t.sizes()));
}

void fused_gate_dispatch(const at::Tensor& logits, const std::optional<at::Tensor>& bias, const at::Tensor& weights,
                         const at::Tensor& ids, int64_t topk, int64_t num_groups, int64_t topk_groups,
                         std::string_view scoring, std::string_view group_score, bool renormalize,
                         double routed_scaling_factor, int64_t num_shared_experts, double shared_expert_weight);
void unpermute_reduce_dispatch(const at::Tensor& y_perm, const at::Tensor& row_index, const at::Tensor& weights,
                               const std::optional<at::Tensor>& residual, const at::Tensor& out, double routed_scale);

// tessera.fused_gate: returns (weights fp32 [T, topk + s], ids int32 [T, topk + s]), or the given pair.
std::pair<at::Tensor, at::Tensor> fused_gate_eager(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& out_weights,
                                                   const std::optional<at::Tensor>& out_ids, int64_t topk,
                                                   int64_t num_groups, int64_t topk_groups, std::string_view scoring,
                                                   std::string_view group_score, bool renormalize,
                                                   double routed_scaling_factor, int64_t num_shared_experts,
                                                   double shared_expert_weight) {
  constexpr const char* op = "tessera.fused_gate";
  no_symbolic_sizes({&logits});
  // Checks before anything is allocated.
  (void)parse_scoring(scoring, op);
  (void)parse_group_score(group_score, op);
  at_least(topk, 1, op, "topk");
  at_least(num_shared_experts, 0, op, "num_shared_experts");
  if (out_weights.has_value() != out_ids.has_value()) fail(op, "out", "must be a (weights, ids) pair");
  if (!needs_dispatcher(logits)) (void)device_of(logits, op, "logits");
  rank_is(logits, 2, "[T, E]", op, "logits");
  at::Tensor weights, ids;
  if (out_weights.has_value()) {
    weights = *out_weights;
    ids = *out_ids;
  } else {
    const int64_t width = topk + num_shared_experts;
    weights = at::empty({logits.size(0), width}, logits.options().dtype(at::kFloat));
    ids = at::empty({logits.size(0), width}, logits.options().dtype(at::kInt));
  }
  fused_gate_dispatch(logits, bias, weights, ids, topk, num_groups, topk_groups, scoring, group_score, renormalize,
                      routed_scaling_factor, num_shared_experts, shared_expert_weight);
  return {weights, ids};
}

void permute_dispatch(const at::Tensor& x, const at::Tensor& ids, const std::optional<at::Tensor>& input_scale,
                      const at::Tensor& x_perm, const std::optional<at::Tensor>& scales,
                      const at::Tensor& expert_offsets, const at::Tensor& expert_counts, const at::Tensor& row_index,
                      const std::optional<at::Tensor>& row_token, const std::optional<at::Tensor>& workspace,
                      int64_t num_experts, int64_t pad_multiple, std::string_view quant);

using PermuteOut = std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor,
                              std::optional<at::Tensor>>;

// tessera.permute: the six PermuteResult fields, given (out_given: the fields of out=, row_token and scales may be
// None) or allocated here (capacity rows T·k, plus E·(pad_multiple − 1) when padding), then the op. quant: "none",
// "fp8_blockwise" or "fp8_per_tensor" (the torch layer maps None to "none").
PermuteOut permute_eager(const at::Tensor& x, const at::Tensor& ids, int64_t num_experts, int64_t pad_multiple,
                         std::string_view quant, const std::optional<at::Tensor>& input_scale, bool with_row_token,
                         const std::optional<at::Tensor>& workspace, bool out_given,
                         const std::optional<at::Tensor>& out_x_perm, const std::optional<at::Tensor>& out_scales,
                         const std::optional<at::Tensor>& out_offsets, const std::optional<at::Tensor>& out_counts,
                         const std::optional<at::Tensor>& out_row_index,
                         const std::optional<at::Tensor>& out_row_token) {
  constexpr const char* op = "tessera.permute";
  no_symbolic_sizes({&x, &ids});
  // Checks before anything is allocated.
  const tessera::moe::PermuteQuant q = parse_quant(quant, op);
  at_least(num_experts, 1, op, "num_experts");
  at_least(pad_multiple, 1, op, "pad_multiple");
  (void)narrow(num_experts, op, "num_experts");  // the capacity below is then computed without overflow
  (void)narrow(pad_multiple, op, "pad_multiple");
  if (!needs_dispatcher(x)) (void)device_of(x, op, "x");
  rank_is(x, 2, "[T, H]", op, "x");
  rank_is(ids, 2, "[T, k]", op, "ids");
  if (ids.size(1) < 1)
    fail(op, "ids", "must have at least one column, got shape [" + std::to_string(ids.size(0)) + ", 0]");
  if (out_given && !(out_x_perm && out_offsets && out_counts && out_row_index))
    fail(op, "out", "must hold x_perm, expert_offsets, expert_counts and row_index tensors");
  if (out_given) {
    permute_dispatch(x, ids, input_scale, *out_x_perm, out_scales, *out_offsets, *out_counts, *out_row_index,
                     out_row_token, workspace, num_experts, pad_multiple, quant);
    return {*out_x_perm, out_scales, *out_offsets, *out_counts, *out_row_index, out_row_token};
  }
  const int64_t tokens = x.size(0), hidden = x.size(1), topk = ids.size(1);
  // The op's limits (experts, padding, topk) are checked by the capacity query, before anything is allocated.
  tessera::moe::PermuteParams limits;
  limits.num_experts = static_cast<int>(num_experts);
  limits.pad_multiple = static_cast<int>(pad_multiple);
  const int64_t rows = tessera::moe::permute_capacity_rows(tokens, static_cast<int>(std::min<int64_t>(topk, 1 << 20)),
                                                           limits);
  const auto i32 = x.options().dtype(at::kInt);
  const bool quantized = q != tessera::moe::PermuteQuant::kNone;
  const at::Tensor x_perm = at::empty({rows, hidden}, quantized ? x.options().dtype(at::kFloat8_e4m3fn) : x.options());
  std::optional<at::Tensor> scales;
  if (q == tessera::moe::PermuteQuant::kFP8Blockwise)
    scales = at::empty({rows, (hidden + tessera::moe::kFP8BlockCols - 1) / tessera::moe::kFP8BlockCols},
                       x.options().dtype(at::kFloat));
  const at::Tensor offsets = at::empty({num_experts + 1}, i32);
  const at::Tensor counts = at::empty({num_experts}, i32);
  const at::Tensor row_index = at::empty({tokens, topk}, i32);
  std::optional<at::Tensor> row_token;
  if (with_row_token) row_token = at::empty({rows}, i32);
  permute_dispatch(x, ids, input_scale, x_perm, scales, offsets, counts, row_index, row_token, workspace, num_experts,
                   pad_multiple, quant);
  return {x_perm, scales, offsets, counts, row_index, row_token};
}

// tessera.unpermute_reduce: returns out [T, H] of y_perm's dtype (allocated unless given).
at::Tensor unpermute_reduce_eager(const at::Tensor& y_perm, const at::Tensor& row_index, const at::Tensor& weights,
                                  const std::optional<at::Tensor>& residual, double routed_scale,
                                  const std::optional<at::Tensor>& out) {
  constexpr const char* op = "tessera.unpermute_reduce";
  no_symbolic_sizes({&y_perm, &row_index});
  // Checks before anything is allocated.
  if (!needs_dispatcher(y_perm)) (void)device_of(y_perm, op, "y_perm");
  rank_is(y_perm, 2, "[R, H]", op, "y_perm");
  rank_is(row_index, 2, "[T, k]", op, "row_index");
  const at::Tensor o = out.has_value() ? *out : at::empty({row_index.size(0), y_perm.size(1)}, y_perm.options());
  unpermute_reduce_dispatch(y_perm, row_index, weights, residual, o, routed_scale);
  return o;
}

// tessera.grouped_gemm_{fp8,bf16}[_masked]'s eager call in one crossing: returns y (bf16 [..., N], allocated here
// unless given). What the torch layer rejects with its own messages (an fp8 dtype other than e4m3, an fp8 tensor for
// bf16, a missing scale, a rank, a tensor off the GPU) and the tensors only the dispatcher handles go back to that
// layer's checked path before anything is allocated, through pybind's own phrase (_dlpack.FALLBACK).
void grouped_gemm_dispatch(bool fp8, bool masked, const at::Tensor& x, const at::Tensor& w,
                           const at::Tensor& group_rows, const at::Tensor& x_scale, const at::Tensor& w_scale,
                           const at::Tensor& y, const std::optional<at::Tensor>& workspace,
                           std::string_view scale_mode, int64_t expected_m);

at::Tensor grouped_gemm_eager(const at::Tensor& x, const at::Tensor& w, const at::Tensor& group_rows,
                              const std::optional<at::Tensor>& x_scale, const std::optional<at::Tensor>& w_scale,
                              const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& workspace,
                              bool masked, bool fp8, std::string_view scale_mode, int64_t expected_m) {
  no_symbolic_sizes({&x, &w});
  const bool checked_path =
      needs_dispatcher(x) || needs_dispatcher(w) || !x.is_cuda() || x.dim() != (masked ? 3 : 2) || w.dim() != 3 ||
      (fp8 ? !(x.scalar_type() == at::kFloat8_e4m3fn && w.scalar_type() == at::kFloat8_e4m3fn && x_scale && w_scale)
           : (is_float8(x) || is_float8(w))) ||
      (out && is_float8(*out));
  if (checked_path) throw pybind11::type_error("tessera: incompatible function arguments (checked path)");
  at::Tensor y;
  if (out) {
    y = *out;
  } else {
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
    sizes.push_back(w.size(1));
    y = at::empty(sizes, x.options().dtype(at::kBFloat16));
  }
  grouped_gemm_dispatch(fp8, masked, x, w, group_rows, fp8 ? *x_scale : x, fp8 ? *w_scale : x, y, workspace,
                        scale_mode, expected_m);
  return y;
}

// The outputs of an attention call (decode, the prefills): the given ones, else out like q and (return_lse) an fp32
// lse of q's leading dims.
std::pair<at::Tensor, std::optional<at::Tensor>> attention_outputs(const at::Tensor& q,
                                                                   const std::optional<at::Tensor>& out,
                                                                   const std::optional<at::Tensor>& lse,
                                                                   bool return_lse) {
  const at::Tensor o = out.has_value() ? *out : at::empty(q.sizes(), q.options());
  std::optional<at::Tensor> m = lse;
  if (!m.has_value() && return_lse) {
    const auto sizes = q.sizes();
    m = at::empty(sizes.slice(0, sizes.size() - 1), q.options().dtype(at::kFloat));
  }
  return {o, m};
}

// What an attention op returns to Python: out, or (out, lse) when return_lse (lse then always holds a tensor).
using AttentionOut = std::variant<at::Tensor, std::pair<at::Tensor, at::Tensor>>;
AttentionOut attention_out(const at::Tensor& o, const std::optional<at::Tensor>& m, bool return_lse) {
  if (return_lse) return std::pair<at::Tensor, at::Tensor>(o, *m);
  return o;
}

// tessera.attention_decode's eager call in one crossing: out (shaped like q) and lse ([..., HQ] fp32, when
// return_lse) are allocated here when not given, on q's device and current stream, as the torch layer's traced path
// allocates them with torch.empty. softmax_scale None means 1/sqrt(D). Returns what the op returns (attention_out).
void attention_decode_dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& block_table, const at::Tensor& cache_seqlens,
                               const at::Tensor& out, const std::optional<at::Tensor>& lse,
                               const std::optional<at::Tensor>& workspace, std::string_view format,
                               double softmax_scale, double softcap, int64_t window, int64_t num_splits,
                               const std::optional<at::Tensor>& k_residual, bool balance_splits);

AttentionOut attention_decode_eager(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& out,
    const std::optional<at::Tensor>& lse, bool return_lse, const std::optional<at::Tensor>& workspace,
    std::string_view format, std::optional<double> softmax_scale, double softcap, int64_t window,
    int64_t num_splits, const std::optional<at::Tensor>& k_residual, std::optional<bool> balance_splits) {
  constexpr const char* op = "tessera.attention_decode";
  no_symbolic_sizes({&q});
  // Checks before anything is allocated: the scalar arguments first, as the torch layer checks them, then q's device
  // and rank.
  (void)parse_kv_format(format, op);
  at_least(window, 0, op, "window");
  at_least(num_splits, 0, op, "num_splits");
  if (!needs_dispatcher(q)) (void)device_of(q, op, "q");
  if (q.dim() != 3 && q.dim() != 4)
    fail(op, "q",
         "must be [B, HQ, D] or [B, S, HQ, D] (S new tokens per sequence), got shape " + sizes_str(q.sizes()));
  auto [o, m] = attention_outputs(q, out, lse, return_lse);
  attention_decode_dispatch(q, k_cache, v_cache, k_scale, v_scale, block_table, cache_seqlens, o, m, workspace,
                            format, softmax_scale.value_or(0.0), softcap, window, num_splits, k_residual,
                            balance_splits.value_or(false));
  return attention_out(o, m, return_lse);
}

// tessera.prefill / tessera.prefill_varlen's eager calls in one crossing: out (shaped like q) and lse (q's shape
// without D, fp32, when return_lse) are allocated here when not given, on q's device and current stream, as the
// torch layer's traced path allocates them with torch.empty. softmax_scale None means 1/sqrt(D). Return what
// the op returns (attention_out).
void attention_prefill_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                const std::optional<at::Tensor>& lse, double softmax_scale, double softcap,
                                int64_t window, bool causal);
void attention_prefill_varlen_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, const at::Tensor& out,
                                       const std::optional<at::Tensor>& lse, double softmax_scale, double softcap,
                                       int64_t window, bool causal);

AttentionOut attention_prefill_eager(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& out,
    const std::optional<at::Tensor>& lse, bool return_lse, std::optional<double> softmax_scale, double softcap,
    int64_t window, bool causal) {
  constexpr const char* op = "tessera.prefill";
  no_symbolic_sizes({&q});
  // Checks before anything is allocated: the scalar arguments, then q's device and rank, as the torch layer does.
  at_least(window, 0, op, "window");
  if (!needs_dispatcher(q)) (void)device_of(q, op, "q");
  rank_is(q, 4, "[B, Sq, HQ, D]", op, "q");
  auto [o, m] = attention_outputs(q, out, lse, return_lse);
  attention_prefill_dispatch(q, k, v, o, m, softmax_scale.value_or(0.0), softcap, window, causal);
  return attention_out(o, m, return_lse);
}

AttentionOut attention_prefill_varlen_eager(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, const std::optional<at::Tensor>& out,
    const std::optional<at::Tensor>& lse, bool return_lse, std::optional<double> softmax_scale, double softcap,
    int64_t window, bool causal) {
  constexpr const char* op = "tessera.prefill_varlen";
  no_symbolic_sizes({&q});
  at_least(max_seqlen_q, 0, op, "max_seqlen_q");
  at_least(window, 0, op, "window");
  if (!needs_dispatcher(q)) (void)device_of(q, op, "q");
  rank_is(q, 3, "[total_q, HQ, D]", op, "q");
  auto [o, m] = attention_outputs(q, out, lse, return_lse);
  attention_prefill_varlen_dispatch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, o, m,
                                    softmax_scale.value_or(0.0), softcap, window, causal);
  return attention_out(o, m, return_lse);
}

void attention_prefill_with_cache_dispatch(const at::Tensor& q, const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const std::optional<at::Tensor>& k_scale,
                                           const std::optional<at::Tensor>& v_scale,
                                           const std::optional<at::Tensor>& block_table,
                                           const at::Tensor& cache_seqlens, const at::Tensor& out,
                                           const std::optional<at::Tensor>& lse, std::string_view format,
                                           double softmax_scale, double softcap, int64_t window, bool causal,
                                           const std::optional<at::Tensor>& k_residual);

// tessera.prefill_with_cache: the torch layer's argument order (the cache's tensors as attention_decode_eager takes
// them, the rest as attention_prefill_varlen_eager's).
AttentionOut attention_prefill_with_cache_eager(
    const at::Tensor& q, const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& lse, bool return_lse,
    std::string_view format, std::optional<double> softmax_scale, double softcap, int64_t window, bool causal,
    const std::optional<at::Tensor>& k_residual) {
  constexpr const char* op = "tessera.prefill_with_cache";
  no_symbolic_sizes({&q});
  // Checks before anything is allocated: the scalar arguments, then q's device and rank, as the torch layer does.
  (void)parse_kv_format(format, op);
  at_least(max_seqlen_q, 0, op, "max_seqlen_q");
  at_least(window, 0, op, "window");
  if (!needs_dispatcher(q)) (void)device_of(q, op, "q");
  rank_is(q, 3, "[total_q, HQ, D]", op, "q");
  auto [o, m] = attention_outputs(q, out, lse, return_lse);
  attention_prefill_with_cache_dispatch(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache, k_scale, v_scale,
                                        block_table, cache_seqlens, o, m, format, softmax_scale.value_or(0.0),
                                        softcap, window, causal, k_residual);
  return attention_out(o, m, return_lse);
}

// tessera.linear's eager call in one crossing: x [..., K] is taken as [M, K] (a view where its strides allow, else a
// copy, as torch.reshape), y [..., N] of x's dtype is allocated here unless out= (that shape, viewable as [M, N]) is
// given, then the op. Returns y.
void linear_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                     const std::optional<at::Tensor>& k_perm, const std::optional<at::Tensor>& bias,
                     const at::Tensor& y, const std::optional<at::Tensor>& workspace, int64_t n, int64_t k,
                     int64_t bits, int64_t block, std::string_view zero_mode, double clamp_min, double clamp_max);

at::Tensor linear_eager(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                        const std::optional<at::Tensor>& k_perm, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& workspace, int64_t n,
                        int64_t k, int64_t bits, int64_t block, std::string_view zero_mode, double clamp_min,
                        double clamp_max) {
  constexpr const char* op = "tessera.linear";
  no_symbolic_sizes({&x});
  // Checks before anything is allocated, with the torch layer's messages.
  (void)tessera::python::parse_zero_mode(zero_mode, op);
  at_least(n, 1, op, "n");
  at_least(k, 1, op, "k");
  if (!needs_dispatcher(x)) (void)device_of(x, op, "x");
  if (x.dim() < 1 || x.size(-1) != k)
    fail(op, "x", "must be [..., K] with K = " + std::to_string(k) + ", got shape " + sizes_str(x.sizes()));
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(n);
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});  // a reshape costs a new tensor even where it is a no-op
  at::Tensor y, y2;
  if (out.has_value()) {
    if (!out->sizes().equals(sizes))
      fail(op, "out", "must be [..., N] = " + sizes_str(sizes) + ", got shape " + sizes_str(out->sizes()));
    y = *out;
    if (y.dim() == 2) {
      y2 = y;
    } else {
      try {
        y2 = y.view({-1, n});
      } catch (const c10::Error&) {
        fail(op, "out", "must be viewable as [M, N] (M = the product of x's leading dims)");
      }
    }
  } else {
    y2 = at::empty({x2.size(0), n}, x.options());
    y = y2.view(sizes);
  }
  linear_dispatch(x2, codes, params, k_perm, bias, y2, workspace, n, k, bits, block, zero_mode, clamp_min, clamp_max);
  return y;
}

void w8a8_quantize_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& sums,
                            int64_t block);
void gemm_w8a8_dispatch(const at::Tensor& a_codes, const at::Tensor& a_scale, const std::optional<at::Tensor>& a_zero,
                        const std::optional<at::Tensor>& a_sums, const at::Tensor& w_codes, const at::Tensor& w_scale,
                        const std::optional<at::Tensor>& w_zero, const std::optional<at::Tensor>& w_sums,
                        const std::optional<at::Tensor>& bias, const at::Tensor& y,
                        const std::optional<at::Tensor>& workspace, int64_t block, double clamp_min, double clamp_max,
                        double out_scale);

using Int8BlocksOut =
    std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, int64_t>;

// An Int8Blocks argument of an eager entry, read under the GIL straight from the tuple (codes, scale, zero or None,
// sums or None, block): codes and scale borrowed from their Python objects, no copy. pybind's tuple caster fetched
// every item through the sequence protocol and held a copy of each tensor, whose release asks the Python interpreter
// for the GIL: ~13 % of the samples of gemm_w8a8's eager call in a py-spy profile on an H200 machine; the call fell
// by 2-4 us with these changes (v2d in docs/perf/host_overhead.md, session 23). Anything else is a TypeError with
// pybind11's phrase for an argument it cannot convert: nothing ran, and the torch layer takes its checked path, which
// names the argument.
struct Int8BlocksArg {
  const at::Tensor& codes;
  const at::Tensor& scale;
  std::optional<at::Tensor> zero, sums;
  int64_t block;
};

Int8BlocksArg int8_blocks_arg(pybind11::handle obj) {
  PyObject* t = obj.ptr();
  const auto mismatch = [] {
    return pybind11::type_error("tessera: incompatible function arguments (an Int8Blocks tuple was expected)");
  };
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) throw mismatch();
  const auto tensor = [&](Py_ssize_t i) -> const at::Tensor& {
    const at::Tensor* v = tessera::python::borrowed_tensor(PyTuple_GET_ITEM(t, i));
    if (v == nullptr) throw mismatch();
    return *v;
  };
  const auto optional = [&](Py_ssize_t i) -> std::optional<at::Tensor> {
    if (PyTuple_GET_ITEM(t, i) == Py_None) return std::nullopt;
    return tensor(i);
  };
  PyObject* b = PyTuple_GET_ITEM(t, 4);
  if (!PyLong_Check(b) || PyBool_Check(b)) throw mismatch();
  const long long block = PyLong_AsLongLong(b);
  if (block == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw mismatch();
  }
  return {tensor(0), tensor(1), optional(2), optional(3), block};
}

// tessera.quantize_per_block's eager call in one crossing: x [..., K] taken as [M, K] (as torch.reshape), then the op
// into out (an Int8Blocks tuple, read under the GIL as int8_blocks_arg reads one; returns None) or into codes int8
// [M, K] and planes fp32 [K / block, ld] (ld: M rounded up to a multiple of 4, at least 4) allocated on x's device and
// current stream (returns the Int8Blocks fields). block -1: K. The checks before anything is allocated carry the
// torch layer's messages.
std::optional<Int8BlocksOut> w8a8_quantize_eager(const at::Tensor& x, int64_t block, bool symmetric, bool with_sums,
                                                 pybind11::handle out_obj) {
  constexpr const char* op = "tessera.quantize_per_block";
  std::optional<Int8BlocksArg> out;
  if (!out_obj.is_none()) out.emplace(int8_blocks_arg(out_obj));
  const pybind11::gil_scoped_release no_gil;  // ends before out: its copies are dropped with the GIL held
  no_symbolic_sizes({&x});
  if (!needs_dispatcher(x)) (void)device_of(x, op, "x");
  if (x.dim() < 1) fail(op, "x", "must be [..., K], got a scalar");
  const int64_t k = x.size(-1);
  if (k <= 0 || k % 16 != 0)
    fail(op, "x", "must have K (its last dim) a positive multiple of 16, got shape " + sizes_str(x.sizes()));
  if (block == -1) block = k;
  if (block != 32 && block != 64 && block != 128 && block != k)
    fail(op, "block", "must be 32, 64, 128 or K (" + std::to_string(k) + "), got " + std::to_string(block));
  if (k % block != 0)
    fail(op, "block", "must divide K (" + std::to_string(k) + "), got " + std::to_string(block));
  const at::Tensor x2 = x.reshape({-1, k});
  if (out.has_value()) {
    const char* const flag[] = {"False", "True"};
    if (out->block != block)
      fail(op, "out", "must have block " + std::to_string(block) + ", got " + std::to_string(out->block));
    if (out->zero.has_value() == symmetric)
      fail(op, "out", std::string("must ") + (symmetric ? "not " : "") + "hold zero points (symmetric=" +
                          flag[symmetric] + ")");
    if (out->sums.has_value() != with_sums)
      fail(op, "out", std::string("must ") + (with_sums ? "" : "not ") + "hold sums (sums=" + flag[with_sums] + ")");
    w8a8_quantize_dispatch(x2, out->codes, out->scale, out->zero, out->sums, block);
    return std::nullopt;
  }
  const int64_t m = x2.size(0), ld = (std::max<int64_t>(m, 1) + 3) / 4 * 4;
  const auto f32 = x.options().dtype(at::kFloat);
  const at::Tensor codes = at::empty({m, k}, x.options().dtype(at::kChar));
  const at::Tensor scale = at::empty({k / block, ld}, f32);
  std::optional<at::Tensor> zero, sums;
  if (!symmetric) zero = at::empty({k / block, ld}, f32);
  if (with_sums) sums = at::empty({k / block, ld}, f32);
  w8a8_quantize_dispatch(x2, codes, scale, zero, sums, block);
  return Int8BlocksOut{codes, scale, zero, sums, block};
}

// tessera.gemm_w8a8's eager call in one crossing: a and w as their Int8Blocks tuples (int8_blocks_arg, under the GIL,
// which is then released for the rest), y [M, N] allocated here (dtype: "bfloat16", "float16", "float32" or "int8",
// as the torch layer resolved it) unless out= is given, then the op. y_dtype "" is the torch layer's common case
// (no epilogue, out_dtype and out_scale None): y of out's dtype, which must then be a float one (anything else goes
// back to the torch layer's checked path, which names the rule), or bfloat16. The torch layer has checked the
// epilogue, the output kind and the operands' types. Returns y.
at::Tensor gemm_w8a8_eager(pybind11::handle a_obj, pybind11::handle w_obj, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& workspace,
                           double clamp_min, double clamp_max, double out_scale, std::string_view y_dtype) {
  constexpr const char* op = "tessera.gemm_w8a8";
  const Int8BlocksArg a = int8_blocks_arg(a_obj), w = int8_blocks_arg(w_obj);
  const pybind11::gil_scoped_release no_gil;  // ends before a and w: their copies are dropped with the GIL held
  if (a.block != w.block)
    fail(op, "w", "must have a's block (" + std::to_string(a.block) + "), got block " + std::to_string(w.block));
  if (y_dtype.empty() && out.has_value()) {  // the output kind next, as the torch layer's checked path orders it
    const at::ScalarType t = out->scalar_type();
    if (t != at::kBFloat16 && t != at::kHalf && t != at::kFloat)
      throw pybind11::type_error("tessera: incompatible function arguments (out's dtype: the checked path)");
  }
  no_symbolic_sizes({&a.codes, &w.codes});
  if (!needs_dispatcher(a.codes)) (void)device_of(a.codes, op, "a.codes");
  rank_is(a.codes, 2, "[M, K]", op, "a.codes");
  rank_is(w.codes, 2, "[N, K]", op, "w.codes");
  const int64_t sizes[2] = {a.codes.size(0), w.codes.size(0)};
  at::Tensor y;
  if (out.has_value()) {
    if (!out->sizes().equals(sizes))
      fail(op, "out", "must be [M, N] = " + sizes_str(sizes) + ", got shape " + sizes_str(out->sizes()));
    y = *out;
  } else {
    static constexpr tessera::python::Choice<at::ScalarType> kDtypes[] = {
        {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}, {"float32", at::kFloat}, {"int8", at::kChar}};
    const at::ScalarType t =
        y_dtype.empty() ? at::kBFloat16 : tessera::python::parse_choice(y_dtype, op, "out_dtype", kDtypes);
    y = at::empty(sizes, a.codes.options().dtype(t));
  }
  gemm_w8a8_dispatch(a.codes, a.scale, a.zero, a.sums, w.codes, w.scale, w.zero, w.sums, bias, y, workspace, a.block,
                     clamp_min, clamp_max, out_scale);
  return y;
}

void conv2d_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                     const std::optional<at::Tensor>& bias, const at::Tensor& y,
                     const std::optional<at::Tensor>& workspace, int64_t n, int64_t k, int64_t bits, int64_t block,
                     std::string_view zero_mode, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w,
                     int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w, int64_t groups,
                     std::string_view x_layout, std::string_view y_layout, double clamp_min, double clamp_max);

// The torch layer's memory-format rule for a 4-D [N, C, H, W] tensor: channels_last (held NHWC) when it is
// channels_last-contiguous and, where it is standard-contiguous too (a size-1 dim), its channel stride is 1.
bool channels_last(const at::Tensor& t) {
  return t.is_contiguous(at::MemoryFormat::ChannelsLast) && (!t.is_contiguous() || t.stride(1) == 1);
}

// tessera.conv2d's eager call in one crossing. x [N, C, H, W] (PyTorch's logical order) is read in its memory
// format: channels_last as the NHWC view x.permute(0, 2, 3, 1) (x_layout 'NHWC'), anything else as NCHW (a copy when
// it is not contiguous). y [N, Co, Ho, Wo] of x's dtype is allocated in x's format unless out= is given (that shape,
// contiguous or channels_last: its format is y's layout). The torch layer has checked the weight (kh, kw, K, no
// k_perm), the epilogue and the geometry's ranges; the checks on x and out are made here with its messages, before
// anything is allocated. Returns y (channels_last for an NHWC y).
at::Tensor conv2d_eager(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out,
                        const std::optional<at::Tensor>& workspace, int64_t n, int64_t k, int64_t bits, int64_t block,
                        std::string_view zero_mode, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w, int64_t groups, double clamp_min,
                        double clamp_max) {
  constexpr const char* op = "tessera.conv2d";
  no_symbolic_sizes({&x});
  // Checks before anything is allocated, with the torch layer's messages.
  (void)tessera::python::parse_zero_mode(zero_mode, op);
  at_least(n, 1, op, "n");
  // Bounded above too (the op's own limit) before the shape arithmetic below multiplies them.
  constexpr int64_t kMaxParam = tessera::conv::kConvMaxParam;
  const auto in_bounds = [&](int64_t v, int64_t minimum, const char* arg) {
    at_least(v, minimum, op, arg);
    if (v > kMaxParam) fail(op, arg, "must be <= " + std::to_string(kMaxParam) + ", got " + std::to_string(v));
  };
  in_bounds(kh, 1, "kh");
  in_bounds(kw, 1, "kw");
  in_bounds(stride_h, 1, "stride");
  in_bounds(stride_w, 1, "stride");
  in_bounds(pad_h, 0, "padding");
  in_bounds(pad_w, 0, "padding");
  in_bounds(dil_h, 1, "dilation");
  in_bounds(dil_w, 1, "dilation");
  in_bounds(groups, 1, "groups");
  if (!needs_dispatcher(x)) (void)device_of(x, op, "x");
  rank_is(x, 4, "[N, C, H, W]", op, "x");
  const int64_t batch = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  if (c % groups != 0)
    fail(op, "groups", "must divide x's channels C = " + std::to_string(c) + ", got " + std::to_string(groups));
  if (n % groups != 0)
    fail(op, "groups",
         "must divide the weight's output channels Co = " + std::to_string(n) + ", got " + std::to_string(groups));
  if ((c / groups) * kh * kw != k) {
    const int64_t ci_g = k / (kh * kw);
    fail(op, "x",
         "must have C = groups·Ci_g = " + std::to_string(groups) + "·" + std::to_string(ci_g) + " = " +
             std::to_string(groups * ci_g) + " channels (the weight's Ci_g = K / (Kh·Kw) = " + std::to_string(k) +
             " / " + std::to_string(kh * kw) + "), got shape " + sizes_str(x.sizes()));
  }
  const int64_t ho = tc::conv2d_output_size(h, kh, stride_h, pad_h, dil_h);
  const int64_t wo = tc::conv2d_output_size(w, kw, stride_w, pad_w, dil_w);
  if (ho < 1 || wo < 1)
    fail(op, "x",
         "[H, W] = [" + std::to_string(h) + ", " + std::to_string(w) + "] with padding [" + std::to_string(pad_h) +
             ", " + std::to_string(pad_w) + "] is smaller than the dilated kernel [" +
             std::to_string(dil_h * (kh - 1) + 1) + ", " + std::to_string(dil_w * (kw - 1) + 1) +
             "] (no output pixel)");
  const std::vector<int64_t> sizes = {batch, n, ho, wo};
  const bool x_nhwc = channels_last(x);
  bool y_nhwc = x_nhwc;
  if (out.has_value()) {
    if (!out->sizes().equals(sizes))
      fail(op, "out", "must be [N, Co, Ho, Wo] = " + sizes_str(sizes) + ", got shape " + sizes_str(out->sizes()));
    y_nhwc = channels_last(*out);
    if (!y_nhwc && !out->is_contiguous())
      fail(op, "out", "must be contiguous or channels_last-contiguous, got strides " + sizes_str(out->strides()));
  }
  // The operator sees x and y contiguous in their layouts: a channels_last tensor as its NHWC view.
  const at::Tensor x_store = x_nhwc ? x.permute({0, 2, 3, 1}) : x.contiguous();
  at::Tensor y_store;
  if (out.has_value())
    y_store = y_nhwc ? out->permute({0, 2, 3, 1}) : *out;
  else
    y_store = y_nhwc ? at::empty({batch, ho, wo, n}, x.options()) : at::empty(sizes, x.options());
  conv2d_dispatch(x_store, codes, params, bias, y_store, workspace, n, k, bits, block, zero_mode, kh, kw, stride_h,
                  stride_w, pad_h, pad_w, dil_h, dil_w, groups, x_nhwc ? "NHWC" : "NCHW", y_nhwc ? "NHWC" : "NCHW",
                  clamp_min, clamp_max);
  if (out.has_value()) return *out;
  return y_nhwc ? y_store.permute({0, 3, 1, 2}) : y_store;
}

// moe_layer's constants, checked and planned once (tessera.moe_layer.MoeLayerPlan builds one per plan, the first
// time its eager path runs), so that an eager call converts one argument instead of fourteen and plans nothing. The
// constants are kept as given for the dispatcher's schema (a call it has to take: fake or meta tensors, a dispatch
// mode). Immutable once built.
struct MoeLayerEagerPlan {
  int64_t hidden, intermediate, num_experts, topk, num_groups, topk_groups;
  std::string scoring, group_score;
  bool renormalize;
  double routed_scaling_factor;
  int64_t num_shared_experts;
  double shared_expert_weight;
  std::string format;
  int64_t max_tokens;
  tm::MoeLayerPlan plan;

  MoeLayerEagerPlan(int64_t hidden_, int64_t intermediate_, int64_t num_experts_, int64_t topk_, int64_t num_groups_,
                    int64_t topk_groups_, std::string scoring_, std::string group_score_, bool renormalize_,
                    double routed_scaling_factor_, int64_t num_shared_experts_, double shared_expert_weight_,
                    std::string format_, int64_t max_tokens_)
      : hidden(hidden_), intermediate(intermediate_), num_experts(num_experts_), topk(topk_), num_groups(num_groups_),
        topk_groups(topk_groups_), scoring(std::move(scoring_)), group_score(std::move(group_score_)),
        renormalize(renormalize_), routed_scaling_factor(routed_scaling_factor_),
        num_shared_experts(num_shared_experts_), shared_expert_weight(shared_expert_weight_),
        format(std::move(format_)), max_tokens(max_tokens_),
        plan(tm::moe_layer_plan(tessera::python::moe_layer_config("tessera.moe_layer", hidden, intermediate,
                                                                  num_experts, topk, num_groups, topk_groups, scoring,
                                                                  group_score, renormalize, routed_scaling_factor,
                                                                  num_shared_experts, shared_expert_weight, format),
                                max_tokens)) {}
};


// ---- the two entry points of every op -------------------------------------------------------------------------
// Entry<op>::dispatcher is the kernel registered with PyTorch's dispatcher (what torch.compile and
// torch.ops.tessera.* call); Entry<op>::python is the same function bound directly for the eager path of the torch
// layer, which skips the dispatcher's boxing of a dozen arguments (its largest host cost). Only the error
// translation differs: c10 errors for the dispatcher, Python exceptions (the module's translate_errors) for pybind.

template <auto Fn>
struct Entry;

template <auto Fn>
struct OpName;  // "tessera::<op>", specialized for every op below

template <typename... Args, void (*Fn)(Args...)>
struct Entry<Fn> {
  // The direct call is an eager shortcut only: with a Python dispatch mode active (FakeTensorMode, a
  // TorchDispatchMode) or a tensor only the dispatcher can handle, the call goes to torch.ops.tessera.<op>.
  static bool through_dispatcher(const Args&... args) {
    return c10::impl::TorchDispatchModeTLS::stack_len() > 0 || (needs_dispatcher(args) || ...);
  }
  static void call_dispatcher(Args... args) {
    static const auto handle =
        c10::Dispatcher::singleton().findSchemaOrThrow(OpName<Fn>::value, "").template typed<void(Args...)>();
    handle.call(args...);
  }
  static void dispatcher(Args... args) {
    try {
      Fn(args...);
    } catch (const tessera::CudaError& e) {
      throw c10::Error(kNoLocation, e.what());
    } catch (const tessera::Error& e) {
      throw c10::ValueError(kNoLocation, e.what());
    }
  }
  static void python(Args... args) {
    if (through_dispatcher(args...)) return call_dispatcher(args...);  // its errors are already c10's
    Fn(args...);  // tessera's errors: the module's translator (translate_errors)
  }
};

// The ops whose direct entries take every argument positionally; attention_decode, append_kv and
// attention_prefill_with_cache are bound with their argument names (k_residual, last, defaults to None there as in
// their schemas).
#define TESSERA_TORCH_OPS_POSITIONAL(X)                                                                          \
  X(fused_gate) X(permute) X(unpermute_reduce) X(grouped_gemm_fp8) X(grouped_gemm_fp8_masked) X(grouped_gemm_bf16) \
  X(grouped_gemm_bf16_masked) X(attention_prefill) X(attention_prefill_varlen) X(linear) X(w8a8_quantize)          \
  X(gemm_w8a8) X(conv2d) X(moe_layer)
#define TESSERA_TORCH_OPS(X) \
  TESSERA_TORCH_OPS_POSITIONAL(X) X(attention_decode) X(append_kv) X(attention_prefill_with_cache)

#define TESSERA_OP_NAME(name)                       \
  template <>                                       \
  struct OpName<&name> {                            \
    static constexpr const char* value = "tessera::" #name; \
  };
TESSERA_TORCH_OPS(TESSERA_OP_NAME)
#undef TESSERA_OP_NAME

void fused_gate_dispatch(const at::Tensor& logits, const std::optional<at::Tensor>& bias, const at::Tensor& weights,
                         const at::Tensor& ids, int64_t topk, int64_t num_groups, int64_t topk_groups,
                         std::string_view scoring, std::string_view group_score, bool renormalize,
                         double routed_scaling_factor, int64_t num_shared_experts, double shared_expert_weight) {
  Entry<&fused_gate>::python(logits, bias, weights, ids, topk, num_groups, topk_groups, scoring, group_score,
                             renormalize, routed_scaling_factor, num_shared_experts, shared_expert_weight);
}

void permute_dispatch(const at::Tensor& x, const at::Tensor& ids, const std::optional<at::Tensor>& input_scale,
                      const at::Tensor& x_perm, const std::optional<at::Tensor>& scales,
                      const at::Tensor& expert_offsets, const at::Tensor& expert_counts, const at::Tensor& row_index,
                      const std::optional<at::Tensor>& row_token, const std::optional<at::Tensor>& workspace,
                      int64_t num_experts, int64_t pad_multiple, std::string_view quant) {
  Entry<&permute>::python(x, ids, input_scale, x_perm, scales, expert_offsets, expert_counts, row_index, row_token,
                          workspace, num_experts, pad_multiple, quant);
}

void unpermute_reduce_dispatch(const at::Tensor& y_perm, const at::Tensor& row_index, const at::Tensor& weights,
                               const std::optional<at::Tensor>& residual, const at::Tensor& out, double routed_scale) {
  Entry<&unpermute_reduce>::python(y_perm, row_index, weights, residual, out, routed_scale);
}

void grouped_gemm_dispatch(bool fp8, bool masked, const at::Tensor& x, const at::Tensor& w,
                           const at::Tensor& group_rows, const at::Tensor& x_scale, const at::Tensor& w_scale,
                           const at::Tensor& y, const std::optional<at::Tensor>& workspace,
                           std::string_view scale_mode, int64_t expected_m) {
  if (fp8 && masked)
    Entry<&grouped_gemm_fp8_masked>::python(x, w, group_rows, x_scale, w_scale, y, workspace, scale_mode, expected_m);
  else if (fp8)
    Entry<&grouped_gemm_fp8>::python(x, w, group_rows, x_scale, w_scale, y, workspace, scale_mode, expected_m);
  else if (masked)
    Entry<&grouped_gemm_bf16_masked>::python(x, w, group_rows, y, workspace, expected_m);
  else
    Entry<&grouped_gemm_bf16>::python(x, w, group_rows, y, workspace, expected_m);
}

void attention_decode_dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& block_table, const at::Tensor& cache_seqlens,
                               const at::Tensor& out, const std::optional<at::Tensor>& lse,
                               const std::optional<at::Tensor>& workspace, std::string_view format,
                               double softmax_scale, double softcap, int64_t window, int64_t num_splits,
                               const std::optional<at::Tensor>& k_residual, bool balance_splits) {
  Entry<&attention_decode>::python(q, k_cache, v_cache, k_scale, v_scale, block_table, cache_seqlens, out, lse,
                                   workspace, format, softmax_scale, softcap, window, num_splits, k_residual,
                                   balance_splits);
}

void attention_prefill_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                const std::optional<at::Tensor>& lse, double softmax_scale, double softcap,
                                int64_t window, bool causal) {
  Entry<&attention_prefill>::python(q, k, v, out, lse, softmax_scale, softcap, window, causal);
}

void attention_prefill_varlen_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, const at::Tensor& out,
                                       const std::optional<at::Tensor>& lse, double softmax_scale, double softcap,
                                       int64_t window, bool causal) {
  Entry<&attention_prefill_varlen>::python(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, lse,
                                           softmax_scale, softcap, window, causal);
}

void attention_prefill_with_cache_dispatch(const at::Tensor& q, const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q,
                                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const std::optional<at::Tensor>& k_scale,
                                           const std::optional<at::Tensor>& v_scale,
                                           const std::optional<at::Tensor>& block_table,
                                           const at::Tensor& cache_seqlens, const at::Tensor& out,
                                           const std::optional<at::Tensor>& lse, std::string_view format,
                                           double softmax_scale, double softcap, int64_t window, bool causal,
                                           const std::optional<at::Tensor>& k_residual) {
  Entry<&attention_prefill_with_cache>::python(q, cu_seqlens_q, max_seqlen_q, k_cache, v_cache, k_scale, v_scale,
                                               block_table, cache_seqlens, out, lse, format, softmax_scale, softcap,
                                               window, causal, k_residual);
}

void linear_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                     const std::optional<at::Tensor>& k_perm, const std::optional<at::Tensor>& bias,
                     const at::Tensor& y, const std::optional<at::Tensor>& workspace, int64_t n, int64_t k,
                     int64_t bits, int64_t block, std::string_view zero_mode, double clamp_min, double clamp_max) {
  Entry<&linear>::python(x, codes, params, k_perm, bias, y, workspace, n, k, bits, block, zero_mode, clamp_min,
                         clamp_max);
}

void w8a8_quantize_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& sums,
                            int64_t block) {
  Entry<&w8a8_quantize>::python(x, codes, scale, zero, sums, block);
}

void gemm_w8a8_dispatch(const at::Tensor& a_codes, const at::Tensor& a_scale, const std::optional<at::Tensor>& a_zero,
                        const std::optional<at::Tensor>& a_sums, const at::Tensor& w_codes, const at::Tensor& w_scale,
                        const std::optional<at::Tensor>& w_zero, const std::optional<at::Tensor>& w_sums,
                        const std::optional<at::Tensor>& bias, const at::Tensor& y,
                        const std::optional<at::Tensor>& workspace, int64_t block, double clamp_min, double clamp_max,
                        double out_scale) {
  Entry<&gemm_w8a8>::python(a_codes, a_scale, a_zero, a_sums, w_codes, w_scale, w_zero, w_sums, bias, y, workspace,
                            block, clamp_min, clamp_max, out_scale);
}

void conv2d_dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params,
                     const std::optional<at::Tensor>& bias, const at::Tensor& y,
                     const std::optional<at::Tensor>& workspace, int64_t n, int64_t k, int64_t bits, int64_t block,
                     std::string_view zero_mode, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w,
                     int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w, int64_t groups,
                     std::string_view x_layout, std::string_view y_layout, double clamp_min, double clamp_max) {
  Entry<&conv2d>::python(x, codes, params, bias, y, workspace, n, k, bits, block, zero_mode, kh, kw, stride_h, stride_w,
                         pad_h, pad_w, dil_h, dil_w, groups, x_layout, y_layout, clamp_min, clamp_max);
}

void moe_layer_dispatch(const at::Tensor& x, const at::Tensor& router_logits,
                        const std::optional<at::Tensor>& correction_bias, const std::optional<at::Tensor>& residual,
                        const std::optional<at::Tensor>& num_tokens, const at::Tensor& w13, const at::Tensor& w2,
                        const std::optional<at::Tensor>& w13_scale, const std::optional<at::Tensor>& w2_scale,
                        const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                        const at::Tensor& y, const std::optional<at::Tensor>& workspace, int64_t hidden,
                        int64_t intermediate, int64_t num_experts, int64_t topk, int64_t num_groups,
                        int64_t topk_groups, std::string_view scoring, std::string_view group_score, bool renormalize,
                        double routed_scaling_factor, int64_t num_shared_experts, double shared_expert_weight,
                        std::string_view format, int64_t max_tokens) {
  Entry<&moe_layer>::python(x, router_logits, correction_bias, residual, num_tokens, w13, w2, w13_scale, w2_scale,
                            a13_scale, a2_scale, y, workspace, hidden, intermediate, num_experts, topk, num_groups,
                            topk_groups, scoring, group_score, renormalize, routed_scaling_factor, num_shared_experts,
                            shared_expert_weight, format, max_tokens);
}

// tessera.moe_layer's eager call in one crossing: x checked, y [T, H] bf16 allocated on x's device and current stream
// unless out= is given, then the op on the prebuilt plan (or, for the tensors and modes only the dispatcher can
// take, torch.ops.tessera.moe_layer with the plan's constants). Returns y.
at::Tensor moe_layer_eager(const MoeLayerEagerPlan& p, const at::Tensor& x, const at::Tensor& router_logits,
                           const std::optional<at::Tensor>& correction_bias, const std::optional<at::Tensor>& residual,
                           const std::optional<at::Tensor>& num_tokens, const at::Tensor& w13, const at::Tensor& w2,
                           const std::optional<at::Tensor>& w13_scale, const std::optional<at::Tensor>& w2_scale,
                           const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                           const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& workspace) {
  constexpr const char* op = "tessera.moe_layer";
  no_symbolic_sizes({&x});
  // x's device, checked before anything is allocated (a tensor only the dispatcher can take is routed there below).
  const std::optional<c10::Device> device =
      needs_dispatcher(x) ? std::nullopt : std::optional<c10::Device>(device_of(x, op, "x"));
  rank_is(x, 2, "[T, H]", op, "x");
  const int64_t sizes[2] = {x.size(0), x.size(1)};
  if (out.has_value() && !out->sizes().equals(sizes))
    fail(op, "out", "must be [T, H] = " + sizes_str(sizes) + " (x's shape), got shape " + sizes_str(out->sizes()));
  const at::Tensor y = out.has_value() ? *out : at::empty(sizes, x.options().dtype(at::kBFloat16));
  using E = Entry<&moe_layer>;
  const auto dispatcher_call = [&](auto&& call) {
    return call(x, router_logits, correction_bias, residual, num_tokens, w13, w2, w13_scale, w2_scale, a13_scale,
                a2_scale, y, workspace, p.hidden, p.intermediate, p.num_experts, p.topk, p.num_groups, p.topk_groups,
                p.scoring, p.group_score, p.renormalize, p.routed_scaling_factor, p.num_shared_experts,
                p.shared_expert_weight, p.format, p.max_tokens);
  };
  if (dispatcher_call([](const auto&... a) { return E::through_dispatcher(a...); })) {
    dispatcher_call([](const auto&... a) { E::call_dispatcher(a...); });
    return y;
  }
  run_on(*device, [&](cudaStream_t s) {  // not routed: x needs no dispatcher, so its device was checked above
    run_moe_layer(p.plan, x, router_logits, correction_bias, residual, num_tokens, w13, w2, w13_scale, w2_scale,
                  a13_scale, a2_scale, y, workspace, *device, s);
  });
  return y;
}

}  // namespace

// The schemas are defined by python/tessera/_torch_ops.py (torch.library); an implementation registered before
// its schema is matched to it when the schema arrives.
TORCH_LIBRARY_IMPL(tessera, CUDA, m) {
#define TESSERA_IMPL(name) m.impl(#name, &Entry<&name>::dispatcher);
  TESSERA_TORCH_OPS(TESSERA_IMPL)
#undef TESSERA_IMPL
}

// Importing the module loads the registrations above; its functions are the eager entry points (positional
// arguments in schema order, tensors as torch tensors, None for absent optional tensors).
PYBIND11_MODULE(_torch_C, m) {
  m.doc() = "tessera's PyTorch operators (registration) and their direct eager entry points; use tessera.*";
  pybind11::register_local_exception_translator(&tessera::python::translate_errors);
#define TESSERA_DEF(name) m.def(#name, &Entry<&name>::python, pybind11::call_guard<pybind11::gil_scoped_release>());
  TESSERA_TORCH_OPS_POSITIONAL(TESSERA_DEF)
#undef TESSERA_DEF
  using pybind11::arg;
  m.def("attention_decode", &Entry<&attention_decode>::python, arg("q"), arg("k_cache"), arg("v_cache"), arg("k_scale"),
        arg("v_scale"), arg("block_table"), arg("cache_seqlens"), arg("out"), arg("lse"), arg("workspace"),
        arg("format"), arg("softmax_scale"), arg("softcap"), arg("window"), arg("num_splits"),
        arg("k_residual") = pybind11::none(), arg("balance_splits") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("append_kv", &Entry<&append_kv>::python, arg("k_new"), arg("v_new"), arg("positions"), arg("k_cache"),
        arg("v_cache"), arg("k_scale"), arg("v_scale"), arg("block_table"), arg("format"),
        arg("k_residual") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attention_prefill_with_cache", &Entry<&attention_prefill_with_cache>::python, arg("q"), arg("cu_seqlens_q"),
        arg("max_seqlen_q"), arg("k_cache"), arg("v_cache"), arg("k_scale"), arg("v_scale"), arg("block_table"),
        arg("cache_seqlens"), arg("out"), arg("lse"), arg("format"), arg("softmax_scale"), arg("softcap"),
        arg("window"), arg("causal"), arg("k_residual") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<MoeLayerEagerPlan>(m, "MoeLayerEagerPlan")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::string, std::string, bool, double,
                          int64_t, double, std::string, int64_t>());
  // The eager entries (fastcall.h): gemm_w8a8 and quantize_per_block read their Int8Blocks tuples under the GIL and
  // then release it themselves.
  using tessera::python::fast_method;
  static PyMethodDef eager[] = {
      fast_method<&attention_decode_eager>("attention_decode_eager"),
      fast_method<&attention_prefill_eager>("attention_prefill_eager"),
      fast_method<&attention_prefill_varlen_eager>("attention_prefill_varlen_eager"),
      fast_method<&attention_prefill_with_cache_eager>("attention_prefill_with_cache_eager"),
      fast_method<&fused_gate_eager>("fused_gate_eager"),
      fast_method<&unpermute_reduce_eager>("unpermute_reduce_eager"),
      fast_method<&permute_eager>("permute_eager"),
      fast_method<&grouped_gemm_eager>("grouped_gemm_eager"),
      fast_method<&linear_eager>("linear_eager"),
      fast_method<&w8a8_quantize_eager, false>("w8a8_quantize_eager"),
      fast_method<&gemm_w8a8_eager, false>("gemm_w8a8_eager"),
      fast_method<&conv2d_eager>("conv2d_eager"),
      fast_method<&moe_layer_eager>("moe_layer_eager"),
      fast_method<&Entry<&append_kv>::python>("append_kv_eager"),  // the direct entry, positional
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), eager) != 0) throw pybind11::error_already_set();
}
