// Grouped GEMM on the CPU: every validation rule of the four ops (the error names the op and the argument, and
// nothing is written), and the float64 reference on cases small enough to work out by hand.
//
// Validation runs before any device query, so host buffers stand in for device memory (device 0). A call that got
// past every rule fails at the device checks: without a GPU on cudaGetDevice, with one on the host pointer. The
// Accepted* tests check that the unmutated arguments get exactly that far, so each rule test fails for its rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/host_numeric.h"
#include "common/validation_util.h"
#include "reference/gemm_reference.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"

namespace tessera::gemm {
namespace {

enum class Op { kFP8, kFP8Masked, kBF16, kBF16Masked };
const Op kAllOps[] = {Op::kFP8, Op::kFP8Masked, Op::kBF16, Op::kBF16Masked};

bool is_fp8(Op op) { return op == Op::kFP8 || op == Op::kFP8Masked; }
bool is_masked(Op op) { return op == Op::kFP8Masked || op == Op::kBF16Masked; }
const char* op_name(Op op) {
  switch (op) {
    case Op::kFP8: return "grouped_gemm_fp8";
    case Op::kFP8Masked: return "grouped_gemm_fp8_masked";
    case Op::kBF16: return "grouped_gemm_bf16";
    case Op::kBF16Masked: return "grouped_gemm_bf16_masked";
  }
  return "";
}
const char* mode_name(ScaleMode m) { return m == ScaleMode::kPerTensor ? "kPerTensor" : "kBlockwise"; }
std::string describe(Op op, ScaleMode m) {
  return std::string(op_name(op)) + (is_fp8(op) ? " " + std::string(mode_name(m)) : "");
}

using test::HostBuffer;

constexpr int64_t kG = 4, kN = 256, kK = 256, kM = 40, kMaxM = 10;
constexpr int64_t kKB = kK / 128, kNB = kN / 128;

struct Buffers {
  // Larger than any view below needs (the rules never read them). The small tensors get room for a whole y, so
  // that the overlap tests can put y inside any one of them without reaching into another buffer.
  static constexpr std::size_t kYBytes = kG * kM * kN * 2 * 2;
  HostBuffer x{kG * kM * kK * 2 * 2, 1}, w{kG * kN * kK * 2 * 2, 2}, rows{kYBytes, 0}, y{kYBytes, 0xAB},
      xs{kYBytes, 3}, ws{kYBytes, 4};
};

struct Args {
  Op op = Op::kFP8;
  bool fp8 = true, masked = false;
  TensorView x, w, rows, y;
  FP8Scales scales;
  Workspace workspace;
  GroupedGemmOptions options;
  int row_dim() const { return masked ? 1 : 0; }
};

TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data, dtype, shape, 0);
}

Args make_args(Op op, ScaleMode mode, Buffers& b) {
  Args a;
  a.op = op;
  a.fp8 = is_fp8(op);
  a.masked = is_masked(op);
  const DType in = a.fp8 ? DType::kFP8E4M3 : DType::kBF16;
  a.x = a.masked ? view(b.x.data(), in, {kG, kMaxM, kK}) : view(b.x.data(), in, {kM, kK});
  a.w = view(b.w.data(), in, {kG, kN, kK});
  a.rows = view(b.rows.data(), DType::kInt32, {a.masked ? kG : kG + 1});
  a.y = a.masked ? view(b.y.data(), DType::kBF16, {kG, kMaxM, kN}) : view(b.y.data(), DType::kBF16, {kM, kN});
  a.scales.mode = mode;
  if (mode == ScaleMode::kPerTensor) {
    a.scales.x_scale = view(b.xs.data(), DType::kFP32, {1});
    a.scales.w_scale = view(b.ws.data(), DType::kFP32, {kG});
  } else {
    // Column-major token scales, the layout moe::permute emits.
    if (a.masked) {
      a.scales.x_scale = view(b.xs.data(), DType::kFP32, {kG, kMaxM, kKB});
      a.scales.x_scale.strides[1] = 1;
      a.scales.x_scale.strides[2] = kMaxM;
    } else {
      a.scales.x_scale = view(b.xs.data(), DType::kFP32, {kM, kKB});
      a.scales.x_scale.strides[0] = 1;
      a.scales.x_scale.strides[1] = kM;
    }
    a.scales.w_scale = view(b.ws.data(), DType::kFP32, {kG, kNB, kKB});
  }
  return a;
}

void call(const Args& a) {
  switch (a.op) {
    case Op::kFP8: return grouped_gemm_fp8(a.x, a.w, a.rows, a.scales, a.y, a.workspace, nullptr, a.options);
    case Op::kFP8Masked:
      return grouped_gemm_fp8_masked(a.x, a.w, a.rows, a.scales, a.y, a.workspace, nullptr, a.options);
    case Op::kBF16: return grouped_gemm_bf16(a.x, a.w, a.rows, a.y, a.workspace, nullptr, a.options);
    case Op::kBF16Masked: return grouped_gemm_bf16_masked(a.x, a.w, a.rows, a.y, a.workspace, nullptr, a.options);
  }
}

const char* rows_name(const Args& a) { return a.masked ? "masked_m" : "offsets"; }

// Which ops (and, for fp8, which scale modes) a rule applies to.
enum Applies : unsigned {
  kContig = 1,
  kMasked = 2,
  kFP8 = 4,
  kBF16 = 8,
  kPerTensor = 16,
  kBlockwise = 32,
  kAny = kContig | kMasked | kFP8 | kBF16 | kPerTensor | kBlockwise,
  kFP8Any = kContig | kMasked | kFP8 | kPerTensor | kBlockwise,
};

struct Case {
  const char* name;
  unsigned applies;
  std::function<void(Args&)> mutate;
  // The argument the message must name; nullptr: the rows argument of the op ("offsets" or "masked_m").
  const char* arg;
  // Substrings the message must contain; %M: the leading dims of x's rows ("[40" or "[4, 10"), %R: rows_name.
  std::vector<std::string> says = {};
};

bool applies_to(unsigned applies, Op op, ScaleMode mode) {
  if (!(applies & (is_masked(op) ? kMasked : kContig))) return false;
  if (!(applies & (is_fp8(op) ? kFP8 : kBF16))) return false;
  if (is_fp8(op) && !(applies & (mode == ScaleMode::kPerTensor ? kPerTensor : kBlockwise))) return false;
  return true;
}

// Shrinks K to `k` in x, w and (blockwise) the scales, keeping every view dense.
void set_k(Args& a, int64_t k) {
  a.x.shape[a.x.rank - 1] = k;
  if (a.masked) {
    a.x.strides[1] = k;
    a.x.strides[0] = kMaxM * k;
  } else {
    a.x.strides[0] = k;
  }
  a.w.shape[2] = k;
  a.w.strides[1] = k;
  a.w.strides[0] = kN * k;
}

int64_t elem(const Args& a) { return a.fp8 ? 1 : 2; }

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      // ---- dtypes
      {"x fp16", kAny, [](Args& a) { a.x.dtype = DType::kFP16; }, "x", {"fp16"}},
      {"x e5m2", kFP8Any, [](Args& a) { a.x.dtype = DType::kFP8E5M2; }, "x", {"fp8_e4m3"}},
      {"x bf16 for fp8 op", kFP8Any, [](Args& a) { a.x.dtype = DType::kBF16; }, "x"},
      {"x fp8 for bf16 op", kAny & ~kFP8, [](Args& a) { a.x.dtype = DType::kFP8E4M3; }, "x", {"bf16"}},
      {"w fp32", kAny, [](Args& a) { a.w.dtype = DType::kFP32; }, "w"},
      {"w bf16 for fp8 op", kFP8Any, [](Args& a) { a.w.dtype = DType::kBF16; }, "w"},
      {"w fp8 for bf16 op", kAny & ~kFP8, [](Args& a) { a.w.dtype = DType::kFP8E4M3; }, "w"},
      {"y fp16", kAny, [](Args& a) { a.y.dtype = DType::kFP16; }, "y", {"bf16"}},
      {"y fp32", kAny, [](Args& a) { a.y.dtype = DType::kFP32; }, "y"},
      // ---- ranks
      {"x rank", kAny,
       [](Args& a) {
         a.x = a.masked ? view(a.x.data, a.x.dtype, {kG * kMaxM, kK}) : view(a.x.data, a.x.dtype, {1, kM, kK});
       },
       "x", {"rank"}},
      {"w rank", kAny, [](Args& a) { a.w = view(a.w.data, a.w.dtype, {kG * kN, kK}); }, "w", {"rank"}},
      {"y rank", kAny,
       [](Args& a) {
         a.y = a.masked ? view(a.y.data, a.y.dtype, {kG * kMaxM, kN}) : view(a.y.data, a.y.dtype, {1, kM, kN});
       },
       "y", {"rank"}},
      // ---- group count
      {"no groups", kAny, [](Args& a) { a.w.shape[0] = 0; }, "w", {"groups"}},
      {"1025 groups", kAny,
       [](Args& a) {
         a.w.shape[0] = 1025;
         a.rows.shape[0] = a.masked ? 1025 : 1026;
         if (a.masked) a.x.shape[0] = a.y.shape[0] = 1025;
       },
       "w", {"1024"}},
      // ---- N and K granularity
      {"N % 128", kAny,
       [](Args& a) {
         a.w.shape[1] = 200;
         a.w.strides[0] = 200 * kK;
         a.y.shape[a.y.rank - 1] = 200;
       },
       "w", {"multiple of 128"}},
      {"N = 0", kAny, [](Args& a) { a.w.shape[1] = 0; a.y.shape[a.y.rank - 1] = 0; }, "w", {"positive multiple"}},
      {"fp8 K % 128", kFP8Any, [](Args& a) { set_k(a, 192); }, "w", {"multiple of 128"}},
      {"fp8 K = 64", kFP8Any, [](Args& a) { set_k(a, 64); }, "w", {"multiple of 128"}},
      {"bf16 K % 64", kAny & ~kFP8, [](Args& a) { set_k(a, 96); }, "w", {"multiple of 64"}},
      {"K = 0", kAny, [](Args& a) { set_k(a, 0); }, "w", {"positive multiple"}},
      // ---- shapes agree
      {"x K differs from w", kAny, [](Args& a) { a.x.shape[a.x.rank - 1] = kK - 128; }, "x", {"K"}},
      {"y N differs from w", kAny, [](Args& a) { a.y.shape[a.y.rank - 1] = kN + 128; }, "y", {"N"}},
      {"y rows differ from x", kAny, [](Args& a) { a.y.shape[a.row_dim()] -= 1; }, "y"},
      {"x groups differ from w", kAny & ~kContig, [](Args& a) { a.x.shape[0] = kG - 1; }, "x", {"num_groups"}},
      {"y groups differ from w", kAny & ~kContig, [](Args& a) { a.y.shape[0] = kG + 1; }, "y", {"num_groups"}},
      {"2^31 rows", kAny,
       [](Args& a) {
         a.x.shape[a.row_dim()] = int64_t{1} << 31;
         a.y.shape[a.row_dim()] = int64_t{1} << 31;
       },
       "x", {"int32"}},
      {"negative rows", kAny, [](Args& a) { a.x.shape[a.row_dim()] = -1; }, "x"},
      // ---- offsets / masked_m
      {"group rows int64", kAny, [](Args& a) { a.rows.dtype = DType::kInt64; }, nullptr, {"int32"}},
      {"group rows rank 2", kAny,
       [](Args& a) { a.rows = view(a.rows.data, DType::kInt32, {1, a.rows.shape[0]}); }, nullptr, {"rank"}},
      {"offsets length G", kAny & ~kMasked, [](Args& a) { a.rows.shape[0] = kG; }, nullptr, {"num_groups + 1"}},
      {"masked_m length G+1", kAny & ~kContig, [](Args& a) { a.rows.shape[0] = kG + 1; }, nullptr, {"num_groups"}},
      {"group rows strided", kAny, [](Args& a) { a.rows.strides[0] = 2; }, nullptr, {"contiguous"}},
      // ---- unit inner strides
      {"x K stride", kAny, [](Args& a) { a.x.strides[a.x.rank - 1] = 2; }, "x", {"unit stride"}},
      {"w K stride", kAny, [](Args& a) { a.w.strides[2] = 2; }, "w", {"unit stride"}},
      {"y N stride", kAny, [](Args& a) { a.y.strides[a.y.rank - 1] = 2; }, "y", {"unit stride"}},
      // ---- alignment (TMA: 16-byte address and strides)
      {"x address", kAny, [](Args& a) { a.x.data = static_cast<uint8_t*>(a.x.data) + elem(a); }, "x", {"16-byte"}},
      {"x row stride", kAny, [](Args& a) { a.x.strides[a.row_dim()] = kK + 8 / elem(a); }, "x", {"16 bytes"}},
      {"x group stride", kAny & ~kContig, [](Args& a) { a.x.strides[0] = kMaxM * kK + 8 / elem(a); }, "x",
       {"16 bytes"}},
      {"w address", kAny, [](Args& a) { a.w.data = static_cast<uint8_t*>(a.w.data) + 8; }, "w", {"16-byte"}},
      {"w row stride", kAny, [](Args& a) { a.w.strides[1] = kK + 8 / elem(a); }, "w", {"16 bytes"}},
      {"w group stride", kAny, [](Args& a) { a.w.strides[0] = kN * kK + 8 / elem(a); }, "w", {"16 bytes"}},
      {"y address", kAny, [](Args& a) { a.y.data = static_cast<uint8_t*>(a.y.data) + 2; }, "y", {"16-byte"}},
      {"y row stride", kAny, [](Args& a) { a.y.strides[a.row_dim()] = kN + 4; }, "y", {"8 elements"}},
      {"y group stride", kAny & ~kContig, [](Args& a) { a.y.strides[0] = kMaxM * kN + 4; }, "y", {"8 elements"}},
      // ---- positive strides on dims with more than one element
      {"x negative row stride", kAny, [](Args& a) { a.x.strides[a.row_dim()] = -kK; }, "x", {"positive"}},
      {"x zero row stride", kAny, [](Args& a) { a.x.strides[a.row_dim()] = 0; }, "x", {"positive"}},
      {"x zero group stride", kAny & ~kContig, [](Args& a) { a.x.strides[0] = 0; }, "x", {"positive"}},
      {"w zero group stride", kAny, [](Args& a) { a.w.strides[0] = 0; }, "w", {"positive"}},
      {"w negative row stride", kAny, [](Args& a) { a.w.strides[1] = -kK; }, "w", {"positive"}},
      {"y zero row stride", kAny, [](Args& a) { a.y.strides[a.row_dim()] = 0; }, "y", {"positive"}},
      {"y negative group stride", kAny & ~kContig, [](Args& a) { a.y.strides[0] = -kMaxM * kN; }, "y",
       {"positive"}},
      // ---- the output's own elements must not share memory
      {"y rows overlap", kAny, [](Args& a) { a.y.strides[a.row_dim()] = kN / 2; }, "y", {"share memory"}},
      {"y groups overlap", kAny & ~kContig, [](Args& a) { a.y.strides[0] = kN; }, "y", {"share memory"}},
      // ---- scales
      {"x_scale bf16", kFP8Any, [](Args& a) { a.scales.x_scale.dtype = DType::kBF16; }, "x_scale", {"fp32"}},
      {"w_scale fp16", kFP8Any, [](Args& a) { a.scales.w_scale.dtype = DType::kFP16; }, "w_scale", {"fp32"}},
      {"x_scale 2 elements", kFP8Any & ~kBlockwise,
       [](Args& a) { a.scales.x_scale = view(a.scales.x_scale.data, DType::kFP32, {2}); }, "x_scale",
       {"1 element", "[2]"}},
      {"x_scale blockwise shape in per-tensor mode", kFP8Any & ~kBlockwise,
       [](Args& a) { a.scales.x_scale = view(a.scales.x_scale.data, DType::kFP32, {kM, kKB}); }, "x_scale",
       {"1 element"}},
      {"w_scale length", kFP8Any & ~kBlockwise, [](Args& a) { a.scales.w_scale.shape[0] = kG - 1; }, "w_scale",
       {"[4]", "[3]"}},
      {"w_scale rank 2", kFP8Any & ~kBlockwise,
       [](Args& a) { a.scales.w_scale = view(a.scales.w_scale.data, DType::kFP32, {kG, 1}); }, "w_scale",
       {"[4]", "[4, 1]"}},
      {"x_scale K blocks", kFP8Any & ~kPerTensor,
       [](Args& a) { a.scales.x_scale.shape[a.scales.x_scale.rank - 1] = kKB + 1; }, "x_scale",
       {"K/128", "%M, 2]", "%M, 3]"}},
      {"x_scale rows", kFP8Any & ~kPerTensor, [](Args& a) { a.scales.x_scale.shape[a.row_dim()] -= 1; }, "x_scale",
       {"K/128"}},
      {"x_scale rank", kFP8Any & ~kPerTensor,
       [](Args& a) { a.scales.x_scale = view(a.scales.x_scale.data, DType::kFP32, {1}); }, "x_scale", {"[1]"}},
      {"x_scale groups (masked)", kFP8Any & ~kPerTensor & ~kContig,
       [](Args& a) { a.scales.x_scale.shape[0] = kG - 1; }, "x_scale", {"[4, 10, 2]", "[3, 10, 2]"}},
      {"w_scale N blocks", kFP8Any & ~kPerTensor, [](Args& a) { a.scales.w_scale.shape[1] = kNB + 1; }, "w_scale",
       {"N/128", "[4, 2, 2]", "[4, 3, 2]"}},
      {"w_scale groups", kFP8Any & ~kPerTensor, [](Args& a) { a.scales.w_scale.shape[0] = kG + 1; }, "w_scale",
       {"[4, 2, 2]", "[5, 2, 2]"}},
      {"w_scale per-tensor shape in blockwise mode", kFP8Any & ~kPerTensor,
       [](Args& a) { a.scales.w_scale = view(a.scales.w_scale.data, DType::kFP32, {kG}); }, "w_scale",
       {"[4, 2, 2]", "[4]"}},
      {"x_scale negative stride", kFP8Any & ~kPerTensor,
       [](Args& a) { a.scales.x_scale.strides[a.scales.x_scale.rank - 1] = -1; }, "x_scale", {"non-negative"}},
      {"w_scale negative stride", kFP8Any & ~kBlockwise, [](Args& a) { a.scales.w_scale.strides[0] = -1; },
       "w_scale", {"non-negative"}},
      {"x_scale address", kFP8Any,
       [](Args& a) { a.scales.x_scale.data = static_cast<uint8_t*>(a.scales.x_scale.data) + 2; }, "x_scale",
       {"4-byte"}},
      {"w_scale address", kFP8Any,
       [](Args& a) { a.scales.w_scale.data = static_cast<uint8_t*>(a.scales.w_scale.data) + 1; }, "w_scale",
       {"4-byte"}},
      {"scale mode", kFP8Any, [](Args& a) { a.scales.mode = static_cast<ScaleMode>(7); }, "scales.mode", {"7"}},
      // ---- options
      {"expected_m < 0", kAny, [](Args& a) { a.options.expected_m = -1; }, "options.expected_m", {"-1"}},
      // ---- the output overlaps no input
      {"y overlaps x", kAny, [](Args& a) { a.y.data = a.x.data; }, "y", {"'x'"}},
      {"y overlaps w", kAny, [](Args& a) { a.y.data = static_cast<uint8_t*>(a.w.data) + 4096; }, "y", {"'w'"}},
      {"y overlaps offsets / masked_m", kAny, [](Args& a) { a.y.data = a.rows.data; }, "y", {"'%R'"}},
      {"y overlaps x_scale", kFP8Any, [](Args& a) { a.y.data = a.scales.x_scale.data; }, "y", {"'x_scale'"}},
      {"y overlaps w_scale", kFP8Any, [](Args& a) { a.y.data = a.scales.w_scale.data; }, "y", {"'w_scale'"}},
  };
  return all;
}

std::string substitute_rows(std::string s, const Args& a) {
  const std::string rows = a.masked ? "[4, 10" : "[40";
  auto at = s.find("%M");
  if (at != std::string::npos) s.replace(at, 2, rows);
  at = s.find("%R");
  if (at != std::string::npos) s.replace(at, 2, rows_name(a));
  return s;
}

TEST(GroupedGemmValidation, EachRuleNamesItsArgument) {
  int runs = 0;
  for (const Case& c : cases())
    for (Op op : kAllOps)
      for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kBlockwise}) {
        if (!is_fp8(op) && mode == ScaleMode::kBlockwise) continue;  // bf16 ops: one run, the mode is unused
        if (!applies_to(c.applies, op, mode)) continue;
        SCOPED_TRACE(std::string(c.name) + " / " + describe(op, mode));
        Buffers b;
        Args a = make_args(op, mode, b);
        c.mutate(a);
        const std::string arg = c.arg ? c.arg : rows_name(a);
        ++runs;
        try {
          call(a);
          ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
        } catch (const Error& e) {
          const std::string msg = e.what();
          // "<op>: '<arg>' ...": names this op (not its masked sibling) and this argument first.
          const std::string head = std::string(op_name(op)) + ": '" + arg + "'";
          EXPECT_NE(msg.find(head), std::string::npos) << "expected \"" << head << "\" in: " << msg;
          for (const std::string& s : c.says) {
            const std::string want = substitute_rows(s, a);
            EXPECT_NE(msg.find(want), std::string::npos) << "expected \"" << want << "\" in: " << msg;
          }
        }
        EXPECT_TRUE(b.y.untouched());
      }
  EXPECT_GT(runs, 200);
}

// The unmutated arguments, and variants the rules must accept, get as far as the device checks.
void expect_reaches_device_checks(const Args& a, const Buffers& b) {
  try {
    call(a);
    ADD_FAILURE() << "host buffers accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(test::is_device_check_error(e.what())) << "stopped before the device checks: " << e.what();
  }
  EXPECT_TRUE(b.y.untouched());
}

TEST(GroupedGemmValidation, AcceptedArgumentsReachTheDeviceChecks) {
  struct Variant {
    const char* name;
    unsigned applies;
    std::function<void(Args&)> mutate;
  };
  const std::vector<Variant> variants = {
      {"as made", kAny, [](Args&) {}},
      {"one group", kAny,
       [](Args& a) {
         a.w.shape[0] = 1;
         a.rows.shape[0] = a.masked ? 1 : 2;
         if (a.masked) a.x.shape[0] = a.y.shape[0] = 1;
         if (a.masked && a.scales.mode == ScaleMode::kBlockwise) a.scales.x_scale.shape[0] = 1;
         a.scales.w_scale.shape[0] = 1;
       }},
      {"1024 groups, N = K = 128", kAny,
       [](Args& a) {
         // Buffers of their own: views must not reach into each other's memory (the overlap rule would fire).
         constexpr int64_t G = kGroupedGemmMaxGroups, R = 3;
         static HostBuffer x(G * R * 128 * 2, 1), w(G * 128 * 128 * 2, 2), rows((G + 1) * 4, 0), y(G * R * 128 * 2, 0),
             xs(G * R * 4, 3), ws(G * 4, 4);
         a.x = a.masked ? view(x.data(), a.x.dtype, {G, R, 128}) : view(x.data(), a.x.dtype, {R, 128});
         a.w = view(w.data(), a.w.dtype, {G, 128, 128});
         a.rows = view(rows.data(), DType::kInt32, {a.masked ? G : G + 1});
         a.y = a.masked ? view(y.data(), DType::kBF16, {G, R, 128}) : view(y.data(), DType::kBF16, {R, 128});
         if (a.scales.mode == ScaleMode::kBlockwise) {
           a.scales.x_scale =
               a.masked ? view(xs.data(), DType::kFP32, {G, R, 1}) : view(xs.data(), DType::kFP32, {R, 1});
           a.scales.w_scale = view(ws.data(), DType::kFP32, {G, 1, 1});
         } else {
           a.scales.x_scale = view(xs.data(), DType::kFP32, {1});
           a.scales.w_scale = view(ws.data(), DType::kFP32, {G});
           a.scales.w_scale.strides[0] = 0;  // any stride, even a broadcast
         }
       }},
      {"bf16 K = 192", kAny & ~kFP8, [](Args& a) { set_k(a, 192); }},
      {"bf16 K = 64", kAny & ~kFP8, [](Args& a) { set_k(a, 64); }},
      {"fp8 K = 128, N = 128", kFP8Any,
       [](Args& a) {
         set_k(a, 128);
         a.w.shape[1] = 128;
         a.w.strides[0] = 128 * 128;
         a.y.shape[a.y.rank - 1] = 128;
         if (a.masked) a.y.strides[0] = kMaxM * 128;
         a.y.strides[a.row_dim()] = 128;
         if (a.scales.mode == ScaleMode::kBlockwise) {
           a.scales.x_scale.shape[a.scales.x_scale.rank - 1] = 1;
           a.scales.w_scale = view(a.scales.w_scale.data, DType::kFP32, {kG, 1, 1});
         }
       }},
      {"no rows", kAny,
       [](Args& a) {
         a.x.shape[a.row_dim()] = 0;
         a.y.shape[a.row_dim()] = 0;
         a.x.data = nullptr;
         a.y.data = nullptr;
         if (a.scales.mode == ScaleMode::kBlockwise) {
           a.scales.x_scale.shape[a.row_dim()] = 0;
           a.scales.x_scale.data = nullptr;
         }
       }},
      {"one row with odd strides", kAny,
       [](Args& a) {
         // Strides of dims of size 1 address nothing: any value is fine.
         a.x.shape[a.row_dim()] = 1;
         a.y.shape[a.row_dim()] = 1;
         a.x.strides[a.row_dim()] = -3;
         a.y.strides[a.row_dim()] = 7;
         if (a.scales.mode == ScaleMode::kBlockwise) a.scales.x_scale.shape[a.row_dim()] = 1;
       }},
      {"padded rows and groups", kAny,
       [](Args& a) {
         a.x.strides[a.row_dim()] = kK + 16 / elem(a);
         a.y.strides[a.row_dim()] = kN + 8;
         a.w.strides[1] = kK + 16 / elem(a);
         a.w.strides[0] = kN * a.w.strides[1] + 64;
         if (a.masked) {
           a.x.strides[0] = (kMaxM + 1) * a.x.strides[1];
           a.y.strides[0] = (kMaxM + 2) * a.y.strides[1];
         }
       }},
      {"groups interleaved in y and x", kAny & ~kContig,
       [](Args& a) {
         // [max_m, G, N] storage seen as [G, max_m, N]: non-overlapping, writable.
         a.y.strides[0] = kN;
         a.y.strides[1] = kG * kN;
         a.x.strides[0] = kK;
         a.x.strides[1] = kG * kK;
       }},
      {"x_scale rank 0", kFP8Any & ~kBlockwise,
       [](Args& a) { a.scales.x_scale = view(a.scales.x_scale.data, DType::kFP32, {}); }},
      {"w_scale strided", kFP8Any & ~kBlockwise, [](Args& a) { a.scales.w_scale.strides[0] = 3; }},
      {"row-major x_scale, transposed w_scale", kFP8Any & ~kPerTensor,
       [](Args& a) {
         TensorView& xs = a.scales.x_scale;
         xs = a.masked ? view(xs.data, DType::kFP32, {kG, kMaxM, kKB}) : view(xs.data, DType::kFP32, {kM, kKB});
         TensorView& ws = a.scales.w_scale;
         ws.strides[1] = 1;
         ws.strides[2] = kNB;
       }},
      {"expected_m hint", kAny, [](Args& a) { a.options.expected_m = 100000; }},
      {"workspace given", kAny,
       [](Args& a) { a.workspace = Workspace{a.scales.w_scale.data, 64}; }},
  };
  for (const Variant& v : variants)
    for (Op op : kAllOps)
      for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kBlockwise}) {
        if (!is_fp8(op) && mode == ScaleMode::kBlockwise) continue;
        if (!applies_to(v.applies, op, mode)) continue;
        SCOPED_TRACE(std::string(v.name) + " / " + describe(op, mode));
        Buffers b;
        Args a = make_args(op, mode, b);
        v.mutate(a);
        expect_reaches_device_checks(a, b);
      }
}

TEST(GroupedGemmValidation, WorkspaceQuery) {
  EXPECT_EQ(grouped_gemm_workspace_bytes(1, 128, 128), 0u);
  EXPECT_EQ(grouped_gemm_workspace_bytes(256, 7168, 2048), 0u);
  EXPECT_EQ(grouped_gemm_workspace_bytes(kGroupedGemmMaxGroups, 4096, 7168), 0u);
}

}  // namespace
}  // namespace tessera::gemm

// ---- the float64 reference ------------------------------------------------------------------------------------
namespace tessera::reference {
namespace {

// The e4m3 encoding of v, which must be representable.
uint8_t e4m3(float v) {
  for (int b = 0; b < 256; ++b)
    if (b != 0x7F && b != 0xFF && host::e4m3_to_f32(static_cast<uint8_t>(b)) == v) return static_cast<uint8_t>(b);
  ADD_FAILURE() << v << " is not an e4m3 value";
  return 0;
}

std::vector<uint8_t> e4m3(const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (float f : v) out.push_back(e4m3(f));
  return out;
}

std::vector<uint16_t> bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float f : v) out.push_back(host::f32_to_bf16(f));
  return out;
}

// Group g's value at (row, col) of the reference.
double at(const GroupedGemmRef& r, int g, int64_t row, int64_t col) {
  EXPECT_GE(row, r.groups.begin[g]);
  EXPECT_LT(row, r.groups.end[g]);
  return r.y[r.value_offset[g] + (row - r.groups.begin[g]) * r.shape.n + col];
}

TEST(GroupedGemmReference, Bf16ContiguousByHand) {
  GroupedGemmShape s;
  s.num_groups = 2;
  s.rows = 5;
  s.n = 2;
  s.k = 3;
  s.x_row_stride = 3;
  s.w_row_stride = 3;
  s.w_group_stride = 6;
  const auto x = bf16({1, 2, 3, 4, 5, 6, 7, 8, 9, -1, 0, 2, 5, 5, 5});
  const auto w = bf16({1, 0, 0, 0, 1, 1, /*g1*/ 2, 2, 2, 1, -1, 0.5f});
  const GroupedGemmRef r = grouped_gemm_bf16(x, w, {1, 3, 4}, s);
  EXPECT_EQ(r.groups.begin, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(r.groups.end, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(r.rows_written(), 3);
  EXPECT_EQ(r.y.size(), 6u);
  EXPECT_EQ(at(r, 0, 1, 0), 4.0);
  EXPECT_EQ(at(r, 0, 1, 1), 11.0);
  EXPECT_EQ(at(r, 0, 2, 0), 7.0);
  EXPECT_EQ(at(r, 0, 2, 1), 17.0);
  EXPECT_EQ(at(r, 1, 3, 0), 2.0);
  EXPECT_EQ(at(r, 1, 3, 1), 0.0);
}

TEST(GroupedGemmReference, Fp8PerTensorMaskedByHand) {
  GroupedGemmShape s;
  s.masked = true;
  s.num_groups = 2;
  s.rows = 3;  // max_m
  s.n = 1;
  s.k = 2;
  s.x_row_stride = 2;
  s.x_group_stride = 6;
  s.w_row_stride = 2;
  s.w_group_stride = 2;
  const auto x = e4m3({1, 2, 3, -0.5f, 448, 448, /*g1*/ 0.25f, 1, 448, 448, 448, 448});
  const auto w = e4m3({2, 1, /*g1*/ 4, -8});
  GroupedGemmScales sc;
  sc.mode = gemm::ScaleMode::kPerTensor;
  sc.x_scale = {0.5f};
  sc.w_scale = {2.0f, 7.0f, 0.25f};  // stride 2
  sc.ws_group_stride = 2;
  const GroupedGemmRef r = grouped_gemm_fp8(x, w, {2, 1}, sc, s);
  EXPECT_EQ(r.output_rows(), 6);
  EXPECT_EQ(r.rows_written(), 3);
  EXPECT_EQ(at(r, 0, 0, 0), 4.0);     // (1*2 + 2*1) * 0.5 * 2
  EXPECT_EQ(at(r, 0, 1, 0), 5.5);     // (3*2 - 0.5) * 1
  EXPECT_EQ(at(r, 1, 0, 0), -0.875);  // (0.25*4 - 8) * 0.5 * 0.25
}

// K = N = 256: two 128-blocks each way, sparse operands so that every term is visible.
GroupedGemmRef blockwise_case(bool col_major_x_scale, bool masked) {
  GroupedGemmShape s;
  s.masked = masked;
  s.num_groups = 1;
  s.rows = 2;
  s.n = 256;
  s.k = 256;
  s.x_row_stride = 256;
  s.x_group_stride = 512;
  s.w_row_stride = 256;
  s.w_group_stride = 256 * 256;
  std::vector<uint8_t> x(2 * 256, 0), w(256 * 256, 0);
  x[0] = e4m3(1);
  x[130] = e4m3(2);
  x[256 + 5] = e4m3(-1);
  w[0 * 256 + 0] = e4m3(1);
  w[0 * 256 + 130] = e4m3(1);
  w[200 * 256 + 130] = e4m3(3);
  w[200 * 256 + 5] = e4m3(2);
  GroupedGemmScales sc;
  sc.mode = gemm::ScaleMode::kBlockwise;
  // x_scale[row][kb] = {{0.5, 0.25}, {2, 4}}
  if (col_major_x_scale) {
    sc.x_scale = {0.5f, 2, 0.25f, 4};
    sc.xs_row_stride = 1;
    sc.xs_k_stride = 2;
  } else {
    sc.x_scale = {0.5f, 0.25f, 2, 4};
    sc.xs_row_stride = 2;
    sc.xs_k_stride = 1;
  }
  sc.xs_group_stride = 4;
  // w_scale[0][nb][kb] = {{1, 10}, {100, 1000}}
  sc.w_scale = {1, 10, 100, 1000};
  sc.ws_group_stride = 4;
  sc.ws_n_stride = 2;
  sc.ws_k_stride = 1;
  return grouped_gemm_fp8(x, w, masked ? std::vector<int32_t>{2} : std::vector<int32_t>{0, 2}, sc, s);
}

TEST(GroupedGemmReference, Fp8BlockwiseByHand) {
  for (bool col_major : {false, true})
    for (bool masked : {false, true}) {
      SCOPED_TRACE(std::string(col_major ? "column-major" : "row-major") + (masked ? " masked" : " contiguous"));
      const GroupedGemmRef r = blockwise_case(col_major, masked);
      ASSERT_EQ(r.y.size(), 2u * 256);
      EXPECT_EQ(at(r, 0, 0, 0), 5.5);       // 0.5*1*(1*1) + 0.25*10*(2*1)
      EXPECT_EQ(at(r, 0, 0, 200), 1500.0);  // 0.25*1000*(2*3)
      EXPECT_EQ(at(r, 0, 1, 0), 0.0);
      EXPECT_EQ(at(r, 0, 1, 200), -400.0);  // 2*100*(-1*2)
      int nonzero = 0;
      for (double v : r.y) nonzero += v != 0.0;
      EXPECT_EQ(nonzero, 3);
    }
}

TEST(GroupedGemmReference, OffsetsAndMaskedCountsAreClampedLikeTheDevice) {
  GroupedGemmShape s;
  s.num_groups = 4;
  s.rows = 6;
  // -3 -> 0; a decreasing pair is empty; 9 -> M; group 2 overlaps group 0 on row 1.
  GroupRows g = clamp_group_rows({-3, 2, 1, 9, 4}, s);
  EXPECT_EQ(g.begin, (std::vector<int64_t>{0, 2, 1, 6}));
  EXPECT_EQ(g.end, (std::vector<int64_t>{2, 2, 6, 6}));
  g = clamp_group_rows({INT32_MIN, INT32_MAX, INT32_MIN, 0, 0}, s);
  EXPECT_EQ(g.begin, (std::vector<int64_t>{0, 6, 0, 0}));
  EXPECT_EQ(g.end, (std::vector<int64_t>{6, 6, 0, 0}));
  s.masked = true;
  s.num_groups = 3;
  s.rows = 3;
  g = clamp_group_rows({-1, 5, 2}, s);
  EXPECT_EQ(g.begin, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(g.end, (std::vector<int64_t>{0, 3, 2}));
  EXPECT_THROW(clamp_group_rows({1, 2}, s), Error);
}

// Every value a whole number: exact in float64 and in bf16 when small.
struct SmallCase {
  GroupedGemmShape s;
  std::vector<uint16_t> x, w;
  std::vector<int32_t> offsets;
};

SmallCase small_case(const std::vector<int32_t>& offsets, int64_t x_pad) {
  SmallCase c;
  c.s.num_groups = static_cast<int>(offsets.size()) - 1;
  c.s.rows = 6;
  c.s.n = 3;
  c.s.k = 2;
  c.s.x_row_stride = 2 + x_pad;
  c.s.w_row_stride = 2;
  c.s.w_group_stride = 6;
  c.offsets = offsets;
  c.x.assign(c.s.rows * c.s.x_row_stride, 0xFFFF);  // NaN in the padding: must not be read
  for (int64_t r = 0; r < c.s.rows; ++r)
    for (int64_t k = 0; k < 2; ++k) c.x[r * c.s.x_row_stride + k] = host::f32_to_bf16(static_cast<float>(r + 1 + k));
  // w_g[n][k] = (g + 1) * (n + 1) - k
  for (int g = 0; g < c.s.num_groups; ++g)
    for (int n = 0; n < 3; ++n)
      for (int k = 0; k < 2; ++k) c.w.push_back(host::f32_to_bf16(static_cast<float>((g + 1) * (n + 1) - k)));
  return c;
}

TEST(GroupedGemmReference, EmptyGroupsOverlapsAndPaddedRows) {
  // Groups 0, 2, 3 empty (3 by a decreasing pair); group 1 rows [0, 3), group 4 rows [2, 5), overlapping on
  // row 2; rows 5 belongs to no group. Rows are padded with NaN, which must not be read.
  const SmallCase c = small_case({0, 0, 3, 3, 2, 5}, 6);
  const GroupedGemmRef r = grouped_gemm_bf16(c.x, c.w, c.offsets, c.s);
  EXPECT_EQ(r.groups.begin, (std::vector<int64_t>{0, 0, 3, 3, 2}));
  EXPECT_EQ(r.groups.end, (std::vector<int64_t>{0, 3, 3, 3, 5}));
  EXPECT_EQ(r.rows_written(), 6);
  EXPECT_EQ(r.y.size(), 6u * 3);
  for (int64_t row = 0; row < 5; ++row)
    for (int g : {1, 4}) {
      if (row < r.groups.begin[g] || row >= r.groups.end[g]) continue;
      for (int64_t n = 0; n < 3; ++n) {
        double expect = 0.0;
        for (int64_t k = 0; k < 2; ++k) expect += (row + 1 + k) * static_cast<double>((g + 1) * (n + 1) - k);
        EXPECT_EQ(at(r, g, row, n), expect) << "group " << g << " row " << row << " col " << n;
      }
    }
}

TEST(GroupedGemmReference, ThreadCountDoesNotChangeResults) {
  GroupedGemmShape s;
  s.num_groups = 3;
  s.rows = 67;
  s.n = 256;
  s.k = 384;
  s.x_row_stride = 400;
  s.w_row_stride = 384;
  s.w_group_stride = 256 * 384;
  std::vector<uint8_t> x(s.rows * s.x_row_stride), w(3 * 256 * 384);
  uint32_t state = 12345;
  const auto next = [&] {
    state = state * 1664525u + 1013904223u;
    const auto b = static_cast<uint8_t>(state >> 24);
    return (b & 0x7F) == 0x7F ? uint8_t{0} : b;
  };
  for (auto& v : x) v = next();
  for (auto& v : w) v = next();
  GroupedGemmScales sc;
  sc.mode = gemm::ScaleMode::kBlockwise;
  sc.x_scale.assign(67 * 3, 0.5f);
  sc.xs_row_stride = 3;
  sc.xs_k_stride = 1;
  sc.w_scale.assign(3 * 2 * 3, 0.125f);
  sc.ws_group_stride = 6;
  sc.ws_n_stride = 3;
  sc.ws_k_stride = 1;
  const std::vector<int32_t> offsets = {3, 30, 31, 60};
  const GroupedGemmRef one = grouped_gemm_fp8(x, w, offsets, sc, s, 1);
  const GroupedGemmRef three = grouped_gemm_fp8(x, w, offsets, sc, s, 3);
  ASSERT_EQ(one.y.size(), three.y.size());
  EXPECT_EQ(0, std::memcmp(one.y.data(), three.y.data(), one.y.size() * sizeof(double)));
  // Row 30 of group 1 spot-checked by a direct sum.
  double expect = 0.0;
  for (int64_t k = 0; k < 384; ++k)
    expect += static_cast<double>(host::e4m3_to_f32(x[30 * 400 + k])) *
              host::e4m3_to_f32(w[256 * 384 + 7 * 384 + k]);
  EXPECT_NEAR(at(one, 1, 30, 7), expect * 0.0625, 1e-9 * std::fabs(expect) + 1e-12);
}

TEST(GroupedGemmReference, InputErrorsThrow) {
  GroupedGemmShape s;
  s.num_groups = 1;
  s.rows = 2;
  s.n = 2;
  s.k = 2;
  s.x_row_stride = 2;
  s.w_row_stride = 2;
  s.w_group_stride = 4;
  EXPECT_THROW(grouped_gemm_bf16(std::vector<uint16_t>(3), std::vector<uint16_t>(4), {0, 2}, s), Error);
  EXPECT_THROW(grouped_gemm_bf16(std::vector<uint16_t>(4), std::vector<uint16_t>(3), {0, 2}, s), Error);
  EXPECT_THROW(grouped_gemm_bf16(std::vector<uint16_t>(4), std::vector<uint16_t>(4), {0}, s), Error);
  GroupedGemmScales sc;
  sc.mode = gemm::ScaleMode::kBlockwise;
  sc.x_scale = {1.0f};  // needs 2 rows
  sc.xs_row_stride = 1;
  sc.w_scale = {1.0f};
  EXPECT_THROW(grouped_gemm_fp8(std::vector<uint8_t>(4), std::vector<uint8_t>(4), {0, 2}, sc, s), Error);
}

// ---- check_grouped_gemm ---------------------------------------------------------------------------------------

constexpr uint16_t kPoison = 0xFFFF;

// The y buffer a correct kernel would leave: every written element the reference rounded to bf16, the rest poison.
std::vector<uint16_t> ideal_y(const GroupedGemmRef& r, int64_t row_stride, int64_t group_stride, int64_t size,
                              bool last_group_wins = true) {
  std::vector<uint16_t> y(size, kPoison);
  const int G = r.shape.num_groups;
  for (int i = 0; i < G; ++i) {
    const int g = last_group_wins ? i : G - 1 - i;
    for (int64_t row = r.groups.begin[g]; row < r.groups.end[g]; ++row)
      for (int64_t c = 0; c < r.shape.n; ++c) {
        const int64_t p = r.shape.masked ? g * group_stride + row * row_stride + c : row * row_stride + c;
        y[p] = host::f32_to_bf16(static_cast<float>(at(r, g, row, c)));
      }
  }
  return y;
}

TEST(GroupedGemmCheck, AcceptsCorrectOutputAndFindsEachKindOfError) {
  const SmallCase c = small_case({1, 3, 5}, 0);  // rows 0 and 5 belong to no group
  const GroupedGemmRef r = grouped_gemm_bf16(c.x, c.w, c.offsets, c.s);
  const int64_t stride = 5;  // two padding columns per row
  const std::vector<uint16_t> good = ideal_y(r, stride, 0, 6 * stride);
  GroupedGemmCheck k = check_grouped_gemm(r, good, stride, 0, kPoison);
  EXPECT_TRUE(k.ok) << k.message;
  EXPECT_EQ(k.compared, 4 * 3);
  EXPECT_EQ(k.error, 0.0);

  std::vector<uint16_t> y = good;
  y[2 * stride + 1] = 0x7FC0;  // NaN in a written element
  k = check_grouped_gemm(r, y, stride, 0, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_EQ(k.nan_count, 1);
  EXPECT_NE(k.message.find("row 2, col 1"), std::string::npos) << k.message;

  y = good;
  y[0 * stride + 2] = 0;  // row 0 belongs to no group
  k = check_grouped_gemm(r, y, stride, 0, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_EQ(k.poison_touched, 1);

  y = good;
  y[1 * stride + 4] = 0;  // padding column
  k = check_grouped_gemm(r, y, stride, 0, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_EQ(k.poison_touched, 1);

  y = good;
  y[3 * stride + 0] = host::f32_to_bf16(host::bf16_to_f32(y[3 * stride]) * 1.1f);  // off by 10% in one element
  k = check_grouped_gemm(r, y, stride, 0, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_EQ(k.out_of_bound, 1);
  EXPECT_GT(k.max_abs_error, 0.0);

  y = good;
  for (int64_t row = 1; row < 5; ++row)
    for (int64_t col = 0; col < 3; ++col)
      y[row * stride + col] = host::f32_to_bf16(host::bf16_to_f32(y[row * stride + col]) * 1.02f);
  GemmTolerance frobenius_only;  // element-wise bounds wide enough that only the Frobenius check can fail
  frobenius_only.acc = 1.0;
  frobenius_only.rel = 1.0;
  k = check_grouped_gemm(r, y, stride, 0, kPoison, frobenius_only);
  EXPECT_FALSE(k.ok);
  EXPECT_NEAR(k.error, 0.02, 0.005);
  EXPECT_EQ(k.out_of_bound, 0);
}

TEST(GroupedGemmCheck, OverlappingGroupsMayLeaveEitherResult) {
  const SmallCase c = small_case({0, 3, 2, 5}, 0);  // row 2 in groups 0 and 2; group 1 empty
  const GroupedGemmRef r = grouped_gemm_bf16(c.x, c.w, c.offsets, c.s);
  for (bool last_wins : {true, false}) {
    const std::vector<uint16_t> y = ideal_y(r, 3, 0, 6 * 3, last_wins);
    const GroupedGemmCheck k = check_grouped_gemm(r, y, 3, 0, kPoison);
    EXPECT_TRUE(k.ok) << k.message;
  }
  std::vector<uint16_t> y = ideal_y(r, 3, 0, 6 * 3);
  y[2 * 3 + 1] = host::f32_to_bf16(1000.0f);  // neither group's value
  const GroupedGemmCheck k = check_grouped_gemm(r, y, 3, 0, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_NE(k.message.find("overlapping"), std::string::npos) << k.message;
}

TEST(GroupedGemmCheck, MaskedRowsPastTheCountMustKeepThePoison) {
  // One group, max_m 3, masked_m 1: rows 1 and 2 must stay poisoned.
  GroupedGemmShape s;
  s.masked = true;
  s.num_groups = 1;
  s.rows = 3;
  s.n = 256;
  s.k = 256;
  s.x_row_stride = 256;
  s.w_row_stride = 256;
  s.w_group_stride = 256 * 256;
  std::vector<uint8_t> x(3 * 256, 0), w(256 * 256, 0);
  x[7] = 0x38;  // 1.0
  w[7] = 0x40;  // 2.0
  GroupedGemmScales sc;
  sc.mode = gemm::ScaleMode::kPerTensor;
  sc.x_scale = {1.0f};
  sc.w_scale = {1.0f};
  s.x_group_stride = 3 * 256;
  const GroupedGemmRef m = grouped_gemm_fp8(x, w, {1}, sc, s);
  EXPECT_EQ(m.rows_written(), 1);
  const int64_t row_stride = 256 + 8, group_stride = 4 * row_stride;
  std::vector<uint16_t> y = ideal_y(m, row_stride, group_stride, group_stride);
  EXPECT_EQ(host::bf16_to_f32(y[0]), 2.0f);
  GroupedGemmCheck k = check_grouped_gemm(m, y, row_stride, group_stride, kPoison);
  EXPECT_TRUE(k.ok) << k.message;
  y[2 * row_stride + 5] = 0;  // row 2 is past masked_m
  k = check_grouped_gemm(m, y, row_stride, group_stride, kPoison);
  EXPECT_FALSE(k.ok);
  EXPECT_EQ(k.poison_touched, 1);
}

}  // namespace
}  // namespace tessera::reference
