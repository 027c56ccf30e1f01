// GGUF quantized weights times 8-bit activations: llama.cpp's arithmetic for a decode step.
//
// CPU, AVX2 + FMA + F16C; built a second time with -DRAGBLEND_Q8_VNNI (AVX512-VNNI + VL, op
// namespace ragblend_q8vnni), where vpdpbusd / vpdpwssd take the place of vpmaddubsw +
// vpmaddwd + vpaddd: the same integers in the same lanes, so both builds give the same floats
// bit for bit; and a third time with -DRAGBLEND_Q8_AMX as well (op namespace ragblend_q8amx),
// whose Q4_1 and Q8_0 run on AMX-INT8 tiles (see rows_amx: the same integer sums, the float32
// terms in another order). The weights are ggml's blocks as stored (quant_blocks.cpp's header
// says how); x [n, cols] (n <= 16 rows, float32) is first quantized per block of the weight's
// type, as ggml quantizes activations for its integer dot products (the Python oracle,
// ragblend/models/int8_reference.py, defines the same arithmetic in torch integers):
//
// - Q8_0 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 values a block): d = amax / 127,
//   q = round(x * (1 / d)) half to even, d then rounded to float16;
// - Q8_K for Q4_K, Q5_K, Q6_K (256 values a block): the same with d kept in float32, and the
//   codes' sums per 16.
//
// A weight block's quants are unpacked to 32 unsigned bytes per span of 32 (the types whose
// quants are signed around a fixed offset, Q4_0 8, Q5_0 16, Q6_K 32, subtract offset * sum(q_x)
// in the integers; Q8_0's signed bytes take vpsignb), multiplied by the codes with vpmaddubsw
// (no pair of products can saturate int16 at these ranges), summed to int32 by vpmaddwd with
// the span's integer scale, so that each block's integer sum is exact. Its float32 term,
// (d_w * d_x) * isum, goes into an 8-lane accumulator per (x row, weight row) by one FMA per
// block; Q4_K and Q5_K subtract their minimums (dmin * d_x * sum_j m_j * bsum_j, the integer
// sums in 8 lanes) by a second FMA, Q4_1 / Q5_1 add theirs (m * d_x * sum(q_x)) into a float32
// scalar beside the lanes. Each pair's sums run over the columns in order and are summed across
// lanes in a fixed order at the end: a row's output is the same bit for bit whatever n and
// however the weight rows are split between threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef RAGBLEND_Q8_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "task_queue.h"

#ifndef RAGBLEND_Q8_NS
#define RAGBLEND_Q8_NS ragblend_q8
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // rows of x per call
constexpr int64_t kTask = 32;     // weight rows per task

using ragblend::for_tasks;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float to_f16(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i and8(__m256i a, int8_t m) { return _mm256_and_si256(a, _mm256_set1_epi8(m)); }

inline float hsum(__m256 v) {  // fixed order: halves, then pairs, then lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 bytes: the low nibbles (weights 0..15), then the high ones
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// a little-endian uint32 at p -> 32 bytes, 0x10 where bit l is set (ggml's bytes_from_bits_32)
inline __m256i bits32_x10(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i one = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return and8(_mm256_cmpeq_epi8(_mm256_and_si256(spread, one), one), 0x10);
}

// acc + the products of u (unsigned bytes) and q (int8), each lane 4 adjacent pairs: 8 int32
inline __m256i dot32(__m256i acc, __m256i u, __m256i q) {
#ifdef RAGBLEND_Q8_VNNI
  return _mm256_dpbusd_epi32(acc, u, q);
#else
  return _mm256_add_epi32(acc,
                          _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)));
#endif
}

// acc + the int16 products p times the int16 scales, each lane 2 adjacent pairs: 8 int32
inline __m256i scaled_add(__m256i acc, __m256i p, __m256i scale) {
#ifdef RAGBLEND_Q8_VNNI
  return _mm256_dpwssd_epi32(acc, p, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

// x quantized for one block kind: codes [n, cols], d [n, cols / block], sums [n, cols / 16];
// for blocks of 32 also each block's sum (sum32) and d times it (dsum) [n, cols / 32]
struct XQuant {
  int64_t block = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;
  std::vector<int32_t> sum32;
  std::vector<float> dsum;
};

XQuant quantize_x(const float* x, int64_t n, int64_t cols, int64_t block) {
  XQuant out;
  out.block = block;
  out.q.resize(n * cols);
  out.d.resize(n * cols / block);
  out.sums.resize(n * cols / 16);
  out.sum32.resize(n * cols / 32);  // filled for blocks of 32 only
  out.dsum.resize(n * cols / 32);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n * cols / block; ++i) {
    const float* v = x + i * block;
    __m256 m = _mm256_setzero_ps();
    for (int64_t k = 0; k < block; k += 8)
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
    const float amax = hmax(m);
    const float d = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    int8_t* q = out.q.data() + i * block;
    for (int64_t k = 0; k < block; k += 32) {
      __m256i r[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(v + k + 8 * j), id);
        r[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      const __m256i w =
          _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the lane packing
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                          _mm256_permutevar8x32_epi32(w, order));
    }
    out.d[i] = block == 32 ? to_f16(d) : d;
    for (int64_t s = 0; s < block / 16; ++s) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += q[16 * s + k];
      out.sums[i * block / 16 + s] = static_cast<int16_t>(sum);
    }
    if (block == 32) {
      out.sum32[i] = out.sums[2 * i] + out.sums[2 * i + 1];
      out.dsum[i] = out.d[i] * static_cast<float>(out.sum32[i]);
    }
  }
  return out;
}

// One row of x's blocks for a dot: codes, scale per block, sums per 16 (and for blocks of 32:
// each block's sum, and d times it).
struct XRow {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  const int32_t* sum32;
  const float* dsum;
};

// The 32-weight types' blocks: quants and d, and for Q4_1 / Q5_1 the minimum m.
struct Small {
  __m256i q;
  float d;
};
struct SmallMin {
  __m256i q;
  float d, m;
};

// (d_w * d_x) * sum((q - kOffset) q_x): the offset subtracted in the integers (Q4_0, Q5_0)
template <int kOffset>
inline void dot_offset(const Small& u, const XRow& x, int64_t k, __m256& acc) {
  const __m256i off =
      _mm256_set_m128i(_mm_setzero_si128(), _mm_cvtsi32_si128(-kOffset * x.sum32[k]));
  const __m256i s = dot32(off, u.q, load32(x.q + 32 * k));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(u.d * x.d[k]), _mm256_cvtepi32_ps(s), acc);
}

// (d_w * d_x) * sum(q q_x) in the lanes, m * d_x * sum(q_x) beside them (Q4_1, Q5_1)
inline void dot_min(const SmallMin& u, const XRow& x, int64_t k, __m256& acc, float& minimum) {
  const __m256i s = dot32(_mm256_setzero_si256(), u.q, load32(x.q + 32 * k));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(u.d * x.d[k]), _mm256_cvtepi32_ps(s), acc);
  minimum += u.m * x.dsum[k];
}

// Per type: kElems weights in kBytes bytes, x in blocks of kX; Unpacked holds a block's
// weights once for every row of x; dot(u, x, k, acc, minimum) adds block k of one x row.
struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18, kX = 32;
  using Unpacked = Small;
  static void unpack(const uint8_t* b, Unpacked& u) { u = {nibbles32(b + 2), f16(b)}; }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float&) {
    dot_offset<8>(u, x, k, acc);
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20, kX = 32;
  using Unpacked = SmallMin;
  static void unpack(const uint8_t* b, Unpacked& u) { u = {nibbles32(b + 4), f16(b), f16(b + 2)}; }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float& minimum) {
    dot_min(u, x, k, acc, minimum);
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22, kX = 32;
  using Unpacked = Small;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u = {_mm256_or_si256(nibbles32(b + 6), bits32_x10(b + 2)), f16(b)};
  }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float&) {
    dot_offset<16>(u, x, k, acc);
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24, kX = 32;
  using Unpacked = SmallMin;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u = {_mm256_or_si256(nibbles32(b + 8), bits32_x10(b + 4)), f16(b), f16(b + 2)};
  }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float& minimum) {
    dot_min(u, x, k, acc, minimum);
  }
};

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34, kX = 32;
  struct Unpacked { __m256i abs, q; float d; };
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.q = load32(b + 2);
    u.abs = _mm256_abs_epi8(u.q);  // -128 -> 0x80, read as the unsigned 128
    u.d = f16(b);
  }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float&) {
    const __m256i s =
        dot32(_mm256_setzero_si256(), u.abs, _mm256_sign_epi8(load32(x.q + 32 * k), u.q));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(u.d * x.d[k]), _mm256_cvtepi32_ps(s), acc);
  }
};

// Q4_K / Q5_K's 8 sub-blocks: 6-bit scales and mins packed in 12 bytes q (ggml's
// get_scale_min_k4), from the block's first 16 bytes a (d, dmin, q) by two byte shuffles into
// [scale 0..7 | min 0..7]. j < 4: scale q[j] & 63, min q[j + 4] & 63; j >= 4: scale
// (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, min q[j + 4] >> 4 | (q[j] >> 6) << 4. The 16-bit
// shifts spill bits between bytes only where the masks drop them.
inline __m128i k_scale_bytes(__m128i a) {
  const __m128i low = _mm_shuffle_epi8(a, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11,
                                                        12, 13, 14, 15));
  const __m128i m6 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m128i min47 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
  const __m128i lo = _mm_and_si128(_mm_blendv_epi8(low, _mm_srli_epi16(low, 4), min47), m6);
  const __m128i top = _mm_shuffle_epi8(a, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1,
                                                        8, 9, 10, 11));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));
  return _mm_or_si128(lo, hi);
}

// the scales as int16 sc[8], the mins as 16 int16 (each twice: one per 16 codes' sum)
inline void k_scales(const uint8_t* b, int16_t* sc, __m256i& mins) {
  const __m128i k = k_scale_bytes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(sc), _mm_cvtepu8_epi16(k));
  const __m128i m = _mm_cvtepu8_epi16(_mm_srli_si128(k, 8));
  mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

template <bool kFive>
struct QK {  // Q4_K (kFive false) and Q5_K: (d * sc_j) * q - dmin * m_j per 32 weights
  static constexpr int kElems = 256, kBytes = kFive ? 176 : 144, kX = 256;
  struct Unpacked { __m256i q[8]; __m256i mins; int16_t sc[8]; float d, dmin; };
  static void unpack(const uint8_t* b, Unpacked& u) {
    k_scales(b, u.sc, u.mins);
    u.d = f16(b);
    u.dmin = f16(b + 2);
    const uint8_t* qs = b + (kFive ? 48 : 16);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load32(qs + 32 * i);
      u.q[2 * i] = and8(v, 15);
      u.q[2 * i + 1] = and8(_mm256_srli_epi16(v, 4), 15);
    }
    if constexpr (kFive) {  // bit j of qh[l]: the fifth bit of sub-block j's weight l
      const __m256i h = load32(b + 16);
      u.q[0] = _mm256_or_si256(u.q[0], and8(_mm256_slli_epi16(h, 4), 0x10));
      u.q[1] = _mm256_or_si256(u.q[1], and8(_mm256_slli_epi16(h, 3), 0x10));
      u.q[2] = _mm256_or_si256(u.q[2], and8(_mm256_slli_epi16(h, 2), 0x10));
      u.q[3] = _mm256_or_si256(u.q[3], and8(_mm256_slli_epi16(h, 1), 0x10));
      u.q[4] = _mm256_or_si256(u.q[4], and8(h, 0x10));
      u.q[5] = _mm256_or_si256(u.q[5], and8(_mm256_srli_epi16(h, 1), 0x10));
      u.q[6] = _mm256_or_si256(u.q[6], and8(_mm256_srli_epi16(h, 2), 0x10));
      u.q[7] = _mm256_or_si256(u.q[7], and8(_mm256_srli_epi16(h, 3), 0x10));
    }
  }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float&) {
    const int8_t* q = x.q + 256 * k;
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j)
      s = scaled_add(s, _mm256_maddubs_epi16(u.q[j], load32(q + 32 * j)),
                     _mm256_set1_epi16(u.sc[j]));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(u.d * x.d[k]), _mm256_cvtepi32_ps(s), acc);
    const __m256i msum = _mm256_madd_epi16(u.mins, load32(x.sums + 16 * k));
    acc = _mm256_fnmadd_ps(_mm256_set1_ps(u.dmin * x.d[k]), _mm256_cvtepi32_ps(msum), acc);
  }
};

struct Q6_K {  // (d * sc_j) * ((ql | qh << 4) - 32), a scale per 16 weights
  static constexpr int kElems = 256, kBytes = 210, kX = 256;
  struct Unpacked { __m256i q[8]; __m256i sc16; int16_t sc[16]; float d; };
  static void unpack(const uint8_t* b, Unpacked& u) {
    for (int h = 0; h < 2; ++h) {  // weight 128 h + 32 t + l
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32);
      const __m256i hi = load32(b + 128 + 32 * h);
      u.q[4 * h + 0] = _mm256_or_si256(and8(l0, 15), and8(_mm256_slli_epi16(hi, 4), 0x30));
      u.q[4 * h + 1] = _mm256_or_si256(and8(l1, 15), and8(_mm256_slli_epi16(hi, 2), 0x30));
      u.q[4 * h + 2] = _mm256_or_si256(and8(_mm256_srli_epi16(l0, 4), 15), and8(hi, 0x30));
      u.q[4 * h + 3] = _mm256_or_si256(and8(_mm256_srli_epi16(l1, 4), 15),
                                       and8(_mm256_srli_epi16(hi, 2), 0x30));
    }
    u.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u.sc), u.sc16);
    u.d = f16(b + 208);
  }
  static void dot(const Unpacked& u, const XRow& x, int64_t k, __m256& acc, float&) {
    const int8_t* q = x.q + 256 * k;
    // the offset: 32 * sum_j sc_j * bsum_j, in the integers
    __m256i s = _mm256_slli_epi32(_mm256_madd_epi16(u.sc16, load32(x.sums + 16 * k)), 5);
    s = _mm256_sub_epi32(_mm256_setzero_si256(), s);
    for (int j = 0; j < 8; ++j) {
      const __m256i scale =
          _mm256_set_m128i(_mm_set1_epi16(u.sc[2 * j + 1]), _mm_set1_epi16(u.sc[2 * j]));
      const __m256i p = _mm256_maddubs_epi16(u.q[j], load32(q + 32 * j));
      s = scaled_add(s, p, scale);
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(u.d * x.d[k]), _mm256_cvtepi32_ps(s), acc);
  }
};

// Software prefetch of a task's weight bytes a fixed distance ahead of the blocks being read:
// a decode step's matmul streams its weights from memory once, and one sequential stream per
// thread is more than the hardware prefetcher keeps up with (without it these kernels read
// 10 GB/s where the float kernels, which prefetch, read 12; Xeon with AMX, 2 threads).
class Ahead {
 public:
  static constexpr int64_t kDistance = 4096;  // bytes ahead of the reads
  Ahead(const uint8_t* from, const uint8_t* end)
      : next_(std::min(from + kDistance, end)), end_(end) {
    fetch(from, next_);  // the task's first bytes, not yet asked for
  }
  // prefetch the next `bytes` (as many as were just read)
  void step(int64_t bytes) {
    const uint8_t* to = std::min(next_ + bytes, end_);
    fetch(next_, to);
    next_ = to;
  }

 private:
  static void fetch(const uint8_t* p, const uint8_t* end) {
    for (; p < end; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  }
  const uint8_t* next_;
  const uint8_t* end_;
};

// One weight row times R rows of x (R known at compile time: the accumulators stay in
// registers), each block unpacked once for the R rows: out[i] = lanes summed + minimum.
// `ahead`: the prefetcher to step by each block read (the first group of x's rows only).
template <class T, int R>
inline void dot_rows(const uint8_t* row, int64_t nb, const XRow* xr, float* out, Ahead* ahead) {
  __m256 acc[R];
  float minimum[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    minimum[i] = 0.0f;
  }
  for (int64_t k = 0; k < nb; ++k) {
    if (ahead != nullptr) ahead->step(T::kBytes);
    typename T::Unpacked u;
    T::unpack(row + k * T::kBytes, u);
    for (int i = 0; i < R; ++i) T::dot(u, xr[i], k, acc[i], minimum[i]);
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]) + minimum[i];
}

// Weight rows [r0, r1) times the n quantized rows of x: out[i * stride + r] (+ bias[r]). x's
// rows go 4 at a time (the weight row, in L1 by then, read again for each 4); a pair's sums
// are the same in any group.
template <class T>
void rows_dot(const uint8_t* w, int64_t row_bytes, int64_t cols, const XQuant& xq, int64_t n,
              const float* bias, int64_t stride, int64_t r0, int64_t r1, float* out) {
  const int64_t nb = cols / T::kElems;
  Ahead ahead(w + r0 * row_bytes, w + r1 * row_bytes);
  XRow xr[kMaxRows];
  for (int64_t i = 0; i < n; ++i)
    xr[i] = {xq.q.data() + i * cols, xq.d.data() + i * (cols / T::kX),
             xq.sums.data() + i * (cols / 16), xq.sum32.data() + i * (cols / 32),
             xq.dsum.data() + i * (cols / 32)};
  float sums[kMaxRows];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t i = 0; i < n; i += 4) {
      Ahead* a = i == 0 ? &ahead : nullptr;
      switch (std::min<int64_t>(4, n - i)) {
        case 1: dot_rows<T, 1>(row, nb, xr + i, sums + i, a); break;
        case 2: dot_rows<T, 2>(row, nb, xr + i, sums + i, a); break;
        case 3: dot_rows<T, 3>(row, nb, xr + i, sums + i, a); break;
        default: dot_rows<T, 4>(row, nb, xr + i, sums + i, a);
      }
    }
    for (int64_t i = 0; i < n; ++i)
      out[i * stride + r] = bias != nullptr ? sums[i] + bias[r] : sums[i];
  }
}

#ifdef RAGBLEND_Q8_AMX
// AMX-INT8 tiles for Q4_1 and Q8_0 (built with -DRAGBLEND_Q8_AMX beside the VNNI build's
// flags; the other types run the VNNI code). 16 weight rows a group; per 32-weight block, x's
// codes (n rows x 32, signed) are tile A straight from the quantized x, the group's weights
// tile B in VNNI layout (row kk: weights 4kk..4kk+3 of each of the 16 rows: the blocks as
// stored, loaded and transposed in registers, Q4_1's nibbles split after; q8_tile, q4_1_tile),
// and one tdpbsud (Q4_1's unsigned quants) or tdpbssd (Q8_0) gives the block's exact integer
// sum for every (x row, weight row) pair at once. Then per x row one FMA over the 16 weight
// rows, (d_w * d_x) * isum, and for Q4_1 a second, m * d_x * sum(q_x). A row's output depends
// only on its own x row: the same alone and batched. The float32 order is per block, where the
// VNNI and AVX2 builds' 8 lanes each sum 4 products a block: the same to float32 rounding of
// the per-block terms (the reference's), not bit for bit.
struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the tiles' state only when it asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// B rows 0..7 for Q8_0: dword kk of each of the 16 rows' 32 quants at p[m] (zero rows where
// p[m] is null), an 8 x 8 dword transpose in each 256-bit half of rows m and m + 8
inline void q8_tile(const uint8_t* const* p, uint8_t* b_tile) {
  __m512i z[8], t[8], u[8];
  const auto row = [&](int m) {
    return p[m] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[m]))
                : _mm256_setzero_si256();
  };
  for (int m = 0; m < 8; ++m)
    z[m] = _mm512_inserti64x4(_mm512_castsi256_si512(row(m)), row(m + 8), 1);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + m], 128-bit lane l: dword 4 (l % 2) + m of 4 rows
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int m = 0; m < 4; ++m) {
    _mm512_store_si512(b_tile + m * 64, _mm512_permutex2var_epi64(u[m], low, u[4 + m]));
    _mm512_store_si512(b_tile + (m + 4) * 64, _mm512_permutex2var_epi64(u[m], high, u[4 + m]));
  }
}

// B rows 0..7 for Q4_1: dword kk of each of the 16 rows' 16 bytes of nibbles at p[m] (a 4 x 4
// dword transpose in each 128-bit lane of rows j, j + 4, j + 8, j + 12), low nibbles (weights
// 4kk..4kk+3) in row kk, high (16 + 4kk..) in row kk + 4
inline void q4_1_tile(const uint8_t* const* p, uint8_t* b_tile) {
  __m512i v[4];
  const auto row = [&](int m) {
    return p[m] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[m])) : _mm_setzero_si128();
  };
  for (int j = 0; j < 4; ++j) {
    __m512i w = _mm512_castsi128_si512(row(j));
    w = _mm512_inserti32x4(w, row(j + 4), 1);
    w = _mm512_inserti32x4(w, row(j + 8), 2);
    v[j] = _mm512_inserti32x4(w, row(j + 12), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  const __m512i q[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  const __m512i m15 = _mm512_set1_epi8(15);
  for (int kk = 0; kk < 4; ++kk) {
    _mm512_store_si512(b_tile + kk * 64, _mm512_and_si512(q[kk], m15));
    _mm512_store_si512(b_tile + (kk + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(q[kk], 4), m15));
  }
}

// One block's tiles: B (weights, from b_tile) in tile kB, A (x's codes) in kA, the sums into
// kC, stored to c_tile. Two sets of tile registers alternate between blocks, so that one
// block's tile work overlaps the next's (tile registers are not renamed). A macro: GCC's tile
// intrinsics take their register numbers as literal tokens.
#define RAGBLEND_BLOCK_SUMS(kQ8, kC, kA, kB, b_tile, x, cols, c_tile) \
  do {                                                                 \
    _tile_loadd(kB, b_tile, 64);                                       \
    _tile_loadd(kA, x, cols);                                          \
    _tile_zero(kC);                                                    \
    if constexpr (kQ8) _tile_dpbssd(kC, kA, kB);                       \
    else _tile_dpbsud(kC, kA, kB);                                     \
    _tile_stored(kC, c_tile, 64);                                      \
  } while (0)

template <bool kQ8>  // Q8_0 (d, 32 signed quants) or Q4_1 (d, m, 16 bytes of nibbles)
void rows_amx(const uint8_t* w, int64_t row_bytes, int64_t cols, const XQuant& xq, int64_t n,
              const float* bias, int64_t stride, int64_t r0, int64_t r1, float* out) {
  constexpr int64_t kBytes = kQ8 ? Q8_0::kBytes : Q4_1::kBytes, kQuants = kQ8 ? 2 : 4;
  const int64_t nb = cols / 32;
  TileConfig cfg;
  for (int set = 0; set < 6; set += 3) {
    cfg.rows[set] = static_cast<uint8_t>(n), cfg.colsb[set] = 64;      // C: n x 16 int32
    cfg.rows[set + 1] = static_cast<uint8_t>(n), cfg.colsb[set + 1] = 32;  // A: n x 32 codes
    cfg.rows[set + 2] = 8, cfg.colsb[set + 2] = 64;  // B: 8 x 16 rows x 4 weights
  }
  _tile_loadconfig(&cfg);
  // kRun blocks at a time: all their B tiles prepared first (vector work), then their tile
  // work back to back (the B stores long done, one block's tiles overlapping the next's),
  // then their sums combined in block order
  constexpr int64_t kRun = 16;
  alignas(64) uint8_t b_tile[kRun][8 * 64];
  alignas(64) int32_t c_tile[kRun][kMaxRows * 16];
  __m512i head[kRun];
  const __m512i at = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(row_bytes)));
  // the first group's bytes, not yet asked for (the task may start anywhere in the weight)
  for (const uint8_t* p = w + r0 * row_bytes; p < w + std::min(r1, r0 + 16) * row_bytes; p += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  for (int64_t g = r0; g < r1; g += 16) {
    const int64_t rows = std::min<int64_t>(16, r1 - g);
    const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
    const uint8_t* group = w + g * row_bytes;
    // the next group's bytes prefetched to L2 in the order they will be read (a group's rows
    // are read block by block across them, not in memory order); into L1 they cost more at
    // one row of x than they gave (0.8x of the VNNI build's LM head, against ~1x)
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(16, r1 - g - 16));
    __m512 acc[kMaxRows];
    for (int64_t i = 0; i < n; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < nb; k0 += kRun) {
      const int64_t run = std::min(kRun, nb - k0);
      for (int64_t j = 0; j < run; ++j) {
        const uint8_t* b = group + (k0 + j) * kBytes;
        const uint8_t* quants[16];
        for (int m = 0; m < 16; ++m) quants[m] = m < rows ? b + m * row_bytes + kQuants : nullptr;
        for (int m = 0; m < ahead; ++m)
          _mm_prefetch(reinterpret_cast<const char*>(b + (16 + m) * row_bytes), _MM_HINT_T1);
        head[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, b, 1);  // d, m
        if constexpr (kQ8) q8_tile(quants, b_tile[j]);
        else q4_1_tile(quants, b_tile[j]);
      }
      for (int64_t j = 0; j < run; ++j) {
        const int8_t* x = xq.q.data() + (k0 + j) * 32;
        if (j % 2 == 0) RAGBLEND_BLOCK_SUMS(kQ8, 0, 1, 2, b_tile[j], x, cols, c_tile[j]);
        else RAGBLEND_BLOCK_SUMS(kQ8, 3, 4, 5, b_tile[j], x, cols, c_tile[j]);
      }
      for (int64_t j = 0; j < run; ++j) {
        const int64_t k = k0 + j;
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head[j]));
        const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head[j], 16)));
        for (int64_t i = 0; i < n; ++i) {
          const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c_tile[j] + 16 * i));
          acc[i] =
              _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(xq.d[i * nb + k])), acc[i]);
          if constexpr (!kQ8)
            acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq.dsum[i * nb + k]), acc[i]);
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      __m512 v = acc[i];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + g));
      _mm512_mask_storeu_ps(out + i * stride + g, live, v);
    }
  }
  _tile_release();
}
#endif

// Weight rows [r0, r1) of type T times x (rows_dot's arguments): on the tiles where this build
// has them for T (rows_amx), else rows_dot.
template <class T>
void weight_rows(const uint8_t* w, int64_t row_bytes, int64_t cols, const XQuant& xq, int64_t n,
                 const float* bias, int64_t stride, int64_t r0, int64_t r1, float* out) {
#ifdef RAGBLEND_Q8_AMX
  if constexpr (std::is_same_v<T, Q4_1> || std::is_same_v<T, Q8_0>)
    return rows_amx<std::is_same_v<T, Q8_0>>(w, row_bytes, cols, xq, n, bias, stride, r0, r1, out);
#endif
  rows_dot<T>(w, row_bytes, cols, xq, n, bias, stride, r0, r1, out);
}

template <class F>
void dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case 2: return f(Q4_0{});
    case 3: return f(Q4_1{});
    case 6: return f(Q5_0{});
    case 7: return f(Q5_1{});
    case 8: return f(Q8_0{});
    case 12: return f(QK<false>{});
    case 13: return f(QK<true>{});
    case 14: return f(Q6_K{});
    default:
      TORCH_CHECK(false, "ragblend_q8: unsupported ggml type ", qtype,
                  " (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)");
  }
}

template <class T>
void check_blocks(const at::Tensor& blocks, int64_t cols) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              "matmul_int8: blocks must be a contiguous 2-D uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(cols > 0 && cols % T::kElems == 0, "matmul_int8: cols (", cols,
              ") must be a positive multiple of the type's block of ", T::kElems, " weights");
  TORCH_CHECK(blocks.size(1) == cols / T::kElems * T::kBytes, "matmul_int8: rows of ",
              blocks.size(1), " bytes, expected ", cols / T::kElems * T::kBytes);
}

struct Part {
  int64_t rows;
  std::function<void(int64_t, int64_t)> run;
};

// x @ [W_0; W_1; ...].T (+ each one's bias) in 8-bit activations: [n, sum of rows] float32.
at::Tensor matmul_cat(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                      int64_t cols, const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "matmul_int8: x must be a contiguous 2-D float32 CPU tensor [n, cols]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "matmul_int8: x has ", x.size(0),
              " rows; expected 1 to ", kMaxRows);
  TORCH_CHECK(x.size(1) == cols && cols % 32 == 0, "matmul_int8: x has ", x.size(1),
              " columns, expected ", cols, " (a multiple of 32)");
  TORCH_CHECK(!blocks.empty() && qtypes.size() == blocks.size() && biases.size() == blocks.size(),
              "matmul_int8: one qtype and one bias (or None) per weight, and at least one weight");
#ifdef RAGBLEND_Q8_AMX
  TORCH_CHECK(amx_permitted(), "matmul_int8: Linux did not grant the AMX tiles' state");
#endif
  const int64_t n = x.size(0);
  int64_t total = 0;
  for (const at::Tensor& b : blocks) total += b.dim() == 2 ? b.size(0) : 0;
  at::Tensor out = at::empty({n, total}, x.options());
  XQuant x32, x256;  // made when a weight needs them
  std::vector<Part> parts;
  std::vector<at::Tensor> keep;
  int64_t offset = 0;
  for (size_t k = 0; k < blocks.size(); ++k) {
    dispatch(qtypes[k], [&](auto type) {
      using T = decltype(type);
      check_blocks<T>(blocks[k], cols);
      XQuant& xq = T::kX == 32 ? x32 : x256;
      if (xq.block == 0) xq = quantize_x(x.const_data_ptr<float>(), n, cols, T::kX);
      const XQuant* xp = &xq;
      const int64_t rows = blocks[k].size(0), row_bytes = blocks[k].size(1);
      const float* bias = nullptr;
      if (biases.get(k).has_value()) {
        const at::Tensor& b = *biases.get(k);
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == rows &&
                        b.is_contiguous(),
                    "matmul_int8: bias must be a contiguous float32 [rows] tensor");
        keep.push_back(b);
        bias = b.const_data_ptr<float>();
      }
      const uint8_t* w = blocks[k].const_data_ptr<uint8_t>();
      float* o = out.data_ptr<float>() + offset;
      parts.push_back({rows, [=](int64_t r0, int64_t r1) {
                         weight_rows<T>(w, row_bytes, cols, *xp, n, bias, total, r0, r1, o);
                       }});
      offset += rows;
    });
  }
  ragblend::for_part_rows(parts, kTask);
  return out;
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t cols,
                  const std::optional<at::Tensor>& bias) {
  c10::List<std::optional<at::Tensor>> biases;
  biases.push_back(bias);
  return matmul_cat(x, {blocks}, {qtype}, cols, biases);
}

// x quantized as the kernels quantize it, for the tests: (codes int8 [n, cols], d float32
// [n, cols / block], sums int16 [n, cols / 16])
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  (block == 32 || block == 256) && x.size(1) % block == 0,
              "quantize: x must be contiguous float32 [n, cols], block 32 or 256 dividing cols");
  const int64_t n = x.size(0), cols = x.size(1);
  XQuant xq = quantize_x(x.const_data_ptr<float>(), n, cols, block);
  at::Tensor q = at::empty({n, cols}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({n, cols / block}, x.options());
  at::Tensor s = at::empty({n, cols / 16}, x.options().dtype(at::kShort));
  std::memcpy(q.data_ptr(), xq.q.data(), xq.q.size());
  std::memcpy(d.data_ptr(), xq.d.data(), xq.d.size() * sizeof(float));
  std::memcpy(s.data_ptr(), xq.sums.data(), xq.sums.size() * sizeof(int16_t));
  return {q, d, s};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(RAGBLEND_Q8_NS, m) {
  m.def("matmul(Tensor x, Tensor blocks, int qtype, int cols, Tensor? bias) -> Tensor");
  m.def(
      "matmul_cat(Tensor x, Tensor[] blocks, int[] qtypes, int cols, Tensor?[] biases) -> "
      "Tensor");
  m.def("quantize(Tensor x, int block) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(RAGBLEND_Q8_NS, CPU, m) {
  m.impl("matmul", &matmul);
  m.impl("matmul_cat", &matmul_cat);
  m.impl("quantize", &quantize);
}
