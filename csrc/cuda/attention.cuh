// One thread block attends a tile of up to 64 query rows to a range of key /
// value positions of one sequence in the paged cache, on tensor cores.
// Used by the chunk-first and sequence-first phases of TPP decode
// (tpp_decode.cu) and by paged prefill (prefill.cu).
//
// Geometry: 128 threads = 4 warps. Query rows go in groups of 16 (the M of
// mma.m16n8k16): with R = ceil(rows / 16) row groups, the 4 warps form an
// R x K grid, K = min(4 / R, TKC / 16): warp (rg, kg) owns rows
// [16 rg, 16 rg + 16) and, of every KV tile of TKC positions staged in shared
// memory, the positions [kg TKC / K, (kg + 1) TKC / K). So a 64-row tile (a
// shared node covering many requests, a prefill tile) shares every K/V tile
// between 4 row groups, and a tile of a few rows (one decode request times
// its GQA group) splits every KV tile between 4 warps instead; the per-warp
// partial states are merged through shared memory at the end.
//
// Per 16 KV positions a warp computes S = Q K^T (16 x 16, fp32) with
// D/16 x 2 MMAs, applies the scale (log2 domain) and the mask, updates its
// online-softmax state (running max m and sum l per row, rescaling its fp32
// output accumulators), converts P to fp16/bf16 and accumulates O += P V with
// D/8 MMAs. K fragments come from ldmatrix, V fragments from ldmatrix.trans.
//
// Shared memory (dynamic), 16-bit elements, rows padded to D + 8 elements so
// that ldmatrix row addresses fall into distinct banks:
//   Q  [ROWS][D + 8]
//   KV [STAGES][2][TKC][D + 8]   (K tile then V tile per stage; cp.async)
// reused after the main loop as the epilogue buffer
//   O [4 warps][16][D + 4] fp32, m [4][16], l [4][16].
// Two layouts, a template parameter of attend(): kStacked, ROWS = 64, for
// stacked tiles (chunk-first nodes, prefill), and kGroup, ROWS = the call's
// rows rounded up to 16, for one decode request's GQA group (the
// sequence-first phase). A group's small Q buffer leaves room for a second KV
// stage, so a memory-bound sequence-first block has its next tile in flight
// while it computes this one; the launcher keeps one stage where the second
// would cost resident blocks (tpp_decode.cu). TKC and the stages depend on D so that every
// configuration fits the 99 KiB per-block limit of sm_86/sm_89:
//   D = 64:  TKC 64, 2 stages (stacked 45 KiB; group of 16 rows 38 KiB)
//   D = 128: TKC 64, stacked 1 stage (51 KiB), group 2 stages (16 rows 72 KiB, 64 rows 85 KiB)
//   D = 256: TKC 32, stacked 1 stage (66 KiB), group 2 stages (16 rows 74 KiB, 64 rows 99 KiB)
// KV tiles cover TKC consecutive positions and may span several chunks
// (block_size 16 or 32): each row is fetched through the block table.
#pragma once

#include <climits>

#include "cuda/common.cuh"

namespace chunkattn::cuda {

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kMaxRows = 64;

template <int D>
struct TileConfig;
template <>
struct TileConfig<64> {
  static constexpr int kKvTile = 64, kStages = 2, kGroupStages = 2;
};
template <>
struct TileConfig<128> {
  static constexpr int kKvTile = 64, kStages = 1, kGroupStages = 2;
};
template <>
struct TileConfig<256> {
  static constexpr int kKvTile = 32, kStages = 1, kGroupStages = 2;
};

enum class RowLayout { kStacked, kGroup };

template <int D, RowLayout kLayout = RowLayout::kStacked>
struct SmemLayout {
  static constexpr int kKvTile = TileConfig<D>::kKvTile;
  // K/V stages: the stacked layout's are fixed; a group's are chosen per launch
  // (1 or up to kGroupStages, tpp_decode.cu), this is the most.
  static constexpr int kStages = kLayout == RowLayout::kStacked ? TileConfig<D>::kStages : TileConfig<D>::kGroupStages;
  static constexpr int kLd = D + 8;  // 16-bit elements per staged row
  static constexpr int kKvTileElems = kKvTile * kLd;
  static constexpr int kOutLd = D + 4;  // floats per epilogue row
  static constexpr int kEpilogueBytes = (kWarps * 16 * kOutLd + 2 * kWarps * 16) * 4;
  // Q rows staged for a call of num_rows rows; the K/V stages follow them.
  static constexpr int q_rows(int num_rows) {
    return kLayout == RowLayout::kStacked ? kMaxRows : (num_rows + 15) / 16 * 16;
  }
  static constexpr int bytes(int num_rows, int stages = kStages) {
    const int main = (q_rows(num_rows) * kLd + stages * 2 * kKvTileElems) * 2;
    return main > kEpilogueBytes ? main : kEpilogueBytes;
  }
  static constexpr int kBytes = bytes(kMaxRows);  // the most a call of this layout takes
  static_assert(kStages == 1 || kStages == 2, "attend() pipelines one or two K/V stages");
  static_assert(kBytes <= 99 * 1024, "shared memory must fit sm_86/sm_89 (99 KiB per block)");
  static_assert(kKvTile % 16 == 0 && D % 16 == 0, "tiles are multiples of the MMA shape");
};

// Whether a group's second K/V stage can take shared memory beyond the stacked
// layout's (not at D = 64, where both have two): only then is a group's stage
// count chosen per launch; otherwise it is fixed, and so is attend()'s loop.
template <int D>
constexpr bool kGroupStagesVary = SmemLayout<D, RowLayout::kGroup>::kBytes > SmemLayout<D>::kBytes;

// Dynamic shared memory of the TPP attend kernel, whose blocks call attend()
// in both layouts: stacked chunk-first tiles and sequence-first groups of
// `group` rows (the GQA group) with `group_stages` K/V stages. Shapes only.
template <int D>
constexpr int tpp_attend_smem_bytes(int group, int group_stages) {
  const int stacked = SmemLayout<D>::kBytes, grouped = SmemLayout<D, RowLayout::kGroup>::bytes(group, group_stages);
  return stacked > grouped ? stacked : grouped;
}

// How a score q.k becomes the softmax's logit (log2 domain), and which
// positions a row sees beyond the causal mask: the attention variants of
// common/attention_variant.h (csrc/chunkattn.h), in the kernels' terms.
struct ScoreMod {
  float scale_log2;                     // scale * log2(e)
  float cap_log2 = 0.f;                 // soft-cap c * log2(e); 0: none
  float cap_scale = 0.f;                // scale / c: the logit is cap_log2 * tanh(q.k * cap_scale)
  int window = 0;                       // a row at position p sees p - window + 1 .. p; 0: none
  const float* alibi_slopes = nullptr;  // per query head: the logit gains slope * (key - p) (natural units)
};

inline ScoreMod score_mod(const AttentionVariant& v) {
  ScoreMod mod;
  mod.scale_log2 = v.scale * kLog2e;
  if (v.logits_soft_cap > 0.f) {
    mod.cap_log2 = v.logits_soft_cap * kLog2e;
    mod.cap_scale = v.scale / v.logits_soft_cap;
  }
  mod.window = static_cast<int>(v.sliding_window);
  mod.alibi_slopes = v.alibi_slopes;
  return mod;
}

// Where one sequence's keys and values are: the cache, its block-table row,
// and the KV head.
template <typename T>
struct KvSource {
  const T* cache;
  int64_t stride_block, stride_head;  // elements
  const int* blocks;                  // block-table row
  int head;
  int block_shift;  // log2(block_size)
};

// Attend rows [0, num_rows) (num_rows <= 64) to positions [t_begin, t_end).
//   q_row(r)    -> const T*: the head_size query elements of row r (16-byte aligned)
//   row_pos(r)  -> int: row r's query position: with kCausal the last position
//                  it sees; also its window's end and ALiBi's origin
//   row_head(r) -> int: row r's query head (its ALiBi slope)
//   epilogue(r, d, float4 o, float m, float n): for each row r < num_rows and
//     column d (a multiple of 4): o = sum_j exp2(s_j - m) v_j[d..d+3] over the
//     positions the row saw, m = max_j s_j, n = sum_j exp2(s_j - m), where
//     s_j is the logit `mod` makes of q . k_j. A row that saw no position has
//     m = -inf, n = 0, o = 0.
// kv_stages: 1 or 2 K/V stages in shared memory; the stacked layout's are fixed.
// Must be called by all 128 threads of the block with the same arguments.
template <typename T, int D, bool kCausal, RowLayout kLayout = RowLayout::kStacked, class QRow, class RowPos, class RowHead,
          class Epilogue>
__device__ __forceinline__ void attend(char* smem_raw, int num_rows, QRow q_row, const KvSource<T>& kv,
                                       int t_begin, int t_end, RowPos row_pos, RowHead row_head,
                                       const ScoreMod& mod, Epilogue epilogue,
                                       int kv_stages = SmemLayout<D, kLayout>::kStages) {
  using L = SmemLayout<D, kLayout>;
  constexpr int kTile = L::kKvTile, kLd = L::kLd, kVecPerRow = D / 8;
  if constexpr (kLayout == RowLayout::kStacked || !kGroupStagesVary<D>) kv_stages = L::kStages;
  constexpr bool kQInRegisters = D <= 128;  // D = 256 re-reads Q from shared memory (registers)
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_kv = s_q + L::q_rows(num_rows) * L::kLd;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row_groups = ceil_div(num_rows, 16);  // 1..4
  const int kv_groups = min(kWarps / row_groups, kTile / 16);
  const int rg = warp % row_groups, kg = warp / row_groups;
  const bool active = warp < row_groups * kv_groups;  // warp-uniform
  const int tokens_per_warp = kTile / kv_groups;

  __syncthreads();  // a previous call's epilogue may still read shared memory

  // ---- stage Q (rows beyond num_rows are zero)
  for (int i = tid; i < row_groups * 16 * kVecPerRow; i += kThreads) {
    const int r = i / kVecPerRow, c = i % kVecPerRow;
    const bool valid = r < num_rows;
    const T* src = valid ? q_row(r) + c * 8 : kv.cache;
    cp_async_16(s_q + r * kLd + c * 8, src, valid);
  }

  const int block_size = 1 << kv.block_shift;
  auto load_tile = [&](int tile, int stage) {
    T* s_k = s_kv + stage * 2 * L::kKvTileElems;
    T* s_v = s_k + L::kKvTileElems;
    const int t0 = t_begin + tile * kTile;
    for (int i = tid; i < kTile * kVecPerRow; i += kThreads) {
      const int j = i / kVecPerRow, c = i % kVecPerRow;
      const int pos = t0 + j;
      const bool valid = pos < t_end;
      const T* k_src = kv.cache;
      const T* v_src = kv.cache;
      if (valid) {
        const int64_t block = kv.blocks[pos >> kv.block_shift];
        k_src = kv.cache + block * kv.stride_block + static_cast<int64_t>(kv.head) * kv.stride_head +
                static_cast<int64_t>(pos & (block_size - 1)) * D + c * 8;
        v_src = k_src + static_cast<int64_t>(block_size) * D;
      }
      cp_async_16(s_k + j * kLd + c * 8, k_src, valid);
      cp_async_16(s_v + j * kLd + c * 8, v_src, valid);
    }
  };

  // ---- per-thread state: rows g and g + 8 of the warp's 16, columns by MMA layout
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = rg * 16 + g, row1 = row0 + 8;
  int limit0 = INT_MAX, limit1 = INT_MAX, warp_limit = INT_MAX;
  int first0 = INT_MIN, first1 = INT_MIN;  // sliding window: first position seen
  float slope0 = 0.f, slope1 = 0.f;        // ALiBi, log2 domain
  int pos_r0 = 0, pos_r1 = 0;
  if (kCausal || mod.window > 0 || mod.alibi_slopes) {
    pos_r0 = row0 < num_rows ? row_pos(row0) : -1;
    pos_r1 = row1 < num_rows ? row_pos(row1) : -1;
  }
  if constexpr (kCausal) {
    limit0 = pos_r0;
    limit1 = pos_r1;
    warp_limit = __reduce_max_sync(0xffffffffu, max(limit0, limit1));
  }
  if (mod.window > 0) {
    first0 = pos_r0 - mod.window + 1;
    first1 = pos_r1 - mod.window + 1;
  }
  if (mod.alibi_slopes) {
    slope0 = row0 < num_rows ? mod.alibi_slopes[row_head(row0)] * kLog2e : 0.f;
    slope1 = row1 < num_rows ? mod.alibi_slopes[row_head(row1)] * kLog2e : 0.f;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  uint32_t q_frag[kQInRegisters ? D / 16 : 1][4];

  auto compute = [&](int tile, int stage) {
    const T* s_k = s_kv + stage * 2 * L::kKvTileElems;
    const T* s_v = s_k + L::kKvTileElems;
    const int t0 = t_begin + tile * kTile;
    const int j_end = (kg + 1) * tokens_per_warp;
    for (int j0 = kg * tokens_per_warp; j0 < j_end; j0 += 16) {
      const int pos0 = t0 + j0;
      if (pos0 >= t_end) break;
      if (kCausal && pos0 > warp_limit) break;
      // S = Q K^T for 16 rows x 16 positions: s[0] positions 0..7, s[1] 8..15
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int x = 0; x < 4; ++x) a[x] = q_frag[kk][x];
        } else {
          ldmatrix_x4(a, s_q + (rg * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
        }
        // matrices: (pos 0-7, d 0-7), (pos 0-7, d 8-15), (pos 8-15, d 0-7), (pos 8-15, d 8-15)
        uint32_t b[4];
        ldmatrix_x4(b, s_k + (j0 + (lane >> 4) * 8 + (lane & 7)) * kLd + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_16816<T>(s[0], a, b[0], b[1]);
        mma_16816<T>(s[1], a, b[2], b[3]);
      }
      // logit (scale, soft-cap, ALiBi), mask, row max
      float max0 = kNegInf, max1 = kNegInf;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = pos0 + nt * 8 + 2 * t4 + (e & 1);
          float v = mod.cap_log2 != 0.f ? mod.cap_log2 * tanhf(s[nt][e] * mod.cap_scale) : s[nt][e] * mod.scale_log2;
          if (mod.alibi_slopes) v += (e < 2 ? slope0 : slope1) * static_cast<float>(pos - (e < 2 ? pos_r0 : pos_r1));
          bool masked = pos >= t_end || pos < (e < 2 ? first0 : first1);
          if constexpr (kCausal) masked = masked || pos > (e < 2 ? limit0 : limit1);
          v = masked ? kNegInf : v;
          s[nt][e] = v;
          if (e < 2) {
            max0 = fmaxf(max0, v);
          } else {
            max1 = fmaxf(max1, v);
          }
        }
      }
      max0 = quad_max(max0);
      max1 = quad_max(max1);
      // A row that has seen nothing yet keeps m = -inf and base 0 (exp_base).
      const MaxUpdate update0 = update_max<Log2Exp>(m0, max0), update1 = update_max<Log2Exp>(m1, max1);
      const float base0 = update0.base, base1 = update1.base;
      const float alpha0 = update0.rescale, alpha1 = update1.rescale;
      m0 = update0.m;
      m1 = update1.m;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[nt][0] = fast_exp2(s[nt][0] - base0);
        s[nt][1] = fast_exp2(s[nt][1] - base0);
        s[nt][2] = fast_exp2(s[nt][2] - base1);
        s[nt][3] = fast_exp2(s[nt][3] - base1);
        sum0 += s[nt][0] + s[nt][1];
        sum1 += s[nt][2] + s[nt][3];
      }
      l0 = l0 * alpha0 + sum0;  // per-thread part of the row sum; quad-reduced at the end
      l1 = l1 * alpha1 + sum1;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha0;
        acc[n][1] *= alpha0;
        acc[n][2] *= alpha1;
        acc[n][3] *= alpha1;
      }
      // P (fp32 accumulator layout) -> A operand (16-bit) of O += P V
      uint32_t p[4];
      p[0] = Float16<T>::pack(s[0][0], s[0][1]);
      p[1] = Float16<T>::pack(s[0][2], s[0][3]);
      p[2] = Float16<T>::pack(s[1][0], s[1][1]);
      p[3] = Float16<T>::pack(s[1][2], s[1][3]);
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        // transposed matrices: (pos 0-7, d 0-7), (pos 8-15, d 0-7), (pos 0-7, d 8-15), (pos 8-15, d 8-15)
        uint32_t v[4];
        ldmatrix_x4_trans(v, s_v + (j0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kLd + dd * 16 + (lane >> 4) * 8);
        mma_16816<T>(acc[2 * dd], p, v[0], v[1]);
        mma_16816<T>(acc[2 * dd + 1], p, v[2], v[3]);
      }
    }
  };

  // ---- main loop over KV tiles. With one stage the next tile's copy starts
  // after this tile's math; with two it runs under it (tile t in stage t & 1).
  const int num_tiles = t_end > t_begin ? ceil_div(t_end - t_begin, kTile) : 0;
  if (num_tiles > 0) load_tile(0, 0);
  cp_async_commit();  // group 0: Q and tile 0
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (kv_stages == 2) {
      if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) & 1);
      cp_async_commit();  // possibly empty: the count stays one group per tile
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (kQInRegisters) {
      if (tile == 0 && active) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          ldmatrix_x4(q_frag[kk], s_q + (rg * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
        }
      }
    }
    if (active) compute(tile, kv_stages == 2 ? tile & 1 : 0);
    __syncthreads();
    if (kv_stages == 1 && tile + 1 < num_tiles) {
      load_tile(tile + 1, 0);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- epilogue: merge the warps that split the KV tiles, hand rows out
  float* s_o = reinterpret_cast<float*>(smem_raw);  // [warp][16][kOutLd]
  float* s_m = s_o + kWarps * 16 * L::kOutLd;       // [warp][16]
  float* s_l = s_m + kWarps * 16;
  if (active) {
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    float* mine = s_o + warp * 16 * L::kOutLd;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * t4;
      *reinterpret_cast<float2*>(mine + g * L::kOutLd + col) = make_float2(acc[n][0], acc[n][1]);
      *reinterpret_cast<float2*>(mine + (g + 8) * L::kOutLd + col) = make_float2(acc[n][2], acc[n][3]);
    }
    if (t4 == 0) {
      s_m[warp * 16 + g] = m0;
      s_m[warp * 16 + g + 8] = m1;
      s_l[warp * 16 + g] = l0;
      s_l[warp * 16 + g + 8] = l1;
    }
  }
  __syncthreads();
  for (int i = tid; i < num_rows * (D / 4); i += kThreads) {
    const int r = i / (D / 4), d = (i % (D / 4)) * 4;
    const int group = r >> 4, lr = r & 15;
    PartialState state;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < kv_groups; ++k) {
      const int w = k * row_groups + group;
      const MergeScales scales = merge<Log2Exp>(state, PartialState{s_m[w * 16 + lr], s_l[w * 16 + lr]});
      o = combine4(o, *reinterpret_cast<const float4*>(s_o + (w * 16 + lr) * L::kOutLd + d), scales);
    }
    epilogue(r, d, o, state.m, state.n);
  }
}

// Store 4 floats as 4 16-bit values (8 bytes, 8-byte aligned destination).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  uint2 v;
  v.x = Float16<T>::pack(a, b);
  v.y = Float16<T>::pack(c, d);
  *reinterpret_cast<uint2*>(dst) = v;
}

inline int log2_exact(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

}  // namespace chunkattn::cuda
