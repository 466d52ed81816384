// Internal: argument rules shared by the attention families' validation (decode, append_kv, prefill). Every rule
// throws tessera::Error through ArgCheck, naming the op and the argument, before anything is launched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "common/validate.h"
#include "tessera/tensor.h"

namespace tessera::attention::detail {

using tessera::detail::ArgCheck;

inline constexpr int64_t kVectorBytes = 16;                // data rows move as whole 16-byte vectors
inline constexpr int64_t kMaxTmaStrideBytes = int64_t{1} << 40;  // cuTensorMapEncodeTiled's stride limit

std::string str(int64_t v);
std::string strides_str(const TensorView& t);
bool supported_head_dim(int64_t d);  // 64, 128, 256

// A copy of `t` whose dims of size <= 1 get a stride reaching past the dims inside them. Such strides never
// address memory, so frameworks leave anything there; the rules and the launchers see a harmless value instead.
TensorView normalized(TensorView t);

// Layout of a (normalized) view: non-negative sizes and strides; unit stride along the last dim if `unit_last`;
// the other strides multiples of `stride_bytes` (0: any); the data `base_bytes`-aligned. Empty views pass the
// stride and alignment rules: they address nothing.
void check_layout(const ArgCheck& check, const TensorView& t, const char* arg, bool unit_last, int64_t stride_bytes,
                  int64_t base_bytes);

// Shape check against a list of expected sizes, with the whole expected shape in the message.
void check_shape(const ArgCheck& check, const TensorView& t, const char* arg, std::initializer_list<int64_t> expected,
                 const char* what);

// cache_seqlens / positions: int32 [B], contiguous (`what` names the shape in the message: cu_seqlens are [B + 1]).
void check_lengths(const ArgCheck& check, const TensorView& t, const char* arg, int64_t batch,
                   const char* what = "[B]");

using ::tessera::detail::byte_dims;
using ::tessera::detail::ByteDims;
using ::tessera::detail::injective;

bool spans_overlap(const TensorView& a, const TensorView& b);

// Two views of one dtype, shape and strides (k and v, or their scales) share no byte. Either their extents are
// apart, or b is a shifted by an offset that fits between a's elements as one more dim: the interleaved halves of
// a fused KV buffer such as [num_pages, 2, page_size, HKV, D], which a plain extent test would reject.
bool disjoint_twins(const TensorView& a, const TensorView& b);

struct Named {
  const TensorView* t;
  const char* name;
};

// Each output overlaps no input and no other output.
void check_outputs_apart(const ArgCheck& check, const std::vector<Named>& inputs, const std::vector<Named>& outputs);

// params.softcap finite and >= 0, params.window >= 0 (decode's and prefill's rules; the messages name them so).
void check_softcap_window(const ArgCheck& check, float softcap, int window);

}  // namespace tessera::attention::detail
