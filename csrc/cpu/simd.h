// Thin SIMD wrappers used by the attention tiles (attention_tiles.inc).
//
// One struct per instruction set, all with the same static interface, so the
// tile code is written once and compiled once per ISA (kernels_<isa>.cpp):
//   W        lanes of one float register
//   kRegs    architectural vector registers (sizes the register blocks)
//   reg      the float register type
//   zero/set1/load/store, load(const T*) converting bf16/fp16 -> fp32,
//   load_pairs (2W bf16 -> even-indexed and odd-indexed values as fp32),
//   gather (strided load, for the edges of transposes), transpose (a W x W
//   block in registers),
//   add/sub/mul/div/max/fma, hsum/hmax, exp, fill_gt (masking),
//   sum_each/store_sums (the horizontal sums of up to W registers at once).
//
// Each struct is defined inside a `#pragma GCC target` region, so its member
// functions may use that ISA's intrinsics while the rest of the library is
// built for the baseline x86-64; which one runs is decided at run time
// (kernels.cpp). Code that *calls* these members must itself be compiled for
// the same target, which is why the tile code is included per ISA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/amx.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CHUNKATTN_X86 1
#endif

namespace chunkattn::simd {

// Cephes-style expf constants, shared by all ISAs. Inputs below kExpLo return
// exactly 0 (exp(-inf) must be 0 for masked and empty rows).
constexpr float kExpHi = 88.3762626647949f;
constexpr float kExpLo = -87.3365447505531f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500E-4f;
constexpr float kExpP1 = 1.3981999507E-3f;
constexpr float kExpP2 = 8.3334519073E-3f;
constexpr float kExpP3 = 4.1665795894E-2f;
constexpr float kExpP4 = 1.6666665459E-1f;
constexpr float kExpP5 = 5.0000001201E-1f;

inline float bf16_to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The permute that brings the sums of v[E0 .. E0 + J) from the lanes a
// transposed reduction left them in (lane(e), sum_each) to lanes 0 .. J - 1.
template <int W, int J, int E0, int (*lane)(int)>
constexpr std::array<int, W> sums_to_front() {
  std::array<int, W> a{};
  for (int j = 0; j < J; ++j) a[j] = lane(E0 + j);
  return a;
}

// ---------------------------------------------------------------------------
// Portable fallback: 4 lanes as a GCC vector extension, lowered to whatever
// the baseline target has (one SSE2 register on x86-64).
struct Scalar {
  static constexpr int W = 4;
  static constexpr int kRegs = 16;
  typedef float reg __attribute__((vector_size(16)));
  static inline const char* name() { return "scalar"; }

  static inline reg zero() { return set1(0.f); }
  static inline reg set1(float x) { return reg{x, x, x, x}; }
  static inline reg load(const float* p) {
    reg r;
    std::memcpy(&r, p, sizeof(r));
    return r;
  }
  static inline reg load(const c10::BFloat16* p) {
    reg r;
    for (int i = 0; i < W; ++i) r[i] = bf16_to_float(p[i]);
    return r;
  }
  static inline reg load(const c10::Half* p) {
    reg r;
    for (int i = 0; i < W; ++i) r[i] = static_cast<float>(p[i]);
    return r;
  }
  static inline void store(float* p, reg a) { std::memcpy(p, &a, sizeof(a)); }
  // Lane i < count: p[i * stride]; lanes from count on: 0.
  static inline reg gather(const float* p, int stride, int count = W) {
    reg r = zero();
    for (int i = 0; i < count && i < W; ++i) r[i] = p[i * stride];
    return r;
  }
  // dst[i * ldd + j] = src[j * lds + i] for i, j < W.
  static inline void transpose(const float* src, int lds, float* dst, int ldd) {
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < W; ++j) dst[i * ldd + j] = src[j * lds + i];
  }
  // 2W bf16 -> even elements, odd elements (see Avx512::load_pairs)
  static inline void load_pairs(const c10::BFloat16* p, reg& even, reg& odd) {
    for (int i = 0; i < W; ++i) {
      even[i] = bf16_to_float(p[2 * i]);
      odd[i] = bf16_to_float(p[2 * i + 1]);
    }
  }
  static inline reg add(reg a, reg b) { return a + b; }
  static inline reg sub(reg a, reg b) { return a - b; }
  static inline reg mul(reg a, reg b) { return a * b; }
  static inline reg div(reg a, reg b) { return a / b; }
  static inline reg max(reg a, reg b) { return a > b ? a : b; }
  static inline reg fma(reg a, reg b, reg c) { return a * b + c; }
  static inline float hsum(reg a) {
    float s = 0.f;
    for (int i = 0; i < W; ++i) s += a[i];
    return s;
  }
  static inline float hmax(reg a) {
    float s = a[0];
    for (int i = 1; i < W; ++i) s = a[i] > s ? a[i] : s;
    return s;
  }
  static constexpr int sum_lane(int e) { return e; }
  template <int N>
  static inline reg sum_each(const reg* v) {
    reg r = zero();
    for (int e = 0; e < N; ++e) r[e] = hsum(v[e]);
    return r;
  }
  template <int J, int E0>
  static inline void store_sums(float* p, reg x) {
    for (int j = 0; j < J; ++j) p[j] = x[E0 + j];
  }
  static inline reg exp(reg a) {
    reg r;
    for (int i = 0; i < W; ++i) r[i] = a[i] < kExpLo ? 0.f : std::exp(a[i]);
    return r;
  }
  // (a > b) ? fill : x, lane-wise
  static inline reg fill_gt(reg x, reg a, reg b, float fill) { return a > b ? set1(fill) : x; }
};

#ifdef CHUNKATTN_X86

// ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct Avx2 {
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  using reg = __m256;
  static inline const char* name() { return "avx2"; }

  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg set1(float x) { return _mm256_set1_ps(x); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline reg load(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen and shift, no rounding involved.
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static inline reg gather(const float* p, int stride, int count = W) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(stride));
    if (count >= W) return _mm256_i32gather_ps(p, idx, 4);
    const reg live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
    return _mm256_mask_i32gather_ps(zero(), p, idx, live, 4);
  }
  // dst[i * ldd + j] = src[j * lds + i] for i, j < W: 24 shuffles for 8 rows, where gathering them costs
  // 64 element loads.
  static inline void transpose(const float* src, int lds, float* dst, int ldd) {
    reg r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }
  static inline void load_pairs(const c10::BFloat16* p, reg& even, reg& odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static inline reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static inline reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static inline reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float hmax(reg a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // The horizontal sums of v[0..N), N <= W, as one register: registers are
  // folded into each other in pairs, halving the lanes each holds per level
  // (3 instructions a pair, where an hsum takes 7 a register). After the 3
  // levels lane 4h + j holds v[h + 2j]'s sum.
  static constexpr int sum_lane(int e) { return 4 * (e % 2) + e / 2; }
  template <int N>
  static inline reg sum_each(const reg* v) {
    static_assert(N >= 1 && N <= W);
    constexpr int n1 = (N + 1) / 2, n2 = (n1 + 1) / 2;
    reg l1[n1], l2[n2];
    for (int i = 0; i < n1; ++i) {
      const reg a = v[2 * i], b = 2 * i + 1 < N ? v[2 * i + 1] : zero();
      l1[i] = add(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int i = 0; i < n2; ++i) {
      const reg a = l1[2 * i], b = 2 * i + 1 < n1 ? l1[2 * i + 1] : zero();
      l2[i] = add(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
    }
    const reg a = l2[0], b = n2 > 1 ? l2[1] : zero();
    return add(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  }
  // p[j] = the sum of v[E0 + j] (j < J) from sum_each's register; p[J..W)
  // get the register's other lanes, for the caller to overwrite (a masked
  // store, vmaskmovps, is microcoded on AMD CPUs: 1.2x to 1.3x the whole
  // direct tile's time with 4 rows on a Zen 4).
  template <int J, int E0>
  static inline void store_sums(float* p, reg x) {
    static constexpr std::array<int, W> lane = sums_to_front<W, J, E0, sum_lane>();
    store(p, _mm256_permutevar8x32_ps(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane.data()))));
  }
  static inline reg exp(reg x) {
    const reg under = _mm256_cmp_ps(x, set1(kExpLo), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, set1(kExpLo)), set1(kExpHi));
    const reg fx = _mm256_round_ps(_mm256_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg r = _mm256_fnmadd_ps(fx, set1(kLn2Hi), x);
    r = _mm256_fnmadd_ps(fx, set1(kLn2Lo), r);
    reg p = set1(kExpP0);
    p = fma(p, r, set1(kExpP1));
    p = fma(p, r, set1(kExpP2));
    p = fma(p, r, set1(kExpP3));
    p = fma(p, r, set1(kExpP4));
    p = fma(p, r, set1(kExpP5));
    p = fma(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
  static inline reg fill_gt(reg x, reg a, reg b, float fill) {
    return _mm256_blendv_ps(x, set1(fill), _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
};
#pragma GCC pop_options

// ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
struct Avx512 {
  static constexpr int W = 16;
  static constexpr int kRegs = 32;
  using reg = __m512;
  static inline const char* name() { return "avx512"; }

  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg set1(float x) { return _mm512_set1_ps(x); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline reg load(const c10::BFloat16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static inline reg gather(const float* p, int stride, int count = W) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(stride));
    if (count >= W) return _mm512_i32gather_ps(idx, p, 4);
    return _mm512_mask_i32gather_ps(zero(), _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(count), lane), idx, p, 4);
  }
  // dst[i * ldd + j] = src[j * lds + i] for i, j < W: 64 shuffles for 16 rows. Gathering them took 16 gathers
  // of 16 elements, which on a Zen 5 were 6% of an fp32 prefill (perf).
  static inline void transpose(const float* src, int lds, float* dst, int ldd) {
    reg r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
    // Within each 128-bit lane: 32-bit, then 64-bit interleaves give 4 x 4 transposes.
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
      const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // Then the 4 x 4 grid of 128-bit lanes: two rounds of lane shuffles.
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
      t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
      _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
      _mm512_storeu_ps(dst + (i + 8) * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
  }
  // 2W bf16 values as the fp32 of the even-indexed ones and of the odd-indexed
  // ones: a shift and a mask, where widening them in order takes a
  // lane-crossing shuffle per W values (2 cycles per zmm on Zen 4).
  static inline void load_pairs(const c10::BFloat16* p, reg& even, reg& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static inline reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static inline reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static inline reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float hmax(reg a) {
    __m256 s8 = _mm256_max_ps(_mm512_castps512_ps256(a),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // As Avx2::sum_each, in 4 levels (256-bit halves, 128-bit quarters, then
  // pairs and single lanes within quarters): lane 4i + j holds v[i + 4j]'s sum.
  static constexpr int sum_lane(int e) { return 4 * (e % 4) + e / 4; }
  template <int A, int B>
  static inline reg fold_quarters(reg a, reg b) {
    return add(_mm512_shuffle_f32x4(a, b, A), _mm512_shuffle_f32x4(a, b, B));
  }
  template <int A, int B>
  static inline reg fold_lanes(reg a, reg b) {
    return add(_mm512_shuffle_ps(a, b, A), _mm512_shuffle_ps(a, b, B));
  }
  template <int N>
  static inline reg sum_each(const reg* v) {
    static_assert(N >= 1 && N <= W);
    constexpr int n1 = (N + 1) / 2, n2 = (n1 + 1) / 2, n3 = (n2 + 1) / 2;
    reg l1[n1], l2[n2], l3[n3];
    for (int i = 0; i < n1; ++i) l1[i] = fold_quarters<0x44, 0xEE>(v[2 * i], 2 * i + 1 < N ? v[2 * i + 1] : zero());
    for (int i = 0; i < n2; ++i) l2[i] = fold_quarters<0x88, 0xDD>(l1[2 * i], 2 * i + 1 < n1 ? l1[2 * i + 1] : zero());
    for (int i = 0; i < n3; ++i) l3[i] = fold_lanes<0x44, 0xEE>(l2[2 * i], 2 * i + 1 < n2 ? l2[2 * i + 1] : zero());
    return fold_lanes<0x88, 0xDD>(l3[0], n3 > 1 ? l3[1] : zero());
  }
  template <int J, int E0>
  static inline void store_sums(float* p, reg x) {
    static constexpr std::array<int, W> lane = sums_to_front<W, J, E0, sum_lane>();
    store(p, _mm512_permutexvar_ps(_mm512_loadu_si512(lane.data()), x));
  }
  static inline reg exp(reg x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(kExpLo), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, set1(kExpLo)), set1(kExpHi));
    const reg fx = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg r = _mm512_fnmadd_ps(fx, set1(kLn2Hi), x);
    r = _mm512_fnmadd_ps(fx, set1(kLn2Lo), r);
    reg p = set1(kExpP0);
    p = fma(p, r, set1(kExpP1));
    p = fma(p, r, set1(kExpP2));
    p = fma(p, r, set1(kExpP3));
    p = fma(p, r, set1(kExpP4));
    p = fma(p, r, set1(kExpP5));
    p = fma(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, fx));
  }
  static inline reg fill_gt(reg x, reg a, reg b, float fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), x, set1(fill));
  }
};
#pragma GCC pop_options

// ---------------------------------------------------------------------------
// AVX-512 plus AVX512_BF16 (Zen 4, Sapphire Rapids and later): the same
// float operations, and bf16 pair dot products for the bf16 lanes tiles' S^T.
// vdpbf16ps adds two bf16 products per fp32 lane, twice the multiply-adds per
// instruction of an fp32 FMA. A "pair" is one 32-bit word holding two bf16
// values, the lower-addressed one in the low half.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
struct Avx512Bf16 : Avx512 {
  static constexpr bool kBf16Dot = true;
  static inline const char* name() { return "avx512bf16"; }
  using pairs = __m512i;  // W pairs

  static inline pairs load_pairs_raw(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static inline pairs broadcast_pair(const void* p) {
    uint32_t x;
    std::memcpy(&x, p, sizeof(x));
    return _mm512_set1_epi32(static_cast<int>(x));
  }
  // acc[i] += a.lo[i] * b.lo[i] + a.hi[i] * b.hi[i]
  static inline reg dot_pairs(reg acc, pairs a, pairs b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
};
#pragma GCC pop_options

// AVX-512 with AVX512_BF16 and AMX-BF16 (Intel from Sapphire Rapids): the
// same registers and instructions, and the bf16 lanes tile's two products on
// AMX's tile multiply (attention_tiles.inc, "Both products on AMX").
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
struct Amx : Avx512Bf16 {
  static constexpr bool kAmxBf16 = true;
  static inline const char* name() { return "amx"; }
  // exp as 2^(x log2 e): 2^f on [-1/2, 1/2] by a degree-5 polynomial (relative error 2^-21.7 at |x| <= 1,
  // 2^-18 at x = -87, the rounding of x log2 e included), six operations fewer than the Cephes form with
  // its two-part reduction. Every exp of this build weights P.V, whose P keeps about 16 bits (two bf16
  // terms), or rescales a sum and its normaliser alike.
  static inline reg exp(reg x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(kExpLo), _CMP_GE_OQ);
    const reg t = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, set1(kExpLo)), set1(kExpHi)), set1(kLog2e));
    const reg n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm512_sub_ps(t, n);
    reg p = set1(1.3400432653725147e-3f);
    p = fma(p, f, set1(9.676037356257439e-3f));
    p = fma(p, f, set1(5.550327152013779e-2f));
    p = fma(p, f, set1(2.402210682630539e-1f));
    p = fma(p, f, set1(6.931471824645996e-1f));
    p = fma(p, f, set1(1.0000001192092896f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
  }
};
#pragma GCC pop_options

#endif  // CHUNKATTN_X86

}  // namespace chunkattn::simd
