// The online-softmax partial state of one query row and its merge (ChunkAttention
// equations (1) and (2)), written once for every kernel: the CPU tiles and
// drivers (csrc/cpu), the CUDA kernels (csrc/cuda) and the merge_attn_states op.
//
// A part of the keys leaves, for one query row with scores s_j against them,
//   m = max_j s_j,  n = sum_j exp(s_j - m),  o = sum_j exp(s_j - m) v_j  (unnormalised),
// and the row's attention output over all parts is o / n after merging them.
// A part that saw no key has m = -inf, n = 0, o = 0; merging it changes nothing.
//
// Exponentials go through a policy `Exp` with `static float exp(float)`, so one
// merge serves both domains in use: natural units on the CPU (NaturalExp), and
// scores pre-multiplied by log2(e) with exp2 on CUDA (csrc/cuda/common.cuh).
// o stays with the caller (a row of floats, a float4 of one thread): the merge
// returns the two factors its o values take (combine()).
//
// Header-only and force-inlined: these run in the innermost loops of the tiles.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(CHUNKATTN_EMULATE)
// nvcc, and the CPU emulator of the CUDA kernels (which defines __host__,
// __device__ and __forceinline__ for the host compiler).
#define CHUNKATTN_INLINE __host__ __device__ __forceinline__
#else
#define CHUNKATTN_INLINE inline __attribute__((always_inline))
#endif

namespace chunkattn {

constexpr float kPartialNegInf = -__builtin_huge_valf();

// Natural-units exponential, for scores that are plain q.k * scale (CPU).
struct NaturalExp {
  static inline float exp(float x) { return std::exp(x); }
};

// m and n of a partial state; o is the caller's (see above).
struct PartialState {
  float m = kPartialNegInf;
  float n = 0.f;
};

// The value exponentials are taken against when the running max is m: m
// itself, or 0 while no key has been seen (m = -inf), so that exp(-inf - 0) = 0
// instead of exp(-inf - -inf) = NaN.
CHUNKATTN_INLINE float exp_base(float m) { return m == kPartialNegInf ? 0.f : m; }

// The factor that scales a part with max m_part to a common max m_total >= m_part:
// exp(m_part - m_total), 0 for a part that saw no key. Equation (2) over many
// parts at once is: m_total the max of their m, then the sum of each part's
// (n, o) times its scale_to(m, m_total).
template <class Exp>
CHUNKATTN_INLINE float scale_to(float m_part, float m_total) {
  return Exp::exp(m_part - exp_base(m_total));
}

// The running max after a part with max m_in joins a state with max m_old,
// and the factor the state's (n, o) take. Online softmax over blocks of
// scores: exponentiate the new block's scores against `base`, then
// n = n * rescale + sum, o = o * rescale + P V.
struct MaxUpdate {
  float m;        // max(m_old, m_in)
  float base;     // exp_base(m)
  float rescale;  // exp(m_old - base); 0 when the state saw no key
};

template <class Exp>
CHUNKATTN_INLINE MaxUpdate update_max(float m_old, float m_in) {
#ifdef __CUDA_ARCH__
  const float m = fmaxf(m_old, m_in);  // one max.f32
#else
  const float m = m_old > m_in ? m_old : m_in;  // one maxss; std::max would do, fmaxf adds NaN handling
#endif
  return {m, exp_base(m), scale_to<Exp>(m_old, m)};
}

// Factors of the two sides of a merge: o = o_running * running + o_part * part.
struct MergeScales {
  float running;
  float part;
};

// Equation (2): merges `part` into `running` (m and n) and returns the
// factors for o. A side with m = -inf gets factor 0; both empty stays empty.
// An empty part leaves the state as it is without an exponential (this early
// exit also keeps the CUDA epilogues at their register counts).
template <class Exp>
CHUNKATTN_INLINE MergeScales merge(PartialState& running, const PartialState& part) {
  if (part.m == kPartialNegInf) return {1.f, 0.f};
  const MaxUpdate u = update_max<Exp>(running.m, part.m);
  const MergeScales scales{u.rescale, scale_to<Exp>(part.m, u.m)};
  running.n = running.n * scales.running + part.n * scales.part;
  running.m = u.m;
  return scales;
}

// The partial state of a normalised attention result `out` with log-sum-exp
// `lse` (in the Exp's domain): m = lse, n = 1, o = out; or the empty state
// (n = 0) for lse = -inf, whose o then only ever takes factor 0.
CHUNKATTN_INLINE PartialState normalised_state(float lse) { return {lse, lse == kPartialNegInf ? 0.f : 1.f}; }

// Attention sinks (gpt-oss): a learned logit per query head that joins the
// softmax denominator once per query, like a key with score `sink` and value 0.
// Merged into a row's total state after all its parts, before the final o / n;
// returns the factor the row's o takes.
template <class Exp>
CHUNKATTN_INLINE float merge_sink(PartialState& total, float sink) {
  return merge<Exp>(total, PartialState{sink, 1.f}).running;
}

CHUNKATTN_INLINE float combine(float o_running, float o_part, const MergeScales& s) {
  return o_running * s.running + o_part * s.part;
}

// 1 / n for the final o / n; 0 for a row that saw no key (its o is 0).
CHUNKATTN_INLINE float inverse_sum(float n) { return n > 0.f ? 1.f / n : 0.f; }

}  // namespace chunkattn
