// Prefill: the public entry points (include/tessera/attention.h): validate, then launch.
#include <optional>

#include "attention/prefill/problem.h"
#include "common/device_info.h"
#include "tessera/attention.h"

namespace tessera::attention {

void prefill(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
             const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream) {
  constexpr const char* op = "tessera::attention::prefill";
  const detail::PrefillProblem pb =
      detail::check_prefill(op, q, k, v, std::nullopt, std::nullopt, 0, o, lse, params);
  if (pb.batch == 0 || pb.total_q == 0) return;  // nothing to compute: no device needed
  tessera::detail::require_hopper(op);
  detail::launch_prefill(pb, stream);
}

void prefill_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
                    const TensorView& cu_seqlens_k, int64_t max_seqlen_q, const TensorView& o,
                    const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream) {
  constexpr const char* op = "tessera::attention::prefill_varlen";
  const detail::PrefillProblem pb =
      detail::check_prefill(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, o, lse, params);
  if (pb.batch == 0 || pb.total_q == 0) return;  // nothing to compute: no device needed
  tessera::detail::require_hopper(op);
  detail::launch_prefill(pb, stream);
}

void prefill_with_cache(const TensorView& q, const TensorView& cu_seqlens_q, int64_t max_seqlen_q,
                        const KVCache& cache, const TensorView& cache_seqlens, const TensorView& o,
                        const std::optional<TensorView>& lse, const PrefillParams& params, cudaStream_t stream) {
  constexpr const char* op = "tessera::attention::prefill_with_cache";
  const detail::PrefillProblem pb =
      detail::check_prefill_cache(op, q, cu_seqlens_q, max_seqlen_q, cache, cache_seqlens, o, lse, params);
  if (pb.batch == 0 || pb.total_q == 0) return;
  tessera::detail::require_hopper(op);
  detail::launch_prefill(pb, stream);
}

}  // namespace tessera::attention
