// Prefill kernel, version 1 (docs/perf/prefill.md): Hopper TMA + wgmma, a producer warpgroup and two consumer
// warpgroups of 64 query rows each.
//
// CTA = one tile of 128 query rows of one sequence: 128 tokens of one query head, or with GQA packing 128 / G tokens
// of each of the G query heads of one KV head (rows (head, token)). The producer's first thread loads the Q tile
// once and the K and V tiles of the key range this tile attends to (causal and window ranges are cut to whole
// tiles; tiles outside are never loaded) into a ring of kStages stages; K and V of a stage complete on their own
// mbarriers, so S = Q·Kᵀ starts while V is still in flight. Each consumer warpgroup computes, per key tile,
//   S (64 × kBlockN) = Q·Kᵀ  (wgmma, both operands in shared memory, K-major),
//   online softmax in the log2 domain on S's accumulator registers (softcap, masking where the tile crosses the
//   sequence end, the causal diagonal or the window edge),
//   O (64 × D) += P·V (wgmma with P from registers, converted in place from S's layout, and V in shared memory as
//   an MN-major operand), then releases the stage.
// Every tile is 128-byte swizzled by TMA in boxes of 64 elements: a [rows][D] tile is D / 64 column blocks of
// rows × 128 bytes.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/numeric.cuh"
#include "ptx/math.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "pipeline/pipeline.cuh"
#include "ptx/wgmma.cuh"
#include "attention/prefill/kv_transform.cuh"

namespace tessera::attention::detail {

inline constexpr int kPrefillBlockM = 128;  // query rows per CTA: two consumer warpgroups of 64
inline constexpr int kPrefillThreads = 384;
// log2 of the factor by which a row's running max may trail its true max before O is rescaled (P <= 2^kMaxSlack).
inline constexpr float kMaxSlack = 8.0f;
// Keys per K / V tile: S's accumulators (kBlockN / 2 registers) and O's (D / 2) must fit beside each other.
constexpr int prefill_block_n(int head_dim) { return head_dim == 256 ? 64 : 128; }

// Key tile and ring depth per head dim: the ring fills what shared memory is left. kQuant (K / V from a quantized
// cache): a staging ring of raw code tiles (up to 8 bits per element) besides, which the producer warpgroup turns into
// the fp16 K / V tiles.
template <int kD, bool kQuant = false>
struct PrefillTile {
  static constexpr int kBlockN = prefill_block_n(kD);
  static constexpr int kStages = kD == 64 ? 3 : 2;
  static constexpr int kChunks = kD / 64;                          // 64-element column blocks
  static constexpr int kQBytes = kPrefillBlockM * kD * 2;          // the Q tile
  static constexpr int kKVBytes = kBlockN * kD * 2;                // one K (or V) tile
  static constexpr int kQChunkBytes = kPrefillBlockM * 128;        // one column block of Q
  static constexpr int kKVChunkBytes = kBlockN * 128;              // one column block of K or V
  static constexpr int kStageBytes = 2 * kKVBytes;                 // K then V
  static constexpr int kCodeBytes = kBlockN * kD;                  // one K (or V) tile of codes, 8-bit at most
  static constexpr int kCodeStages = kQuant ? (kD == 256 ? 1 : 2) : 0;
  static constexpr int kCodeOff = kQBytes + kStages * kStageBytes;
  // kQuant: the scale pairs of one K or V tile's rows (up to D / 32 per row), or its 32-token blocks' channel
  // parameters (2·D per block), staged for the conversion: 2 KiB at every head dim.
  static constexpr int kPairBytes = kQuant ? 2048 : 0;
  static constexpr int kPairOff = kCodeOff + kCodeStages * 2 * kCodeBytes;
  // q_full, the K and V rings' full then empty barriers; kQuant: q_ready, the code ring's full and empty
  static constexpr int kBarOff = kPairOff + kPairBytes;
  static constexpr int kNumBars = 1 + 4 * kStages + (kQuant ? 1 + 2 * kCodeStages : 0);
  // The data start at the first 1024-byte boundary (the 128-byte swizzle's period) of the dynamic shared memory;
  // the barriers go in the gap before it when it holds them, else after the data: 1024 bytes cover both cases.
  static constexpr int kBytes = 1024 + kBarOff;
  static_assert(2 * kNumBars * 8 <= 1024, "the barriers fit in the alignment slack, or after the data");
  static_assert(kBytes <= 232448, "227 KiB of shared memory per CTA");
};
// Named barriers (0 is __syncthreads): the consumer warpgroups' turns (kTurn + warpgroup), warpgroup 0's V-tail
// zeroing, and the quantized kernel's producer warpgroup (its parameter staging).
enum class PrefillBarrier : int { kTurn = 1, kVTail = 3, kTransform = 4 };
constexpr int barrier_id(PrefillBarrier b, int offset = 0) { return static_cast<int>(b) + offset; }

// Register split (setmaxnreg): producer warpgroup, consumer warpgroups; the quantized variant's producer warpgroup
// also transforms codes. setmaxnreg moves registers within the CTA's allocation at launch (168 per thread under
// __launch_bounds__(384, 1)): a split past it leaves setmaxnreg.inc waiting forever.
template <bool kQuant>
inline constexpr int kProducerRegs = kQuant ? 72 : 24;
template <bool kQuant>
inline constexpr int kConsumerRegs = kQuant ? 216 : 240;
inline constexpr int kPrefillLaunchRegs = (65536 / kPrefillThreads / 8 * 8) * kPrefillThreads;
static_assert(kProducerRegs<false> * 128 + kConsumerRegs<false> * 256 <= kPrefillLaunchRegs &&
                  kProducerRegs<true> * 128 + kConsumerRegs<true> * 256 <= kPrefillLaunchRegs,
              "setmaxnreg budget of the CTA");

using ::tessera::detail::pack2;

struct PrefillArgs {
  // 4-D maps of q, k and v over (D, tokens, heads, batch) with the 128-byte swizzle: q boxes of (64 elements,
  // q_tokens, q_heads, 1), k and v boxes of (64 elements, kBlockN rows, 1, 1). Packed: a batch of one.
  CUtensorMap q_map, k_map, v_map;
  void* o = nullptr;
  int64_t o_stride_token = 0, o_stride_head = 0, o_stride_batch = 0;
  float* lse = nullptr;
  int64_t lse_stride_token = 0, lse_stride_head = 0, lse_stride_batch = 0;
  const int32_t* cu_seqlens_q = nullptr;  // null: the plain batch, every sequence total_q queries and total_k keys
  const int32_t* cu_seqlens_k = nullptr;
  // K / V from the decode cache: L = min(cache_seqlens[b], total_k = capacity) keys. Contiguous: the maps span
  // (D, capacity, HKV, B); paged (block_table non-null): (D, page_size, HKV, num_pages), boxes of page_rows rows.
  const int32_t* cache_seqlens = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int max_pages = 0, log2_page_size = 0, page_rows = 0;
  // Quantized cache (the kQuant kernel): k_map / v_map span the code rows (bytes: row_bytes, rows, HKV, outer, no
  // swizzle); q is converted to fp16 in shared memory when it is bf16, o is written in q's dtype.
  PrefillQuant quant;
  bool q_bf16 = false;
  // Rows of q and o per batch entry: a token outside [0, total_q) (a wrong cu_seqlens_q) is never written.
  int64_t total_q = 0;
  int total_k = 0;
  int group = 0;  // HQ / HKV
  int num_m_blocks = 0;
  // Query rows of a tile: q_tokens tokens of each of q_heads heads (q_heads · q_tokens <= 128; q_map's box).
  int q_tokens = kPrefillBlockM, q_heads = 1;
  float scale_log2 = 0.0f;  // softmax_scale · log2(e) (no softcap), or softmax_scale / softcap (softcap)
  float softcap_log2 = 0.0f;  // softcap · log2(e), 0: no softcap
  int window = 0;
  bool causal = false;
};

// The threads that convert a quantized cache's tiles: the whole producer warpgroup (its first thread also issues
// the TMA loads).
inline constexpr int kTransformThreads = 128;

// One thread's share of the scale parameters of a K or V tile, loaded from global memory a tile ahead of its
// conversion and staged in shared memory for it: row t of the tile (its pair, or its D / 32 group pairs), or 16-byte
// vector t of the tile's 32-token blocks' channel parameters (2·D each).
template <int kD, int kBlockN, QuantParams P>
struct TileParams {
  static constexpr int kVecs = 2 * kD * 2 / 16;  // vectors of one block's channel parameters
  static constexpr int kItems = P == QuantParams::kChannel ? kBlockN / kKeyBlock * kVecs : kBlockN;
  static constexpr int kItemWords = P == QuantParams::kChannel ? 4 : P == QuantParams::kGroup32 ? kD / 32 : 1;
  static constexpr int kPerThread = (kItems + kTransformThreads - 1) / kTransformThreads;
  static constexpr int kWords = P == QuantParams::kNone ? 1 : kPerThread * kItemWords;
  static_assert(kItems * kItemWords * 4 <= 2048, "the staging buffer (kPairBytes)");
  uint32_t w[kWords];

  // The first key of item i, or -1 past the tile's keys.
  __device__ __forceinline__ static int item_key(int n, int i, int sk) {
    const int key = n * kBlockN + (P == QuantParams::kChannel ? (i / kVecs) * kKeyBlock : i);
    return i < kItems && key < sk ? key : -1;
  }
  // `locate(key, outer, slot)`: the cache row of a key. A page outside the cache (a wrong block table) reads no
  // parameters: zeros (values 0).
  template <class Locate>
  __device__ __forceinline__ void load(const PrefillQuant& qt, const uint16_t* scales, int kvh, int n, int sk, int t,
                                       Locate&& locate) {
    if constexpr (P != QuantParams::kNone) {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t + kTransformThreads * k, key = item_key(n, i, sk);
        if (key < 0) continue;
        int64_t outer, slot;
        locate(key, outer, slot);
        const bool ok = outer >= 0 && outer < qt.num_outer;
        if constexpr (P == QuantParams::kChannel) {
          const uint4* src = reinterpret_cast<const uint4*>(scales + outer * qt.kc_outer + (slot / kKeyBlock) *
                                                            qt.kc_block + kvh * qt.kc_head) + i % kVecs;
          const uint4 v = ok ? __ldg(src) : make_uint4(0u, 0u, 0u, 0u);
          w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
        } else {
          const uint32_t* src =
              reinterpret_cast<const uint32_t*>(scales + outer * qt.s_outer + slot * qt.s_token + kvh * qt.s_head);
#pragma unroll
          for (int g = 0; g < kItemWords; ++g) w[k * kItemWords + g] = ok ? __ldg(src + g) : 0u;
        }
      }
    }
  }
  // Into the staging buffer: item i at words [i · kItemWords, (i + 1) · kItemWords).
  __device__ __forceinline__ void store(uint32_t* staged, int n, int sk, int t) const {
    if constexpr (P != QuantParams::kNone) {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t + kTransformThreads * k;
        if (item_key(n, i, sk) < 0) continue;
        if constexpr (P == QuantParams::kChannel)
          reinterpret_cast<uint4*>(staged)[i] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
        else
#pragma unroll
          for (int g = 0; g < kItemWords; ++g) staged[i * kItemWords + g] = w[k * kItemWords + g];
      }
    }
  }
};

// Converts one staged tile of codes into the swizzled fp16 tile. Thread t takes the 16-element unit u = t mod
// (D / 16) of rows r0 + m · 128 / (D / 16), r0 = t / (D / 16): the row step is a multiple of 8, so every row of a
// thread has the same swizzle phase (r mod 8) and every address is the thread's base plus a constant. Rows below
// first_row and from valid_rows on become zeros.
template <int kD, class Tile, KVFormat F, QuantParams P>
__device__ __forceinline__ void convert_tile(const uint8_t* src, const uint32_t* staged, uint8_t* tile, int t,
                                             int valid_rows, int first_row = 0) {
  constexpr int kBlockN = Tile::kBlockN, kUnits = kD / 16, kRowStep = kTransformThreads / kUnits;
  constexpr int kSteps = kBlockN / kRowStep;
  constexpr int kRowBytes = QuantFormat<F>::kInt4 ? kD / 2 : kD;
  static_assert(kTransformThreads % kUnits == 0 && kRowStep % 8 == 0 && kBlockN % kRowStep == 0,
                "whole steps of rows of one swizzle phase");
  const int u = t % kUnits, r0 = t / kUnits;
  const uint16_t* channel = reinterpret_cast<const uint16_t*>(staged) + 16 * u;  // this unit's channels
  // Batches of steps, every shared-memory load of a batch before its first store (the compiler cannot move a load
  // of the codes above a store to the tile: both are shared memory). A per-channel thread's 32-token block is
  // kRowStep · m / 32 (r0 < kRowStep, and kRowStep divides 32): known at compile time.
  constexpr int kBatch = P == QuantParams::kChannel ? 2 : 4;
  static_assert(kSteps % kBatch == 0 && 32 % kRowStep == 0, "whole batches, blocks by step");
#pragma unroll
  for (int m0 = 0; m0 < kSteps; m0 += kBatch) {
    RawCodes16<F> raw[kBatch];
    uint32_t pair[kBatch];
    uint4 chan[kBatch][4];  // per-channel: scales (two vectors) then offsets of the step's block
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int r = r0 + kRowStep * (m0 + j);
      raw[j] = load_codes16<F>(src + r * kRowBytes, u);
      if constexpr (P == QuantParams::kRow) pair[j] = staged[r];
      if constexpr (P == QuantParams::kGroup32) pair[j] = staged[r * (kD / 32) + u / 2];
      if constexpr (P == QuantParams::kChannel) {
        const int blk = kRowStep * (m0 + j) / kKeyBlock;
        if (j > 0 && blk == kRowStep * (m0 + j - 1) / kKeyBlock) {
#pragma unroll
          for (int v = 0; v < 4; ++v) chan[j][v] = chan[j - 1][v];
        } else {
          const uint16_t* block = channel + blk * 2 * kD;
          chan[j][0] = *reinterpret_cast<const uint4*>(block);
          chan[j][1] = *reinterpret_cast<const uint4*>(block + 8);
          chan[j][2] = *reinterpret_cast<const uint4*>(block + kD);
          chan[j][3] = *reinterpret_cast<const uint4*>(block + kD + 8);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      uint32_t p[8];
      expand16<F>(raw[j], p);
      if constexpr (P == QuantParams::kRow || P == QuantParams::kGroup32) {
        const __half2 s = __low2half2(as_half2(pair[j])), o = __high2half2(as_half2(pair[j]));
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = fp16_bits2(__hfma2(as_half2(p[i]), s, o));
      } else if constexpr (P == QuantParams::kChannel) {
        const uint32_t s[8] = {chan[j][0].x, chan[j][0].y, chan[j][0].z, chan[j][0].w,
                               chan[j][1].x, chan[j][1].y, chan[j][1].z, chan[j][1].w};
        const uint32_t o[8] = {chan[j][2].x, chan[j][2].y, chan[j][2].z, chan[j][2].w,
                               chan[j][3].x, chan[j][3].y, chan[j][3].z, chan[j][3].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = fp16_bits2(__hfma2(as_half2(p[i]), as_half2(s[i]), as_half2(o[i])));
      }
      store16(tile, Tile::kKVChunkBytes, r0 + kRowStep * (m0 + j), r0 % 8, u, p);
    }
  }
  // The sequence's last tile: the rows past it; a first tile: the rows below first_row (converted from whatever
  // they held).
  if (valid_rows < kBlockN || first_row > 0) {
    const uint32_t zero[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
    for (int m = 0; m < kSteps; ++m) {
      const int r = r0 + kRowStep * m;
      if (r >= valid_rows || r < first_row) store16(tile, Tile::kKVChunkBytes, r, r0 % 8, u, zero);
    }
  }
}

// The key tiles [n_lo, n_hi) of format F: per tile, wait for its codes, stage the K parameters (loaded a tile
// ahead), convert K into the fp16 ring and signal it, then the same for V; each signal is one arrival per warp on the
// consumers' full barrier. Thread 0 issues the code tiles (load_codes(it, n)) kCodeStages ahead: a stage is
// reloaded as soon as every warp has converted it.
// convert_q() runs once the first tiles' code and parameter loads are in flight.
template <int kD, class Tile, KVFormat F, class LoadCodes, class ConvertQ>
__device__ __forceinline__ void transform_tiles(const PrefillArgs& a, uint8_t* ring, const uint8_t* codes,
                                                uint32_t* staged, pipeline::StageRing k_ring,
                                                pipeline::StageRing v_ring, pipeline::StageRing code_ring,
                                                LoadCodes&& load_codes, ConvertQ&& convert_q, int b, int kvh, int sk,
                                                int n_lo, int n_hi, int lo_key) {
  constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages;
  constexpr QuantParams kKP = QuantFormat<F>::kKeys, kVP = QuantFormat<F>::kValues;
  const int t = threadIdx.x, lane = threadIdx.x % 32;
  const PrefillQuant& qt = a.quant;
  const auto locate = [&](int key, int64_t& outer, int64_t& slot) {
    outer = b;
    slot = key;
    if (a.block_table != nullptr) {
      outer = __ldg(a.block_table + b * a.block_table_stride + (key >> a.log2_page_size));
      slot = key & ((1 << a.log2_page_size) - 1);
    }
  };
  const auto sync = [] { ptx::named_barrier_sync(barrier_id(PrefillBarrier::kTransform), kTransformThreads); };
  const auto signal = [&](uint64_t* bar) {
    ptx::fence_proxy_async_shared();  // this thread's tile writes, before the consumers' wgmma reads them
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(bar);
  };
  if (t == 0)
    for (int it = 0; it < Tile::kCodeStages && n_lo + it < n_hi; ++it) load_codes(it, n_lo + it);
  TileParams<kD, kBlockN, kKP> kp;
  TileParams<kD, kBlockN, kVP> vp;
  kp.load(qt, qt.k_scale, kvh, n_lo, sk, t, locate);
  vp.load(qt, qt.v_scale, kvh, n_lo, sk, t, locate);
  convert_q();
  for (int n = n_lo, it = 0; n < n_hi; ++n, ++it) {
    const pipeline::PipelineState code_st = pipeline::PipelineState::at(it, Tile::kCodeStages);
    const pipeline::PipelineState st = pipeline::PipelineState::at(it, kStages);
    const uint8_t* k_codes = codes + code_st.stage * 2 * Tile::kCodeBytes;
    uint8_t* k_tile = ring + st.stage * Tile::kStageBytes;
    const int valid_rows = sk - n * kBlockN;
    code_ring.consumer_wait(code_st);
    if constexpr (kKP != QuantParams::kNone) {
      kp.store(staged, n, sk, t);
      sync();
    }
    if (it >= kStages) k_ring.producer_acquire(st);
    convert_tile<kD, Tile, F, kKP>(k_codes, staged, k_tile, t, valid_rows);
    signal(k_ring.full_barrier(st));
    if constexpr (kKP != QuantParams::kNone) sync();  // the K parameters are read: V's may overwrite them
    if constexpr (kVP != QuantParams::kNone) {
      vp.store(staged, n, sk, t);
      sync();
    }
    if (n + 1 < n_hi) {  // the next tile's parameters, in flight while V converts and the next codes land
      kp.load(qt, qt.k_scale, kvh, n + 1, sk, t, locate);
      vp.load(qt, qt.v_scale, kvh, n + 1, sk, t, locate);
    }
    if (it >= kStages) v_ring.producer_acquire(st);
    // V rows below every query's window (first tile) become zeros here, with the rows past the keys.
    convert_tile<kD, Tile, F, kVP>(k_codes + Tile::kCodeBytes, staged, k_tile + Tile::kKVBytes, t, valid_rows,
                                   n == n_lo ? lo_key - n_lo * kBlockN : 0);
    signal(v_ring.full_barrier(st));
    __syncwarp();
    if (lane == 0) code_ring.consumer_release(code_st);
    if (t == 0 && n + Tile::kCodeStages < n_hi) {
      const int next = it + Tile::kCodeStages;
      code_ring.producer_acquire(pipeline::PipelineState::at(next, Tile::kCodeStages));
      load_codes(next, n + Tile::kCodeStages);
    }
    if constexpr (kVP != QuantParams::kNone) sync();  // the V parameters are read: the next K's may overwrite them
  }
}

// The producer warpgroup's Q step in the quantized kernel: once Q has landed, Q to fp16 in place when q is bf16
// (saturated to fp16's range), then one arrival per warp on q_ready.
template <class Tile>
__device__ __forceinline__ void q_to_fp16(const PrefillArgs& a, uint8_t* q_tile, uint64_t* q_full, uint64_t* q_ready) {
  const int t = threadIdx.x, lane = threadIdx.x % 32;
  ptx::mbarrier_wait_parity(q_full, 0);
  if (a.q_bf16) {
    for (int i = t; i < Tile::kQBytes / 16; i += kTransformThreads) {
      uint4* p = reinterpret_cast<uint4*>(q_tile) + i;
      uint4 v = *p;
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float lo = fminf(fmaxf(__uint_as_float(w[k] << 16), -65504.0f), 65504.0f);
        const float hi = fminf(fmaxf(__uint_as_float(w[k] & 0xffff0000u), -65504.0f), 65504.0f);
        w[k] = ::tessera::detail::pack2<true>(lo, hi);
      }
      *p = v;
    }
  }
  ptx::fence_proxy_async_shared();
  __syncwarp();
  if (lane == 0) ptx::mbarrier_arrive(q_ready);
}

// kFormat: the K / V format, kNative (rows of q's dtype) or a quantized one (the kQuant kernel: its own instance per
// format, so that each holds one conversion loop beside the consumers' code).
template <int kD, bool kFP16, KVFormat kFormat>
__global__ void __launch_bounds__(kPrefillThreads, 1) prefill_kernel(const __grid_constant__ PrefillArgs a) {
  constexpr bool kQuant = kFormat != KVFormat::kNative;
  static_assert(kFP16 || !kQuant, "quantized caches run the fp16 tensor-core path");
  using Tile = PrefillTile<kD, kQuant>;
  constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages;
  constexpr int kSRegs = kBlockN / 2, kORegs = kD / 2;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t pad = (1024 - (ptx::smem_u32(smem_raw) & 1023)) & 1023;
  uint8_t* smem = smem_raw + pad;
  uint8_t* q_tile = smem;
  uint8_t* ring = smem + Tile::kQBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(pad >= Tile::kNumBars * 8 ? smem_raw : smem + Tile::kBarOff);
  uint64_t* q_full = bars;
  // K and V tiles (full: TMA, or kQuant's producer warpgroup; empty: the consumer warpgroups).
  const pipeline::StageRing k_ring{bars + 1, bars + 1 + 2 * kStages, kStages};
  const pipeline::StageRing v_ring{bars + 1 + kStages, bars + 1 + 3 * kStages, kStages};
  uint64_t* q_ready = bars + 1 + 4 * kStages;  // kQuant: Q in fp16 (q_to_fp16)
  // kQuant: staged code tiles (full: TMA; empty: the producer warpgroup has converted them).
  const pipeline::StageRing code_ring{q_ready + 1, q_ready + 1 + Tile::kCodeStages, Tile::kCodeStages};
  uint8_t* codes = smem + Tile::kCodeOff;

  // Late query tiles first: under a causal mask they attend to the most keys.
  // The tile's query rows: q_tokens consecutive tokens of each of q_heads consecutive query heads from h, row
  // g · q_tokens + s (GQA packing: the heads of one KV head share the K / V tiles; unpacked: 128 tokens of one head).
  const int m_block = a.num_m_blocks - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y * a.q_heads, b = blockIdx.z, tile_tokens = a.q_tokens;
  const bool packed = a.cu_seqlens_q != nullptr;
  const int bc = packed ? 0 : b;  // the batch coordinate of q's map and of the outputs
  const int q0 = packed ? a.cu_seqlens_q[b] : 0, sq = packed ? a.cu_seqlens_q[b + 1] - q0 : static_cast<int>(a.total_q);
  // Keys: rows k0 .. k0 + sk - 1 of batch entry kb of the k / v maps (the cache: of sequence b, or its pages).
  int k0 = 0, sk = a.total_k, kb = b;
  if (a.cache_seqlens != nullptr) {
    sk = min(max(a.cache_seqlens[b], 0), a.total_k);  // total_k: the cache's capacity
  } else if (a.cu_seqlens_k != nullptr) {
    k0 = a.cu_seqlens_k[b];
    sk = max(a.cu_seqlens_k[b + 1] - k0, 0);  // decreasing offsets: no keys (negative counts indexed shared memory)
    kb = 0;
  }
  if (m_block * tile_tokens >= sq) return;  // the whole CTA: no barrier has been touched
  const int kvh = h / a.group;
  // Positions (bottom-right aligned) of the tile's first and last query rows, and the key range they attend to.
  const int pos_first = sk - sq + m_block * tile_tokens;
  const int pos_last = sk - sq + min(sq, (m_block + 1) * tile_tokens) - 1;
  const int hi_key = a.causal ? max(0, min(sk, pos_last + 1)) : sk;
  const int lo_key = a.window > 0 ? min(max(0, pos_first - a.window + 1), sk) : 0;
  const int n_lo = lo_key / kBlockN;
  const int n_hi = hi_key > lo_key ? (hi_key + kBlockN - 1) / kBlockN : n_lo;  // no keys: no tile

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(q_full, 1);
    // Full: TMA (one arrival), or kQuant's producer warpgroup (one per warp); empty: one per consumer warpgroup.
    k_ring.init_barriers(kQuant ? 4 : 1, 2);
    v_ring.init_barriers(kQuant ? 4 : 1, 2);
    if constexpr (kQuant) {
      ptx::mbarrier_init(q_ready, 4);
      code_ring.init_barriers(1, 4);  // TMA; one arrival per warp of the producer warpgroup
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----------------------------------------------------------------------------------------------
    ptx::setmaxnreg_dec<kProducerRegs<kQuant>>();
    // No key tile: the consumers write zeros without reading Q, so Q is not loaded (an unwaited copy could still be
    // landing when the next CTA on this SM reuses the shared memory).
    if (n_hi <= n_lo) return;
    const auto load_q = [&] {
      ptx::mbarrier_arrive_expect_tx(q_full, a.q_heads * tile_tokens * kD * 2);  // the box; other rows stay stale
#pragma unroll
      for (int c = 0; c < Tile::kChunks; ++c)
        ptx::tma_load_4d(q_tile + c * Tile::kQChunkBytes, &a.q_map, q_full, 64 * c, q0 + m_block * tile_tokens,
                         h, bc);
    };
    // The boxes of a kBlockN-row K or V tile from `row` on: load(r, coord, outer) for the rows r.. of the tile at
    // row coordinate `coord` of batch entry or page `outer`: one box for the tile, or with a paged cache one per
    // page piece (page_rows rows, a multiple of 8: the pieces land where one box would have put them, 128-byte
    // swizzle included). Rows past the block table's pages get page -1, which TMA fills with zeros.
    const auto for_each_box = [&](int row, auto&& load) {
      if (a.block_table == nullptr) {
        load(0, row, kb);
        return;
      }
      for (int r = 0; r < kBlockN; r += a.page_rows) {
        const int key = row + r, page_index = key >> a.log2_page_size;
        const int page = page_index < a.max_pages ? __ldg(a.block_table + b * a.block_table_stride + page_index) : -1;
        load(r, key & ((1 << a.log2_page_size) - 1), page);
      }
    };
    if constexpr (kQuant) {
      // The whole warpgroup transforms; its first thread loads Q and, from inside the transform loop, the code
      // tiles (rows of row_bytes, unswizzled) into their staging ring.
      const auto load_codes = [&](int it, int n) {
        const pipeline::PipelineState st = pipeline::PipelineState::at(it, Tile::kCodeStages);
        const int rb = a.quant.row_bytes;
        uint8_t* k_dst = codes + st.stage * 2 * Tile::kCodeBytes;
        uint8_t* v_dst = k_dst + Tile::kCodeBytes;
        uint64_t* bar = code_ring.full_barrier(st);
        ptx::mbarrier_arrive_expect_tx(bar, 2 * kBlockN * rb);
        for_each_box(k0 + n * kBlockN, [&](int r, int coord, int outer) {
          ptx::tma_load_4d(k_dst + r * rb, &a.k_map, bar, 0, coord, kvh, outer);
          ptx::tma_load_4d(v_dst + r * rb, &a.v_map, bar, 0, coord, kvh, outer);
        });
      };
      if (threadIdx.x == 0) load_q();
      transform_tiles<kD, Tile, kFormat>(
          a, ring, codes, reinterpret_cast<uint32_t*>(smem + Tile::kPairOff), k_ring, v_ring, code_ring, load_codes,
          [&] { q_to_fp16<Tile>(a, q_tile, q_full, q_ready); }, b, kvh, sk, n_lo, n_hi, lo_key);
      return;
    }
    if (threadIdx.x != 0) return;
    load_q();
    for (int n = n_lo, it = 0; n < n_hi; ++n, ++it) {
      const int row = k0 + n * kBlockN;  // rows past the sequence: the next one's (masked) or zeros past the tensor
      const pipeline::PipelineState st = pipeline::PipelineState::at(it, kStages);
      for (int is_v = 0; is_v < 2; ++is_v) {
        const pipeline::StageRing kv_ring = is_v ? v_ring : k_ring;
        if (it >= kStages) kv_ring.producer_acquire_suspend(st);
        uint8_t* dst = ring + st.stage * Tile::kStageBytes + is_v * Tile::kKVBytes;
        uint64_t* bar = kv_ring.full_barrier(st);
        const CUtensorMap* map = is_v ? &a.v_map : &a.k_map;
        ptx::mbarrier_arrive_expect_tx(bar, Tile::kKVBytes);
        for_each_box(row, [&](int r, int coord, int outer) {
#pragma unroll
          for (int c = 0; c < Tile::kChunks; ++c)
            ptx::tma_load_4d(dst + c * Tile::kKVChunkBytes + r * 128, map, bar, 64 * c, coord, kvh, outer);
        });
      }
    }
    return;
  }

  // ---- consumers -----------------------------------------------------------------------------------------------
  ptx::setmaxnreg_inc<kConsumerRegs<kQuant>>();
  const int cw = wg - 1;                         // consumer warpgroup: query rows 64 cw .. 64 cw + 63
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
  const int row0 = 64 * cw + 16 * warp + r;      // this thread's rows in the tile: row0 and row0 + 8
  // Their tokens in the tile, heads (from h) and positions. Rows past q_heads · q_tokens (a packing of a group
  // that does not divide 128) hold stale values: computed, never written.
  const int tok_in_tile[2] = {row0 % tile_tokens, (row0 + 8) % tile_tokens};
  const int head_in_tile[2] = {row0 / tile_tokens, (row0 + 8) / tile_tokens};
  const int pos_row[2] = {pos_first + tok_in_tile[0], pos_first + tok_in_tile[1]};
  const bool wg_leader = threadIdx.x % 128 == 0;
  // fp8 caches: the keys' scale multiplies S, the values' multiplies O (both per tensor or per KV head).
  float qk_scale = a.scale_log2, v_scale = 1.0f;
  if constexpr (kQuant) {
    if constexpr (kFormat == KVFormat::kFP8) {
      const int i = a.quant.fp8_per_head ? kvh : 0;
      qk_scale *= a.quant.k_fp8[i];
      v_scale = a.quant.v_fp8[i];
    }
  }
  float o_acc[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o_acc[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
  float s_acc[kSRegs];
  uint32_t p_frag[kBlockN / 16][4];  // P of the previous key tile as A fragments, k-steps of 16 keys

  // Turns (FA3's ping-pong): a warpgroup issues its GEMMs only in its turn, between a sync on its own named barrier
  // and an arrival on the other's, so one warpgroup's softmax runs while the other's GEMMs hold the tensor cores.
  // Warpgroup 0 takes the first turn. Turn t issues S of key tile t and P·V of tile t - 1, so the softmax of tile t
  // also overlaps P·V of tile t - 1 inside the warpgroup: n_tiles + 1 turns each (the first without P·V, the last
  // without S, peeled so that every wgmma sits on a non-divergent path). Warpgroup 1's last arrival, which nobody
  // would wait for, is skipped so both barriers end the CTA empty.
  const int n_tiles = n_hi - n_lo;
  const int my_turn = barrier_id(PrefillBarrier::kTurn, cw);
  const int other_turn = barrier_id(PrefillBarrier::kTurn, 1 - cw);
  const uint8_t* q_rows = q_tile + cw * 64 * 128;  // this warpgroup's 64 rows of every column block

  // S = Q Kᵀ over D in k-steps of 16 (4 per 128-byte column block: +32 bytes each), one commit group.
  // Descriptor bases: a tile's descriptor plus (byte offset >> 4) addresses the same layout further on (the start
  // address field holds address >> 4; shared memory stays below 2^18 bytes, so the sum never carries out of it).
  // D 256 (128 accumulator registers for O) keeps no bases in registers: ptxas spills them there; it computes each
  // descriptor from its address instead.
  constexpr bool kHoist = kD != 256;
  const uint64_t q_desc = ptx::wgmma_desc_k_major_sw128(q_rows);
  const uint64_t k_desc = ptx::wgmma_desc_k_major_sw128(ring);
  const uint64_t v_desc = ptx::wgmma_desc_mn_major_sw128(ring + Tile::kKVBytes, Tile::kKVChunkBytes);
  // The descriptors of Q's k-step ks, of K's k-step ks in stage `stage`, and of V's k-step kk in stage `stage`.
  auto desc_q = [&](int ks) {
    if constexpr (kHoist) return q_desc + (ks / 4) * (Tile::kQChunkBytes >> 4) + 2 * (ks % 4);
    return ptx::wgmma_desc_k_major_sw128(q_rows + (ks / 4) * Tile::kQChunkBytes) + 2 * (ks % 4);
  };
  auto desc_k = [&](int stage, int ks) {
    if constexpr (kHoist)
      return k_desc + static_cast<uint64_t>(stage * (Tile::kStageBytes >> 4)) + (ks / 4) * (Tile::kKVChunkBytes >> 4) +
             2 * (ks % 4);
    return ptx::wgmma_desc_k_major_sw128(ring + stage * Tile::kStageBytes + (ks / 4) * Tile::kKVChunkBytes) +
           2 * (ks % 4);
  };
  auto desc_v = [&](int stage, int kk) {
    if constexpr (kHoist) return v_desc + static_cast<uint64_t>(stage * (Tile::kStageBytes >> 4)) + kk * (2048 >> 4);
    return ptx::wgmma_desc_mn_major_sw128(ring + stage * Tile::kStageBytes + Tile::kKVBytes + kk * 2048,
                                          Tile::kKVChunkBytes);
  };
  auto issue_s = [&](int t) {
    k_ring.consumer_wait(pipeline::PipelineState::at(t, kStages));
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint64_t da = desc_q(ks), db = desc_k(t % kStages, ks);
      if constexpr (kFP16)
        ptx::Wgmma<kBlockN>::mma_f16(s_acc, da, db, ks > 0);
      else
        ptx::Wgmma<kBlockN>::mma_bf16(s_acc, da, db, ks > 0);
    }
    ptx::wgmma_commit_group();
  };
  // O = alpha · O + P V of tile t: V's rows are the keys (K of this product), 16 per step (two 8-row swizzle atoms,
  // 2048 bytes), one commit group.
  auto issue_pv = [&](int t) {
    if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {  // per warp: its 16 rows
#pragma unroll
      for (int j = 0; j < kORegs / 4; ++j) {
        o_acc[4 * j] *= alpha[0];
        o_acc[4 * j + 1] *= alpha[0];
        o_acc[4 * j + 2] *= alpha[1];
        o_acc[4 * j + 3] *= alpha[1];
      }
    }
    v_ring.consumer_wait(pipeline::PipelineState::at(t, kStages));
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t db = desc_v(t % kStages, kk);
      if constexpr (kFP16)
        ptx::Wgmma<kD>::mma_f16_rs_tb(o_acc, p_frag[kk], db, 1);
      else
        ptx::Wgmma<kD>::mma_bf16_rs_tb(o_acc, p_frag[kk], db, 1);
    }
    ptx::wgmma_commit_group();
  };
  // The stage of tile t has been read by this warpgroup's wgmma: one arrival per warpgroup.
  auto release = [&](const pipeline::StageRing& kv_ring, int t) {
    __syncwarp();
    if (wg_leader) kv_ring.consumer_release(pipeline::PipelineState::at(t, kStages));
  };
  // The online softmax of tile t on S (in place, becoming P), in the log2 domain; sets alpha, m_run, l_run.
  auto softmax = [&](int t) {
    // Without softcap S stays raw and the scale folds into the exponent's FMA: p = 2^(S·mul − m).
    float mul = qk_scale;
    if (a.softcap_log2 > 0.0f) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) s_acc[i] = a.softcap_log2 * ptx::tanh_ex2(s_acc[i] * qk_scale);
      mul = 1.0f;
    }
    // Keys outside a row's range become -inf where the tile crosses a boundary.
    // s_acc[4j + e]: row row0 + 8 (e >> 1), key n·kBlockN + 8j + 2c + (e & 1).
    const int key0 = (n_lo + t) * kBlockN;
    const bool crosses = key0 + kBlockN > sk || (a.causal && key0 + kBlockN - 1 > pos_first) ||
                         (a.window > 0 && key0 < pos_last - a.window + 1);
    if (crosses) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int key = key0 + 8 * (i / 4) + 2 * c + (i & 1);
        const int pos = pos_row[(i >> 1) & 1];
        // Bitwise, not short-circuit: no branch per element.
        const bool ok = (key < sk) & (!a.causal | (key <= pos)) & ((a.window <= 0) | (pos - key < a.window));
        s_acc[i] = ok ? s_acc[i] : -INFINITY;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      // Four independent chains each for the row max and the row sum (the chains' latency, not the ALU, bounds them).
      float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j)
        mx4[j % 4] = fmaxf(mx4[j % 4], fmaxf(s_acc[4 * j + 2 * hr], s_acc[4 * j + 2 * hr + 1]));
      float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The running max moves only when the tile's max exceeds it by more than kMaxSlack (FlashAttention-4's
      // conditional rescale): P stays below 2^kMaxSlack, O and l stay relative to the same (stale) max, so the result
      // is unchanged, and most tiles then leave O unscaled (alpha 1). -inf + slack is -inf: a row's first keys move it.
      const float m_tile = mx * mul;
      const bool grow = m_tile > m_run[hr] + kMaxSlack;
      alpha[hr] = grow ? ptx::ex2_approx_ftz(m_run[hr] - m_tile) : 1.0f;
      m_run[hr] = grow ? m_tile : m_run[hr];
      const float base = m_run[hr] == -INFINITY ? 0.0f : m_run[hr];  // a row without keys so far keeps zero weight
      float sum4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j) {
        const float p0 = ptx::ex2_approx_ftz(fmaf(s_acc[4 * j + 2 * hr], mul, -base));
        const float p1 = ptx::ex2_approx_ftz(fmaf(s_acc[4 * j + 2 * hr + 1], mul, -base));
        s_acc[4 * j + 2 * hr] = p0;
        s_acc[4 * j + 2 * hr + 1] = p1;
        sum4[j % 4] += p0 + p1;
      }
      const float sum0 = sum4[0] + sum4[1], sum1 = sum4[2] + sum4[3];
      l_run[hr] = l_run[hr] * alpha[hr] + (sum0 + sum1);
    }
  };
  // P as the A fragments of k-steps of 16 keys: step kk takes S's n8 blocks 2kk (columns 0-7) and 2kk + 1.
  auto convert_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = pack2<kFP16>(s_acc[8 * kk], s_acc[8 * kk + 1]);
      p_frag[kk][1] = pack2<kFP16>(s_acc[8 * kk + 2], s_acc[8 * kk + 3]);
      p_frag[kk][2] = pack2<kFP16>(s_acc[8 * kk + 4], s_acc[8 * kk + 5]);
      p_frag[kk][3] = pack2<kFP16>(s_acc[8 * kk + 6], s_acc[8 * kk + 7]);
    }
  };

  // V rows of a tile that no query row of this CTA attends and that may hold anything (P is 0 there, but 0 · NaN is
  // NaN): the first tile's rows below the window of every row (lo_key; keys an engine may have dropped, or never
  // written), and the last tile's rows past the sequence's keys (the next sequence's rows, or never-written cache
  // slots). Warpgroup 0 zeroes rows r < head_rows and r >= tail_from of tile t, once the tile has landed, before its
  // own P·V of the tile and before it opens the turn in which warpgroup 1 issues its P·V of the tile.
  const int head = lo_key - n_lo * kBlockN;  // 0 <= head < kBlockN
  auto zero_v_rows = [&](int t, int head_rows, int tail_from) {
    v_ring.consumer_wait(pipeline::PipelineState::at(t, kStages));
    uint8_t* v_tile = ring + (t % kStages) * Tile::kStageBytes + Tile::kKVBytes;
    const int rows = head_rows + (kBlockN - tail_from);  // 128-byte lines per 64-column block, of 8 16-byte units
    for (int i = threadIdx.x % 128; i < Tile::kChunks * rows * 8; i += 128) {
      const int unit = i % 8, line = i / 8, ch = line / rows, j = line % rows;
      const int r = j < head_rows ? j : tail_from + (j - head_rows);
      ptx::st_shared_v4(v_tile + ch * Tile::kKVChunkBytes + r * 128 + unit * 16, make_uint4(0u, 0u, 0u, 0u));
    }
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(barrier_id(PrefillBarrier::kVTail), 128);
  };

  if (n_tiles > 0) {
    if (cw == 1) ptx::named_barrier_arrive(barrier_id(PrefillBarrier::kTurn, 0), 256);
    ptx::mbarrier_wait_parity(kQuant ? q_ready : q_full, 0);
    // Turn 0: S of tile 0 only.
    ptx::named_barrier_sync(my_turn, 256);
    issue_s(0);
    ptx::named_barrier_arrive(other_turn, 256);
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(s_acc);
    release(k_ring, 0);
    softmax(0);
    // The first tile's rows below the window, zeroed before either warpgroup's P·V of it (warpgroup 1's comes in its
    // turn after warpgroup 0's next one): here, outside the loop, so that the loop keeps its registers. The
    // quantized kernel's producer warpgroup zeroes them as it converts the tile (convert_tile).
    if (!kQuant && cw == 0 && head > 0) zero_v_rows(0, head, kBlockN);
    // Turns 1 .. n_tiles - 1: S of tile t, P·V of tile t - 1. An iteration ends with the softmax of tile t and
    // starts by waiting for P·V of tile t - 2 before P of tile t - 1 takes the fragments: the wait sits behind the
    // loop's back edge, where ptxas cannot schedule it ahead of the softmax (inside one block it does, which
    // serializes the softmax behind P·V).
    for (int t = 1; t < n_tiles; ++t) {
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_registers(o_acc);
      if (t >= 2) release(v_ring, t - 2);
      convert_p();
      ptx::named_barrier_sync(my_turn, 256);
      issue_s(t);
      issue_pv(t - 1);
      ptx::named_barrier_arrive(other_turn, 256);
      ptx::wgmma_wait_group<1>();
      ptx::wgmma_fence_registers(s_acc);
      release(k_ring, t);
      softmax(t);
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(o_acc);
    if (n_tiles >= 2) release(v_ring, n_tiles - 2);
    convert_p();
    // Turn n_tiles: P·V of the last tile, its rows past the sequence's keys zeroed first.
    ptx::named_barrier_sync(my_turn, 256);
    const int tail = sk - (n_lo + n_tiles - 1) * kBlockN;  // rows of the last tile that are keys
    if (cw == 0 && tail < kBlockN) zero_v_rows(n_tiles - 1, 0, tail);
    issue_pv(n_tiles - 1);
    if (cw == 0) ptx::named_barrier_arrive(other_turn, 256);
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(o_acc);
    release(v_ring, n_tiles - 1);
  }

  // ---- epilogue: o = O / l in q's dtype, lse = (m + log2 l) · ln 2 -----------------------------------------------
  float inv[2], lse2[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = l_run[hr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[hr] = l > 0.0f ? v_scale / l : 0.0f;
    lse2[hr] = l > 0.0f ? m_run[hr] + __log2f(l) : -INFINITY;
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int qi = m_block * tile_tokens + tok_in_tile[hr];  // query index in the sequence
    const int64_t tok = static_cast<int64_t>(q0) + qi;
    if (head_in_tile[hr] >= a.q_heads || qi >= sq || tok < 0 || tok >= a.total_q) continue;
    const int head = h + head_in_tile[hr];
    uint32_t* orow = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.o) + tok * a.o_stride_token +
                                                 head * a.o_stride_head + bc * a.o_stride_batch);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j)
      orow[4 * j + c] = kQuant && a.q_bf16
                            ? pack2<false>(o_acc[4 * j + 2 * hr] * inv[hr], o_acc[4 * j + 2 * hr + 1] * inv[hr])
                            : pack2<kFP16>(o_acc[4 * j + 2 * hr] * inv[hr], o_acc[4 * j + 2 * hr + 1] * inv[hr]);
    if (a.lse != nullptr && c == 0)
      a.lse[tok * a.lse_stride_token + head * a.lse_stride_head + bc * a.lse_stride_batch] =
          lse2[hr] == -INFINITY ? -INFINITY : lse2[hr] * 0.69314718055994531f;
  }
}

}  // namespace tessera::attention::detail
