// GGUF quantized weights read in place: dequantization and a decode step's matmul.
//
// CPU, AVX2 + FMA + F16C. A weight tensor is ggml's blocks as the GGUF file stores them, a
// uint8 tensor [rows, row_bytes]: one row is cols / block_elems consecutive blocks of one of
// the types below (ggml type ids Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13,
// Q6_K 14).
//
// Built three times: for AVX2 + FMA + F16C; with -DRAGBLEND_QUANT_512 for AVX512 F/BW/VL/DQ (its
// own op namespace), whose `matmul` works otherwise (see its section); and with
// -DRAGBLEND_QUANT_BF16 as well for AVX512-BF16, whose `matmul` of bf16 x multiplies the
// weights rounded to bf16 by vdpbf16ps (see dot_tile for bf16 x). `dequantize` is the same in
// all.
//
// Each block decodes into one scale per span of 16 or 32 weights (`sc`), for the types with a
// minimum one offset per 32 weights (`mn`), and its quants, 32 at a time, as small integers in
// float32 lanes (`q`): weight = sc * q + mn. The quants come out as q * 2^24 (vpshufb puts
// each byte in the top byte of its lane, then one int -> float conversion) and the scales as
// sc * 2^-24; powers of two are exact, so every product sc * q is the same float32 as without
// them. The products and sums are the ones of the gguf package's `dequantize_blocks`, in the
// same order (Q4_K: (d * sc) * q - dmin * m, each product rounded to float32 on its own; f16
// fields converted exactly by F16C), with no FMA contraction (-ffp-contract=off and explicit
// mul / add intrinsics), so that `dequantize` gives gguf's values bit for bit.
//
// `matmul` is x [n, cols] @ W.T for n <= 16 rows of x, reading each weight block once for
// all n rows; x in float32, or in bf16 (widened on entry, the output rounded to bf16 on exit;
// in the AVX512-BF16 build, bf16 x times the weights rounded to bf16, the products summed in
// float32 and the output rounded to bf16). The AVX2 build, per span, sums x * q in 8 lanes and
// scales that once (sc * sum(x q)); a minimum adds mn * sum(x), x's sums over each 32 columns
// computed once per call. Each (x row, weight row) pair has its own 8-lane accumulator that
// runs over the columns in order (in registers for up to 8 rows of x at a time, or for 4 weight
// rows at a time when x has one row) and is summed across lanes in a fixed order at the end, so
// a row's output is the same bit for bit whatever n and however the weight rows are split
// between threads.
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "task_queue.h"
#include "unroll.h"

// The op namespace: ragblend_quant for the AVX2 build, another for a wider one (its -D flag).
#ifndef RAGBLEND_QUANT_NS
#define RAGBLEND_QUANT_NS ragblend_quant
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // rows of x per matmul call
constexpr int64_t kChunk = 8;     // rows of x whose accumulators stay in registers together
constexpr int64_t kRowTile = 4;   // weight rows that share x's columns while they are in L1
constexpr int64_t kMatmulTask = 64;  // weight rows per task (a multiple of kRowTile)
#ifdef RAGBLEND_QUANT_512
// columns per call of the inner loop: 4 K blocks, so that its fixed cost (a weight row's
// accumulators loaded and stored, the tile dispatch) is spread over 32 spans; x's group of
// 8 rows (32 KiB) stays in L1
constexpr int64_t kGroup = 1024;
template <class T>
constexpr int64_t kGroupOf = kGroup;
#else
// columns per call of the inner loop, per type: Q4_K and Q5_K 4 blocks (1024), spreading its
// fixed cost over 32 spans (1.03-1.1x at one row); Q6_K and the small types are as fast or
// faster with one K block or 8 small blocks (256)
template <class T>
constexpr int64_t kGroupOf = T::kElems == 256 && T::kSpan == 32 ? 1024 : 256;
#endif
constexpr float kQ = 1.0f / 16777216.0f;  // 2^-24

using ragblend::for_tasks;
using ragblend::unroll;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes in both 128-bit lanes
inline __m256i bcast16(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i and_(__m256i a, int8_t m) { return _mm256_and_si256(a, _mm256_set1_epi8(m)); }

// v's 16-bit lanes shifted left by S (right by -S), as immediates
template <int S>
inline __m256i shift(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

// 16 quants as int8, the same in both lanes of v -> 2 x 8 float32 lanes of q * 2^24: vpshufb
// moves byte k to the top byte of a 32-bit lane and zeroes the rest.
inline void bytes16_to_f(__m256i v, __m256* q) {
  constexpr char z = -128;
  const __m256i lo = _mm256_setr_epi8(z, z, z, 0, z, z, z, 1, z, z, z, 2, z, z, z, 3,  //
                                      z, z, z, 4, z, z, z, 5, z, z, z, 6, z, z, z, 7);
  const __m256i hi = _mm256_setr_epi8(z, z, z, 8, z, z, z, 9, z, z, z, 10, z, z, z, 11,  //
                                      z, z, z, 12, z, z, z, 13, z, z, z, 14, z, z, z, 15);
  q[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, hi));
}

// Bits [16 * H, 16 * H + 16) of a little-endian uint32 -> 16 bytes (both lanes), 0x10 where
// the bit is set.
template <int H>
inline __m256i bits16_x10(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const int64_t b0 = 0x0101010101010101LL * (2 * H), b1 = 0x0101010101010101LL * (2 * H + 1);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(b1, b0, b1, b0));
  const __m256i one = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return and_(_mm256_cmpeq_epi8(_mm256_and_si256(spread, one), one), 0x10);
}

// Per type: kElems weights in kBytes bytes, a scale per kSpan weights, kMin: an offset per 32.
// scales(block, sc, mn): sc[kElems / kSpan] (times 2^-24), mn[kElems / 32];
// bytes<U>(block, v): weights [32 U, 32 U + 16) and [32 U + 16, 32 U + 32) as int8 quants,
// 16 in v[0] and 16 in v[1], each the same in both 128-bit lanes.
struct Q4_0 {  // d * (q - 8)
  static constexpr int kElems = 32, kBytes = 18, kSpan = 32;
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* sc, float*) { sc[0] = f16(b) * kQ; }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const __m256i w = bcast16(b + 2), e8 = _mm256_set1_epi8(8);
    v[0] = _mm256_sub_epi8(and_(w, 0x0F), e8);
    v[1] = _mm256_sub_epi8(and_(shift<-4>(w), 0x0F), e8);
  }
};

struct Q4_1 {  // (d * q) + m
  static constexpr int kElems = 32, kBytes = 20, kSpan = 32;
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* sc, float* mn) {
    sc[0] = f16(b) * kQ;
    mn[0] = f16(b + 2);
  }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const __m256i w = bcast16(b + 4);
    v[0] = and_(w, 0x0F);
    v[1] = and_(shift<-4>(w), 0x0F);
  }
};

struct Q5_0 {  // d * ((ql | qh << 4) - 16)
  static constexpr int kElems = 32, kBytes = 22, kSpan = 32;
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* sc, float*) { sc[0] = f16(b) * kQ; }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const __m256i w = bcast16(b + 6), e16 = _mm256_set1_epi8(16);
    v[0] = _mm256_sub_epi8(_mm256_or_si256(and_(w, 0x0F), bits16_x10<0>(b + 2)), e16);
    v[1] = _mm256_sub_epi8(_mm256_or_si256(and_(shift<-4>(w), 0x0F), bits16_x10<1>(b + 2)), e16);
  }
};

struct Q5_1 {  // (d * (ql | qh << 4)) + m
  static constexpr int kElems = 32, kBytes = 24, kSpan = 32;
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* sc, float* mn) {
    sc[0] = f16(b) * kQ;
    mn[0] = f16(b + 2);
  }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const __m256i w = bcast16(b + 8);
    v[0] = _mm256_or_si256(and_(w, 0x0F), bits16_x10<0>(b + 4));
    v[1] = _mm256_or_si256(and_(shift<-4>(w), 0x0F), bits16_x10<1>(b + 4));
  }
};

struct Q8_0 {  // q * d
  static constexpr int kElems = 32, kBytes = 34, kSpan = 32;
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* sc, float*) { sc[0] = f16(b) * kQ; }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    v[0] = bcast16(b + 2);
    v[1] = bcast16(b + 18);
  }
};

// Q4_K and Q5_K's 8 sub-blocks: 6-bit scales and mins packed in 12 bytes q (ggml's
// unpacking), from the block's first 16 bytes a (d, dmin, q) by two byte shuffles into
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

// sc_j = (d * scale_j) * 2^-24 and mn_j = -(dmin * min_j), each product rounded as gguf's.
inline void k_scales(const uint8_t* b, float* sc, float* mn) {
  const __m128i k = k_scale_bytes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(k, 8)));
  _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(f16(b) * kQ), s));
  _mm256_storeu_ps(mn, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), m),
                                     _mm256_set1_ps(-0.0f)));
}

struct Q4_K {  // (d * sc) * q - dmin * m; 32 bytes of qs: sub-block 2i low nibbles, 2i+1 high
  static constexpr int kElems = 256, kBytes = 144, kSpan = 32;
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* sc, float* mn) { k_scales(b, sc, mn); }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const uint8_t* p = b + 16 + 32 * (U / 2);
    v[0] = and_(shift<-4 * (U % 2)>(bcast16(p)), 0x0F);
    v[1] = and_(shift<-4 * (U % 2)>(bcast16(p + 16)), 0x0F);
  }
};

struct Q5_K {  // as Q4_K, with bit U of qh[l] the fifth bit of sub-block U's weight l
  static constexpr int kElems = 256, kBytes = 176, kSpan = 32;
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* sc, float* mn) { k_scales(b, sc, mn); }
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    const uint8_t* p = b + 48 + 32 * (U / 2);
    const __m256i l0 = and_(shift<-4 * (U % 2)>(bcast16(p)), 0x0F);
    const __m256i l1 = and_(shift<-4 * (U % 2)>(bcast16(p + 16)), 0x0F);
    const __m256i h0 = and_(shift<4 - U>(bcast16(b + 16)), 0x10);
    const __m256i h1 = and_(shift<4 - U>(bcast16(b + 32)), 0x10);
    v[0] = _mm256_or_si256(l0, h0);
    v[1] = _mm256_or_si256(l1, h1);
  }
};

struct Q6_K {  // (d * sc) * ((ql | qh << 4) - 32), a scale per 16 weights
  static constexpr int kElems = 256, kBytes = 210, kSpan = 16;
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* sc, float*) {
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(f16(b + 208) * kQ);
    _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_srli_si128(s8, 8)))));
  }
  // weights 128 h + 32 t + l: ql[64 h + 32 (t % 2) + l] nibble t / 2, qh[32 h + l] bits 2t, 2t+1
  template <int U>
  static void bytes(const uint8_t* b, __m256i* v) {
    constexpr int h = U / 4, t = U % 4;
    const uint8_t* ql = b + 64 * h + 32 * (t % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const __m256i e32 = _mm256_set1_epi8(32);
    const __m256i v0 = _mm256_or_si256(and_(shift<-4 * (t / 2)>(bcast16(ql)), 0x0F),
                                       and_(shift<4 - 2 * t>(bcast16(qh)), 0x30));
    const __m256i v1 = _mm256_or_si256(and_(shift<-4 * (t / 2)>(bcast16(ql + 16)), 0x0F),
                                       and_(shift<4 - 2 * t>(bcast16(qh + 16)), 0x30));
    v[0] = _mm256_sub_epi8(v0, e32);
    v[1] = _mm256_sub_epi8(v1, e32);
  }
};

// Weights [32 U, 32 U + 32) of a block of type T as 4 x 8 float32 lanes of q * 2^24.
template <class T, int U>
inline void quants(const uint8_t* b, __m256* q) {
  __m256i v[2];
  T::template bytes<U>(b, v);
  bytes16_to_f(v[0], q);
  bytes16_to_f(v[1], q + 2);
}

// float32 -> bfloat16 rounded to nearest even, as torch's c10::BFloat16 (NaN -> 0x7FC0)
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

inline void store_bf16(uint16_t* dst, __m256 a, __m256 b) {
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));  // lanes interleaved
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(packed, 0xD8));
}

// Rows [r0, r1) of the weights dequantized into out [rows, cols] (float32, or bf16 bits).
template <class T, typename Out>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r0, int64_t r1,
                  Out* out) {
  alignas(32) float sc[T::kElems / T::kSpan], mn[T::kElems / 32];
  const int64_t blocks = cols / T::kElems;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t* src = w + r * row_bytes + blk * T::kBytes;
      Out* dst = out + r * cols + blk * T::kElems;
      T::scales(src, sc, mn);
      unroll<T::kElems / 32>([&](auto U) {
        __m256 q[4];
        quants<T, U>(src, q);
        for (int k = 0; k < 4; ++k) {
          q[k] = _mm256_mul_ps(_mm256_set1_ps(sc[(32 * U + 8 * k) / T::kSpan]), q[k]);
          if constexpr (T::kMin) q[k] = _mm256_add_ps(q[k], _mm256_set1_ps(mn[U]));
        }
        if constexpr (sizeof(Out) == 4) {
          for (int k = 0; k < 4; ++k)
            _mm256_storeu_ps(reinterpret_cast<float*>(dst) + 32 * U + 8 * k, q[k]);
        } else {
          store_bf16(reinterpret_cast<uint16_t*>(dst) + 32 * U, q[0], q[1]);
          store_bf16(reinterpret_cast<uint16_t*>(dst) + 32 * U + 16, q[2], q[3]);
        }
      });
    }
  }
}

inline float hsum(__m256 v) {  // fixed order: halves, then pairs, then lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


inline float widen(uint16_t bf16) {  // exact
  const uint32_t u = uint32_t{bf16} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t round_bf16(float f) {  // c10::BFloat16's round to nearest even (NaN -> 0x7FC0)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// An output value: float32 as it is, or rounded to bf16 (what .to(torch.bfloat16) gives).
inline void store(float* out, float v) { *out = v; }
inline void store(uint16_t* out, float v) { *out = round_bf16(v); }

// x [n, cols] (float32, or bf16 bits widened to float32, or kept as bf16 bits if Packed is
// uint16_t) repacked by groups of kGroupOf<T> columns, [groups][n][kGroupOf<T>] (a short last
// group zero-padded), so that one group of all n rows is contiguous. Torch's allocator aligns
// it to 64 bytes: no 64-byte load of it straddles two cache lines.
template <class T, typename In, typename Packed = float>
at::Tensor pack_x(const In* x, int64_t n, int64_t cols) {
  constexpr int64_t kGroup = kGroupOf<T>;
  constexpr bool kSame = std::is_same_v<In, Packed>;
  const int64_t groups = (cols + kGroup - 1) / kGroup;
  const auto dtype = std::is_same_v<Packed, float> ? at::kFloat : at::kBFloat16;
  at::Tensor packed = at::zeros({groups * n * kGroup}, dtype);
  Packed* p = static_cast<Packed*>(packed.data_ptr());
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t width = std::min(kGroup, cols - g * kGroup);
      Packed* dst = p + (g * n + i) * kGroup;
      const In* src = x + i * cols + g * kGroup;
      if constexpr (kSame) std::memcpy(dst, src, width * sizeof(In));
      else for (int64_t c = 0; c < width; ++c) dst[c] = widen(src[c]);
    }
  return packed;
}

// Prefetches the cache lines of [p, end) into L1; returns where it stopped (end, or p).
inline const uint8_t* prefetch(const uint8_t* p, const uint8_t* end) {
  for (; p < end; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  return std::max(p, end);
}

// A task's weight rows [r0, r1) go by in tiles of kRowTile, each tile's blocks contiguous. Their
// decoding is slow enough that the hardware prefetcher falls behind: while a tile runs, this
// prefetches the tile after the next one, a group's bytes per step (and the next one too at
// the task's start).
class TilePrefetch {
 public:
  TilePrefetch(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1)
      : w_(w), row_bytes_(row_bytes), r0_(r0), r1_(r1) {}

  void start(int64_t t0, int64_t tile) {
    next_ = w_ + std::min(r1_, t0 + kRowTile + tile) * row_bytes_;
    end_ = w_ + std::min(r1_, t0 + 2 * kRowTile + tile) * row_bytes_;
    if (t0 == r0_) prefetch(w_ + (t0 + tile) * row_bytes_, next_);
  }
  void step(int64_t bytes) { next_ = prefetch(next_, std::min(next_ + bytes, end_)); }

 private:
  const uint8_t* w_;
  int64_t row_bytes_, r0_, r1_;
  const uint8_t* next_ = nullptr;
  const uint8_t* end_ = nullptr;
};

#ifdef RAGBLEND_QUANT_512
// The AVX512 matmul dequantizes each 32 weights of a block in registers into the values
// `dequantize` writes (gguf's, bit for bit) and multiplies them into two 16-lane accumulators
// per (x row, weight row) pair: weights [32 U, 32 U + 16) into one, [32 U + 16, 32 U + 32) into
// the other, over the columns in order, summed in a fixed order at the end. A tile of R weight
// rows by G rows of x shares each decoded weight between the G rows and each x load between
// the R rows, and keeps 2 R G independent sums in flight (a lone row of x takes 4 weight rows
// at a time, so that no add waits on the one before it). Each pair's sums are the same
// whatever R and G, so a row's output is the same alone and batched.
//
// 4-bit quants are indices into a 16-entry table of their span's weights (sc * k + mn, k =
// 0..15), built with the same products and sums as gguf's and looked up by vpermps; Q5_0's and
// Q5_1's 5-bit quants into two such tables (k = 0..15 and 16..31), their fifth bits the mask of
// a masked vpermps that takes the second (1.2x a Q5_0 matmul's speed against converting them).
// Q8_0 and Q6_K convert their quants (int8 -> float) and scale them. Q6_K's 6-bit quants are
// first unpacked for a whole block at a time, 64 per 512-bit op, into int8 in L1 (q6_unpack).

inline __m512 iota16(float first) {
  return _mm512_add_ps(_mm512_set1_ps(first), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15));
}

// 16 bytes -> 16 int32 lanes 0..255, their high nibbles if H
template <bool H>
inline __m512i nibbles16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (H) return _mm512_srli_epi32(v, 4);
  else return v;  // vpermps reads an index's low 4 bits only
}

// 16 int8 quants times their scale, as gguf multiplies them (sc * q, one product each)
inline __m512 scaled_int8(__m128i q, __m512 sc) {
  return _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
}
inline __m512 scaled_int8(__m128i q, float sc) { return scaled_int8(q, _mm512_set1_ps(sc)); }

// The f16 at p in all 16 lanes, converted exactly
RAGBLEND_INLINE __m512 f16x16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(h)));
}

// A 32-weight block's scale d and (Q4_1, Q5_1) offset m in all lanes, read from the block as
// its weights are decoded: the values T::scales gives (less its 2^-24), with no pass of scalar
// code over the blocks first (that pass took a third of a one-row matmul's time in cache).
RAGBLEND_INLINE __m512 small_d(const uint8_t* b) { return f16x16(b); }
RAGBLEND_INLINE __m512 small_m(const uint8_t* b) { return f16x16(b + 2); }

// A Q4_K or Q5_K block's 8 scales sc_j = d * scale_j and offsets mn_j = -(dmin * min_j), the
// products gguf rounds, in one 16-lane multiply (k_scale_bytes' unpacking; no 2^-24 round
// trip).
RAGBLEND_INLINE void k_scales512(const uint8_t* b, float* sc, float* mn) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m512 k = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k_scale_bytes(a)));
  const __m512 dd = _mm512_permutexvar_ps(  // d in lanes 0..7, dmin in 8..15
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_castps128_ps512(_mm_cvtph_ps(a)));
  const __m512 neg_mins = _mm512_castsi512_ps(_mm512_setr_epi32(
      0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
      INT32_MIN, INT32_MIN));
  const __m512 v = _mm512_xor_ps(_mm512_mul_ps(dd, k), neg_mins);
  _mm256_storeu_ps(sc, _mm512_castps512_ps256(v));
  _mm256_storeu_ps(mn, _mm512_extractf32x8_ps(v, 1));
}

// A K block's scales (T::scales) as `weights` takes them: sc * q as gguf multiplies it (the
// 32-weight types' are read with their weights: small_d, small_m).
template <class T>
RAGBLEND_INLINE void block_scales(const uint8_t* b, float* sc, float* mn) {
  if constexpr (std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K>) {
    k_scales512(b, sc, mn);
  } else if constexpr (std::is_same_v<T, Q6_K>) {  // d * scale_j, 16 int8 scales
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8))));
  } else {
    static_assert(T::kElems != 32, "a 32-weight block's scales are read with its weights");
  }
}

// A 4-bit span's 16 weights (k = 0..15) as a table, with gguf's products and sums: Q4_K's
// sub-block U (sc * k + mn), Q4_1's (sc * k) + mn, Q4_0's sc * (k - 8); and where its quants
// are (bytes 32 (U / 2) + l of Q4_K's, U even low nibbles, odd high; the small types' low
// nibbles then high).
template <class T, int U>
RAGBLEND_INLINE __m512 nibble_table(const uint8_t* b, const float* sc, const float* mn) {
  if constexpr (std::is_same_v<T, Q4_K>) {
    return _mm512_add_ps(_mm512_mul_ps(iota16(0), _mm512_set1_ps(sc[U])), _mm512_set1_ps(mn[U]));
  } else {
    constexpr bool kOffset = std::is_same_v<T, Q4_1>;
    const __m512 tab = _mm512_mul_ps(iota16(kOffset ? 0.0f : -8.0f), small_d(b));
    return kOffset ? _mm512_add_ps(tab, small_m(b)) : tab;
  }
}
template <class T, int U>
RAGBLEND_INLINE const uint8_t* nibble_bytes(const uint8_t* b) {
  if constexpr (std::is_same_v<T, Q4_K>) return b + 16 + 32 * (U / 2);
  else return b + (std::is_same_v<T, Q4_1> ? 4 : 2);
}

// A Q5_0 or Q5_1 block's tables of its weights with quants 0..15 (lo) and 16..31 (hi), with
// gguf's products and sums; returns its fifth bits (bit l: weight l's), its low 4 bits at
// q5_bytes(b). Weight l < 16: qs[l] & 15 | bit l << 4; l + 16: qs[l] >> 4 | bit l + 16 << 4.
template <class T>
RAGBLEND_INLINE uint32_t q5_tables(const uint8_t* b, __m512& lo, __m512& hi) {
  constexpr bool kOffset = std::is_same_v<T, Q5_1>;
  uint32_t fifth;
  std::memcpy(&fifth, b + (kOffset ? 4 : 2), 4);
  const __m512 d = small_d(b);
  lo = _mm512_mul_ps(iota16(kOffset ? 0.0f : -16.0f), d);
  hi = _mm512_mul_ps(iota16(kOffset ? 16.0f : 0.0f), d);
  if constexpr (kOffset) {
    const __m512 m = small_m(b);
    lo = _mm512_add_ps(lo, m);
    hi = _mm512_add_ps(hi, m);
  }
  return fifth;
}
template <class T>
RAGBLEND_INLINE const uint8_t* q5_bytes(const uint8_t* b) {
  return b + (std::is_same_v<T, Q5_1> ? 8 : 6);
}

// Weights [32 U, 32 U + 32) of block b of type T as float32, gguf's values: w[0], w[1] 16 each.
// sc, mn: a K block's scales (block_scales: sc * q as gguf multiplies it); a 32-weight block's
// are read from b (small_d, small_m).
template <class T, int U>
RAGBLEND_INLINE void weights(const uint8_t* b, const float* sc, const float* mn, __m512* w) {
  if constexpr (std::is_same_v<T, Q4_K>) {
    const uint8_t* p = nibble_bytes<T, U>(b);
    const __m512 tab = nibble_table<T, U>(b, sc, mn);
    w[0] = _mm512_permutexvar_ps(nibbles16<U % 2 == 1>(p), tab);
    w[1] = _mm512_permutexvar_ps(nibbles16<U % 2 == 1>(p + 16), tab);
  } else if constexpr (std::is_same_v<T, Q4_1> || std::is_same_v<T, Q4_0>) {  // low, high
    const uint8_t* p = nibble_bytes<T, U>(b);
    const __m512 tab = nibble_table<T, U>(b, sc, mn);
    w[0] = _mm512_permutexvar_ps(nibbles16<false>(p), tab);
    w[1] = _mm512_permutexvar_ps(nibbles16<true>(p), tab);
  } else if constexpr (std::is_same_v<T, Q5_1> || std::is_same_v<T, Q5_0>) {
    // The fifth bit picks the table: qh's bits are the masks of a masked vpermps.
    __m512 lo, hi;
    const uint32_t fifth = q5_tables<T>(b, lo, hi);
    const uint8_t* p = q5_bytes<T>(b);
    const __m512i i0 = nibbles16<false>(p), i1 = nibbles16<true>(p);
    w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i0, lo),
                                      static_cast<__mmask16>(fifth), i0, hi);
    w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i1, lo),
                                      static_cast<__mmask16>(fifth >> 16), i1, hi);
  } else {
    __m256i v[2];
    T::template bytes<U>(b, v);
    for (int k = 0; k < 2; ++k) {
      if constexpr (T::kElems == 32)
        w[k] = scaled_int8(_mm256_castsi256_si128(v[k]), small_d(b));
      else
        w[k] = scaled_int8(_mm256_castsi256_si128(v[k]), sc[T::kSpan == 32 ? U : 2 * U + k]);
      if constexpr (T::kMin) w[k] = _mm512_add_ps(w[k], _mm512_set1_ps(mn[U]));
    }
  }
}

// A Q6_K block's 256 quants as int8 (ql | qh << 4) - 32, in weight order: each half h of the
// block (weights 128 h + 32 t + l) from ql[64 h + 32 (t % 2) + l] (nibble t / 2) and qh[32 h +
// l] (bits 2t, 2t + 1), 64 weights per op: t = 0, 1 from ql's low nibbles, t = 2, 3 from its
// high ones. The 16-bit shifts spill bits between bytes only where the masks drop them.
RAGBLEND_INLINE void q6_unpack(const uint8_t* b, int8_t* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
  const __m512i e32 = _mm512_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    const __m512i lo = _mm512_and_si512(ql, m4);                         // t = 0 | t = 1
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);  // t = 2 | t = 3
    const __m512i h01 = _mm512_and_si512(
        _mm512_mask_blend_epi64(0xF0, _mm512_slli_epi16(qh, 4), _mm512_slli_epi16(qh, 2)), m2);
    const __m512i h23 =
        _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, qh, _mm512_srli_epi16(qh, 2)), m2);
    _mm512_storeu_si512(out + 128 * h, _mm512_sub_epi8(_mm512_or_si512(lo, h01), e32));
    _mm512_storeu_si512(out + 128 * h + 64, _mm512_sub_epi8(_mm512_or_si512(hi, h23), e32));
  }
}

// Weights [32 U, 32 U + 32) of a Q6_K block from its unpacked quants q (q6_unpack): as
// `weights` does for the other int8 types.
template <int U>
RAGBLEND_INLINE void q6_weights(const int8_t* q, const float* sc, __m512* w) {
  for (int k = 0; k < 2; ++k)
    w[k] = scaled_int8(
        _mm_load_si128(reinterpret_cast<const __m128i*>(q + 32 * U + 16 * k)), sc[2 * U + k]);
}

using Acc = __m512;  // one of a pair's two accumulators
inline float lane_sum(__m512 s) {  // fixed order: halves, then as hsum
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)));
}
inline float pair_sum(const Acc* a) { return lane_sum(_mm512_add_ps(a[0], a[1])); }

// lane_sum of 16 vectors at once: lane 4 q + j of the result is lane_sum(a[4 j + q]), bit for
// bit, each lane's adds the tree lane_sum makes (lanes k and k + 8, then k and k + 4, k and
// k + 2, k and k + 1), with the vectors' lanes moved between them rather than within one: 15
// adds and 30 shuffles where 16 lane_sums take 16 x 8 ops (a tenth of a 896-column matmul's
// time at eight rows of x).
RAGBLEND_INLINE __m512 lane_sums16(const __m512* a) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // t[k]: a[2 k]'s and a[2 k + 1]'s 8 sums of lanes k, k + 8
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // u[k]: 128-bit quarter q holds a[4 k + q]'s 4 sums
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k) {  // w[k]: quarter q holds a[8 k + q]'s and a[8 k + 4 + q]'s 2
    const __m512d lo = _mm512_castps_pd(u[2 * k]), hi = _mm512_castps_pd(u[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 4 x 4 outputs from v's lanes: lane 4 i + r to out[i * stride + r], float32 or rounded to
// bf16 (bf16_bits: round_bf16's values)
RAGBLEND_INLINE void store4x4(float* out, int64_t stride, __m512 v) {
  unroll<4>([&](auto i) RAGBLEND_INLINE_LAMBDA {
    _mm_storeu_ps(out + i * stride, _mm512_extractf32x4_ps(v, decltype(i)::value));
  });
}
RAGBLEND_INLINE void store4x4(uint16_t* out, int64_t stride, __m512 v) {
  const __m512i bits = _mm512_inserti64x4(
      _mm512_castsi256_si512(bf16_bits(_mm512_castps512_ps256(v))),
      bf16_bits(_mm512_extractf32x8_ps(v, 1)), 1);
  const __m256i h = _mm512_cvtepi32_epi16(bits);
  unroll<4>([&](auto i) RAGBLEND_INLINE_LAMBDA {
    const int64_t four = _mm256_extract_epi64(h, decltype(i)::value);
    std::memcpy(out + i * stride, &four, 8);
  });
}

// Outputs [i0, i0 + 4) x [0, 4) of a tile of 4 weight rows: acc[r][i0 + i]'s sums (lane_sum,
// or pair_sum where kOne is false) plus bias[r] if any, to out[i * stride + r]; the same
// values as summing each pair on its own
template <bool kOne, typename Out>
RAGBLEND_INLINE void store_sums4x4(const Acc (*acc)[kMaxRows][2], int64_t i0, const float* bias,
                                   Out* out, int64_t stride) {
  __m512 a[16];
  unroll<4>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<4>([&](auto i) RAGBLEND_INLINE_LAMBDA {
      const Acc* p = acc[r][i0 + i];
      a[4 * r + i] = kOne ? p[0] : _mm512_add_ps(p[0], p[1]);
    });
  });
  __m512 v = lane_sums16(a);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_loadu_ps(bias)));
  store4x4(out, stride, v);
}

// R weight rows (their nb blocks from src[r], K blocks' scales sc[r], mn[r]) by G rows of x
// (one packed group, [G][kGroup]): acc[r][i0 + g][0..2) += their products, or = them where
// `fresh` (a row's first group: acc not read).
template <class T, int R, int G>
void dot_tile(const uint8_t* const* src, int64_t nb, const float* const* sc,
              const float* const* mn, const float* x, Acc (*acc)[kMaxRows][2], int64_t i0,
              bool fresh) {
  constexpr int kSc = T::kElems / T::kSpan, kMn = T::kElems / 32;
  constexpr bool kQ6 = std::is_same_v<T, Q6_K>;
  alignas(64) int8_t q6[kQ6 ? R : 1][kQ6 ? T::kElems : 1];
  Acc a[R][G][2];
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
      a[r][g][0] = fresh ? _mm512_setzero_ps() : acc[r][i0 + g][0];
      a[r][g][1] = fresh ? _mm512_setzero_ps() : acc[r][i0 + g][1];
    });
  });
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (kQ6)
      unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA { q6_unpack(src[r] + b * T::kBytes, q6[r]); });
    unroll<T::kElems / 32>([&](auto U) RAGBLEND_INLINE_LAMBDA {
      unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
        __m512 w[2];
        if constexpr (kQ6) q6_weights<U>(q6[r], sc[r] + b * kSc, w);
        else weights<T, U>(src[r] + b * T::kBytes, sc[r] + b * kSc, mn[r] + b * kMn, w);
        unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
          const float* xp = x + g * kGroup + b * T::kElems + 32 * U;
          a[r][g][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w[0], a[r][g][0]);
          a[r][g][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w[1], a[r][g][1]);
        });
      });
    });
  }
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
      acc[r][i0 + g][0] = a[r][g][0], acc[r][i0 + g][1] = a[r][g][1];
    });
  });
}

#ifdef RAGBLEND_QUANT_BF16
// Weights [32 U, 32 U + 32) of block b of type T as 32 bf16, `weights`' values rounded to
// nearest even. The 4- and 5-bit types look their quants up in a 32-entry bf16 table (vpermw,
// which reads an index's low 5 bits): a 16-entry table twice, or Q5's two tables.
template <class T, int U>
RAGBLEND_INLINE __m512bh weights_bf16(const uint8_t* b, const float* sc, const float* mn) {
  if constexpr (std::is_same_v<T, Q4_K>) {
    const __m512 tab = nibble_table<T, U>(b, sc, mn);
    __m512i i = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibble_bytes<T, U>(b))));
    if constexpr (U % 2 == 1) i = _mm512_srli_epi16(i, 4);
    return (__m512bh)_mm512_permutexvar_epi16(i, (__m512i)_mm512_cvtne2ps_pbh(tab, tab));
  } else if constexpr (std::is_same_v<T, Q4_1> || std::is_same_v<T, Q4_0>) {
    const __m512 tab = nibble_table<T, U>(b, sc, mn);
    __m512i i = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_bytes<T, U>(b)))));
    i = _mm512_mask_srli_epi16(i, 0xFFFF0000u, i, 4);
    return (__m512bh)_mm512_permutexvar_epi16(i, (__m512i)_mm512_cvtne2ps_pbh(tab, tab));
  } else if constexpr (std::is_same_v<T, Q5_1> || std::is_same_v<T, Q5_0>) {
    __m512 lo, hi;
    const uint32_t fifth = q5_tables<T>(b, lo, hi);
    __m512i i = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q5_bytes<T>(b)))));
    i = _mm512_and_si512(_mm512_mask_srli_epi16(i, 0xFFFF0000u, i, 4), _mm512_set1_epi16(15));
    i = _mm512_mask_add_epi16(i, static_cast<__mmask32>(fifth), i, _mm512_set1_epi16(16));
    return (__m512bh)_mm512_permutexvar_epi16(i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  } else if constexpr (std::is_same_v<T, Q8_0>) {  // its 32 quants by 16-byte loads
    const auto* p = reinterpret_cast<const __m128i*>(b + 2);
    const __m512 d = small_d(b);
    return _mm512_cvtne2ps_pbh(scaled_int8(_mm_loadu_si128(p + 1), d),
                               scaled_int8(_mm_loadu_si128(p), d));
  } else {
    __m512 w[2];
    weights<T, U>(b, sc, mn, w);
    return _mm512_cvtne2ps_pbh(w[1], w[0]);
  }
}

// dot_tile for bf16 x (the AVX512-BF16 build): each 32 weights of a block rounded to bf16
// (weights_bf16: what `dequantize` to bf16 gives) and multiplied with x's 32 bf16 by one
// vdpbf16ps (16 lanes, each adding two products) into the pair's one accumulator, over the
// columns in order, so that each pair's sums are the same whatever R and G. Half the multiply
// instructions, half x's bytes and half the accumulators of the float32 tile: R G <= 16 pairs
// (dot_rows_bf16) share each x load between R weight rows. acc[r][g][0] += the products, or =
// them where `fresh` (a row's first group: acc not read).
template <class T, int R, int G>
void dot_tile(const uint8_t* const* src, int64_t nb, const float* const* sc,
              const float* const* mn, const uint16_t* x, Acc (*acc)[kMaxRows][2], bool fresh) {
  constexpr int kSc = T::kElems / T::kSpan, kMn = T::kElems / 32;
  constexpr int kSpans = T::kElems / 32;
  constexpr bool kQ6 = std::is_same_v<T, Q6_K>;
  alignas(64) int8_t q6[kQ6 ? R : 1][kQ6 ? T::kElems : 1];
  Acc a[R][G];
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
      a[r][g] = fresh ? _mm512_setzero_ps() : acc[r][g][0];
    });
  });
  const auto decode = [&](auto r, int64_t b, auto U) RAGBLEND_INLINE_LAMBDA {
    if constexpr (kQ6) {
      __m512 w[2];
      q6_weights<U>(q6[r], sc[r] + b * kSc, w);
      return _mm512_cvtne2ps_pbh(w[1], w[0]);
    } else {
      return weights_bf16<T, U>(src[r] + b * T::kBytes, sc[r] + b * kSc, mn[r] + b * kMn);
    }
  };
  // kAhead spans of all R rows decoded before their products (a span's products wait on its
  // decoding's chain of dependent ops: table, conversion, lookup); the table types' one-span
  // blocks two at a time, four where the tile has 1 or 2 weight rows (5-16 rows of x: up to
  // 1.1x a Q5_0 matmul's speed against two; four at 4 weight rows gained nothing); Q8_0's as
  // fast one at a time
  constexpr int kBlocks =
      kSpans == 1 && !std::is_same_v<T, Q8_0> ? (R <= 2 ? 4 : 2) : 1;
  constexpr int kPerStep = kSpans * kBlocks;
  constexpr int kAhead = std::max(1, std::min(kPerStep, 8 / R));
  const auto step = [&](int64_t b, auto blocks) RAGBLEND_INLINE_LAMBDA {
    constexpr int kStepSpans = kSpans * blocks;
    if constexpr (kQ6)
      unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA { q6_unpack(src[r] + b * T::kBytes, q6[r]); });
    unroll<(kStepSpans + kAhead - 1) / kAhead>([&](auto k) RAGBLEND_INLINE_LAMBDA {
      constexpr int kFirst = k * kAhead, kCount = std::min(kAhead, kStepSpans - kFirst);
      __m512bh w[kCount][R];
      unroll<kCount>([&](auto c) RAGBLEND_INLINE_LAMBDA {
        constexpr int kS = kFirst + c;  // the step's span: block b + kS / kSpans, U kS % kSpans
        unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
          w[c][r] = decode(r, b + kS / kSpans, std::integral_constant<int, kS % kSpans>{});
        });
      });
      unroll<kCount>([&](auto c) RAGBLEND_INLINE_LAMBDA {
        const uint16_t* xp = x + b * T::kElems + 32 * (kFirst + c);
        unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + g * kGroup);
          unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
            a[r][g] = _mm512_dpbf16_ps(a[r][g], xv, w[c][r]);
          });
        });
      });
    });
  };
  int64_t b = 0;
  for (; b + kBlocks <= nb; b += kBlocks) step(b, std::integral_constant<int, kBlocks>{});
  for (; b < nb; ++b) step(b, std::integral_constant<int, 1>{});  // the last 1-3 blocks
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { acc[r][g][0] = a[r][g]; });
  });
}

// R weight rows by all n rows of x (bf16) in one tile of R x n <= 16 pairs: dot_tile<T, R, n>
template <class T, int R, int G = 1>
RAGBLEND_INLINE void dot_rows_bf16(int64_t n, const uint8_t* const* src, int64_t nb,
                                   const float* const* sc, const float* const* mn,
                                   const uint16_t* x, Acc (*acc)[kMaxRows][2], bool fresh) {
  if constexpr (G < 16 / R) {
    if (n > G) return dot_rows_bf16<T, R, G + 1>(n, src, nb, sc, mn, x, acc, fresh);
  }
  dot_tile<T, R, G>(src, nb, sc, mn, x, acc, fresh);
}
#endif

// rows x n pairs of float32 x in tiles: 4 weight rows by 1 or 2 of x, 2 by 3 or 4, else 1 by
// up to 8. fresh: the group is the rows' first, which the tiles start from zero in registers
template <class T>
void dot_rows_f32(int64_t rows, int64_t n, const uint8_t* const* src, int64_t nb,
                  const float* const* sc, const float* const* mn, const float* x,
                  Acc (*acc)[kMaxRows][2], bool fresh) {
  const int64_t R = n <= 2 ? 4 : n <= 4 ? 2 : 1;
  int64_t r = 0;
  for (; R > 1 && r + R <= rows; r += R) {
    const auto* s = src + r;
    if (n == 1) dot_tile<T, 4, 1>(s, nb, sc + r, mn + r, x, acc + r, 0, fresh);
    else if (n == 2) dot_tile<T, 4, 2>(s, nb, sc + r, mn + r, x, acc + r, 0, fresh);
    else if (n == 3) dot_tile<T, 2, 3>(s, nb, sc + r, mn + r, x, acc + r, 0, fresh);
    else dot_tile<T, 2, 4>(s, nb, sc + r, mn + r, x, acc + r, 0, fresh);
  }
  for (; r < rows; ++r)
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const auto* s = src + r;
      const float* xi = x + i0 * kGroup;
      switch (std::min(kChunk, n - i0)) {
        case 1: dot_tile<T, 1, 1>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 2: dot_tile<T, 1, 2>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 3: dot_tile<T, 1, 3>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 4: dot_tile<T, 1, 4>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 5: dot_tile<T, 1, 5>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 6: dot_tile<T, 1, 6>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        case 7: dot_tile<T, 1, 7>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
        default: dot_tile<T, 1, 8>(s, nb, sc + r, mn + r, xi, acc + r, i0, fresh); break;
      }
    }
}

// rows x n pairs: dot_rows_f32's tiles, or for bf16 x (the AVX512-BF16 build) 4 weight rows by
// 1-4 rows of x, 2 by 5-8, 1 by 9-16
template <class T, typename X>
void dot_rows(int64_t rows, int64_t n, const uint8_t* const* src, int64_t nb,
              const float* const* sc, const float* const* mn, const X* x,
              Acc (*acc)[kMaxRows][2], bool fresh) {
#ifdef RAGBLEND_QUANT_BF16
  if constexpr (std::is_same_v<X, uint16_t>) {
    int64_t r = 0;
    const auto rows_of = [&](auto R) RAGBLEND_INLINE_LAMBDA {
      dot_rows_bf16<T, R>(n, src + r, nb, sc + r, mn + r, x, acc + r, fresh);
    };
    if (n <= 4)
      for (; r + 4 <= rows; r += 4) rows_of(std::integral_constant<int, 4>{});
    if (n <= 8)
      for (; r + 2 <= rows; r += 2) rows_of(std::integral_constant<int, 2>{});
    for (; r < rows; ++r) rows_of(std::integral_constant<int, 1>{});
    return;
  } else
#endif
    dot_rows_f32<T>(rows, n, src, nb, sc, mn, x, acc, fresh);
}

// out[i, r] for weight rows [r0, r1): out [n, rows] (float32 or bf16); x packed (pack_x).
template <class T, typename X, typename Out>
void matmul_rows(const X* x, int64_t n, int64_t cols, const uint8_t* w, int64_t row_bytes,
                 const float* bias, int64_t rows, int64_t r0, int64_t r1, Out* out) {
  constexpr int64_t per_group = kGroup / T::kElems;
  constexpr int64_t kSc = T::kElems / T::kSpan, kMn = T::kElems / 32;
  alignas(64) float sc[kRowTile][per_group * kSc], mn[kRowTile][per_group * kMn];
  alignas(64) Acc acc[kRowTile][kMaxRows][2];
  const uint8_t* src[kRowTile];
  const float* scp[kRowTile];
  const float* mnp[kRowTile];
  for (int64_t r = 0; r < kRowTile; ++r) scp[r] = sc[r], mnp[r] = mn[r];
  const int64_t blocks = cols / T::kElems;
  // The tiles start a row's first group from zero in registers (dot_tile's `fresh`) rather
  // than from zeros stored and loaded back, and the bf16 tile (bf16 x) keeps one accumulator
  // per pair: the second is neither zeroed nor added (pair_sum's a[0] + 0 is a[0]: a sum that
  // starts at +0 never becomes -0). At eight rows of x each was 1.07-1.11x the speed of a 896-
  // or 576-column matmul (bf16 x and float32 x), the loads and stores of 16 pairs' zeros
  // weighing on tiles of two rows.
  constexpr bool kOne = std::is_same_v<X, uint16_t>;
  TilePrefetch ahead(w, row_bytes, r0, r1);
  for (int64_t t0 = r0; t0 < r1; t0 += kRowTile) {
    const int64_t tile = std::min(kRowTile, r1 - t0);
    ahead.start(t0, tile);
    for (int64_t b0 = 0, g = 0; b0 < blocks; b0 += per_group, ++g) {
      const int64_t nb = std::min(per_group, blocks - b0);
      for (int64_t r = 0; r < tile; ++r) {
        src[r] = w + (t0 + r) * row_bytes + b0 * T::kBytes;
        ahead.step(per_group * T::kBytes);
        if constexpr (T::kElems == 256)
          for (int64_t b = 0; b < nb; ++b)
            block_scales<T>(src[r] + b * T::kBytes, sc[r] + b * kSc, mn[r] + b * kMn);
        else if constexpr (std::is_same_v<T, Q8_0>)  // the fewest ops per byte: its tile waits
          prefetch(src[r], src[r] + nb * T::kBytes);  // on memory unless the group is asked for
      }
      dot_rows<T, X>(tile, n, src, nb, scp, mnp, x + g * n * kGroup, acc, b0 == 0);
    }
    int64_t sums = 0;  // rows of x whose outputs store_sums4x4 gave
    static_assert(kRowTile == 4);
    if (tile == kRowTile)
      for (; sums + 4 <= n; sums += 4)
        store_sums4x4<kOne>(acc, sums, bias == nullptr ? nullptr : bias + t0,
                            out + sums * rows + t0, rows);
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t i = sums; i < n; ++i) {
        float v = kOne ? lane_sum(acc[r][i][0]) : pair_sum(acc[r][i]);
        if (bias != nullptr) v += bias[t0 + r];
        store(out + i * rows + t0 + r, v);
      }
  }
}
#else
// A (x row, weight row) pair's accumulator: 8 float32 lanes.
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(__m256 v) { return hsum(v); }

// x's sums that an offset multiplies, per 32 columns, [groups][n][kXs]: K types one float
// per 32 columns (kGroupOf<T> / 32 per group), small types with an offset 8 lanes per 32
// columns, from x packed (pack_x). 64-byte aligned as pack_x's; empty for the types without
// an offset.
template <class T>
constexpr int64_t kXs = T::kElems == 32 ? kGroupOf<T> / 4 : kGroupOf<T> / 32;

template <class T>
at::Tensor x_sums(const float* x, int64_t n, int64_t cols) {
  if constexpr (!T::kMin) return at::empty({0}, at::kFloat);
  constexpr int64_t kPer = kGroupOf<T> / 32;  // spans of 32 columns per group
  const int64_t groups = (cols + kGroupOf<T> - 1) / kGroupOf<T>;
  at::Tensor sums = at::zeros({groups * n * kXs<T>}, at::kFloat);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t u = 0; u < cols / 32; ++u) {
      const float* p = x + (u / kPer * n + i) * kGroupOf<T> + 32 * (u % kPer);
      const __m256 s01 = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
      const __m256 s23 = _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24));
      const __m256 s = _mm256_add_ps(s01, s23);
      float* dst = sums.data_ptr<float>() + (u / kPer * n + i) * kXs<T>;
      if constexpr (T::kElems == 32)
        _mm256_storeu_ps(dst + 8 * (u % kPer), s);
      else
        dst[u % kPer] = hsum(s);
    }
  return sums;
}

// The f16 at p in all 8 lanes, converted exactly
RAGBLEND_INLINE __m256 f16x8(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(h)));
}

// One pair's span U of block blk: a += sc * sum(x q) per span of the scales s (the block's),
// x q in 8 lanes in column order (xp: x's 32 columns; q: quants<T, U>'s). A 32-weight block's
// scale (T::scales' sc[0]) is read from the block here, with its weights, rather than by a
// pass of scalar code over the blocks first (Q4_1 at one row of x: 1.16x without it).
template <class T, int U>
RAGBLEND_INLINE void span_dot(const __m256* q, const float* xp, const uint8_t* blk,
                              const float* s, __m256& a) {
  if constexpr (T::kSpan == 32) {
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xp), q[0]);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), q[1], t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), q[2], t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), q[3], t);
    const __m256 sc = T::kElems == 32 ? _mm256_mul_ps(f16x8(blk), _mm256_set1_ps(kQ))
                                      : _mm256_broadcast_ss(s + U);
    a = _mm256_fmadd_ps(sc, t, a);
  } else {
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xp), q[0]);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), q[1], t);
    a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * U), t, a);
    t = _mm256_mul_ps(_mm256_loadu_ps(xp + 16), q[2]);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), q[3], t);
    a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * U + 1), t, a);
  }
}

// One pair's offsets of block b at blk (types with a minimum): a += mn * x's sums (xsp: the x
// row's sums in its group, mn: the weight row's offsets; a 32-weight block's own, read from it).
template <class T>
RAGBLEND_INLINE void block_min(const uint8_t* blk, const float* mn, int64_t b, const float* xsp,
                               __m256& a) {
  constexpr int kMn = T::kElems / 32;
  if constexpr (T::kElems == 32)  // the block's offset (T::scales' mn[0]) times x's 8 sums
    a = _mm256_fmadd_ps(f16x8(blk + 2), _mm256_loadu_ps(xsp + 8 * b), a);
  else  // 8 offsets times x's 8 sums
    a = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b * kMn), _mm256_loadu_ps(xsp + b * kMn), a);
}

// R weight rows (their nb blocks from src[r], scales sc[r], mn[r]) by G rows of x
// (x [G][kGroupOf<T>], one group packed; xs [G][kXs], its sums): acc[r][g] += their dot
// products, in 8 lanes, the same sums as dot_group's (span_dot, block_min). R > 1 shares each
// x load between R rows and keeps R G independent chains of adds in flight.
template <class T, int R, int G>
void dot_tile(const uint8_t* const* src, int64_t nb, const float* const* sc,
              const float* const* mn, const float* x, const float* xs, Acc (*acc)[kMaxRows]) {
  constexpr int kSc = T::kElems / T::kSpan;
  __m256 a[R][G];
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { a[r][g] = acc[r][g]; });
  });
  for (int64_t b = 0; b < nb; ++b) {
    unroll<T::kElems / 32>([&](auto U) RAGBLEND_INLINE_LAMBDA {
      unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
        __m256 q[4];
        const uint8_t* blk = src[r] + b * T::kBytes;
        quants<T, U>(blk, q);
        const float* s = sc[r] + b * kSc;
        unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
          span_dot<T, U>(q, x + g * kGroupOf<T> + b * T::kElems + 32 * U, blk, s, a[r][g]);
        });
      });
    });
    if constexpr (T::kMin) {
      unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
        unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA {
          block_min<T>(src[r] + b * T::kBytes, mn[r], b, xs + g * kXs<T>, a[r][g]);
        });
      });
    }
  }
  unroll<R>([&](auto r) RAGBLEND_INLINE_LAMBDA {
    unroll<G>([&](auto g) RAGBLEND_INLINE_LAMBDA { acc[r][g] = a[r][g]; });
  });
}

// G rows of x (x [G][kGroupOf<T>], one group packed) against the group's `nb` blocks of one
// weight row (src), whose scales are sc, mn: acc[0..G) += their dot products, in 8 lanes. xs: the
// group's sums of x, [G][kXs].
template <class T, int G>
void dot_group(const uint8_t* src, int64_t nb, const float* sc, const float* mn, const float* x,
               const float* xs, Acc* acc) {
  constexpr int kSc = T::kElems / T::kSpan;
  __m256 a[G];
  for (int g = 0; g < G; ++g) a[g] = acc[g];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = src + b * T::kBytes;
    unroll<T::kElems / 32>([&](auto U) {
      __m256 q[4];
      quants<T, U>(blk, q);
      for (int g = 0; g < G; ++g)
        span_dot<T, U>(q, x + g * kGroupOf<T> + b * T::kElems + 32 * U, blk, sc + b * kSc,
                       a[g]);
    });
    if constexpr (T::kMin)
      for (int g = 0; g < G; ++g) block_min<T>(blk, mn, b, xs + g * kXs<T>, a[g]);
  }
  for (int g = 0; g < G; ++g) acc[g] = a[g];
}

template <class T>
void dot_chunk(int64_t rows, const uint8_t* src, int64_t nb, const float* sc, const float* mn,
               const float* x, const float* xs, Acc* acc) {
  switch (rows) {
    case 1: return dot_group<T, 1>(src, nb, sc, mn, x, xs, acc);
    case 2: return dot_group<T, 2>(src, nb, sc, mn, x, xs, acc);
    case 3: return dot_group<T, 3>(src, nb, sc, mn, x, xs, acc);
    case 4: return dot_group<T, 4>(src, nb, sc, mn, x, xs, acc);
    case 5: return dot_group<T, 5>(src, nb, sc, mn, x, xs, acc);
    case 6: return dot_group<T, 6>(src, nb, sc, mn, x, xs, acc);
    case 7: return dot_group<T, 7>(src, nb, sc, mn, x, xs, acc);
    default: return dot_group<T, 8>(src, nb, sc, mn, x, xs, acc);
  }
}

// out[i, r] for weight rows [r0, r1): out [n, rows] (float32 or bf16); x, xs packed (pack_x,
// x_sums).
template <class T, typename Out>
void matmul_rows(const float* x, int64_t n, int64_t cols, const uint8_t* w, int64_t row_bytes,
                 const float* xs, const float* bias, int64_t rows, int64_t r0, int64_t r1,
                 Out* out) {
  constexpr int64_t per_group = kGroupOf<T> / T::kElems;
  constexpr int64_t kSc = T::kElems / T::kSpan, kMn = T::kElems / 32;
  // a lone row of x takes kRowTile weight rows at a time (dot_tile), but for Q6_K, which is
  // faster a row at a time
  constexpr bool kTiled = !std::is_same_v<T, Q6_K>;
  alignas(32) float sc[kRowTile][per_group * kSc], mn[kRowTile][per_group * kMn];
  alignas(64) Acc acc[kRowTile][kMaxRows];
  const uint8_t* src[kRowTile];
  const float* scp[kRowTile];
  const float* mnp[kRowTile];
  for (int64_t r = 0; r < kRowTile; ++r) scp[r] = sc[r], mnp[r] = mn[r];
  const int64_t blocks = cols / T::kElems;
  TilePrefetch ahead(w, row_bytes, r0, r1);
  for (int64_t t0 = r0; t0 < r1; t0 += kRowTile) {
    const int64_t tile = std::min(kRowTile, r1 - t0);
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t i = 0; i < n; ++i) acc[r][i] = acc_zero();
    ahead.start(t0, tile);
    for (int64_t b0 = 0, g = 0; b0 < blocks; b0 += per_group, ++g) {
      const int64_t nb = std::min(per_group, blocks - b0);
      const float* xg = x + g * n * kGroupOf<T>;
      const float* xsg = T::kMin ? xs + g * n * kXs<T> : nullptr;
      if (kTiled && n == 1 && tile == kRowTile) {
        for (int64_t r = 0; r < tile; ++r) {
          src[r] = w + (t0 + r) * row_bytes + b0 * T::kBytes;
          ahead.step(per_group * T::kBytes);
          if constexpr (T::kElems == 256)  // a 32-weight block's are read with its weights
            for (int64_t b = 0; b < nb; ++b)
              T::scales(src[r] + b * T::kBytes, sc[r] + b * kSc, mn[r] + b * kMn);
        }
        dot_tile<T, kRowTile, 1>(src, nb, scp, mnp, xg, xsg, acc);
        continue;
      }
      for (int64_t r = 0; r < tile; ++r) {  // a row at a time, its scales while it is in L1
        const uint8_t* s = w + (t0 + r) * row_bytes + b0 * T::kBytes;
        ahead.step(per_group * T::kBytes);
        if constexpr (T::kElems == 256)
          for (int64_t b = 0; b < nb; ++b)
            T::scales(s + b * T::kBytes, sc[0] + b * kSc, mn[0] + b * kMn);
        for (int64_t i0 = 0; i0 < n; i0 += kChunk)
          dot_chunk<T>(std::min(kChunk, n - i0), s, nb, sc[0], mn[0], xg + i0 * kGroupOf<T>,
                       T::kMin ? xsg + i0 * kXs<T> : nullptr, acc[r] + i0);
      }
    }
    for (int64_t r = 0; r < tile; ++r)
      for (int64_t i = 0; i < n; ++i) {
        float v = acc_sum(acc[r][i]);
        if (bias != nullptr) v += bias[t0 + r];
        store(out + i * rows + t0 + r, v);
      }
  }
}
#endif  // RAGBLEND_QUANT_512

template <class F>
void dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case 2: return f(Q4_0{});
    case 3: return f(Q4_1{});
    case 6: return f(Q5_0{});
    case 7: return f(Q5_1{});
    case 8: return f(Q8_0{});
    case 12: return f(Q4_K{});
    case 13: return f(Q5_K{});
    case 14: return f(Q6_K{});
    default:
      TORCH_CHECK(false, "ragblend_quant: unsupported ggml type ", qtype,
                  " (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)");
  }
}

// f(r0, r1) over [0, rows) in tasks of `task` rows (for_tasks). Each row's values do not
// depend on the split.
template <class F>
void for_row_tasks(int64_t rows, int64_t task, const F& f) {
  for_tasks((rows + task - 1) / task,
            [&](int64_t t) { f(t * task, std::min(rows, (t + 1) * task)); });
}

// A large output's fresh pages, first touched by the kernel: one page fault per 4 kB costs
// several times the dequantization itself, so ask for 2 MB pages (what torch's allocator does
// under THP_MEM_ALLOC_ENABLE=1). Only from 32 MB up, which glibc always maps on its own.
void advise_huge_pages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (bytes < (size_t{32} << 20)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + 4095) & ~uintptr_t{4095};
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~uintptr_t{4095};
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

template <class T>
void check_blocks(const at::Tensor& blocks, int64_t cols, const char* op) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              op, ": blocks must be a 2-D uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous");
  TORCH_CHECK(cols > 0 && cols % T::kElems == 0, op, ": cols (", cols,
              ") must be a positive multiple of the type's block of ", T::kElems, " weights");
  TORCH_CHECK(blocks.size(1) == cols / T::kElems * T::kBytes, op, ": rows of ", blocks.size(1),
              " bytes, expected ", cols / T::kElems * T::kBytes, " for ", cols, " columns");
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols,
                      at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize: dtype must be float32 or bfloat16, got ", dtype);
  at::Tensor out;
  dispatch(qtype, [&](auto type) {
    using T = decltype(type);
    check_blocks<T>(blocks, cols, "dequantize");
    const int64_t rows = blocks.size(0), row_bytes = blocks.size(1);
    out = at::empty({rows, cols}, blocks.options().dtype(dtype));
    advise_huge_pages(out.data_ptr(), out.nbytes());
    const uint8_t* w = blocks.const_data_ptr<uint8_t>();
    const int64_t grain = std::max<int64_t>(1, 65536 / cols);
    if (dtype == at::kFloat) {
      float* o = out.data_ptr<float>();
      for_row_tasks(rows, grain, [&](int64_t r0, int64_t r1) {
        dequant_rows<T>(w, row_bytes, cols, r0, r1, o);
      });
    } else {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      for_row_tasks(rows, grain, [&](int64_t r0, int64_t r1) {
        dequant_rows<T>(w, row_bytes, cols, r0, r1, o);
      });
    }
  });
  return out;
}

// A bias as float32 (a bf16 one widened into `keep`), or nullptr for none.
const float* float_bias(const std::optional<at::Tensor>& bias, int64_t rows, at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK((bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) &&
                  bias->dim() == 1 && bias->size(0) == rows && bias->is_contiguous(),
              "matmul: bias must be a contiguous float32 or bfloat16 [rows] tensor");
  keep = *bias;
  if (bias->scalar_type() == at::kBFloat16) {
    keep = at::empty({rows}, at::kFloat);
    const auto* h = reinterpret_cast<const uint16_t*>(bias->const_data_ptr<at::BFloat16>());
    float* f = keep.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) f[r] = widen(h[r]);
  }
  return keep.const_data_ptr<float>();
}

// One weight of a matmul_cat call: rows [r0, r1) of its output (its type's kernel, bound to
// x packed for it), and the tensors that must live while it runs.
struct Part {
  int64_t rows;
  std::function<void(int64_t, int64_t)> run;
  at::Tensor sums, bias;
};

#ifdef RAGBLEND_QUANT_BF16
constexpr bool kBf16Dot = true;  // bf16 x stays bf16: dot_tile for bf16 x
#else
constexpr bool kBf16Dot = false;
#endif

// x packed for type T (pack_x; bf16 bits for kBf16Dot's bf16 x, else float32): the copy in
// `packs` a type of the same group width made, else a new one kept there (a Qwen2.5 file's
// q/k/v are Q5_0, Q5_0 and Q8_0: one copy).
template <class T>
const void* packed_x(const at::Tensor& x, int64_t cols,
                     std::vector<std::pair<int64_t, at::Tensor>>& packs) {
  for (const std::pair<int64_t, at::Tensor>& pack : packs)
    if (pack.first == kGroupOf<T>) return pack.second.const_data_ptr();
  const int64_t n = x.size(0);
  const auto* h = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  packs.emplace_back(kGroupOf<T>, x.scalar_type() != at::kBFloat16
                                      ? pack_x<T>(x.const_data_ptr<float>(), n, cols)
                                  : kBf16Dot ? pack_x<T, uint16_t, uint16_t>(h, n, cols)
                                             : pack_x<T>(h, n, cols));
  return packs.back().second.const_data_ptr();
}

// x @ [W_0; W_1; ...].T (+ each one's bias): their outputs side by side, [n, sum of rows], in
// x's dtype: float32, or bf16 (x widened, the float32 result rounded to bf16, bit for bit what
// x.float(), bias.float() and .to(torch.bfloat16) around the float32 call give). Each weight
// has its own type; its columns are the same values `matmul` gives for it alone. One parallel
// region takes every weight's row tasks (a decode step's q/k/v or gate/up in one call).
at::Tensor matmul_cat(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                      int64_t cols, const c10::List<std::optional<at::Tensor>>& biases) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 &&
                  x.is_contiguous(),
              "matmul: x must be a contiguous 2-D float32 or bfloat16 CPU tensor [n, cols]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "matmul: x has ", x.size(0),
              " rows; expected 1 to ", kMaxRows);
  TORCH_CHECK(x.size(1) == cols, "matmul: x has ", x.size(1), " columns, expected ", cols);
  TORCH_CHECK(!blocks.empty() && qtypes.size() == blocks.size() && biases.size() == blocks.size(),
              "matmul_cat: one qtype and one bias (or None) per weight, and at least one weight");
  const int64_t n = x.size(0);
  int64_t total = 0;
  for (const at::Tensor& b : blocks) total += b.dim() == 2 ? b.size(0) : 0;
  at::Tensor out = at::empty({n, total}, x.options());
  std::vector<Part> parts;
  std::vector<std::pair<int64_t, at::Tensor>> packs;  // x packed, per group width
  int64_t offset = 0;
  for (size_t k = 0; k < blocks.size(); ++k) {
    dispatch(qtypes[k], [&](auto type) {
      using T = decltype(type);
      check_blocks<T>(blocks[k], cols, "matmul");
      Part part;
      part.rows = blocks[k].size(0);
      const int64_t row_bytes = blocks[k].size(1);
      const float* b = float_bias(biases.get(k), part.rows, part.bias);
      const void* xv = packed_x<T>(x, cols, packs);
      const float* xp = static_cast<const float*>(xv);
      const uint8_t* w = blocks[k].const_data_ptr<uint8_t>();
#ifndef RAGBLEND_QUANT_512
      part.sums = x_sums<T>(xp, n, cols);
      const float* xs = part.sums.const_data_ptr<float>();
#endif
      const auto bind = [&](auto* o) {
        part.run = [=](int64_t r0, int64_t r1) {
#ifdef RAGBLEND_QUANT_512
          if constexpr (kBf16Dot) {
            if (bf16) {
              matmul_rows<T>(static_cast<const uint16_t*>(xv), n, cols, w, row_bytes, b, total,
                             r0, r1, o);
              return;
            }
          }
          matmul_rows<T>(xp, n, cols, w, row_bytes, b, total, r0, r1, o);
#else
          matmul_rows<T>(xp, n, cols, w, row_bytes, xs, b, total, r0, r1, o);
#endif
        };
      };
      if (bf16) bind(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + offset);
      else bind(out.data_ptr<float>() + offset);
      offset += part.rows;
      parts.push_back(std::move(part));
    });
  }
  ragblend::for_part_rows(parts, kMatmulTask);
  return out;
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t cols,
                  const std::optional<at::Tensor>& bias) {
  c10::List<std::optional<at::Tensor>> biases;
  biases.push_back(bias);
  return matmul_cat(x, {blocks}, {qtype}, cols, biases);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(RAGBLEND_QUANT_NS, m) {
  m.def("dequantize(Tensor blocks, int qtype, int cols, ScalarType dtype) -> Tensor");
  m.def("matmul(Tensor x, Tensor blocks, int qtype, int cols, Tensor? bias) -> Tensor");
  m.def(
      "matmul_cat(Tensor x, Tensor[] blocks, int[] qtypes, int cols, Tensor?[] biases) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(RAGBLEND_QUANT_NS, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("matmul", &matmul);
  m.impl("matmul_cat", &matmul_cat);
}
