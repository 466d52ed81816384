// Decode kernel (split-K flash-decoding over a low-precision KV cache), sm_80+ mma.sync path.
//
// One CTA = (sequence b, KV head, split of the sequence, tile of 8 or 16 query heads of that KV head). Its 4 warps
// take the split's stages of 16 or 32 tokens (kv_format.cuh: kRows) round-robin; each warp keeps its own
// online-softmax state over its stages, per 16-token mma tile:
//   S^T (16 tokens × 8 heads per n-tile) = K · Q^T on tensor cores, P = exp2(S - m), O^T += V^T · P^T,
// with P^T moved from S^T's accumulator layout to a B operand by movmatrix. Tokens are the mma's M, so a group of
// 8 query heads fills N without padding.
// Keys and values travel by TMA: lane 0 of each warp loads a stage's key block and value block (one 5-D box each,
// or one per page for 16-token pages; swizzled, see kv_format.cuh) into a ring of kStages stages per warp that
// completes on an mbarrier per stage; each lane then reads the bytes of its own fragments. The stage's scale pairs
// go by cp.async to a warp-shared row block (4-byte copies). No CTA barrier in the main loop.
// At the end the 4 warps merge through shared memory; with one split the CTA writes o (and lse), otherwise a
// normalized partial O and its log2-sum-exp go to the workspace for the merge kernel.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/decode/config.h"
#include "attention/decode/kv_format.cuh"
#include "attention/decode/problem.h"
#include "common/numeric.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/grid.cuh"
#include "ptx/math.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"

namespace tessera::attention::detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.69314718055994531f;

struct DecodeArgs {
  // TMA maps of the key and value rows (bytes), built by launch_decode:
  //   keys   dims (W, rowB / W, HKV, tokens, outer), box (W, rowB / W, 1, 16, 1)
  //   values dims (W, tokens, rowB / W, HKV, outer), box (W, 16, rowB / W, 1, 1)
  // with W = min(rowB, 128) the swizzle span, tokens = T_max or the page size, outer = B or the pages.
  CUtensorMap k_map, v_map;
  CacheDesc cache;
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_s = 0, q_stride_h = 0;
  void* o = nullptr;
  int64_t o_stride_b = 0, o_stride_s = 0, o_stride_h = 0;
  float* lse = nullptr;
  int64_t lse_stride_b = 0, lse_stride_s = 0, lse_stride_h = 0;
  const int32_t* seqlens = nullptr;
  bool q_fp16 = false;  // q and o dtype: fp16 or bf16
  int num_q_heads = 0;
  int group = 0;       // query heads per KV head (G)
  int num_new = 1;     // new query tokens per sequence (S), causal among themselves
  int rows = 0;        // query rows per KV head, S * G: row i * G + j is token i of head j
  int head_tiles = 0;  // decode_head_tiles(rows)
  int batch = 0;       // B
  int num_splits = 1;  // per sequence (classic), or the budget per sequence of a balanced plan (config.h)
  bool balanced = false;  // DecodeProblem::balanced: the splits follow the device lengths (the kBalanced kernel)
  int max_seq_splits = 1;  // balanced: decode_max_seq_splits(num_splits)
  bool programmatic = false;  // launched as a programmatic dependent (config.h: decode_launch_programmatic)
  float qk_scale = 0;  // softmax_scale (× the fp8 key scale is applied per head in the kernel)
  float softcap = 0;
  int window = 0;
  // The split workspace: B·splits slots of S·HQ rows; sequence b's n splits own the slots [f, f + n) (classic: f =
  // b · splits, n = splits; balanced: from the plan), and split j of its query row (i, h) is row
  // f · S · HQ + (i · HQ + h) · n + j (classic: [B, S, HQ, splits]).
  float* ws_o = nullptr;      // [rows, D] fp32, normalized partial outputs
  float* ws_lse = nullptr;    // [rows] fp32, log2 domain
  int2* ws_plan = nullptr;    // balanced: [B] (first slot, splits) of each sequence, written by its split 0
  // Measurement builds only (-DTESSERA_DECODE_TRACE, bench/decode_trace.cu): per CTA below trace_ctas, thread 0
  // writes (%globaltimer, clock64) at kDecodeTraceEvents points of the decode kernel, then kMergeTraceEvents of the
  // merge kernel's CTA of the same index, at trace (null: nothing written).
  unsigned long long* trace = nullptr;
  int trace_ctas = 0;
};

inline constexpr int kDecodeTraceEvents = 8, kMergeTraceEvents = 4;
#ifdef TESSERA_DECODE_TRACE
// Event ev of this CTA: region 0 the decode kernel's events, region 1 the merge's. Written before the kernel's
// griddepcontrol.wait too (its first event), into a buffer no other kernel touches: measurement builds only.
__device__ __forceinline__ void decode_trace_mark(const DecodeArgs& a, int region, int ev) {
  if (a.trace == nullptr || threadIdx.x != 0 || static_cast<int>(blockIdx.x) >= a.trace_ctas) return;
  const unsigned long long g = ptx::globaltimer();
  const int64_t base = region == 0 ? int64_t{blockIdx.x} * kDecodeTraceEvents
                                   : int64_t{a.trace_ctas} * kDecodeTraceEvents + int64_t{blockIdx.x} * kMergeTraceEvents;
  a.trace[2 * (base + ev)] = g;
  a.trace[2 * (base + ev) + 1] = static_cast<unsigned long long>(clock64());
}
#define TESSERA_DECODE_MARK(region, ev) decode_trace_mark(a, region, ev)
#else
#define TESSERA_DECODE_MARK(region, ev) ((void)0)
#endif

template <class T, int kNT>
struct DecodeLayout {
  static constexpr DecodeConfig kCfg = decode_config(T::kFmt, T::kD, kNT);
  static_assert(kCfg.stage_bytes == T::kStageBytes, "config.h and kv_format.cuh disagree on the staging size");
  static constexpr int kStages = kCfg.stages;
  static constexpr int kQBytes = kCfg.q_bytes;  // query fragments: [n-tile][k-step][lane] uint2
  static constexpr int kPairRingOff = kQBytes + kDecodeWarps * kStages * T::kDataBytes;
  static constexpr int kBarOff = kCfg.bar_off;
  static constexpr int kConstOff = kCfg.const_off;
  static constexpr int kBytes = kCfg.smem_bytes;  // with kDecodeSmemAlign of slack for aligning the base
};

using ::tessera::detail::pack2;

// Writes o[b, i, h, d] in q's dtype and, from the d = 0 thread, lse[b, i, h] (natural log; lse2 is in the log2
// domain, -inf when nothing was attended). Shared by the single-split epilogue and the merge kernel.
__device__ __forceinline__ void store_output(const DecodeArgs& a, int b, int i, int h, int d, float out, float lse2,
                                             bool any) {
  const int64_t at = b * a.o_stride_b + i * a.o_stride_s + h * a.o_stride_h + d;
  if (a.q_fp16)
    static_cast<__half*>(a.o)[at] = __float2half_rn(out);
  else
    static_cast<__nv_bfloat16*>(a.o)[at] = __float2bfloat16_rn(out);
  if (a.lse != nullptr && d == 0)
    a.lse[b * a.lse_stride_b + i * a.lse_stride_s + h * a.lse_stride_h] = any ? lse2 * kLn2 : -INFINITY;
}

template <int kBytes>
__device__ __forceinline__ void lds_words(const uint8_t* p, uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    static_assert(kBytes == 4, "chunks are 4, 8 or 16 bytes");
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

__device__ __forceinline__ float2 half2_to_float2(uint32_t u) { return __half22float2(as_half2(u)); }

// The split a CTA runs: sequence b, split `split` of `splits`, `slot` its workspace slot.
struct DecodeSplit {
  int b, split, splits, slot, len;
};

// The balanced plan (config.h, decode_balanced), computed by each warp alone from all B lengths (no shared memory,
// no CTA barrier): lane l takes sequences [l·n, l·n + n), n = ceil(B / 32) <= kDecodePlanPerLane, all of its loads
// issued at once and their stage counts held in registers (with a branch per sequence the loads went one round trip
// after another, v18b). Stages per split: chunk = max(ceil(W / (B·S)), ceil(longest / max_seq_splits), 4) for the
// batch's W stages, raised until the splits, max(1, ceil(tiles_b / chunk)) per sequence, number at most B·S (equal
// lengths fit at once, as many non-empty splits as the classic plan's; the ceilings of a skewed batch may need one or
// two more rounds; config.h holds the arithmetic, which the CPU tests check). Split slots are numbered
// in order of b. key is a slot: returns (b, split, splits, 1), or w = 0 for a slot past the plan. Every warp returns
// the same. Out of line, so that its registers do not add to the main loop's.
inline constexpr int kDecodePlanPerLane = (kDecodeBalanceMaxBatch + 31) / 32;
// What the plan reads, by value (in registers: the out-of-line function would otherwise load each field of the
// kernel's parameters through generic addresses).
struct DecodePlanArgs {
  const int32_t* seqlens;
  int64_t capacity;
  int batch, num_splits, max_seq_splits, num_new, window, rows_log2;
};
template <int kPerLane>
__device__ __noinline__ int4 decode_plan(const DecodePlanArgs a, int key) {
  const int lane = threadIdx.x % 32;
  const int per_lane = kPerLane == 1 ? 1 : (a.batch + 31) / 32, first = lane * per_lane;
  int tiles[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {  // every load first (an index inside [0, B) for each), then the arithmetic
    const int b = first + k;
    tiles[k] = a.seqlens[b < a.batch ? b : a.batch - 1];
  }
  long long total = 0;
  int longest = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const bool valid = k < per_lane && first + k < a.batch;
    tiles[k] = valid ? decode_num_tiles(decode_clamped_len(tiles[k], a.capacity), a.num_new, a.window, a.rows_log2)
                     : -1;  // -1: no sequence
    total += valid ? tiles[k] : 0;
    longest = tiles[k] > longest ? tiles[k] : longest;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    const int m = __shfl_xor_sync(0xffffffffu, longest, o);
    longest = m > longest ? m : longest;
  }
  // config.h's plan arithmetic (shared with the CPU tests).
  const int budget = a.batch * a.num_splits;
  int chunk = decode_plan_first_chunk(total, longest, budget, a.max_seq_splits);
  auto splits = [&](int k) { return decode_plan_splits(tiles[k], chunk); };
  int mine, count;
  for (;;) {  // at most a few rounds: the count falls towards B <= B·S as the chunk grows
    mine = 0;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) mine += splits(k);
    count = mine;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
    if (count <= budget) break;
    chunk = decode_plan_next_chunk(chunk, count, budget);
  }
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  int off = incl - mine;
  if (key >= count) return make_int4(0, 0, 1, 0);
  int4 found = make_int4(0, 0, 1, 1);
  const bool owner_lane = key >= off && key < incl;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int n = splits(k);
    if (owner_lane && key >= off && key < off + n) found = make_int4(first + k, key - off, n, 1);
    off += n;
  }
  const int owner = __ffs(__ballot_sync(0xffffffffu, owner_lane)) - 1;
  return make_int4(__shfl_sync(0xffffffffu, found.x, owner), __shfl_sync(0xffffffffu, found.y, owner),
                   __shfl_sync(0xffffffffu, found.z, owner), 1);
}
__device__ __forceinline__ int4 decode_plan_lookup(const DecodePlanArgs& pa, int slot) {
  return pa.batch <= 32 ? decode_plan<1>(pa, slot) : decode_plan<kDecodePlanPerLane>(pa, slot);
}

// kBalanced: a.balanced, a separate instantiation so that the plan's code and registers stay out of the classic
// kernel (with one kernel for both, ptxas spilled up to ~110 more bytes in several instantiations).
template <class T, int kNT, bool kBalanced>
__global__ void __launch_bounds__(kDecodeThreads, DecodeLayout<T, kNT>::kCfg.ctas_per_sm)
    decode_kernel(const __grid_constant__ DecodeArgs a) {
  using L = DecodeLayout<T, kNT>;
  constexpr int kD = T::kD;
  constexpr int kStages = L::kStages;
  constexpr int kRows = T::kRows;      // tokens per stage
  constexpr int kHalves = T::kHalves;  // 16-token mma tiles per stage
  constexpr bool kF16 = T::kMmaFP16;
  constexpr int kKSteps = kD / 16;
  constexpr int kMTiles = kD / 16;  // O^T m-tiles of 16 output columns
  constexpr int kHeads = 8 * kNT;   // query heads per CTA
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // TMA's swizzle pattern follows the address bits: start the layout on its repeat.
  uint8_t* smem = smem_raw + ((kDecodeSmemAlign - (ptx::smem_u32(smem_raw) & (kDecodeSmemAlign - 1))) &
                              (kDecodeSmemAlign - 1));
  uint2* q_frag = reinterpret_cast<uint2*>(smem);
  uint8_t* staging = smem + L::kQBytes;  // the data ring; the merge area at the end overlaps it

  // A plainly launched grid lets the stream's next kernel, where that is a programmatic dependent (the merge, the
  // next call's small decode, a user's kernel launched so; each waits for this grid's completion before it touches
  // what this grid writes), be scheduled once every CTA has started; a programmatic grid does so after its own wait,
  // below.
  TESSERA_DECODE_MARK(0, 0);  // entry
  if (!a.programmatic) ptx::launch_dependents();
  const CacheDesc& cd = a.cache;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
  // blockIdx.x = (slot · HKV + kvh) · head_tiles + ht (balanced: the slot's sequence and split come from the plan),
  // ((b · HKV + kvh) · splits + split) · head_tiles + ht (classic).
  int idx = blockIdx.x;
  const int ht = idx % a.head_tiles;
  idx /= a.head_tiles;
  int kvh;
  DecodeSplit sp{0, 0, a.num_splits, 0, 0};
  if constexpr (kBalanced) {
    kvh = idx % cd.num_kv_heads;
    sp.slot = idx / cd.num_kv_heads;
  } else {
    sp.split = idx % a.num_splits;
    idx /= a.num_splits;
    kvh = idx % cd.num_kv_heads;
    sp.b = idx / cd.num_kv_heads;
    sp.slot = sp.b * a.num_splits + sp.split;
  }

  // ---- per-warp pipeline over this warp's stages -------------------------------------------------------------
  uint8_t* my_data = staging + warp * kStages * T::kDataBytes;
  uint8_t* my_pairs = smem + L::kPairRingOff + warp * kStages * T::kPairBytes;
  uint64_t* my_bars = reinterpret_cast<uint64_t*>(smem + L::kBarOff) + warp * kStages;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&my_bars[s], 1);
    ptx::fence_mbarrier_init();
  }
  __syncwarp();
  if (threadIdx.x == 0 && cd.capacity > 0) {  // capacity 0: no maps were built, and no copy is issued
    ptx::prefetch_tensormap(&a.k_map);
    ptx::prefetch_tensormap(&a.v_map);
  }
  // The kernel is launched as a programmatic dependent of the stream's previous kernel (v16, docs/perf/decode.md):
  // its CTAs may start while that kernel runs (after it triggered, or as its last CTAs exit) and do the set-up above,
  // which touches no global memory but the kernel's own parameters; here they wait until that kernel has completed
  // and its writes (q, the cache, the lengths, and a previous merge's reads of the workspace) are settled. Nothing
  // in global memory is read or written before this line. Without the launch attribute the wait returns at once.
  ptx::grid_dependency_wait();
  // A programmatic grid lets the stream's next kernel (the merge, or the next call's decode) be scheduled once every
  // CTA of this grid has got here; it waits for this grid's completion before touching anything. Triggering after the
  // wait, not at the start, keeps the chain of early-launched grids short: with the trigger first (and the merge's),
  // the CTAs of several calls ahead became resident, each waiting on the one before, packed onto the SMs the running
  // grids left free, and the 8- and 4-bit rows at B <= 32 ran 10-64 % slower (v16's first form, docs/perf/decode.md).
  if (a.programmatic) ptx::launch_dependents();
  TESSERA_DECODE_MARK(0, 1);  // past the wait

  // This CTA's sequence and split. Classic: from the grid index; the length is read below, after q's loads are
  // issued, so that the two round trips overlap (v17: the lengths, then q, took ~0.6 + ~1.1 us at B 1,
  // tessera-decode-trace). Balanced: the plan over all lengths first (q's address needs b); q's round trip then
  // overlaps the first stages' copies instead.
  if constexpr (kBalanced) {
    const DecodePlanArgs pa{a.seqlens, cd.capacity, a.batch, a.num_splits, a.max_seq_splits, a.num_new, a.window,
                            __builtin_ctz(static_cast<unsigned>(kRows))};
    const int4 w = decode_plan_lookup(pa, sp.slot);
    if (w.w == 0) return;  // a slot past the plan
    sp.b = w.x;
    sp.split = w.y;
    sp.splits = w.z;
    sp.len = decode_clamped_len(a.seqlens[sp.b], cd.capacity);  // an L1 hit: this warp read it in the plan
  }
  const int b = sp.b, split = sp.split;

  // The raw bits of this thread's query values (the fragments below).
  constexpr int kQIters = (kNT * kKSteps * 32 + kDecodeThreads - 1) / kDecodeThreads;
  uint16_t q_raw[kQIters][4];
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int e = threadIdx.x + it * kDecodeThreads;
    const int nt = e / (kKSteps * 32), ks = (e / 32) % kKSteps, ln = e % 32, rr = ln / 4, cc = ln % 4;
    const int jr = ht * kHeads + nt * 8 + rr;  // query row: token jr / G, head jr % G
#pragma unroll
    for (int i = 0; i < 4; ++i) q_raw[it][i] = 0;  // +0 in both 16-bit types
    if (e < kNT * kKSteps * 32 && jr < a.rows) {
      const int tok = jr / a.group, j = jr - tok * a.group;
      const int64_t base =
          b * a.q_stride_b + tok * a.q_stride_s + static_cast<int64_t>(kvh * a.group + j) * a.q_stride_h;
#pragma unroll
      for (int i = 0; i < 4; ++i) q_raw[it][i] = static_cast<const uint16_t*>(a.q)[base + k_dim<T>(cc, 4 * ks + i)];
    }
  }

  // Query token i of the S new ones sits at position len - S + i and attends to keys [lo_i, lim_i): lim_i =
  // len - S + 1 + i (causal), lo_i = max(0, lim_i - window) (window 0: 0). Together they read keys [lo, len), in
  // stages of kRows tokens counted from tile_base (kRows-aligned); this split owns a contiguous run of stages.
  // Positions are int32: check_cache keeps the capacity below 2^31.
  const int len = kBalanced ? sp.len : decode_clamped_len(a.seqlens[b], cd.capacity);
  // lim_0 (may be <= 0: the first tokens attend to nothing), lo_0 and lo_{S-1}; recomputed where needed from len
  // and the parameters rather than held in registers through the main loop.
  auto lim_first = [&] { return len - a.num_new + 1; };
  auto lo_of = [&](int lim) { return decode_lo(lim, a.window); };
  const int lo = lo_of(lim_first());
  const int tile_base = lo & ~(kRows - 1);
  static_assert((kRows & (kRows - 1)) == 0, "stages of a power-of-two rows");
  const int num_tiles = decode_num_tiles(len, a.num_new, a.window, __builtin_ctz(kRows));
  const int per_split = (num_tiles + sp.splits - 1) / sp.splits;
  const int first_tile = split * per_split;
  int split_tiles = num_tiles - first_tile;
  split_tiles = split_tiles < 0 ? 0 : (split_tiles > per_split ? per_split : split_tiles);
  const int my_tiles = split_tiles > warp ? (split_tiles - warp + kDecodeWarps - 1) / kDecodeWarps : 0;

  // First token of this warp's stage i (only taken for stages that start below len, so it fits int32).
  auto tile_tok0 = [&](int i) { return tile_base + (first_tile + warp + kDecodeWarps * i) * kRows; };

  // Block-table entries of a stage, fetched a stage ahead of its copy: one per 16 tokens where pages are shorter
  // than a stage (16-token pages under 32-row stages), else one. Entries of tokens at or past len are not read.
  const bool split_pages = kHalves > 1 && cd.paged && cd.page_size < kRows;
  const int32_t* bt_row = cd.paged ? cd.block_table + b * cd.block_table_stride : nullptr;
  auto stage_pages = [&](int i, int32_t (&pg)[kHalves]) {
    const int tok0 = tile_tok0(i);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int tok = tok0 + 16 * h;
      pg[h] = cd.paged && (h == 0 || (split_pages && tok < len)) ? __ldg(bt_row + (tok >> cd.log2_page_size)) : -1;
    }
  };
  constexpr uint32_t kHalfMask = (1u << kHalves) - 1;
  uint32_t page_ok_bits = 0;  // bit kHalves * s + h: half h of the stage in ring slot s lies on a valid page
  // Row `row` of the stage at tok0 is attended: inside [lo, len) and on a half whose page is valid (halves_ok).
  auto attended = [&](int row, int tok0, uint32_t halves_ok) {
    return row >= lo - tok0 && row < len - tok0 && ((halves_ok >> (row >> 4)) & 1u);
  };

  // Scale pairs: lane l copies those of key row l and value row l (32-row stages), or of key row l (l < 16) or
  // value row l - 16 (16-row stages), kGroups 4-byte words each.
  const int64_t scale_base = kvh * cd.scale_stride_head + (cd.paged ? 0 : b * cd.scale_stride_outer);

  auto issue = [&](int i, int stage, const int32_t (&pg)[kHalves]) {
    const int tok0 = tile_tok0(i);
    int32_t outer[kHalves];
    uint32_t ok = 0;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int32_t page = split_pages ? pg[h] : pg[0];
      const bool valid = !cd.paged || (page >= 0 && page < cd.num_pages);
      outer[h] = cd.paged ? (valid ? page : -1) : b;  // -1: outside the maps, TMA reads zeros
      ok |= valid ? 1u << h : 0u;
    }
    page_ok_bits = (page_ok_bits & ~(kHalfMask << (kHalves * stage))) | (ok << (kHalves * stage));
    const int slot = cd.paged ? tok0 & (cd.page_size - 1) : tok0;
    if (lane == 0) {  // whole blocks; rows past the tensor (capacity, invalid page) arrive as zeros
      uint8_t* st = my_data + stage * T::kDataBytes;
      ptx::mbarrier_arrive_expect_tx(&my_bars[stage], T::kDataBytes);
      if (split_pages) {  // a 16-row box per page (slot 0: stages are 32-aligned)
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          ptx::tma_load_5d(st + 16 * h * T::kRowBytes, &a.k_map, &my_bars[stage], 0, 0, kvh, 0, outer[h]);
          ptx::tma_load_5d(st + T::kTileBytes + 16 * h * T::kRowBytes, &a.v_map, &my_bars[stage], 0, 0, 0, kvh,
                           outer[h]);
        }
      } else {
        ptx::tma_load_5d(st, &a.k_map, &my_bars[stage], 0, 0, kvh, slot, outer[0]);
        ptx::tma_load_5d(st + T::kTileBytes, &a.v_map, &my_bars[stage], 0, slot, 0, kvh, outer[0]);
      }
    }
    if constexpr (T::kPairs) {  // pairs of rows outside the attended ones read nothing (zeros)
      const int row = lane % kRows;
      const bool copy = attended(row, tok0, ok);
      const int tok = tok0 + row;
      const int32_t row_outer = kHalves > 1 && row >= 16 ? outer[kHalves - 1] : outer[0];
      const int64_t at = !copy ? 0
                         : cd.paged ? scale_base + row_outer * cd.scale_stride_outer +
                                          (tok & (cd.page_size - 1)) * cd.scale_stride_token
                                    : scale_base + tok * cd.scale_stride_token;
      uint8_t* dst = my_pairs + stage * T::kPairBytes + pair_pos(row) * T::kPairRowBytes;
      if constexpr (T::kKChannel) {
        // The stage's key block (one: stages are kRows-aligned and kRows <= kKeyBlock): its D scales and D offsets,
        // 16 bytes per lane and copy. A page that is not valid reads nothing (its logits are masked anyway).
        const bool block_ok = (ok & 1u) != 0;
        const int64_t kat =
            !block_ok ? 0
            : cd.paged ? outer[0] * cd.kc_stride_outer + ((tok0 & (cd.page_size - 1)) / kKeyBlock) * cd.kc_stride_block +
                             kvh * cd.kc_stride_head
                       : b * cd.kc_stride_outer + (tok0 / kKeyBlock) * cd.kc_stride_block + kvh * cd.kc_stride_head;
        uint8_t* kdst = my_pairs + stage * T::kPairBytes;
#pragma unroll
        for (int q = lane; q < kD / 4; q += 32)  // 4·D bytes in 16-byte pieces
          ptx::cp_async_zfill<16>(ptx::smem_u32(kdst + 16 * q), cd.k_scale + kat + 8 * q, block_ok ? 16 : 0);
      }
#pragma unroll
      for (int kv = 0; kv < 2 * kRows / 32; ++kv) {  // 0: keys, 1: values (32-row stages)
        const bool values = kRows == 32 ? kv == 1 : lane >= 16;
        if (T::kKChannel && !values) continue;  // the keys' scales came above
        const uint16_t* gs = (values ? cd.v_scale : cd.k_scale) + at;
        uint8_t* d = dst + (values ? T::kKeyPairBytes : 0);
#pragma unroll
        for (int g = 0; g < T::kGroups; ++g)
          ptx::cp_async_zfill<4>(ptx::smem_u32(d + 4 * g), gs + 2 * g, copy ? 4 : 0);  // 0: reads nothing
      }
    }
  };

#pragma unroll 1
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_tiles) {
      int32_t pg[kHalves];
      stage_pages(i, pg);
      issue(i, i, pg);
    }
    if constexpr (T::kPairs) ptx::cp_async_commit();
  }
  TESSERA_DECODE_MARK(0, 2);  // warp 0's first stages issued (the lengths read)
  int32_t next_pages[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) next_pages[h] = -1;
  if (kStages - 1 < my_tiles) stage_pages(kStages - 1, next_pages);

  float k_scale = 1.0f, v_scale = 1.0f;
  if constexpr (T::kFP8) {
    k_scale = cd.k_fp8_scale[cd.fp8_per_head ? kvh : 0];
    v_scale = cd.v_fp8_scale[cd.fp8_per_head ? kvh : 0];
  }

  // Query fragments of this head tile, [n-tile][k-step][lane] = the B registers of S^T = K Q^T (head n = r), D in
  // the order of k_dim, in the tensor-core type, from the raw bits loaded above. Quantized formats run in fp16: q is
  // saturated to its range.
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int e = threadIdx.x + it * kDecodeThreads;
    if (e >= kNT * kKSteps * 32) break;
    const int ks = (e / 32) % kKSteps, cc = (e % 32) % 4;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t u = q_raw[it][i];
      float x = a.q_fp16 ? __half2float(__ushort_as_half(u)) : __bfloat162float(__ushort_as_bfloat16(u));
      if constexpr (!T::kNative) x = fminf(fmaxf(x, -65504.0f), 65504.0f);
      if constexpr (T::kOddUnit) x = (k_dim<T>(cc, 4 * ks + i) & 1) ? x * (1.0f / kInt4OddUnit) : x;
      v[i] = x;
    }
    q_frag[e] = make_uint2(pack2<kF16>(v[0], v[1]), pack2<kF16>(v[2], v[3]));
  }
  if (T::kFold && threadIdx.x == 0)
    *reinterpret_cast<uint4*>(smem + L::kConstOff) =
        make_uint4(T::kVCentreEven, T::kVCentreOdd, T::kVCentreEven, T::kVCentreOdd);
  __syncthreads();
  TESSERA_DECODE_MARK(0, 3);  // query fragments in shared memory

  // Folded formats: Σ_d q_hd of the fp16 query values (qsum), and of the values as fed (qsum_fed: with int4's
  // odd D positions at 1/16; those are the fragments' second registers), for this lane's heads 2c, 2c + 1.
  float qsum[kNT][2] = {}, qsum_fed[kNT][2] = {};
  if constexpr (T::kKeyRowFold) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      float part[2] = {0.0f, 0.0f};  // even-position and odd-position registers
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const uint2 f = q_frag[(nt * kKSteps + ks) * 32 + lane];
        const float2 x = half2_to_float2(f.x), y = half2_to_float2(f.y);
        part[0] += x.x + x.y;
        part[1] += y.x + y.y;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        part[e] += __shfl_xor_sync(0xffffffffu, part[e], 1);
        part[e] += __shfl_xor_sync(0xffffffffu, part[e], 2);  // head r's sums on lanes (r, *)
      }
      const float fed = part[0] + part[1], full = T::kOddUnit ? fmaf(kInt4OddUnit, part[1], part[0]) : fed;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        qsum_fed[nt][h] = __shfl_sync(0xffffffffu, fed, 8 * c + 4 * h);
        qsum[nt][h] = __shfl_sync(0xffffffffu, full, 8 * c + 4 * h);
      }
    }
  }

  // Logits in the log2 domain: x = S * qk_mul, or with a soft cap x = cap_log2 * tanh(S * qk_mul).
  const bool capped = a.softcap > 0.0f;
  const float qk_mul = capped ? a.qk_scale * k_scale / a.softcap : a.qk_scale * k_scale * kLog2e;
  const float cap_log2 = a.softcap * kLog2e;

  float o_acc[kNT][kMTiles][4];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int f = 0; f < kMTiles; ++f) o_acc[nt][f][0] = o_acc[nt][f][1] = o_acc[nt][f][2] = o_acc[nt][f][3] = 0.0f;
  // Per head 2c + h of each n-tile (the same on the 8 lanes that share c): running max and its finite stand-in
  // (0 while nothing is attended); this lane's part of the row sum and of the folded value correction.
  float m_run[kNT][2], base_run[kNT][2], l_run[kNT][2], corr[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[nt][h] = -INFINITY;
      base_run[nt][h] = 0.0f;
      l_run[nt][h] = 0.0f;
      corr[nt][h] = 0.0f;
    }

  // This lane's fragment bytes in a stage's blocks (kv_format.cuh): key row r from chunk kKChunks * c (row + 8:
  // + 8 rows of bytes; chunk + j: XOR 16 j), value rows 2c and 2c + 1 at chunk r (row + 8: + 8 swizzle rows;
  // chunk + 8 j: + 16 j swizzle rows, the next part). The same offsets as k_smem / v_smem, kept in registers.
  const int k_lane = k_smem<T>(r, T::kKChunks * c * T::kKChunk);
  const int v_lane[2] = {T::kTileBytes + v_smem<T>(2 * c, r * T::kVChunk),
                         T::kTileBytes + v_smem<T>(2 * c + 1, r * T::kVChunk)};

  int stage = 0;         // i % kStages
  uint32_t parity = 0;   // (i / kStages) & 1: the phase of the stage's barrier that stage i completes
#pragma unroll 1
  for (int i = 0; i < my_tiles; ++i) {
    if constexpr (T::kPairs) ptx::cp_async_wait<kStages - 2>();
    ptx::mbarrier_wait_parity(&my_bars[stage], parity);
    // Every lane is past its reads of the previous stage (re-filled next), and sees the other lanes' pairs.
    __syncwarp();
#ifdef TESSERA_DECODE_TRACE
    if (i == 0) TESSERA_DECODE_MARK(0, 4);  // warp 0's first stage landed
#endif
    if (i + kStages - 1 < my_tiles) {
      issue(i + kStages - 1, stage == 0 ? kStages - 1 : stage - 1, next_pages);
      if (i + kStages < my_tiles) stage_pages(i + kStages, next_pages);
    }
    if constexpr (T::kPairs) ptx::cp_async_commit();
    const uint8_t* st = my_data + stage * T::kDataBytes;
    const uint8_t* pairs = my_pairs + stage * T::kPairBytes;
    // Rows [lo - tok0, len - tok0) of the stage are read by some query token, on the halves whose page is valid;
    // token i's own range is [lo_i, lim_i). Rows outside are in the blocks too (TMA copies whole boxes): their keys
    // become -inf logits by selection below, and 16-bit / fp8 values outside every range (which may hold NaN or
    // Inf) are zeroed in the fragments. A stage inside every token's range needs no selection.
    const int tok0 = tile_tok0(i);
    const uint32_t halves_ok = (page_ok_bits >> (kHalves * stage)) & kHalfMask;

    // Per-channel keys: s_t = Σ_d q_d (σ_d c_td + ω_d) = Σ_d (q_d σ_d)(bias + u_d c_td) - bias Σ_d q_d σ_d + Σ_d q_d ω_d.
    // The scaled query q' = q σ (fp16; the fragments already carry int4's 1/16 at odd positions) is this stage's B
    // operand; the second term starts the S^T accumulators (an mma of q' with the constant A = -bias), the third
    // (kap) is added per head: an mma of the unscaled fragments with A rows 0..7 = the offsets at even positions
    // and rows 8..15 = those at odd positions, so that int4's odd sum can be multiplied back by 16 exactly.
    uint2 qp[kNT][T::kKChannel ? kKSteps : 1];
    float bias0[kNT][2] = {}, kap[kNT][2] = {};
    if constexpr (T::kKChannel) {
      const uint8_t* kparams = my_pairs + stage * T::kPairBytes;
      constexpr uint32_t kMinusBias = 0xe400e400u;  // fp16x2 (-1024, -1024)
      const uint32_t minus_bias[4] = {kMinusBias, kMinusBias, kMinusBias, kMinusBias};
      float bacc[kNT][4] = {}, wacc[kNT][4] = {};
#pragma unroll
      for (int kp = 0; kp < kKSteps; kp += KcParams<T>::kSteps) {
        const KcParams<T> prm(kparams, c, kp);  // the block's scales and offsets of k-steps kp.. (one load each)
#pragma unroll
        for (int ks = kp; ks < kp + KcParams<T>::kSteps; ++ks) {
          uint32_t sx, sy, wx, wy;
          prm.get(ks - kp, sx, sy, wx, wy);
          const uint32_t wa[4] = {wx, T::kOddUnit ? 0u : wx, T::kOddUnit ? 0u : wy, wy};
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const uint2 qf = q_frag[(nt * kKSteps + ks) * 32 + lane];
            qp[nt][ks] = make_uint2(fp16_bits2(__hmul2(as_half2(qf.x), as_half2(sx))),
                                    fp16_bits2(__hmul2(as_half2(qf.y), as_half2(sy))));
            ptx::mma_m16n8k16<true>(bacc[nt], minus_bias, qp[nt][ks].x, qp[nt][ks].y);
            ptx::mma_m16n8k16<true>(wacc[nt], wa, qf.x, qf.y);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          bias0[nt][h] = bacc[nt][h];
          // int8 (no odd unit): rows r and r + 8 both hold the whole sum.
          kap[nt][h] = T::kOddUnit ? fmaf(kInt4OddUnit, wacc[nt][h + 2], wacc[nt][h]) : wacc[nt][h];
        }
    }
    const bool partial = lo_of(len) > tok0 || lim_first() - tok0 < kRows || halves_ok != kHalfMask;
    auto row_ok = [&](int row) { return attended(row, tok0, halves_ok); };

    // S^T = K Q^T per 16-row half m, for key rows r, r + 8 (M) and heads (N). Two independent mma chains per n-tile
    // hide each other's latency: the two halves, or (16-row stages) the even and odd k-steps. (Four chains, two per
    // half, measured no better in an interleaved A/B: v8c in docs/perf/decode.md.)
    constexpr int kSplitK = kHalves == 2 ? 1 : 2;
    float sacc[kNT][kHalves * kSplitK][4] = {};
    if constexpr (T::kKChannel) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int m = 0; m < kHalves; ++m)
#pragma unroll
          for (int k = 0; k < 4; ++k) sacc[nt][m * kSplitK][k] = bias0[nt][k & 1];
    }
#pragma unroll
    for (int j = 0; j < T::kKChunks; ++j) {
#pragma unroll
      for (int m = 0; m < kHalves; ++m) {
        uint32_t kf[2][T::kKChunkElems / 2];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          uint32_t w[T::kKChunk / 4];
          lds_words<T::kKChunk>(st + 16 * m * T::kRowBytes + ((k_lane + n * 8 * T::kRowBytes) ^ (j * T::kKChunk)), w);
          uint32_t pair = 0;
          if constexpr (T::kGrouped) {
            const int g = (T::kKChunks * c + j) * T::kKChunkElems / kInt4GroupSize;
            pair = *reinterpret_cast<const uint32_t*>(pairs + pair_pos(16 * m + r + 8 * n) * T::kPairRowBytes + 4 * g);
          }
          decode_k<T, T::kKChunk / 4>(w, pair, kf[n]);
        }
#pragma unroll
        for (int sub = 0; sub < T::kKChunkElems / 4; ++sub) {
          const int ks = j * (T::kKChunkElems / 4) + sub;
          const uint32_t ka[4] = {kf[0][2 * sub], kf[1][2 * sub], kf[0][2 * sub + 1], kf[1][2 * sub + 1]};
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            uint2 qb;
            if constexpr (T::kKChannel)
              qb = qp[nt][ks];
            else
              qb = q_frag[(nt * kKSteps + ks) * 32 + lane];
            ptx::mma_m16n8k16<kF16>(sacc[nt][m * kSplitK + (ks & (kSplitK - 1))], ka, qb.x, qb.y);
          }
        }
      }
    }

    // Logits. x[nt][m][k]: token tok0 + 16 m + r + 8 (k >> 1), head 2c + (k & 1) of n-tile nt.
    // Per token: x = sc * acc + qsum_fed * shb + qsum * sho (the folded scale, bias and offset).
    float x[kNT][kHalves][4], lmax[kNT][2];
#pragma unroll
    for (int m = 0; m < kHalves; ++m) {
      float sc[2] = {qk_mul, qk_mul}, shb[2] = {0.0f, 0.0f}, sho[2] = {0.0f, 0.0f};
      if constexpr (T::kKeyRowFold) {
        const uint2 kp = *reinterpret_cast<const uint2*>(pairs + (16 * m + 2 * r) * T::kPairRowBytes);
        const float2 p0 = half2_to_float2(kp.x), p1 = half2_to_float2(kp.y);  // (scale, offset) of rows r, r + 8
        sc[0] = p0.x * qk_mul;
        sc[1] = p1.x * qk_mul;
        shb[0] = -T::kCodeBias * sc[0];
        shb[1] = -T::kCodeBias * sc[1];
        sho[0] = p0.y * qk_mul;
        sho[1] = p1.y * qk_mul;
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float acc = sacc[nt][m * kSplitK][k];
#pragma unroll
          for (int e = 1; e < kSplitK; ++e) acc += sacc[nt][m * kSplitK + e][k];
          float v = acc * qk_mul;
          if constexpr (T::kKChannel)
            v = (acc + kap[nt][k & 1]) * qk_mul;
          else if constexpr (T::kKeyRowFold)
            v = fmaf(sc[k >> 1], acc, fmaf(qsum_fed[nt][k & 1], shb[k >> 1], qsum[nt][k & 1] * sho[k >> 1]));
          if (capped) v = cap_log2 * tanhf(v);
          x[nt][m][k] = v;
        }
    }
    if (partial) {
      // The key range of each of this lane's columns (query rows 2c, 2c + 1 of each n-tile), relative to tok0.
      int col_lo[kNT][2], col_lim[kNT][2];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int jr = ht * kHeads + nt * 8 + 2 * c + h;
          const int tok = a.num_new == 1 ? 0 : min(jr / a.group, a.num_new - 1);  // rows past G * S: any token
          col_lim[nt][h] = lim_first() + tok - tok0;
          col_lo[nt][h] = lo_of(lim_first() + tok) - tok0;
        }
#pragma unroll
      for (int m = 0; m < kHalves; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int row = 16 * m + r + 8 * n;
          const bool page_ok = (halves_ok >> m) & 1u;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const bool ok = page_ok && row >= col_lo[nt][h] && row < col_lim[nt][h];
              x[nt][m][2 * n + h] = ok ? x[nt][m][2 * n + h] : -INFINITY;
            }
        }
    }
    bool grow = false;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(x[nt][0][h], x[nt][0][h + 2]);
#pragma unroll
        for (int m = 1; m < kHalves; ++m) mx = fmaxf(mx, fmaxf(x[nt][m][h], x[nt][m][h + 2]));
        lmax[nt][h] = mx;
        grow = grow || mx > m_run[nt][h];
      }
    // The max only moves now and then; while no lane's stage exceeds it, the old base stands (no reduction, no
    // rescale).
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = lmax[nt][h];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(m_run[nt][h], mx);
          const float base = m_new == -INFINITY ? 0.0f : m_new;  // an all-masked head so far stays at zero weight
          const float alpha = ptx::ex2_approx_ftz(m_run[nt][h] - base);
          m_run[nt][h] = m_new;
          base_run[nt][h] = base;
          l_run[nt][h] *= alpha;
          corr[nt][h] *= alpha;
#pragma unroll
          for (int f = 0; f < kMTiles; ++f) {
            o_acc[nt][f][h] *= alpha;
            o_acc[nt][f][h + 2] *= alpha;
          }
        }
    }

    // P, scaled per token by the value scale for folded formats; packed, then transposed into P^T's B fragments.
    uint32_t pb[kNT][kHalves][2];
#pragma unroll
    for (int m = 0; m < kHalves; ++m) {
      // Folded formats: per token the value scale (into P) and vo + centre · scale (into corr; the tensor cores
      // see the centred codes).
      float vs[2] = {1.0f, 1.0f}, vw[2] = {0.0f, 0.0f};
      if constexpr (T::kFold) {
        const uint2 vp =
            *reinterpret_cast<const uint2*>(pairs + T::kKeyPairBytes + (16 * m + 2 * r) * T::kPairRowBytes);
        const float2 p0 = half2_to_float2(vp.x), p1 = half2_to_float2(vp.y);
        vs[0] = p0.x;
        vs[1] = p1.x;
        vw[0] = fmaf(-T::kVCodeBias, p0.x, p0.y);
        vw[1] = fmaf(-T::kVCodeBias, p1.x, p1.y);
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        float p[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) p[k] = ptx::ex2_approx_ftz(x[nt][m][k] - base_run[nt][k & 1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[nt][h] += p[h] + p[h + 2];
#pragma unroll
        for (int n = 0; n < 2; ++n) {  // token r + 8n of half m
          const uint32_t packed = pack2<kF16>(p[2 * n] * vs[n], p[2 * n + 1] * vs[n]);
          if constexpr (T::kFold) {
            corr[nt][0] = fmaf(p[2 * n], vw[n], corr[nt][0]);
            corr[nt][1] = fmaf(p[2 * n + 1], vw[n], corr[nt][1]);
          }
          pb[nt][m][n] = ptx::movmatrix_trans(packed);  // → P[head r][tokens 2c, 2c + 1 (+ 8n)]
        }
      }
    }

    // O^T += V^T P^T per half m. Value rows of this lane: 2c, 2c+1 (k 2c..2c+1) and 2c+8, 2c+9 (k 2c+8..2c+9).
    // vmask[hi]: the halves of the value pairs (tokens 2c + 8 hi, 2c + 1 + 8 hi) that are attended.
    constexpr bool kMaskValues = T::kNative || T::kFP8;  // integer codes are finite (their pairs are zero-filled)
    // The A operand of the value-centring mma of folded formats, {even rows, odd rows, even, odd}, read from shared
    // memory as one quad: built from constants, the compiler copies it into a fresh register quad before each mma.
    uint32_t centre[4] = {0u, 0u, 0u, 0u};
    if constexpr (T::kFold) {
      const uint4 cq = *reinterpret_cast<const uint4*>(smem + L::kConstOff);
      centre[0] = cq.x;
      centre[1] = cq.y;
      centre[2] = cq.z;
      centre[3] = cq.w;
    }
#pragma unroll
    for (int m = 0; m < kHalves; ++m) {
      uint32_t vmask[2] = {~0u, ~0u};
      if (kMaskValues && partial) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int t = 16 * m + 2 * c + 8 * hi;
          vmask[hi] = (row_ok(t) ? 0x0000ffffu : 0u) | (row_ok(t + 1) ? 0xffff0000u : 0u);
        }
      }
#pragma unroll
      for (int j = 0; j < T::kVChunks; ++j) {
        uint32_t vlo[T::kVChunkElems], vhi[T::kVChunkElems];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          uint32_t w0[T::kVChunk / 4], w1[T::kVChunk / 4];
          const int step = (8 * hi + 16 * m + kRows * j) * T::kSwizzle;
          lds_words<T::kVChunk>(st + v_lane[0] + step, w0);
          lds_words<T::kVChunk>(st + v_lane[1] + step, w1);
          uint32_t pair0 = 0, pair1 = 0;
          if constexpr (T::kGrouped) {
            const int g = (r + 8 * j) * T::kVChunkElems / kInt4GroupSize;
            const int t0 = 16 * m + 2 * c + 8 * hi;
            pair0 = *reinterpret_cast<const uint32_t*>(pairs + T::kKeyPairBytes + pair_pos(t0) * T::kPairRowBytes + 4 * g);
            pair1 =
                *reinterpret_cast<const uint32_t*>(pairs + T::kKeyPairBytes + pair_pos(t0 + 1) * T::kPairRowBytes + 4 * g);
          }
          decode_v<T, T::kVChunk / 4>(w0, w1, pair0, pair1, hi ? vhi : vlo);
        }
        if (kMaskValues && partial) {
#pragma unroll
          for (int e = 0; e < T::kVChunkElems; ++e) {
            vlo[e] &= vmask[0];
            vhi[e] &= vmask[1];
          }
        }
#pragma unroll
        for (int i2 = 0; i2 < T::kVChunkElems / 2; ++i2) {
          const int f = j * (T::kVChunkElems / 2) + i2;
          const uint32_t va[4] = {vlo[2 * i2], vlo[2 * i2 + 1], vhi[2 * i2], vhi[2 * i2 + 1]};
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            // - (1024 + u · centre) · P first: O^T never holds the codes' common bias.
            if constexpr (T::kFold) ptx::mma_m16n8k16<kF16>(o_acc[nt][f], centre, pb[nt][m][0], pb[nt][m][1]);
            ptx::mma_m16n8k16<kF16>(o_acc[nt][f], va, pb[nt][m][0], pb[nt][m][1]);
          }
        }
      }
    }
    if (++stage == kStages) {
      stage = 0;
      parity ^= 1u;
    }
  }
  if constexpr (T::kPairs) ptx::cp_async_wait<0>();
  TESSERA_DECODE_MARK(0, 5);  // warp 0's stages done

  // ---- merge the 4 warps ------------------------------------------------------------------------------------
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int off = 4; off < 32; off *= 2) {
        l_run[nt][h] += __shfl_xor_sync(0xffffffffu, l_run[nt][h], off);
        if constexpr (T::kFold) corr[nt][h] += __shfl_xor_sync(0xffffffffu, corr[nt][h], off);
      }
  __syncthreads();  // every warp is done with its staging (the merge area overlaps it)
  float* m_o = reinterpret_cast<float*>(staging);  // [warp][head][D]
  float* m_ml = m_o + kDecodeWarps * kHeads * kD;  // [warp][head][2]: (m, l)
  {
    float* ow = m_o + warp * kHeads * kD;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int f = 0; f < kMTiles; ++f) {
        const int j = f / (T::kVChunkElems / 2), i2 = f % (T::kVChunkElems / 2);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int head = nt * 8 + 2 * c + (k & 1);
          const int d = o_dim<T>(r, j, 2 * i2 + (k >> 1));
          // O^T's odd rows of folded int4 carry the code unit 16 (w = 2 * i2 + 1 is odd exactly for k >= 2).
          const float unit = (T::kOddUnit && k >= 2) ? 1.0f / kInt4OddUnit : 1.0f;
          ow[head * kD + d] = fmaf(o_acc[nt][f][k], unit, corr[nt][k & 1]);
        }
      }
    if (r == 0) {
      float* ml = m_ml + warp * kHeads * 2;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ml[(nt * 8 + 2 * c + h) * 2] = m_run[nt][h];
          ml[(nt * 8 + 2 * c + h) * 2 + 1] = l_run[nt][h];
        }
    }
  }
  __syncthreads();
  TESSERA_DECODE_MARK(0, 6);  // the warps' partial results in shared memory

  // Per query row: the 4 warps' weights folded into one coefficient each, coef_w = 2^(m_w - m) v_scale / l (0 when
  // nothing was attended), and the row's log2-sum-exp, computed once per row by one thread and written over that
  // row's own (m, l) entries (8 floats: 4 coefficients, then the lse in the second slot of warp 0's pair). v17: per
  // element this took 4 exp2, a division and a log2, ~2.7 us of a B 1 call's ~9.4 with 4 warps an SM to hide them.
  if (threadIdx.x < kHeads) {
    const int row = threadIdx.x;
    float m_w[kDecodeWarps], l_w[kDecodeWarps];
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m_w[w] = m_ml[(w * kHeads + row) * 2];
      l_w[w] = m_ml[(w * kHeads + row) * 2 + 1];
      m_all = fmaxf(m_all, m_w[w]);
    }
    float sc[kDecodeWarps], l_all = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      sc[w] = m_all != -INFINITY ? ptx::ex2_approx_ftz(m_w[w] - m_all) : 0.0f;  // -inf → 0
      l_all += l_w[w] * sc[w];
    }
    const bool any = l_all > 0.0f;
    const float inv = any ? v_scale / l_all : 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_ml[(w * kHeads + row) * 2] = sc[w] * inv;
    m_ml[row * 2 + 1] = any ? m_all + __log2f(l_all) : -INFINITY;  // log2 domain
  }
  __syncthreads();

  // Each thread 4 consecutive columns of a row: o = Σ_w coef_w O_w.
  const bool final_out = sp.splits == 1;
  if constexpr (kBalanced) {  // for the merge: where this sequence's splits are
    if (split == 0 && kvh == 0 && ht == 0 && threadIdx.x == 0) a.ws_plan[b] = make_int2(sp.slot, sp.splits);
  }
  constexpr int kQuads = kD / 4;
  for (int e = threadIdx.x; e < kHeads * kQuads; e += kDecodeThreads) {
    const int row = e / kQuads, d0 = 4 * (e % kQuads);
    const int jr = ht * kHeads + row;
    if (jr >= a.rows) continue;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float cw = m_ml[(w * kHeads + row) * 2];
      const float4 ow = *reinterpret_cast<const float4*>(m_o + (w * kHeads + row) * kD + d0);
      acc.x = fmaf(cw, ow.x, acc.x);
      acc.y = fmaf(cw, ow.y, acc.y);
      acc.z = fmaf(cw, ow.z, acc.z);
      acc.w = fmaf(cw, ow.w, acc.w);
    }
    const float lse2 = m_ml[row * 2 + 1];
    const bool any = lse2 != -INFINITY;
    const int tok = jr / a.group, h = kvh * a.group + (jr - tok * a.group);
    if (final_out) {
      const float out[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) store_output(a, b, tok, h, d0 + k, out[k], lse2, any);
    } else {
      const int64_t row_idx = static_cast<int64_t>(sp.slot - split) * a.num_new * a.num_q_heads +
                              static_cast<int64_t>(tok * a.num_q_heads + h) * sp.splits + split;
      *reinterpret_cast<float4*>(a.ws_o + row_idx * kD + d0) = acc;
      if (d0 == 0) a.ws_lse[row_idx] = lse2;
    }
  }
  TESSERA_DECODE_MARK(0, 7);  // thread 0's outputs written
}

}  // namespace tessera::attention::detail
