// tessera._C — the Python extension module: thin pybind11 bindings over the public C++ API.
//
// Tensors cross the boundary as DLPack capsules (PyCapsule named "dltensor" holding a DLManagedTensor*) or as any
// object with __dlpack__ (asked for its capsule with no stream argument: the producer's default-stream contract). The
// binding only reads the DLTensor: it never renames or consumes the capsule, so the producer's deleter runs when
// the capsule is collected, and the Python caller keeps the tensors alive for the duration of the call. Optional
// tensors are None. The stream is the cudaStream_t as an int (0 = legacy default stream).
//
// fp8: tessera's from_dlpack knows the DLPack fp8 type codes only when built against a DLPack header >= 1.1
// (Debian ships 0.6), and PyTorch's to_dlpack has long refused fp8 tensors ("float8 types are not supported by
// dlpack"). The Python layer therefore passes fp8 tensors as torch.uint8 views of the same bytes and strides, and
// the bindings re-label a uint8 view as fp8 e4m3 wherever the argument can only be fp8 e4m3: permute's x_perm when
// quant is not "none", x and w of grouped_gemm_fp8{,_masked}, the k/v cache data when the KV format is "fp8",
// and moe_layer's w13 / w2 when its format is an fp8 one. The Python layer checks the torch dtype
// (float8_e4m3fn) before making the view, so an e5m2 or a genuine uint8 tensor is refused there, not
// reinterpreted. A capsule that already says fp8 e4m3 (new header and producer) is accepted as is; any other
// dtype is left to the op's validation.
//
// A tessera::CudaError (CUDA runtime or device failure) becomes a Python RuntimeError, any other tessera::Error (an
// argument error) a ValueError, each with the same message. The GIL is released around each call
// into the library (argument conversion happens before, with the GIL held).

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/attention.h"
#include "tessera/conv.h"
#include "tessera/dlpack.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/linear.h"
#include "tessera/moe.h"
#include "tessera/moe_layer.h"
#include "tessera/tensor.h"
#include "tessera/version.h"
#include "tessera/w8a8.h"

#include "options.h"

namespace py = pybind11;

namespace {

using tessera::DType;
using tessera::TensorView;

constexpr const char* kLegacyCapsule = "dltensor";

using tessera::python::fail;
using tessera::python::gemm_options;
using tessera::python::int8_blocks_of;
using tessera::python::parse_group_score;
using tessera::python::parse_kv_format;
using tessera::python::parse_scale_mode;
using tessera::python::parse_scoring;
using tessera::python::prefill_params;

// The capsules view_of asked producers for during one call of an entry point, released when it returns (every entry
// point is bound with py::call_guard<CallCapsules>). A producer's capsule may be the only owner of the memory it
// describes (a producer that copies, as `__dlpack__(copy=None)` allows): dropped as soon as it was read, the call
// would use freed memory.
struct CallCapsules {
  static thread_local std::vector<py::object>* current;
  std::vector<py::object> held;
  std::vector<py::object>* outer;
  CallCapsules() : outer(current) { current = &held; }
  ~CallCapsules() { current = outer; }  // `held` goes after: the pybind dispatcher still holds the GIL here
  CallCapsules(const CallCapsules&) = delete;
  CallCapsules& operator=(const CallCapsules&) = delete;
};
thread_local std::vector<py::object>* CallCapsules::current = nullptr;

// The TensorView of a DLPack capsule. The capsule is only read.
TensorView view_of(const py::object& given, const char* op, const char* arg) {
  // A DLPack producer (CuPy, JAX, NumPy, torch ...) is asked for its capsule, which lives until the entry point
  // returns (CallCapsules); a capsule given as is, the caller keeps alive for the call.
  py::object obj = given;
  if (!PyCapsule_CheckExact(given.ptr()) && py::hasattr(given, "__dlpack__")) {
    obj = given.attr("__dlpack__")();
    if (CallCapsules::current == nullptr)  // an entry point bound without the guard: a bug here, not the caller's
      throw std::logic_error(std::string(op) + ": internal error: DLPack capsule asked for outside an entry point");
    CallCapsules::current->push_back(obj);
  }
  PyObject* p = obj.ptr();
  if (p == nullptr || !PyCapsule_CheckExact(p)) {
    std::string type = p == nullptr ? "NULL" : Py_TYPE(p)->tp_name;
    throw py::type_error(std::string(op) + ": '" + arg + "' must be a DLPack capsule, got " + type);
  }
  const char* name = PyCapsule_GetName(p);
  if (name == nullptr) {
    PyErr_Clear();
    fail(op, arg, "is a capsule without a name, not a DLPack capsule");
  }
  const std::string cap_name(name);
  if (cap_name == kLegacyCapsule) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(p, kLegacyCapsule));
    if (managed == nullptr) throw py::error_already_set();
    return tessera::from_dlpack(managed->dl_tensor, arg);
  }
#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
  if (cap_name == "dltensor_versioned") {
    auto* managed = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(p, "dltensor_versioned"));
    if (managed == nullptr) throw py::error_already_set();
    if (managed->version.major > DLPACK_MAJOR_VERSION)
      fail(op, arg, "is a DLPack " + std::to_string(managed->version.major) + ".x capsule; tessera knows " +
                        std::to_string(DLPACK_MAJOR_VERSION) + ".x");
    return tessera::from_dlpack(managed->dl_tensor, arg);
  }
#endif
  if (cap_name == "used_dltensor" || cap_name == "used_dltensor_versioned")
    fail(op, arg, "is a DLPack capsule that was already consumed");
  fail(op, arg, "must be a DLPack capsule named 'dltensor', got a capsule named '" + cap_name + "'");
}

std::optional<TensorView> optional_view_of(const py::object& obj, const char* op, const char* arg) {
  if (obj.is_none()) return std::nullopt;
  return view_of(obj, op, arg);
}

// An operand that can only be fp8 e4m3: a uint8 view is taken as e4m3 bits (see the note at the top).
TensorView fp8_view_of(const py::object& obj, const char* op, const char* arg) {
  TensorView v = view_of(obj, op, arg);
  if (v.dtype == DType::kUInt8) v.dtype = DType::kFP8E4M3;
  return v;
}

// Caller-owned device scratch memory (any dtype, contiguous), or none.
tessera::Workspace workspace_of(const py::object& obj, const char* op) {
  tessera::Workspace ws;
  if (obj.is_none()) return ws;
  const TensorView w = view_of(obj, op, "workspace");
  if (!w.is_contiguous()) fail(op, "workspace", "must be contiguous, got shape " + w.shape_str());
  if (w.device == TensorView::kHostDevice) fail(op, "workspace", "must be device memory, got a host tensor");
  ws.data = w.data;
  ws.bytes = w.nbytes_min();
  return ws;
}

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

tessera::moe::PermuteQuant parse_quant(const py::object& q, const char* op) {
  if (q.is_none()) return tessera::moe::PermuteQuant::kNone;
  if (!py::isinstance<py::str>(q))
    fail(op, "quant", std::string("must be None, 'none', 'fp8_blockwise' or 'fp8_per_tensor', got an object of type ") +
                          Py_TYPE(q.ptr())->tp_name);
  return tessera::python::parse_quant(q.cast<std::string>(), op);
}

tessera::moe::PermuteParams permute_params(int num_experts, int pad_multiple, const py::object& quant,
                                           const char* op) {
  tessera::moe::PermuteParams params;
  params.num_experts = num_experts;
  params.pad_multiple = pad_multiple;
  params.quant = parse_quant(quant, op);
  return params;
}

// ------------------------------------------------------------------------------------------------------------

void fused_gate(const py::object& logits, const py::object& bias, const py::object& weights,
                const py::object& ids, int topk, int num_groups, int topk_groups, const std::string& scoring,
                const std::string& group_score, bool renormalize, float routed_scaling_factor,
                int num_shared_experts, float shared_expert_weight, std::uintptr_t stream) {
  constexpr const char* op = "tessera.fused_gate";
  tessera::moe::GateParams params;
  params.topk = topk;
  params.num_groups = num_groups;
  params.topk_groups = topk_groups;
  params.scoring = parse_scoring(scoring, op);
  params.group_score = parse_group_score(group_score, op);
  params.renormalize = renormalize;
  params.routed_scaling_factor = routed_scaling_factor;
  params.num_shared_experts = num_shared_experts;
  params.shared_expert_weight = shared_expert_weight;

  const TensorView logits_v = view_of(logits, op, "logits");
  const std::optional<TensorView> bias_v = optional_view_of(bias, op, "bias");
  const TensorView weights_v = view_of(weights, op, "weights");
  const TensorView ids_v = view_of(ids, op, "ids");

  py::gil_scoped_release no_gil;
  tessera::moe::fused_gate(logits_v, bias_v, weights_v, ids_v, params, as_stream(stream));
}

void permute(const py::object& x, const py::object& ids, const py::object& input_scale, const py::object& x_perm,
             const py::object& scales, const py::object& expert_offsets, const py::object& expert_counts,
             const py::object& row_index, const py::object& row_token, const py::object& workspace,
             int num_experts, int pad_multiple, const py::object& quant, std::uintptr_t stream) {
  constexpr const char* op = "tessera.permute";
  const tessera::moe::PermuteParams params = permute_params(num_experts, pad_multiple, quant, op);

  const TensorView x_v = view_of(x, op, "x");
  const TensorView ids_v = view_of(ids, op, "ids");
  const std::optional<TensorView> input_scale_v = optional_view_of(input_scale, op, "input_scale");

  tessera::moe::PermuteOutputs out;
  out.x_perm = view_of(x_perm, op, "x_perm");
  // fp8 outputs arrive as uint8 views (see the note at the top of this file).
  if (params.quant != tessera::moe::PermuteQuant::kNone && out.x_perm.dtype == DType::kUInt8)
    out.x_perm.dtype = DType::kFP8E4M3;
  out.scales = optional_view_of(scales, op, "scales");
  out.expert_offsets = view_of(expert_offsets, op, "expert_offsets");
  out.expert_counts = view_of(expert_counts, op, "expert_counts");
  out.row_index = view_of(row_index, op, "row_index");
  out.row_token = optional_view_of(row_token, op, "row_token");

  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  tessera::moe::permute(x_v, ids_v, input_scale_v, out, ws, params, as_stream(stream));
}

void unpermute_reduce(const py::object& y_perm, const py::object& row_index, const py::object& weights,
                      const py::object& residual, const py::object& out, float routed_scale,
                      std::uintptr_t stream) {
  constexpr const char* op = "tessera.unpermute_reduce";
  const TensorView y_v = view_of(y_perm, op, "y_perm");
  const TensorView row_index_v = view_of(row_index, op, "row_index");
  const TensorView weights_v = view_of(weights, op, "weights");
  const std::optional<TensorView> residual_v = optional_view_of(residual, op, "residual");
  const TensorView out_v = view_of(out, op, "out");

  py::gil_scoped_release no_gil;
  tessera::moe::unpermute_reduce(y_v, row_index_v, weights_v, residual_v, out_v, routed_scale, as_stream(stream));
}

int64_t permute_capacity_rows(int64_t num_tokens, int topk, int num_experts, int pad_multiple,
                              const py::object& quant) {
  return tessera::moe::permute_capacity_rows(
      num_tokens, topk, permute_params(num_experts, pad_multiple, quant, "tessera.permute_capacity_rows"));
}

std::size_t permute_workspace_bytes(int64_t num_tokens, int topk, int num_experts, int pad_multiple,
                                    const py::object& quant) {
  return tessera::moe::permute_workspace_bytes(
      num_tokens, topk, permute_params(num_experts, pad_multiple, quant, "tessera.permute_workspace_bytes"));
}

// ---- grouped GEMM -------------------------------------------------------------------------------------------

// group_rows is offsets (contiguous layout) or masked_m (masked layout).
void grouped_gemm_fp8_impl(const char* op, bool masked, const char* group_rows_arg, const py::object& x,
                           const py::object& w, const py::object& group_rows, const py::object& x_scale,
                           const py::object& w_scale, const py::object& y, const py::object& workspace,
                           const std::string& scale_mode, int64_t expected_m, std::uintptr_t stream) {
  tessera::gemm::FP8Scales scales;
  scales.mode = parse_scale_mode(scale_mode, op);
  const TensorView x_v = fp8_view_of(x, op, "x");
  const TensorView w_v = fp8_view_of(w, op, "w");
  const TensorView rows_v = view_of(group_rows, op, group_rows_arg);
  scales.x_scale = view_of(x_scale, op, "x_scale");
  scales.w_scale = view_of(w_scale, op, "w_scale");
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);
  const tessera::gemm::GroupedGemmOptions options = gemm_options(expected_m);

  py::gil_scoped_release no_gil;
  if (masked)
    tessera::gemm::grouped_gemm_fp8_masked(x_v, w_v, rows_v, scales, y_v, ws, as_stream(stream), options);
  else
    tessera::gemm::grouped_gemm_fp8(x_v, w_v, rows_v, scales, y_v, ws, as_stream(stream), options);
}

void grouped_gemm_bf16_impl(const char* op, bool masked, const char* group_rows_arg, const py::object& x,
                            const py::object& w, const py::object& group_rows, const py::object& y,
                            const py::object& workspace, int64_t expected_m, std::uintptr_t stream) {
  const TensorView x_v = view_of(x, op, "x");
  const TensorView w_v = view_of(w, op, "w");
  const TensorView rows_v = view_of(group_rows, op, group_rows_arg);
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);
  const tessera::gemm::GroupedGemmOptions options = gemm_options(expected_m);

  py::gil_scoped_release no_gil;
  if (masked)
    tessera::gemm::grouped_gemm_bf16_masked(x_v, w_v, rows_v, y_v, ws, as_stream(stream), options);
  else
    tessera::gemm::grouped_gemm_bf16(x_v, w_v, rows_v, y_v, ws, as_stream(stream), options);
}

void grouped_gemm_fp8(const py::object& x, const py::object& w, const py::object& offsets,
                      const py::object& x_scale, const py::object& w_scale, const py::object& y,
                      const py::object& workspace, const std::string& scale_mode, int64_t expected_m,
                      std::uintptr_t stream) {
  grouped_gemm_fp8_impl("tessera.grouped_gemm_fp8", false, "offsets", x, w, offsets, x_scale, w_scale, y, workspace,
                        scale_mode, expected_m, stream);
}

void grouped_gemm_fp8_masked(const py::object& x, const py::object& w, const py::object& masked_m,
                             const py::object& x_scale, const py::object& w_scale, const py::object& y,
                             const py::object& workspace, const std::string& scale_mode, int64_t expected_m,
                             std::uintptr_t stream) {
  grouped_gemm_fp8_impl("tessera.grouped_gemm_fp8_masked", true, "masked_m", x, w, masked_m, x_scale, w_scale, y,
                        workspace, scale_mode, expected_m, stream);
}

void grouped_gemm_bf16(const py::object& x, const py::object& w, const py::object& offsets, const py::object& y,
                       const py::object& workspace, int64_t expected_m, std::uintptr_t stream) {
  grouped_gemm_bf16_impl("tessera.grouped_gemm_bf16", false, "offsets", x, w, offsets, y, workspace, expected_m,
                         stream);
}

void grouped_gemm_bf16_masked(const py::object& x, const py::object& w, const py::object& masked_m,
                              const py::object& y, const py::object& workspace, int64_t expected_m,
                              std::uintptr_t stream) {
  grouped_gemm_bf16_impl("tessera.grouped_gemm_bf16_masked", true, "masked_m", x, w, masked_m, y, workspace,
                         expected_m, stream);
}

// ---- attention decode -----------------------------------------------------------------------------------------
// The cache travels as its parts (k, v, k_scale, v_scale, block_table: capsules or None) plus the format name, and
// k_residual (the per-channel key formats' 16-bit key residual, capsule or None) last, a keyword defaulting to None so
// that calls written before it existed keep their meaning.

namespace ta = tessera::attention;

// The callers parse the format first, so a bad name is reported before any tensor is looked at.
ta::KVCache kv_cache_of(const char* op, ta::KVFormat format, const py::object& k, const py::object& v,
                        const py::object& k_scale, const py::object& v_scale, const py::object& block_table,
                        const py::object& k_residual) {
  ta::KVCache cache;
  cache.format = format;
  if (cache.format == ta::KVFormat::kFP8) {
    // fp8 data arrives as uint8 views (see the note at the top of this file).
    cache.k = fp8_view_of(k, op, "k_cache");
    cache.v = fp8_view_of(v, op, "v_cache");
  } else {
    cache.k = view_of(k, op, "k_cache");
    cache.v = view_of(v, op, "v_cache");
  }
  cache.k_scale = optional_view_of(k_scale, op, "k_scale");
  cache.v_scale = optional_view_of(v_scale, op, "v_scale");
  cache.block_table = optional_view_of(block_table, op, "block_table");
  cache.k_residual = optional_view_of(k_residual, op, "k_residual");
  return cache;
}

ta::DecodeParams decode_params(float softmax_scale, float softcap, int window, int num_splits, bool balance_splits) {
  ta::DecodeParams params;
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window = window;
  params.num_splits = num_splits;
  params.balance_splits = balance_splits;
  return params;
}

void attention_decode(const py::object& q, const py::object& k, const py::object& v, const py::object& k_scale,
                      const py::object& v_scale, const py::object& block_table, const py::object& cache_seqlens,
                      const py::object& out, const py::object& lse, const py::object& workspace,
                      const std::string& format, float softmax_scale, float softcap, int window, int num_splits,
                      std::uintptr_t stream, const py::object& k_residual, bool balance_splits) {
  constexpr const char* op = "tessera.attention_decode";
  const ta::KVFormat kv_format = parse_kv_format(format, op);
  const ta::DecodeParams params = decode_params(softmax_scale, softcap, window, num_splits, balance_splits);
  const TensorView q_v = view_of(q, op, "q");
  const ta::KVCache cache = kv_cache_of(op, kv_format, k, v, k_scale, v_scale, block_table, k_residual);
  const TensorView seqlens_v = view_of(cache_seqlens, op, "cache_seqlens");
  const TensorView out_v = view_of(out, op, "out");
  const std::optional<TensorView> lse_v = optional_view_of(lse, op, "lse");
  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  ta::decode(q_v, cache, seqlens_v, out_v, lse_v, ws, params, as_stream(stream));
}

std::size_t decode_workspace_bytes(const py::object& q, const py::object& k, const py::object& v,
                                   const py::object& k_scale, const py::object& v_scale,
                                   const py::object& block_table, const std::string& format, float softmax_scale,
                                   float softcap, int window, int num_splits, const py::object& k_residual,
                                   bool balance_splits) {
  constexpr const char* op = "tessera.decode_workspace_size";
  const ta::KVFormat kv_format = parse_kv_format(format, op);
  const ta::DecodeParams params = decode_params(softmax_scale, softcap, window, num_splits, balance_splits);
  const TensorView q_v = view_of(q, op, "q");
  const ta::KVCache cache = kv_cache_of(op, kv_format, k, v, k_scale, v_scale, block_table, k_residual);
  return ta::decode_workspace_bytes(q_v, cache, params);
}

void append_kv(const py::object& k_new, const py::object& v_new, const py::object& positions, const py::object& k,
               const py::object& v, const py::object& k_scale, const py::object& v_scale,
               const py::object& block_table, const std::string& format, std::uintptr_t stream,
               const py::object& k_residual) {
  constexpr const char* op = "tessera.append_kv";
  const ta::KVFormat kv_format = parse_kv_format(format, op);
  const TensorView k_new_v = view_of(k_new, op, "k_new");
  const TensorView v_new_v = view_of(v_new, op, "v_new");
  const TensorView positions_v = view_of(positions, op, "positions");
  const ta::KVCache cache = kv_cache_of(op, kv_format, k, v, k_scale, v_scale, block_table, k_residual);

  py::gil_scoped_release no_gil;
  ta::append_kv(k_new_v, v_new_v, positions_v, cache, as_stream(stream));
}

// ---- attention prefill ----------------------------------------------------------------------------------------
// Preallocated out (and lse, or None); no workspace. cu_seqlens_q / cu_seqlens_k are read on the device only.

void attention_prefill(const py::object& q, const py::object& k, const py::object& v, const py::object& out,
                       const py::object& lse, float softmax_scale, float softcap, int window, bool causal,
                       std::uintptr_t stream) {
  constexpr const char* op = "tessera.attention_prefill";
  const ta::PrefillParams params = prefill_params(softmax_scale, softcap, window, causal);
  const TensorView q_v = view_of(q, op, "q");
  const TensorView k_v = view_of(k, op, "k");
  const TensorView v_v = view_of(v, op, "v");
  const TensorView out_v = view_of(out, op, "out");
  const std::optional<TensorView> lse_v = optional_view_of(lse, op, "lse");

  py::gil_scoped_release no_gil;
  ta::prefill(q_v, k_v, v_v, out_v, lse_v, params, as_stream(stream));
}

void attention_prefill_varlen(const py::object& q, const py::object& k, const py::object& v,
                              const py::object& cu_seqlens_q, const py::object& cu_seqlens_k, int64_t max_seqlen_q,
                              const py::object& out, const py::object& lse, float softmax_scale, float softcap,
                              int window, bool causal, std::uintptr_t stream) {
  constexpr const char* op = "tessera.attention_prefill_varlen";
  const ta::PrefillParams params = prefill_params(softmax_scale, softcap, window, causal);
  const TensorView q_v = view_of(q, op, "q");
  const TensorView k_v = view_of(k, op, "k");
  const TensorView v_v = view_of(v, op, "v");
  const TensorView cu_q_v = view_of(cu_seqlens_q, op, "cu_seqlens_q");
  const TensorView cu_k_v = view_of(cu_seqlens_k, op, "cu_seqlens_k");
  const TensorView out_v = view_of(out, op, "out");
  const std::optional<TensorView> lse_v = optional_view_of(lse, op, "lse");

  py::gil_scoped_release no_gil;
  ta::prefill_varlen(q_v, k_v, v_v, cu_q_v, cu_k_v, max_seqlen_q, out_v, lse_v, params, as_stream(stream));
}

// Chunked prefill over the decode KV cache: the cache as attention_decode takes it (kv_cache_of, k_residual last and
// optional), the rest as attention_prefill_varlen's; the order of torch.ops.tessera.attention_prefill_with_cache's
// schema, with the stream before k_residual. cache_seqlens and the block table are read on the device only.
void attention_prefill_with_cache(const py::object& q, const py::object& cu_seqlens_q, int64_t max_seqlen_q,
                                  const py::object& k, const py::object& v, const py::object& k_scale,
                                  const py::object& v_scale, const py::object& block_table,
                                  const py::object& cache_seqlens, const py::object& out, const py::object& lse,
                                  const std::string& format, float softmax_scale, float softcap, int window,
                                  bool causal, std::uintptr_t stream, const py::object& k_residual) {
  constexpr const char* op = "tessera.attention_prefill_with_cache";
  const ta::KVFormat kv_format = parse_kv_format(format, op);
  const ta::PrefillParams params = prefill_params(softmax_scale, softcap, window, causal);
  const TensorView q_v = view_of(q, op, "q");
  const TensorView cu_q_v = view_of(cu_seqlens_q, op, "cu_seqlens_q");
  const ta::KVCache cache = kv_cache_of(op, kv_format, k, v, k_scale, v_scale, block_table, k_residual);
  const TensorView seqlens_v = view_of(cache_seqlens, op, "cache_seqlens");
  const TensorView out_v = view_of(out, op, "out");
  const std::optional<TensorView> lse_v = optional_view_of(lse, op, "lse");

  py::gil_scoped_release no_gil;
  ta::prefill_with_cache(q_v, cu_q_v, max_seqlen_q, cache, seqlens_v, out_v, lse_v, params, as_stream(stream));
}

// ---- weight-only quantized linear ---------------------------------------------------------------------------
// The host steps (quantize, the GPTQ / AWQ importers, prepack, unpack) take host tensors (DLPack capsules of CPU
// memory, contiguous, exact dtypes) and return a dict of the result's constants and arrays, each array a bytearray of
// its row-major elements (None for an empty one) that the Python layer views as a torch tensor (numpy.frombuffer
// reads it as well): the module stays free of torch and numpy. The GIL is released while the library works. The
// device op takes the prepacked arrays as device tensors with the weight's constants, as tessera::linear::linear.

namespace tl = tessera::linear;

const char* zero_mode_name(tl::ZeroMode mode) { return mode == tl::ZeroMode::kZeroPoint ? "zero_point" : "offset"; }

// The 16-bit type the kernels compute in ("bfloat16" | "float16"), or also "float32" for x's dtype.
DType parse_float_dtype(std::string_view s, const char* op, const char* arg, bool with_fp32) {
  static constexpr tessera::python::Choice<DType> k16[] = {{"bfloat16", DType::kBF16}, {"float16", DType::kFP16}};
  static constexpr tessera::python::Choice<DType> kAll[] = {
      {"bfloat16", DType::kBF16}, {"float16", DType::kFP16}, {"float32", DType::kFP32}};
  return with_fp32 ? tessera::python::parse_choice(s, op, arg, kAll) : tessera::python::parse_choice(s, op, arg, k16);
}

const char* float_dtype_name(DType dtype) { return dtype == DType::kFP16 ? "float16" : "bfloat16"; }

// A host array of the weight helpers: CPU memory, contiguous, one of `dtypes`, `rank` dims (shapes: shape_is).
TensorView host_view(const py::object& obj, const char* op, const char* arg, std::initializer_list<DType> dtypes,
                     int rank) {
  const TensorView v = view_of(obj, op, arg);
  if (v.device != TensorView::kHostDevice)
    fail(op, arg, "must be host (CPU) memory, got a tensor on CUDA device " + std::to_string(v.device));
  bool known = false;
  std::string names;
  for (DType d : dtypes) {
    known = known || v.dtype == d;
    names += (names.empty() ? "" : " or ") + std::string(tessera::dtype_name(d));
  }
  if (!known) fail(op, arg, "must be " + names + ", got " + tessera::dtype_name(v.dtype));
  if (v.rank != rank) fail(op, arg, "must have rank " + std::to_string(rank) + ", got shape " + v.shape_str());
  if (!v.is_contiguous()) fail(op, arg, "must be contiguous, got shape " + v.shape_str() + " with other strides");
  return v;
}

// v.shape == shape, else "'arg' must be [a, b] (what), got shape [...]".
void shape_is(const TensorView& v, const char* op, const char* arg, std::initializer_list<int64_t> shape,
              const char* what) {
  bool same = v.rank == static_cast<int>(shape.size());
  std::string want = "[";
  int d = 0;
  for (int64_t s : shape) {
    same = same && v.shape[d] == s;
    want += (d++ ? ", " : "") + std::to_string(s);
  }
  if (!same) fail(op, arg, "must be " + want + "] (" + what + "), got shape " + v.shape_str());
}

template <typename T>
std::vector<T> copy_of(const TensorView& v) {
  const T* p = static_cast<const T*>(v.data);
  return std::vector<T>(p, p + v.numel());
}

template <typename T>
py::object bytes_of(const std::vector<T>& v) {
  if (v.empty()) return py::none();
  return py::bytearray(reinterpret_cast<const char*>(v.data()), static_cast<py::ssize_t>(v.size() * sizeof(T)));
}

// The constants both host forms carry.
template <class W>
void put_constants(py::dict& d, const W& w) {
  d["n"] = w.n;
  d["k"] = w.k;
  d["bits"] = w.bits;
  d["block"] = w.block;
  d["zero_mode"] = zero_mode_name(w.zero_mode);
}

// The canonical form: n, k, bits, block, zero_mode; codes uint8 [N, K], scale / offset fp32 [N, K/block], zero
// uint8 [N, K/block] (zero_point mode, else None), k_perm int32 [K] (or None: the identity).
py::dict quantized_dict(const tl::QuantizedWeight& w) {
  py::dict d;
  put_constants(d, w);
  d["codes"] = bytes_of(w.codes);
  d["scale"] = bytes_of(w.scale);
  d["offset"] = bytes_of(w.offset);
  d["zero"] = bytes_of(w.zero);
  d["k_perm"] = bytes_of(w.k_perm);
  return d;
}

// The prepacked form: the constants, compute_dtype, padded_n, padded_k, num_blocks; codes uint8 [Np, Kp·bits/8],
// params compute_dtype [Np, num_blocks, 2], k_perm int32 [K] (or None).
py::dict packed_dict(const tl::PackedWeight& p) {
  py::dict d;
  put_constants(d, p);
  d["compute_dtype"] = float_dtype_name(p.compute_dtype);
  d["padded_n"] = p.padded_n();
  d["padded_k"] = p.padded_k();
  d["num_blocks"] = p.num_blocks();
  d["codes"] = bytes_of(p.codes);
  d["params"] = bytes_of(p.params);
  d["k_perm"] = bytes_of(p.k_perm);
  return d;
}

py::dict linear_quantize(const py::object& w, int bits, int64_t block, const std::string& zero_mode) {
  constexpr const char* op = "tessera.linear.quantize";
  const tl::ZeroMode mode = tessera::python::parse_zero_mode(zero_mode, op);
  const TensorView wv = host_view(w, op, "w", {DType::kFP32}, 2);
  tl::QuantizedWeight q;
  {
    py::gil_scoped_release no_gil;
    q = tl::quantize_weight(static_cast<const float*>(wv.data), wv.shape[0], wv.shape[1], bits, block, mode);
  }
  return quantized_dict(q);
}

// The checkpoint's arrays are checked against the K and N that qweight implies before the importer reads them
// (it takes raw pointers); the rules on the values are the importer's.
py::dict linear_import_gptq(const py::object& qweight, const py::object& qzeros, const py::object& scales,
                            const py::object& g_idx, int bits, int64_t group, bool zero_stored_minus_one) {
  constexpr const char* op = "tessera.linear.import_gptq";
  if (bits != 4 && bits != 8) fail(op, "bits", "must be 4 or 8, got " + std::to_string(bits));
  const int64_t per_word = 32 / bits;
  const TensorView qw = host_view(qweight, op, "qweight", {DType::kInt32}, 2);
  const int64_t k = qw.shape[0] * per_word, n = qw.shape[1];
  if (k <= 0 || n <= 0) fail(op, "qweight", "must be [K·bits/32, N] with K, N > 0, got shape " + qw.shape_str());
  if (group <= 0 || k % group != 0)
    fail(op, "group",
         "must divide K = " + std::to_string(k) + " (qweight rows × " + std::to_string(per_word) + "), got " +
             std::to_string(group));
  if (n % per_word != 0)
    fail(op, "qweight",
         "must have N (dim 1) a multiple of " + std::to_string(per_word) +
             " (qzeros packs N into 32-bit words), got shape " + qw.shape_str());
  const TensorView qz = host_view(qzeros, op, "qzeros", {DType::kInt32}, 2);
  shape_is(qz, op, "qzeros", {k / group, n / per_word}, "[K/group, N·bits/32]");
  const TensorView sv = host_view(scales, op, "scales", {DType::kFP16}, 2);
  shape_is(sv, op, "scales", {k / group, n}, "[K/group, N]");
  const int32_t* g = nullptr;
  if (!g_idx.is_none()) {
    const TensorView gv = host_view(g_idx, op, "g_idx", {DType::kInt32}, 1);
    shape_is(gv, op, "g_idx", {k}, "[K]");
    g = static_cast<const int32_t*>(gv.data);
  }
  tl::QuantizedWeight w;
  {
    py::gil_scoped_release no_gil;
    w = tl::import_gptq(static_cast<const int32_t*>(qw.data), static_cast<const int32_t*>(qz.data),
                        static_cast<const uint16_t*>(sv.data), g, k, n, bits, group, zero_stored_minus_one);
  }
  return quantized_dict(w);
}

py::dict linear_import_awq(const py::object& qweight, const py::object& qzeros, const py::object& scales,
                           int64_t group) {
  constexpr const char* op = "tessera.linear.import_awq";
  const TensorView qw = host_view(qweight, op, "qweight", {DType::kInt32}, 2);
  const int64_t k = qw.shape[0], n = qw.shape[1] * 8;
  if (k <= 0 || n <= 0) fail(op, "qweight", "must be [K, N/8] with K, N > 0, got shape " + qw.shape_str());
  if (group <= 0 || k % group != 0)
    fail(op, "group", "must divide K = " + std::to_string(k) + " (qweight rows), got " + std::to_string(group));
  const TensorView qz = host_view(qzeros, op, "qzeros", {DType::kInt32}, 2);
  shape_is(qz, op, "qzeros", {k / group, n / 8}, "[K/group, N/8]");
  const TensorView sv = host_view(scales, op, "scales", {DType::kFP16}, 2);
  shape_is(sv, op, "scales", {k / group, n}, "[K/group, N]");
  tl::QuantizedWeight w;
  {
    py::gil_scoped_release no_gil;
    w = tl::import_awq(static_cast<const int32_t*>(qw.data), static_cast<const int32_t*>(qz.data),
                       static_cast<const uint16_t*>(sv.data), k, n, group);
  }
  return quantized_dict(w);
}

// The canonical form's arrays (N and K from codes); offset may be None in zero_point mode, zero in offset mode.
// The per-block arrays must have N rows here (prepack sees their sizes only); block, sizes and values are prepack's
// to check.
py::dict linear_prepack(const py::object& codes, const py::object& scale, const py::object& offset,
                        const py::object& zero, const py::object& k_perm, int bits, int64_t block,
                        const std::string& zero_mode, const std::string& compute_dtype) {
  constexpr const char* op = "tessera.linear.prepack";
  tl::QuantizedWeight w;
  w.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  const DType dtype = parse_float_dtype(compute_dtype, op, "compute_dtype", false);
  const TensorView cv = host_view(codes, op, "codes", {DType::kUInt8}, 2);
  w.n = cv.shape[0];
  w.k = cv.shape[1];
  w.bits = bits;
  w.block = block;
  const auto per_block = [&](const py::object& obj, const char* arg, DType dt) {
    const TensorView v = host_view(obj, op, arg, {dt}, 2);
    if (v.shape[0] != w.n)
      fail(op, arg,
           "must be [N, K/block] with N = " + std::to_string(w.n) + " rows (codes' dim 0), got shape " + v.shape_str());
    return v;
  };
  w.codes = copy_of<uint8_t>(cv);
  w.scale = copy_of<float>(per_block(scale, "scale", DType::kFP32));
  if (!offset.is_none())
    w.offset = copy_of<float>(per_block(offset, "offset", DType::kFP32));
  else if (w.zero_mode == tl::ZeroMode::kOffset)
    fail(op, "offset", "is required with zero_mode='offset', got None");
  if (!zero.is_none())
    w.zero = copy_of<uint8_t>(per_block(zero, "zero", DType::kUInt8));
  else if (w.zero_mode == tl::ZeroMode::kZeroPoint)
    fail(op, "zero", "is required with zero_mode='zero_point', got None");
  if (!k_perm.is_none()) {
    const TensorView pv = host_view(k_perm, op, "k_perm", {DType::kInt32}, 1);
    shape_is(pv, op, "k_perm", {w.k}, "[K]");
    w.k_perm = copy_of<int32_t>(pv);
  }
  tl::PackedWeight p;
  {
    py::gil_scoped_release no_gil;
    p = tl::prepack(w, dtype);
  }
  return packed_dict(p);
}

// The prepacked arrays back to the canonical form; params' dtype is the compute dtype. Shapes are checked here where
// the constants are valid (else unpack names them), the array sizes again by unpack.
py::dict linear_unpack(const py::object& codes, const py::object& params, const py::object& k_perm, int64_t n,
                       int64_t k, int bits, int64_t block, const std::string& zero_mode) {
  constexpr const char* op = "tessera.linear.unpack";
  tl::PackedWeight p;
  p.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  p.n = n;
  p.k = k;
  p.bits = bits;
  p.block = block;
  const TensorView cv = host_view(codes, op, "codes", {DType::kUInt8}, 2);
  const TensorView pv = host_view(params, op, "params", {DType::kBF16, DType::kFP16}, 3);
  p.compute_dtype = pv.dtype;
  if ((bits == 4 || bits == 8) && n > 0 && k > 0 && block > 0 && k % block == 0) {
    shape_is(cv, op, "codes", {p.padded_n(), p.padded_k() * bits / 8}, "[Np, Kp·bits/8]");
    shape_is(pv, op, "params", {p.padded_n(), p.num_blocks(), 2}, "[Np, num_blocks, 2]");
  }
  p.codes = copy_of<uint8_t>(cv);
  p.params = copy_of<uint16_t>(pv);
  if (!k_perm.is_none()) {
    const TensorView kv = host_view(k_perm, op, "k_perm", {DType::kInt32}, 1);
    shape_is(kv, op, "k_perm", {k}, "[K]");
    p.k_perm = copy_of<int32_t>(kv);
  }
  tl::QuantizedWeight w;
  {
    py::gil_scoped_release no_gil;
    w = tl::unpack(p);
  }
  return quantized_dict(w);
}

tl::LinearWeight linear_weight_of(const char* op, const py::object& codes, const py::object& params,
                                  const py::object& k_perm, int64_t n, int64_t k, int bits, int64_t block,
                                  const std::string& zero_mode) {
  tl::LinearWeight w;
  w.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  w.codes = view_of(codes, op, "codes");
  w.params = view_of(params, op, "params");
  if (!k_perm.is_none()) w.k_perm = view_of(k_perm, op, "k_perm");
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.block = block;
  return w;
}

// The linear / conv epilogue: bias (None: none) and clamp bounds.
tl::LinearEpilogue epilogue_of(const py::object& bias, float clamp_min, float clamp_max, const char* op) {
  tl::LinearEpilogue e;
  if (!bias.is_none()) e.bias = view_of(bias, op, "bias");
  e.clamp_min = clamp_min;
  e.clamp_max = clamp_max;
  return e;
}

void linear(const py::object& x, const py::object& codes, const py::object& params, const py::object& k_perm,
            const py::object& bias, const py::object& y, const py::object& workspace, int64_t n, int64_t k, int bits,
            int64_t block, const std::string& zero_mode, float clamp_min, float clamp_max, std::uintptr_t stream) {
  constexpr const char* op = "tessera.linear";
  const tl::LinearWeight w = linear_weight_of(op, codes, params, k_perm, n, k, bits, block, zero_mode);
  const TensorView x_v = view_of(x, op, "x");
  const tl::LinearEpilogue epilogue = epilogue_of(bias, clamp_min, clamp_max, op);
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  tl::linear(x_v, w, y_v, epilogue, ws, as_stream(stream));
}

std::size_t linear_workspace_bytes(int64_t max_m, const py::object& codes, const py::object& params,
                                   const py::object& k_perm, int64_t n, int64_t k, int bits, int64_t block,
                                   const std::string& zero_mode, const std::string& x_dtype) {
  constexpr const char* op = "tessera.linear_workspace_bytes";
  const DType dtype = parse_float_dtype(x_dtype, op, "x_dtype", true);
  const tl::LinearWeight w = linear_weight_of(op, codes, params, k_perm, n, k, bits, block, zero_mode);
  return tl::linear_workspace_bytes(max_m, w, dtype);
}

// ---- conv2d (int4 / int8 weights) -------------------------------------------------------------------------------
// The weight is a prepacked linear weight (codes, params and its constants, as linear_weight_of reads them; a conv
// weight has no k_perm) plus the kernel's kh, kw; the geometry travels as ints (tessera::conv::Conv2dParams' fields)
// and the layouts by name ('NHWC' | 'NCHW'). The path comes back by name (conv_path_name).

namespace tc = tessera::conv;

using tessera::python::conv2d_params;

// The queries read the weight's tensors too (their shapes and the compute dtype), on the host or the device.
tc::ConvWeight conv_weight_of(const char* op, const py::object& codes, const py::object& params, int64_t n, int64_t k,
                              int bits, int64_t block, const std::string& zero_mode, int64_t kh, int64_t kw) {
  tc::ConvWeight w;
  w.w.zero_mode = tessera::python::parse_zero_mode(zero_mode, op);
  w.w.codes = view_of(codes, op, "codes");
  w.w.params = view_of(params, op, "params");
  w.w.n = n;
  w.w.k = k;
  w.w.bits = bits;
  w.w.block = block;
  w.kh = kh;
  w.kw = kw;
  return w;
}

// The output size, with a stride below 1 (a division by zero or a sign flip in the rule) refused here.
int64_t conv2d_output_size(int64_t in_size, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  if (stride < 1) fail("tessera.conv2d_output_size", "stride", "must be >= 1, got " + std::to_string(stride));
  return tc::conv2d_output_size(in_size, k, stride, pad, dil);
}

const char* conv_path_name(int path) {
  if (path < 0 || path > static_cast<int>(tc::ConvPath::kDirect))
    fail("tessera.conv_path_name", "path",
         "must be 0 (linear), 1 (implicit_gemm) or 2 (direct), got " + std::to_string(path));
  return tc::conv_path_name(static_cast<tc::ConvPath>(path));
}

std::string conv2d_path(int64_t batch, int64_t height, int64_t width, const py::object& codes, const py::object& params,
                        int64_t n, int64_t k, int bits, int64_t block, const std::string& zero_mode, int64_t kh,
                        int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h,
                        int64_t dil_w, int64_t groups, const std::string& x_layout, const std::string& y_layout,
                        const std::string& x_dtype) {
  constexpr const char* op = "tessera.conv2d_path";
  const DType dtype = parse_float_dtype(x_dtype, op, "x_dtype", true);
  const tc::Conv2dParams p =
      conv2d_params(op, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, x_layout, y_layout);
  const tc::ConvWeight w = conv_weight_of(op, codes, params, n, k, bits, block, zero_mode, kh, kw);
  return tc::conv_path_name(tc::conv2d_path(batch, height, width, w, p, dtype));
}

std::size_t conv2d_workspace_bytes(int64_t batch, int64_t height, int64_t width, const py::object& codes,
                                   const py::object& params, int64_t n, int64_t k, int bits, int64_t block,
                                   const std::string& zero_mode, int64_t kh, int64_t kw, int64_t stride_h,
                                   int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h, int64_t dil_w,
                                   int64_t groups, const std::string& x_layout, const std::string& y_layout,
                                   const std::string& x_dtype) {
  constexpr const char* op = "tessera.conv2d_workspace_bytes";
  const DType dtype = parse_float_dtype(x_dtype, op, "x_dtype", true);
  const tc::Conv2dParams p =
      conv2d_params(op, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, x_layout, y_layout);
  const tc::ConvWeight w = conv_weight_of(op, codes, params, n, k, bits, block, zero_mode, kh, kw);
  return tc::conv2d_workspace_bytes(batch, height, width, w, p, dtype);
}

void conv2d(const py::object& x, const py::object& codes, const py::object& params, const py::object& bias,
            const py::object& y, const py::object& workspace, int64_t n, int64_t k, int bits, int64_t block,
            const std::string& zero_mode, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_h,
            int64_t pad_w, int64_t dil_h, int64_t dil_w, int64_t groups, const std::string& x_layout,
            const std::string& y_layout, float clamp_min, float clamp_max, std::uintptr_t stream) {
  constexpr const char* op = "tessera.conv2d";
  const tc::Conv2dParams p =
      conv2d_params(op, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, x_layout, y_layout);
  const tc::ConvWeight w = conv_weight_of(op, codes, params, n, k, bits, block, zero_mode, kh, kw);
  const TensorView x_v = view_of(x, op, "x");
  const tl::LinearEpilogue epilogue = epilogue_of(bias, clamp_min, clamp_max, op);
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  tc::conv2d(x_v, w, y_v, p, epilogue, ws, as_stream(stream));
}

// ---- W8A8 ------------------------------------------------------------------------------------------------------
// The quantized operands travel as their four tensors (codes, scale, zero or None, sums or None) and the block, the
// planes as the torch layer allocates them (int8_blocks_of in options.h narrows them). prepack_w8a8 takes a host
// weight and returns a dict of bytearrays, as linear_prepack does.

void w8a8_quantize(const py::object& x, const py::object& codes, const py::object& scale, const py::object& zero,
                   const py::object& sums, int64_t block, std::uintptr_t stream) {
  constexpr const char* op = "tessera.w8a8_quantize";
  const TensorView x_v = view_of(x, op, "x");
  const tl::Int8BlockTensor out = int8_blocks_of(op, "", codes, scale, zero, sums, block, view_of, optional_view_of);

  py::gil_scoped_release no_gil;
  tl::quantize_per_block(x_v, out, as_stream(stream));
}

void gemm_w8a8(const py::object& a_codes, const py::object& a_scale, const py::object& a_zero,
               const py::object& a_sums, const py::object& w_codes, const py::object& w_scale,
               const py::object& w_zero, const py::object& w_sums, const py::object& bias, const py::object& y,
               const py::object& workspace, int64_t block, float clamp_min, float clamp_max, float out_scale,
               std::uintptr_t stream) {
  constexpr const char* op = "tessera.gemm_w8a8";
  const tl::Int8BlockTensor a =
      int8_blocks_of(op, "a_", a_codes, a_scale, a_zero, a_sums, block, view_of, optional_view_of);
  const tl::Int8BlockTensor w =
      int8_blocks_of(op, "w_", w_codes, w_scale, w_zero, w_sums, block, view_of, optional_view_of);
  tl::W8A8Epilogue epilogue;
  if (!bias.is_none()) epilogue.bias = view_of(bias, op, "bias");
  epilogue.clamp_min = clamp_min;
  epilogue.clamp_max = clamp_max;
  epilogue.out_scale = out_scale;
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  tl::gemm_w8a8(a, w, y_v, epilogue, ws, as_stream(stream));
}

// n, k, block, ld, symmetric; codes int8 [N, K], scale / zero / sums fp32 [K / block, ld] (zero None when
// symmetric), rows N..ld-1 of every plane 0.
py::dict prepack_w8a8(const py::object& w, int64_t block, bool symmetric) {
  constexpr const char* op = "tessera.prepack_w8a8";
  const TensorView wv = host_view(w, op, "w", {DType::kFP32}, 2);
  tl::W8A8HostWeight q;
  {
    py::gil_scoped_release no_gil;
    q = tl::prepack_w8a8(static_cast<const float*>(wv.data), wv.shape[0], wv.shape[1], block, symmetric);
  }
  py::dict d;
  d["n"] = q.n;
  d["k"] = q.k;
  d["block"] = q.block;
  d["ld"] = q.ld;
  d["symmetric"] = q.symmetric;
  d["codes"] = bytes_of(q.codes);
  d["scale"] = bytes_of(q.scale);
  d["zero"] = bytes_of(q.zero);
  d["sums"] = bytes_of(q.sums);
  return d;
}

// ---- MoE layer -------------------------------------------------------------------------------------------------
// The config travels as its constants (tessera.moe_layer.MoeLayerConfig's fields in order, the enums by name) plus
// max_tokens; each call rebuilds the plan with moe_layer_plan (which validates the constants before any tensor is
// read). The weights travel as their six tensors (scales None where the format has none); fp8 weights may be uint8
// views (read as e4m3). Nothing is allocated: the workspace must hold moe_layer_plan's bytes.

namespace tm = tessera::moe;

tm::MoeLayerPlan moe_layer_plan_of(const char* op, int64_t hidden, int64_t intermediate, int64_t num_experts,
                                   int64_t topk, int64_t num_groups, int64_t topk_groups, const std::string& scoring,
                                   const std::string& group_score, bool renormalize, float routed_scaling_factor,
                                   int64_t num_shared_experts, float shared_expert_weight, const std::string& format,
                                   int64_t max_tokens) {
  const tm::MoeLayerConfig config = tessera::python::moe_layer_config(
      op, hidden, intermediate, num_experts, topk, num_groups, topk_groups, scoring, group_score, renormalize,
      routed_scaling_factor, num_shared_experts, shared_expert_weight, format);
  return tm::moe_layer_plan(config, max_tokens);
}

std::size_t moe_layer_plan(int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t topk, int64_t num_groups,
                           int64_t topk_groups, const std::string& scoring, const std::string& group_score,
                           bool renormalize, float routed_scaling_factor, int64_t num_shared_experts,
                           float shared_expert_weight, const std::string& format, int64_t max_tokens) {
  return moe_layer_plan_of("tessera.moe_layer.plan", hidden, intermediate, num_experts, topk, num_groups, topk_groups,
                           scoring, group_score, renormalize, routed_scaling_factor, num_shared_experts,
                           shared_expert_weight, format, max_tokens)
      .workspace_bytes;
}

void moe_layer(const py::object& x, const py::object& router_logits, const py::object& correction_bias,
               const py::object& residual, const py::object& num_tokens, const py::object& w13, const py::object& w2,
               const py::object& w13_scale, const py::object& w2_scale, const py::object& a13_scale,
               const py::object& a2_scale, const py::object& y, const py::object& workspace, int64_t hidden,
               int64_t intermediate, int64_t num_experts, int64_t topk, int64_t num_groups, int64_t topk_groups,
               const std::string& scoring, const std::string& group_score, bool renormalize,
               float routed_scaling_factor, int64_t num_shared_experts, float shared_expert_weight,
               const std::string& format, int64_t max_tokens, std::uintptr_t stream) {
  constexpr const char* op = "tessera.moe_layer";
  const tm::MoeLayerPlan plan = moe_layer_plan_of(op, hidden, intermediate, num_experts, topk, num_groups, topk_groups,
                                                  scoring, group_score, renormalize, routed_scaling_factor,
                                                  num_shared_experts, shared_expert_weight, format, max_tokens);
  tm::MoeLayerInputs in;
  tm::MoeLayerWeights w;
  // fp8 weights arrive as uint8 views (see the note at the top of this file).
  tessera::python::moe_layer_views(op, plan.config.format, x, router_logits, correction_bias, residual, num_tokens,
                                   w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, view_of, optional_view_of,
                                   fp8_view_of, in, w);
  const TensorView y_v = view_of(y, op, "y");
  const tessera::Workspace ws = workspace_of(workspace, op);

  py::gil_scoped_release no_gil;
  tm::moe_layer(plan, in, w, y_v, ws, as_stream(stream));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "tessera._C: low-level bindings. Tensors are DLPack capsules ('dltensor'), optional ones None; stream is a "
      "cudaStream_t as an int. Use the tessera package (tessera.moe, tessera.gemm, tessera.attention, "
      "tessera.linear, tessera.conv, tessera.w8a8, tessera.moe_layer) rather than this module.";

  py::register_exception_translator(&tessera::python::translate_errors);

  m.attr("version") = TESSERA_VERSION_STRING;
  m.attr("__version__") = TESSERA_VERSION_STRING;
  // The DLPack header tessera was built against, as "major.minor" (1.x headers define MAJOR/MINOR; 0.x VERSION).
#if defined(DLPACK_MAJOR_VERSION) && defined(DLPACK_MINOR_VERSION)
  m.attr("dlpack_header_version") = std::to_string(DLPACK_MAJOR_VERSION) + "." + std::to_string(DLPACK_MINOR_VERSION);
#elif defined(DLPACK_VERSION)
  m.attr("dlpack_header_version") = std::to_string(DLPACK_VERSION / 100) + "." + std::to_string(DLPACK_VERSION % 100 / 10);
#else
  m.attr("dlpack_header_version") = "unknown";
#endif
  m.attr("gate_max_experts") = tessera::moe::kGateMaxExperts;
  m.attr("gate_max_topk") = tessera::moe::kGateMaxTopk;
  m.attr("fp8_block_cols") = tessera::moe::kFP8BlockCols;
  m.attr("conv_max_param") = tessera::conv::kConvMaxParam;

  m.def("fused_gate", &fused_gate, py::arg("logits"), py::arg("bias"), py::arg("weights"), py::arg("ids"),
        py::arg("topk"), py::arg("num_groups"), py::arg("topk_groups"), py::arg("scoring"),
        py::arg("group_score"), py::arg("renormalize"), py::arg("routed_scaling_factor"),
        py::arg("num_shared_experts"), py::arg("shared_expert_weight"), py::arg("stream"),
        "Biased grouped top-k gate into preallocated weights (fp32) and ids (int32). "
        "scoring: 'sigmoid' | 'softmax'; group_score: 'top2_sum' | 'max'.", py::call_guard<CallCapsules>());

  m.def("permute", &permute, py::arg("x"), py::arg("ids"), py::arg("input_scale"), py::arg("x_perm"),
        py::arg("scales"), py::arg("expert_offsets"), py::arg("expert_counts"), py::arg("row_index"),
        py::arg("row_token"), py::arg("workspace"), py::arg("num_experts"), py::arg("pad_multiple"),
        py::arg("quant"), py::arg("stream"),
        "Permute token rows by expert into preallocated outputs. quant: None | 'none' | 'fp8_blockwise' | "
        "'fp8_per_tensor'; with quant, x_perm may be a uint8 view (it is treated as fp8 e4m3).",
        py::call_guard<CallCapsules>());

  m.def("unpermute_reduce", &unpermute_reduce, py::arg("y_perm"), py::arg("row_index"), py::arg("weights"),
        py::arg("residual"), py::arg("out"), py::arg("routed_scale"), py::arg("stream"),
        "out[t] = routed_scale * sum_j weights[t,j] * y_perm[row_index[t,j]] (+ residual[t]).",
        py::call_guard<CallCapsules>());

  m.attr("grouped_gemm_block") = tessera::gemm::kGroupedGemmBlock;
  m.attr("grouped_gemm_max_groups") = tessera::gemm::kGroupedGemmMaxGroups;

  m.def("grouped_gemm_fp8", &grouped_gemm_fp8, py::arg("x"), py::arg("w"), py::arg("offsets"), py::arg("x_scale"),
        py::arg("w_scale"), py::arg("y"), py::arg("workspace"), py::arg("scale_mode"), py::arg("expected_m"),
        py::arg("stream"),
        "y[offsets[g]:offsets[g+1]] = scaled x[offsets[g]:offsets[g+1]] @ w[g]^T (fp8 e4m3 -> bf16). x and w may be "
        "uint8 views (treated as fp8 e4m3). scale_mode: 'per_tensor' | 'blockwise'; workspace may be None.",
        py::call_guard<CallCapsules>());

  m.def("grouped_gemm_fp8_masked", &grouped_gemm_fp8_masked, py::arg("x"), py::arg("w"), py::arg("masked_m"),
        py::arg("x_scale"), py::arg("w_scale"), py::arg("y"), py::arg("workspace"), py::arg("scale_mode"),
        py::arg("expected_m"), py::arg("stream"),
        "y[g, :masked_m[g]] = scaled x[g, :masked_m[g]] @ w[g]^T (fp8 e4m3 -> bf16); x and w may be uint8 views.",
        py::call_guard<CallCapsules>());

  m.def("grouped_gemm_bf16", &grouped_gemm_bf16, py::arg("x"), py::arg("w"), py::arg("offsets"), py::arg("y"),
        py::arg("workspace"), py::arg("expected_m"), py::arg("stream"),
        "y[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ w[g]^T (bf16, fp32 accumulation).",
        py::call_guard<CallCapsules>());

  m.def("grouped_gemm_bf16_masked", &grouped_gemm_bf16_masked, py::arg("x"), py::arg("w"), py::arg("masked_m"),
        py::arg("y"), py::arg("workspace"), py::arg("expected_m"), py::arg("stream"),
        "y[g, :masked_m[g]] = x[g, :masked_m[g]] @ w[g]^T (bf16, fp32 accumulation).", py::call_guard<CallCapsules>());

  m.def("grouped_gemm_workspace_bytes", &tessera::gemm::grouped_gemm_workspace_bytes, py::arg("num_groups"),
        py::arg("n"), py::arg("k"), "Bytes of device workspace the grouped GEMM needs (0 today).",
        py::call_guard<CallCapsules>());

  m.def("permute_capacity_rows", &permute_capacity_rows, py::arg("num_tokens"), py::arg("topk"),
        py::arg("num_experts"), py::arg("pad_multiple") = 1, py::arg("quant") = py::none(),
        "Rows x_perm, scales and row_token must have.", py::call_guard<CallCapsules>());

  m.def("permute_workspace_bytes", &permute_workspace_bytes, py::arg("num_tokens"), py::arg("topk"),
        py::arg("num_experts"), py::arg("pad_multiple") = 1, py::arg("quant") = py::none(),
        "Bytes of device workspace permute needs.", py::call_guard<CallCapsules>());

  m.attr("decode_max_splits") = ta::kDecodeMaxSplits;
  m.attr("int4_group_size") = ta::kInt4GroupSize;
  m.attr("key_block") = ta::kKeyBlock;
  m.attr("key_residual_rows") = ta::kKeyResidualRows;

  m.def("attention_decode", &attention_decode, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("block_table"), py::arg("cache_seqlens"), py::arg("out"),
        py::arg("lse"), py::arg("workspace"), py::arg("format"), py::arg("softmax_scale"), py::arg("softcap"),
        py::arg("window"), py::arg("num_splits"), py::arg("stream"), py::arg("k_residual") = py::none(),
        py::arg("balance_splits") = false,
        "One-token attention decode over a KV cache into preallocated out (and lse, or None). format: 'native' | "
        "'fp8' | 'int8' | 'int4' | 'int4_group32' | 'int8_kchannel' | 'int4_kchannel'; with 'fp8' the cache may "
        "be uint8 views (read as e4m3). softmax_scale 0 = 1/sqrt(D); workspace may be None when "
        "decode_workspace_bytes is 0. k_residual (per-channel key formats) is accepted and not read. "
        "balance_splits: the splits planned by the device lengths (DecodeParams::balance_splits).",
        py::call_guard<CallCapsules>());

  m.def("decode_workspace_bytes", &decode_workspace_bytes, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("block_table"), py::arg("format"),
        py::arg("softmax_scale"), py::arg("softcap"), py::arg("window"), py::arg("num_splits"),
        py::arg("k_residual") = py::none(), py::arg("balance_splits") = false,
        "Bytes of device workspace attention_decode needs for these shapes and params (on the current device).",
        py::call_guard<CallCapsules>());

  m.def("append_kv", &append_kv, py::arg("k_new"), py::arg("v_new"), py::arg("positions"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_table"), py::arg("format"),
        py::arg("stream"), py::arg("k_residual") = py::none(),
        "Quantizes k_new/v_new [B, S, HKV, D] into the cache at positions[b] + i (skipping out-of-range slots). "
        "k_residual: [B, 64, HKV, D] in k_new's dtype, required for 'int8_kchannel' / 'int4_kchannel' (read and "
        "written: the 16-bit keys of the last two blocks written), None otherwise.", py::call_guard<CallCapsules>());

  m.def("attention_prefill", &attention_prefill, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("softmax_scale"), py::arg("softcap"), py::arg("window"), py::arg("causal"),
        py::arg("stream"),
        "Prefill attention over a plain batch into preallocated out [B, Sq, HQ, D] (and lse fp32 [B, Sq, HQ], or "
        "None): q [B, Sq, HQ, D], k and v [B, Sk, HKV, D], bf16 | fp16. causal is bottom-right aligned; window "
        "counts the query's own position (0: off); softmax_scale 0 = 1/sqrt(D); softcap 0: off. No workspace.",
        py::call_guard<CallCapsules>());

  m.def("attention_prefill_varlen", &attention_prefill_varlen, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("out"), py::arg("lse"),
        py::arg("softmax_scale"), py::arg("softcap"), py::arg("window"), py::arg("causal"), py::arg("stream"),
        "Prefill attention over a packed variable-length batch into preallocated out [total_q, HQ, D] (and lse "
        "fp32 [total_q, HQ], or None): q [total_q, HQ, D], k and v [total_k, HKV, D], cu_seqlens_q / cu_seqlens_k "
        "int32 [B + 1] on the device (read there only, not validated); max_seqlen_q bounds every sequence's "
        "queries. Parameters as attention_prefill.", py::call_guard<CallCapsules>());

  m.def("attention_prefill_with_cache", &attention_prefill_with_cache, py::arg("q"), py::arg("cu_seqlens_q"),
        py::arg("max_seqlen_q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("block_table"), py::arg("cache_seqlens"), py::arg("out"), py::arg("lse"), py::arg("format"),
        py::arg("softmax_scale"), py::arg("softcap"), py::arg("window"), py::arg("causal"), py::arg("stream"),
        py::arg("k_residual") = py::none(),
        "Chunked prefill over the decode KV cache into preallocated out [total_q, HQ, D] (and lse fp32 "
        "[total_q, HQ], or None): q, cu_seqlens_q and max_seqlen_q as attention_prefill_varlen's; the cache "
        "(k_cache, v_cache, k_scale, v_scale, block_table, format, k_residual) as attention_decode's; cache_seqlens "
        "int32 [B] on the device, each sequence's length including its new tokens (read there only). Sequence b's "
        "queries are its last positions. Parameters as attention_prefill.", py::call_guard<CallCapsules>());

  m.def("linear_quantize", &linear_quantize, py::arg("w"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"),
        "Round-to-nearest quantization of a host fp32 weight [N, K] (contiguous) into the canonical form, per block "
        "of `block` columns (32, 64, 128 or K). zero_mode: 'offset' (w = q*scale + offset) | 'zero_point' "
        "(w = (q - zero)*scale). Returns a dict: n, k, bits, block, zero_mode, and bytearrays of the row-major "
        "arrays codes (uint8 [N, K]), scale and offset (fp32 [N, K/block]), zero (uint8 [N, K/block] or None), "
        "k_perm (int32 [K] or None).", py::call_guard<CallCapsules>());

  m.def("linear_import_gptq", &linear_import_gptq, py::arg("qweight"), py::arg("qzeros"), py::arg("scales"),
        py::arg("g_idx"), py::arg("bits"), py::arg("group"), py::arg("zero_stored_minus_one"),
        "A GPTQ (AutoGPTQ layout) checkpoint's host tensors into the canonical form (a dict as linear_quantize's): "
        "qweight int32 [K*bits/32, N], qzeros int32 [K/group, N*bits/32], scales fp16 [K/group, N], g_idx int32 "
        "[K] or None; an act-order g_idx becomes k_perm.", py::call_guard<CallCapsules>());

  m.def("linear_import_awq", &linear_import_awq, py::arg("qweight"), py::arg("qzeros"), py::arg("scales"),
        py::arg("group"),
        "An AWQ (AutoAWQ GEMM layout, 4-bit) checkpoint's host tensors into the canonical form (a dict as "
        "linear_quantize's): qweight int32 [K, N/8], qzeros int32 [K/group, N/8], scales fp16 [K/group, N].",
        py::call_guard<CallCapsules>());

  m.def("linear_prepack", &linear_prepack, py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("zero"),
        py::arg("k_perm"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"), py::arg("compute_dtype"),
        "The canonical form's host arrays (codes uint8 [N, K], scale fp32 [N, K/block], offset fp32 or None in "
        "'zero_point' mode, zero uint8 or None in 'offset' mode, k_perm int32 [K] or None) into the kernels' "
        "layout. compute_dtype: 'bfloat16' | 'float16'. Returns a dict: n, k, bits, block, zero_mode, "
        "compute_dtype, padded_n, padded_k, num_blocks, and bytearrays codes (uint8 [Np, Kp*bits/8]), params "
        "(compute_dtype [Np, num_blocks, 2]), k_perm (int32 [K] or None).", py::call_guard<CallCapsules>());

  m.def("linear_unpack", &linear_unpack, py::arg("codes"), py::arg("params"), py::arg("k_perm"), py::arg("n"),
        py::arg("k"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"),
        "The inverse of linear_prepack on host arrays (params bf16 | fp16): the canonical form as a dict, its "
        "parameters those rounded to the compute dtype.", py::call_guard<CallCapsules>());

  m.def("linear", &linear, py::arg("x"), py::arg("codes"), py::arg("params"), py::arg("k_perm"), py::arg("bias"),
        py::arg("y"), py::arg("workspace"), py::arg("n"), py::arg("k"), py::arg("bits"), py::arg("block"),
        py::arg("zero_mode"), py::arg("clamp_min"), py::arg("clamp_max"), py::arg("stream"),
        "y = clamp(x @ dequant(W)^T + bias, clamp_min, clamp_max) into preallocated y [M, N] (x's dtype; fp32 x: "
        "fp32 y): x [M, K] bf16 | fp16 | fp32, the prepacked weight as device tensors codes, params, k_perm (or "
        "None) with its constants, bias [N] of y's dtype or None. workspace may be None when "
        "linear_workspace_bytes is 0.", py::call_guard<CallCapsules>());

  m.def("linear_workspace_bytes", &linear_workspace_bytes, py::arg("max_m"), py::arg("codes"), py::arg("params"),
        py::arg("k_perm"), py::arg("n"), py::arg("k"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"),
        py::arg("x_dtype"),
        "Bytes of device workspace linear needs for up to max_m rows of x of x_dtype ('bfloat16' | 'float16' | "
        "'float32'), on the current device.", py::call_guard<CallCapsules>());

  m.attr("conv_paths") =
      py::make_tuple(tc::conv_path_name(tc::ConvPath::kLinear), tc::conv_path_name(tc::ConvPath::kImplicitGemm),
                     tc::conv_path_name(tc::ConvPath::kDirect));

  m.def("conv_path_name", &conv_path_name, py::arg("path"),
        "The name of a tessera::conv::ConvPath value: 0 'linear', 1 'implicit_gemm', 2 'direct'.",
        py::call_guard<CallCapsules>());

  m.def("conv2d_output_size", &conv2d_output_size, py::arg("in_size"), py::arg("k"), py::arg("stride"), py::arg("pad"),
        py::arg("dil"),
        "floor((in_size + 2*pad - dil*(k - 1) - 1) / stride) + 1, PyTorch's rule (a floor for negative numerators "
        "too); stride >= 1.", py::call_guard<CallCapsules>());

  m.def("conv2d_path", &conv2d_path, py::arg("batch"), py::arg("height"), py::arg("width"), py::arg("codes"),
        py::arg("params"), py::arg("n"), py::arg("k"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"),
        py::arg("kh"), py::arg("kw"), py::arg("stride_h"), py::arg("stride_w"), py::arg("pad_h"), py::arg("pad_w"),
        py::arg("dil_h"), py::arg("dil_w"), py::arg("groups"), py::arg("x_layout"), py::arg("y_layout"),
        py::arg("x_dtype"),
        "The path ('linear' | 'implicit_gemm' | 'direct') conv2d takes for an input of [batch, height, width] "
        "pixels of x_dtype ('bfloat16' | 'float16' | 'float32') with this weight (its codes and params, on the host "
        "or the device) and geometry; x_layout / y_layout: 'NHWC' | 'NCHW'. Validates what conv2d validates except "
        "x and y; reads the current device's SM count.", py::call_guard<CallCapsules>());

  m.def("conv2d_workspace_bytes", &conv2d_workspace_bytes, py::arg("batch"), py::arg("height"), py::arg("width"),
        py::arg("codes"), py::arg("params"), py::arg("n"), py::arg("k"), py::arg("bits"), py::arg("block"),
        py::arg("zero_mode"), py::arg("kh"), py::arg("kw"), py::arg("stride_h"), py::arg("stride_w"), py::arg("pad_h"),
        py::arg("pad_w"), py::arg("dil_h"), py::arg("dil_w"), py::arg("groups"), py::arg("x_layout"),
        py::arg("y_layout"), py::arg("x_dtype"),
        "Bytes of device workspace conv2d needs for these arguments (conv2d_path's), on the current device; 0 when "
        "none.", py::call_guard<CallCapsules>());

  m.def("conv2d", &conv2d, py::arg("x"), py::arg("codes"), py::arg("params"), py::arg("bias"), py::arg("y"),
        py::arg("workspace"), py::arg("n"), py::arg("k"), py::arg("bits"), py::arg("block"), py::arg("zero_mode"),
        py::arg("kh"), py::arg("kw"), py::arg("stride_h"), py::arg("stride_w"), py::arg("pad_h"), py::arg("pad_w"),
        py::arg("dil_h"), py::arg("dil_w"), py::arg("groups"), py::arg("x_layout"), py::arg("y_layout"),
        py::arg("clamp_min"), py::arg("clamp_max"), py::arg("stream"),
        "y = clamp(conv2d(x, dequant(W)) + bias, clamp_min, clamp_max) into preallocated y (x's dtype): x "
        "[N, H, W, Ci] ('NHWC') or [N, Ci, H, W] ('NCHW') bf16 | fp16 | fp32, contiguous; y [N, Ho, Wo, Co] or "
        "[N, Co, Ho, Wo] as y_layout says, contiguous; the weight as linear's prepacked [Co, Kh*Kw*Ci_g] device "
        "tensors codes and params with its constants (n = Co, k = Kh*Kw*Ci_g; reduction index (kh*Kw + kw)*Ci_g + "
        "ci) and the kernel's kh, kw; symmetric zero padding; bias [Co] of y's dtype or None. workspace may be None "
        "when conv2d_workspace_bytes is 0.", py::call_guard<CallCapsules>());

  m.attr("moe_layer_formats") =  // WeightFormat's names, in its order
      py::make_tuple(tessera::moe::weight_format_name(tessera::moe::WeightFormat::kFP8Blockwise),
                     tessera::moe::weight_format_name(tessera::moe::WeightFormat::kFP8PerTensor),
                     tessera::moe::weight_format_name(tessera::moe::WeightFormat::kBF16));

  m.def("moe_layer_plan", &moe_layer_plan, py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"),
        py::arg("topk"), py::arg("num_groups"), py::arg("topk_groups"), py::arg("scoring"), py::arg("group_score"),
        py::arg("renormalize"), py::arg("routed_scaling_factor"), py::arg("num_shared_experts"),
        py::arg("shared_expert_weight"), py::arg("format"), py::arg("max_tokens"),
        "Validates the MoE layer's constants (scoring: 'sigmoid' | 'softmax'; group_score: 'top2_sum' | 'max'; "
        "format: 'fp8_blockwise' | 'fp8_per_tensor' | 'bf16') and returns the bytes of device workspace moe_layer "
        "needs for up to max_tokens tokens (tessera::moe::moe_layer_plan's workspace_bytes).",
        py::call_guard<CallCapsules>());

  m.def("moe_layer", &moe_layer, py::arg("x"), py::arg("router_logits"), py::arg("correction_bias"),
        py::arg("residual"), py::arg("num_tokens"), py::arg("w13"), py::arg("w2"), py::arg("w13_scale"),
        py::arg("w2_scale"), py::arg("a13_scale"), py::arg("a2_scale"), py::arg("y"), py::arg("workspace"),
        py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"), py::arg("topk"), py::arg("num_groups"),
        py::arg("topk_groups"), py::arg("scoring"), py::arg("group_score"), py::arg("renormalize"),
        py::arg("routed_scaling_factor"), py::arg("num_shared_experts"), py::arg("shared_expert_weight"),
        py::arg("format"), py::arg("max_tokens"), py::arg("stream"),
        "One MoE layer (gate, permute, w13 GEMM, SiLU-mul, w2 GEMM, weighted reduce) into preallocated y [T, H] "
        "bf16: x [T, H] bf16, router_logits [T, E], correction_bias [E] / residual [T, H] / num_tokens (int32 [1] on "
        "the device) or None; the weights w13 [G, 2I, H], w2 [G, H, I] (fp8 e4m3, uint8 views accepted, or bf16) "
        "with w13_scale, w2_scale, a13_scale, a2_scale as the format needs (else None); the constants as "
        "moe_layer_plan's. workspace: at least moe_layer_plan's bytes (None only when that is 0).",
        py::call_guard<CallCapsules>());

  m.def("w8a8_quantize", &w8a8_quantize, py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("zero"),
        py::arg("sums"), py::arg("block"), py::arg("stream"),
        "Quantizes x [M, K] (bf16 | fp16 | fp32) per (row, block of `block` columns: 32, 64, 128 or K) into "
        "preallocated codes int8 [M, K] and the fp32 parameter planes scale, zero (None: symmetric) and sums "
        "(None: not wanted), each [K/block, ld] with ld >= M a multiple of 4 (their first M columns are written).",
        py::call_guard<CallCapsules>());

  m.def("gemm_w8a8", &gemm_w8a8, py::arg("a_codes"), py::arg("a_scale"), py::arg("a_zero"), py::arg("a_sums"),
        py::arg("w_codes"), py::arg("w_scale"), py::arg("w_zero"), py::arg("w_sums"), py::arg("bias"), py::arg("y"),
        py::arg("workspace"), py::arg("block"), py::arg("clamp_min"), py::arg("clamp_max"), py::arg("out_scale"),
        py::arg("stream"),
        "y [M, N] = clamp(dequant(a) @ dequant(w)^T + bias) from the quantized activations (w8a8_quantize's "
        "outputs, [M, K]) and weights ([N, K], prepack_w8a8's arrays on the device), planes [K/block, ld]. y bf16 | "
        "fp16 | fp32, or int8 (= clamp(rint(v * out_scale), -128, 127)); bias fp32 [N] or None; workspace may be "
        "None when gemm_w8a8_workspace_bytes is 0.", py::call_guard<CallCapsules>());

  m.def("gemm_w8a8_workspace_bytes", &tl::gemm_w8a8_workspace_bytes, py::arg("max_m"), py::arg("n"), py::arg("k"),
        py::arg("block"),
        "Bytes of device workspace gemm_w8a8 needs for up to max_m rows of a, on the current device (0: none).",
        py::call_guard<CallCapsules>());

  m.def("prepack_w8a8", &prepack_w8a8, py::arg("w"), py::arg("block"), py::arg("symmetric"),
        "Quantizes a host fp32 weight [N, K] (contiguous) per (output channel, block) with w8a8_quantize's rule and "
        "sums its codes. Returns a dict: n, k, block, ld, symmetric, and bytearrays codes (int8 [N, K]), scale, zero "
        "(None when symmetric) and sums (fp32 [K/block, ld], rows N..ld-1 zero).", py::call_guard<CallCapsules>());
}
