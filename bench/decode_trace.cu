// tessera-decode-trace: a timeline of attention decode calls, for measurement builds only (issue 16, part 2: where
// the fixed cost of a small-batch call goes; docs/perf/decode.md).
//
//   cmake -S . -B build-trace -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS=-DTESSERA_DECODE_TRACE \
//         -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_PYTHON=OFF && cmake --build build-trace --target tessera-decode-trace
//   build-trace/bench/tessera-decode-trace [--format native|int8|int4] [--batch B] [--tokens T] [--hq HQ] [--hkv HKV]
//                                          [--calls N] [--splits S]
//
// D 128, bf16 q, every sequence T tokens long, a contiguous cache of random contents (the time does not depend on
// them). N back-to-back calls are captured in one CUDA graph (as tessera-bench's graph mode runs them); the graph is
// timed (median of 20 replays, µs a call), then replayed once more with the kernels writing (%globaltimer, clock64)
// at each event of kernel.cuh / merge.cu (TESSERA_DECODE_MARK) into one slot per call. Printed per call (the first
// two left out): the decode grid's span and the medians over its CTAs of the time between its events, the merge
// kernel's events against the decode grid's last exit, and the gap to the next call's first CTA past its wait.
// globaltimer is the one clock common to all SMs but ticks coarsely (its step is printed); clock64 differences
// within a CTA are exact, printed as ns at the SM clock measured from the two clocks over the whole run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/check.h"
#include "harness.h"
#include "tessera/attention.h"
#include "timing.h"

#ifdef TESSERA_DECODE_TRACE
namespace tessera::attention::detail {
void set_decode_trace(unsigned long long* buf, int ctas, int slots);
}  // namespace tessera::attention::detail

namespace {

constexpr int kDecodeEvents = 8, kMergeEvents = 4, kMaxCtas = 4096;
constexpr int kSlotWords = kMaxCtas * 2 * (kDecodeEvents + kMergeEvents);

// bf16 bits in (-1, 1), or any byte, from a 64-bit LCG.
void fill(std::vector<uint16_t>& v, uint64_t seed, bool bf16) {
  uint64_t x = seed;
  for (auto& e : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(x >> 33);
    e = bf16 ? static_cast<uint16_t>((r & 0x8000u) | 0x3C00u | (r & 0x03FFu)) : static_cast<uint16_t>(r);
  }
}

struct Event {
  unsigned long long g = 0, c = 0;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace tessera;
  using namespace tessera::attention;
  using bench::DeviceBuffer;
  using bench::median;
  std::string fmt = "native";
  int B = 1, T = 8192, HQ = 8, HKV = 1, calls = 16, splits = 0;
  const int D = 128;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--format") fmt = v;
    else if (k == "--batch") B = std::atoi(v);
    else if (k == "--tokens") T = std::atoi(v);
    else if (k == "--hq") HQ = std::atoi(v);
    else if (k == "--hkv") HKV = std::atoi(v);
    else if (k == "--calls") calls = std::atoi(v);
    else if (k == "--splits") splits = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const KVFormat format = fmt == "int8" ? KVFormat::kInt8 : fmt == "int4" ? KVFormat::kInt4 : KVFormat::kNative;
  const int row_bytes = format == KVFormat::kNative ? 2 * D : format == KVFormat::kInt8 ? D : D / 2;
  const int64_t rows = int64_t{B} * T * HKV;

  std::vector<uint16_t> host(rows * row_bytes / 2);
  DeviceBuffer k(host.size() * 2), v(host.size() * 2);
  fill(host, 1, format == KVFormat::kNative);
  k.upload(host);
  fill(host, 2, format == KVFormat::kNative);
  v.upload(host);
  std::vector<uint16_t> pairs(rows * 2);
  for (int64_t r = 0; r < rows; ++r) {
    pairs[2 * r] = 0x211F;      // fp16 0.01
    pairs[2 * r + 1] = 0xBC00;  // fp16 -1
  }
  DeviceBuffer ks(pairs.size() * 2), vs(pairs.size() * 2);
  ks.upload(pairs);
  vs.upload(pairs);
  std::vector<uint16_t> qh(int64_t{B} * HQ * D);
  fill(qh, 3, true);
  DeviceBuffer q(qh.size() * 2), o(qh.size() * 2);
  q.upload(qh);
  DeviceBuffer sl(B * 4);
  sl.upload(std::vector<int32_t>(B, T));

  KVCache cache;
  cache.format = format;
  const DType data_dtype = format == KVFormat::kNative ? DType::kBF16 : DType::kUInt8;
  const int64_t last = format == KVFormat::kNative ? D : row_bytes;
  cache.k = TensorView::contiguous(k.get(), data_dtype, {B, T, HKV, last});
  cache.v = TensorView::contiguous(v.get(), data_dtype, {B, T, HKV, last});
  if (format != KVFormat::kNative) {
    cache.k_scale = TensorView::contiguous(ks.get(), DType::kFP16, {B, T, HKV, 2});
    cache.v_scale = TensorView::contiguous(vs.get(), DType::kFP16, {B, T, HKV, 2});
  }
  const TensorView qv = TensorView::contiguous(q.get(), DType::kBF16, {B, HQ, D});
  const TensorView ov = TensorView::contiguous(o.get(), DType::kBF16, {B, HQ, D});
  const TensorView lv = TensorView::contiguous(sl.get(), DType::kInt32, {B});
  DecodeParams params;
  params.num_splits = splits;
  const size_t ws_bytes = decode_workspace_bytes(qv, cache, params);
  DeviceBuffer ws(ws_bytes);
  const Workspace w{ws.get(), ws_bytes};
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer trace(size_t{kSlotWords} * calls * 8);
  TESSERA_CUDA_CHECK(cudaMemset(trace.get(), 0, trace.bytes()));

  for (int i = 0; i < 20; ++i) decode(qv, cache, lv, ov, std::nullopt, w, params, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));

  // The graph, each call with its own trace slot.
  auto* tbuf = trace.as<unsigned long long>();
  attention::detail::set_decode_trace(tbuf, kMaxCtas, calls);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) decode(qv, cache, lv, ov, std::nullopt, w, params, stream);
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  attention::detail::set_decode_trace(nullptr, 0, 0);
  TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 20; ++i) TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t e0, e1;
  TESSERA_CUDA_CHECK(cudaEventCreate(&e0));
  TESSERA_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> per_call;
  for (int i = 0; i < 20; ++i) {
    TESSERA_CUDA_CHECK(cudaEventRecord(e0, stream));
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(e1, stream));
    TESSERA_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    per_call.push_back(1000.0 * ms / calls);
  }
  TESSERA_CUDA_CHECK(cudaMemset(trace.get(), 0, trace.bytes()));
  TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<Event> ev = trace.download<Event>(size_t{kSlotWords} * calls / 2, stream);

  // The SM clock from the two clocks: per CTA, (last - first) cycles over (last - first) ns, the median.
  auto dec = [&](int call, int cta, int e) -> const Event& {
    return ev[static_cast<size_t>(call) * kSlotWords / 2 + static_cast<size_t>(cta) * kDecodeEvents + e];
  };
  auto mrg = [&](int call, int cta, int e) -> const Event& {
    return ev[static_cast<size_t>(call) * kSlotWords / 2 + size_t{kMaxCtas} * kDecodeEvents + static_cast<size_t>(cta) * kMergeEvents + e];
  };
  auto ctas_of = [&](int call, bool merge) {
    int n = 0;
    while (n < kMaxCtas && (merge ? mrg(call, n, 0).g : dec(call, n, 0).g) != 0) ++n;
    return n;
  };
  std::vector<double> ghz;
  unsigned long long step = ~0ull;
  for (int call = 0; call < calls; ++call)
    for (int c = 0; c < ctas_of(call, false); ++c) {
      const Event &a = dec(call, c, 0), &b = dec(call, c, kDecodeEvents - 1);
      if (b.g > a.g + 2000) ghz.push_back(double(b.c - a.c) / double(b.g - a.g));
      for (int e = 1; e < kDecodeEvents; ++e)
        if (dec(call, c, e).g > dec(call, c, e - 1).g) step = std::min(step, dec(call, c, e).g - dec(call, c, e - 1).g);
    }
  const double clk = median(ghz);
  std::printf("decode %s B %d T %d HQ %d HKV %d D %d splits %s, %d calls per graph: %.2f us a call (median of 20 replays)\n",
              fmt.c_str(), B, T, HQ, HKV, D, splits ? std::to_string(splits).c_str() : "auto", calls, median(per_call));
  std::printf("SM clock from clock64 / globaltimer: %.3f GHz; smallest globaltimer step seen: %llu ns\n", clk, step);
  const char* names[kDecodeEvents] = {"entry", "wait done", "1st issued", "q ready", "1st stage", "stages done",
                                      "warps merged", "written"};
  std::printf("\nper call (decode CTAs' medians, clock64 ns; times in us from the call's first decode entry, globaltimer)\n");
  std::printf("call ctas | first..last entry | last past-wait | last exit | ");
  for (int e = 1; e < kDecodeEvents; ++e) std::printf("%s | ", names[e]);
  std::printf("merge ctas | m entry first | m past-wait first | m loaded (med) | m last exit | next past-wait\n");
  for (int call = 2; call < calls; ++call) {
    const int n = ctas_of(call, false), m = ctas_of(call, true);
    if (n == 0) continue;
    unsigned long long t0 = ~0ull, tl = 0, tw = 0, tx = 0;
    std::vector<std::vector<double>> d(kDecodeEvents);
    for (int c = 0; c < n; ++c) {
      t0 = std::min(t0, dec(call, c, 0).g);
      tl = std::max(tl, dec(call, c, 0).g);
      tw = std::max(tw, dec(call, c, 1).g);
      tx = std::max(tx, dec(call, c, kDecodeEvents - 1).g);
      for (int e = 1; e < kDecodeEvents; ++e) d[e].push_back(double(dec(call, c, e).c - dec(call, c, e - 1).c) / clk);
    }
    auto us = [&](unsigned long long t) { return (double(t) - double(t0)) / 1000.0; };
    std::printf("%4d %4d | %.2f..%.2f | %.2f | %.2f | ", call, n, 0.0, us(tl), us(tw), us(tx));
    for (int e = 1; e < kDecodeEvents; ++e) std::printf("%.0f | ", median(d[e]));
    if (m > 0) {
      unsigned long long me = ~0ull, mw = ~0ull, mx = 0;
      std::vector<double> ml;
      for (int c = 0; c < m; ++c) {
        me = std::min(me, mrg(call, c, 0).g);
        mw = std::min(mw, mrg(call, c, 1).g);
        mx = std::max(mx, mrg(call, c, 3).g);
        ml.push_back(double(mrg(call, c, 2).c - mrg(call, c, 1).c) / clk);
      }
      std::printf("%d | %.2f | %.2f | %.0f ns | %.2f | ", m, us(me), us(mw), median(ml), us(mx));
    } else {
      std::printf("0 | - | - | - | - | ");
    }
    if (call + 1 < calls) {
      unsigned long long nw = ~0ull;
      for (int c = 0; c < ctas_of(call + 1, false); ++c) nw = std::min(nw, dec(call + 1, c, 1).g);
      std::printf("%.2f\n", us(nw));
    } else {
      std::printf("-\n");
    }
  }
  TESSERA_CUDA_CHECK(cudaEventDestroy(e0));
  TESSERA_CUDA_CHECK(cudaEventDestroy(e1));
  TESSERA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TESSERA_CUDA_CHECK(cudaGraphDestroy(graph));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

#else
int main() {
  std::fprintf(stderr, "tessera-decode-trace: built without TESSERA_DECODE_TRACE (see the top of bench/decode_trace.cu)\n");
  return 2;
}
#endif
