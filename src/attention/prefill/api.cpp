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

}  // namespace tessera::attention
