// Links against the installed tessera and calls it without needing a GPU: a size query and a rejected call.
#include <tessera/tessera.h>

#include <cstdio>
#include <string>
#include <vector>

int main() {
  tessera::moe::PermuteParams params;
  params.num_experts = 256;
  params.pad_multiple = 128;
  const int64_t rows = tessera::moe::permute_capacity_rows(4096, 8, params);
  if (rows != 4096 * 8 + 256 * 127) {
    std::fprintf(stderr, "unexpected capacity %lld\n", static_cast<long long>(rows));
    return 1;
  }
  std::vector<float> logits(8 * 100), weights(8 * 8);
  std::vector<int> ids(8 * 8);
  tessera::moe::GateParams gate;
  gate.topk = 8;
  gate.num_groups = 8;  // does not divide 100 experts
  try {
    tessera::moe::fused_gate(tessera::TensorView::contiguous(logits.data(), tessera::DType::kFP32, {8, 100}),
                             std::nullopt,
                             tessera::TensorView::contiguous(weights.data(), tessera::DType::kFP32, {8, 8}),
                             tessera::TensorView::contiguous(ids.data(), tessera::DType::kInt32, {8, 8}), gate,
                             nullptr);
  } catch (const tessera::Error& e) {
    if (std::string(e.what()).find("'num_groups'") == std::string::npos) return 1;
    std::printf("tessera %s found and linked: %s\n", TESSERA_VERSION_STRING, e.what());
    return 0;
  }
  return 1;
}
