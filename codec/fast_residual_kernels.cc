#include "codec/fast_residual_kernels.h"

#include <cpuid.h>

#include <algorithm>
#include <cmath>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVTRIE_FAST_AVX2 1
#endif

#include "codec/rans.h"

namespace kvtrie {
namespace internal {
namespace fast {
// sym[i] = ZigZag(q[i]) when < kDirect, else kNoSymbol (vectorizes).
#ifdef KVTRIE_FAST_AVX2
// ZigZag of 8, or all ones (-1, which packs to 255 = kNoSymbol) where z >= kDirect.
__attribute__((target("avx2"))) inline __m256i Symbols8(const int32_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_xor_si256(_mm256_slli_epi32(v, 1), _mm256_srai_epi32(v, 31));
  return _mm256_or_si256(z, _mm256_cmpgt_epi32(z, _mm256_set1_epi32(kDirect - 1)));
}
// 32 at a time (values in [0, kDirect) or -1 survive both signed packs); returns how many.
__attribute__((target("avx2"))) size_t MapSymbolsAvx2(const int32_t* q, size_t n, uint8_t* sym) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = _mm256_packs_epi32(Symbols8(q + i), Symbols8(q + i + 8));
    const __m256i b = _mm256_packs_epi32(Symbols8(q + i + 16), Symbols8(q + i + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sym + i), bytes);
  }
  return i;
}
#endif

void MapSymbols(const int32_t* __restrict q, size_t n, uint8_t* __restrict sym) {
  size_t i = 0;
#ifdef KVTRIE_FAST_AVX2
  if (irans::HasAvx2()) i = MapSymbolsAvx2(q, n, sym);
#endif
  for (; i < n; ++i) {
    const uint32_t z = ZigZag(q[i]);
    sym[i] = z < static_cast<uint32_t>(kDirect) ? static_cast<uint8_t>(z) : kNoSymbol;
  }
}

#ifdef KVTRIE_FAST_AVX2
// counts[s] for s < kDirect of 32 bytes at a time: one byte counter per value and position,
// folded every 255 steps (before they wrap). Returns how many bytes it counted.
__attribute__((target("avx2"))) size_t HistogramDirectAvx2(const uint8_t* sym, size_t n,
                                                           uint32_t* counts) {
  size_t i = 0;
  while (i + 32 <= n) {
    __m256i c[kDirect];
    for (int v = 0; v < kDirect; ++v) c[v] = _mm256_setzero_si256();
    for (int k = 0; k < 255 && i + 32 <= n; ++k, i += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sym + i));
      for (int v = 0; v < kDirect; ++v)
        c[v] = _mm256_sub_epi8(c[v], _mm256_cmpeq_epi8(b, _mm256_set1_epi8(static_cast<char>(v))));
    }
    for (int v = 0; v < kDirect; ++v) {
      alignas(32) uint64_t sums[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums),
                         _mm256_sad_epu8(c[v], _mm256_setzero_si256()));
      counts[v] += static_cast<uint32_t>(sums[0] + sums[1] + sums[2] + sums[3]);
    }
  }
  return i;
}
#endif

void HistogramDirect(const uint8_t* __restrict sym, size_t n, uint32_t* __restrict counts) {
  std::fill(counts, counts + irans::kMaxSymbols, 0u);
  size_t i = 0;
#ifdef KVTRIE_FAST_AVX2
  if (irans::HasAvx2()) i = HistogramDirectAvx2(sym, n, counts);
#endif
  for (; i < n; ++i)
    if (sym[i] < kDirect) ++counts[sym[i]];
}

// counts[s] = occurrences of s < kMaxSymbols (kNoSymbol is not counted). Four copies: no
// store-to-load chain on runs of one symbol.
void Histogram(const uint8_t* __restrict sym, size_t n, uint32_t* __restrict counts) {
  uint32_t h[4][256] = {};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++h[0][sym[i]];
    ++h[1][sym[i + 1]];
    ++h[2][sym[i + 2]];
    ++h[3][sym[i + 3]];
  }
  for (; i < n; ++i) ++h[0][sym[i]];
  for (int k = 0; k < irans::kMaxSymbols; ++k) counts[k] = h[0][k] + h[1][k] + h[2][k] + h[3][k];
}

// Replaces every kNoSymbol by its bucket's symbol, counts it and writes its offset bits, in
// element order.
void EncodeBucket(const int32_t* q, size_t i, uint8_t* sym, uint32_t* counts, BitWriter* bits) {
  const uint32_t z = ZigZag(q[i]);
  // base[2k] = 8 + 2^(k+2), base[2k+1] = 8 + 3 * 2^(k+1): from z - 8's top two bits.
  const uint32_t y = z - 8;
  const int top = 31 - __builtin_clz(y);
  const int b = 2 * (top - 2) + static_cast<int>((y >> (top - 1)) & 1);
  sym[i] = static_cast<uint8_t>(kDirect + b);
  ++counts[sym[i]];
  bits->Put(z - kBucket.base[b], BucketBits(b));
}

void EncodeBuckets(const int32_t* q, size_t n, uint8_t* sym, uint32_t* counts, BitWriter* bits) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {  // the bucket symbols of 16 at a time, from a bit mask
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sym + i));
    uint32_t m = static_cast<uint32_t>(
        _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(static_cast<char>(kNoSymbol)))));
    for (; m != 0; m &= m - 1) EncodeBucket(q, i + __builtin_ctz(m), sym, counts, bits);
  }
#endif
  for (; i < n; ++i) {
    if (sym[i] == kNoSymbol) EncodeBucket(q, i, sym, counts, bits);
  }
}

// True if any float is an infinity or a NaN (exponent all ones); vectorizes.
bool AnyNonFinite(const float* x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
  }
  return bad != 0;
}

// Sum of squares in double and the largest magnitude: of a[i] (b == nullptr) or a[i] - b[i].
double SumSquaresScalar(const float* a, const float* b, size_t n, float* max_abs) {
  double s = 0;
  float mx = 0;
  for (size_t i = 0; i < n; ++i) {
    const float e = b ? a[i] - b[i] : a[i];
    s += static_cast<double>(e) * e;
    mx = std::max(mx, std::fabs(e));
  }
  *max_abs = mx;
  return s;
}

#ifdef KVTRIE_FAST_AVX2
__attribute__((target("avx2"))) double SumSquaresAvx2(const float* a, const float* b, size_t n,
                                                      float* max_abs) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256 mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = _mm256_loadu_ps(a + i);
    if (b) e = _mm256_sub_ps(e, _mm256_loadu_ps(b + i));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(lo, lo));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(hi, hi));
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, e));
  }
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(acc0, acc1));
  alignas(32) float m[8];
  _mm256_store_ps(m, mx);
  float tail_max = 0;
  double s =
      d[0] + d[1] + d[2] + d[3] + SumSquaresScalar(a + i, b ? b + i : nullptr, n - i, &tail_max);
  for (float v : m) tail_max = std::max(tail_max, v);
  *max_abs = tail_max;
  return s;
}
#endif

double SumSquares(const float* a, const float* b, size_t n, float* max_abs) {
#ifdef KVTRIE_FAST_AVX2
  if (irans::HasAvx2()) return SumSquaresAvx2(a, b, n, max_abs);
#endif
  return SumSquaresScalar(a, b, n, max_abs);
}

namespace {
// Scalar: the reference order (per channel, tokens ascending).
void ChannelSumsScalar(const float* x, size_t T, size_t D, float* sum) {
  for (size_t t = 0; t < T; ++t)
    for (size_t d = 0; d < D; ++d) sum[d] += x[t * D + d];
}
void HeadL1Scalar(const float* x, const float* mean, const float* learned, const float* linear,
                  size_t T, size_t D, float* acc) {
  std::fill(acc, acc + 5 * D, 0.0f);
  for (size_t t = 0; t < T; ++t) {
    const float* row = x + t * D;
    for (size_t d = 0; d < D; ++d) {
      acc[d] += std::fabs(row[d]);
      acc[D + d] += std::fabs(row[d] - mean[d]);
      acc[2 * D + d] += std::fabs(t ? row[d] - x[(t - 1) * D + d] : row[d] - 0.0f);
      if (learned) acc[3 * D + d] += std::fabs(row[d] - learned[t * D + d]);
      if (linear) acc[4 * D + d] += std::fabs(row[d] - linear[t * D + d]);
    }
  }
}

#ifdef KVTRIE_FAST_AVX2
__attribute__((target("avx2"))) void ChannelSumsAvx2(const float* x, size_t T, size_t D,
                                                     float* sum) {
  for (size_t d = 0; d < D; d += 8) {
    __m256 a = _mm256_loadu_ps(sum + d);
    for (size_t t = 0; t < T; ++t) a = _mm256_add_ps(a, _mm256_loadu_ps(x + t * D + d));
    _mm256_storeu_ps(sum + d, a);
  }
}
// REQUIRES: D % 8 == 0. Registers hold 8 channels of the five sums over every token.
__attribute__((target("avx2"))) void HeadL1Avx2(const float* x, const float* mean,
                                                const float* learned, const float* linear, size_t T,
                                                size_t D, float* acc) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (size_t d = 0; d < D; d += 8) {
    const __m256 m = _mm256_loadu_ps(mean + d);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, prev = a0;
    for (size_t t = 0; t < T; ++t) {
      const __m256 v = _mm256_loadu_ps(x + t * D + d);
      a0 = _mm256_add_ps(a0, _mm256_andnot_ps(sign, v));
      a1 = _mm256_add_ps(a1, _mm256_andnot_ps(sign, _mm256_sub_ps(v, m)));
      a2 = _mm256_add_ps(a2, _mm256_andnot_ps(sign, _mm256_sub_ps(v, prev)));
      prev = v;
      if (learned) {
        const __m256 e = _mm256_sub_ps(v, _mm256_loadu_ps(learned + t * D + d));
        a3 = _mm256_add_ps(a3, _mm256_andnot_ps(sign, e));
      }
      if (linear) {
        const __m256 e = _mm256_sub_ps(v, _mm256_loadu_ps(linear + t * D + d));
        a4 = _mm256_add_ps(a4, _mm256_andnot_ps(sign, e));
      }
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + D + d, a1);
    _mm256_storeu_ps(acc + 2 * D + d, a2);
    _mm256_storeu_ps(acc + 3 * D + d, a3);
    _mm256_storeu_ps(acc + 4 * D + d, a4);
  }
}
#endif
}  // namespace

void ChannelSums(const float* x, size_t T, size_t D, float* sum) {
#ifdef KVTRIE_FAST_AVX2
  if (D % 8 == 0 && irans::HasAvx2()) return ChannelSumsAvx2(x, T, D, sum);
#endif
  ChannelSumsScalar(x, T, D, sum);
}

void HeadL1(const float* x, const float* mean, const float* learned, const float* linear, size_t T,
            size_t D, float* acc) {
#ifdef KVTRIE_FAST_AVX2
  if (D % 8 == 0 && irans::HasAvx2()) return HeadL1Avx2(x, mean, learned, linear, T, D, acc);
#endif
  HeadL1Scalar(x, mean, learned, linear, T, D, acc);
}

// Closed-loop quantization of one head [T][D] with predictor `pred`.
void QuantizeHead(const float* x, size_t T, size_t D, uint8_t pred, const float* mean,
                  const float* zeros, float step, float dz, int32_t* q, float* rec) {
  const float inv = 1.0f / step;
  for (size_t t = 0; t < T; ++t) {
    const float* p = pred == kPredTemporal ? (t ? rec + (t - 1) * D : zeros)
                     : pred == kPredMean   ? mean
                     : pred == kPredToken  ? mean + t * D
                                           : zeros;
    const float* xr = x + t * D;
    int32_t* qr = q + t * D;
    float* rr = rec + t * D;
    for (size_t d = 0; d < D; ++d) {
      const float u = (xr[d] - p[d]) * inv;
      float a = std::fabs(u) - dz + 0.5f;
      a = std::min(a > 0.0f ? a : 0.0f, static_cast<float>(kMaxQ));
      const int32_t m = static_cast<int32_t>(a);
      const int32_t qi = u < 0 ? -m : m;
      qr[d] = qi;
      rr[d] = Recon(p[d], qi, step);
    }
  }
}

bool HasAvx2F16c() {
#ifndef KVTRIE_FAST_AVX2
  return false;
#else
  static const bool f16c = [] {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
  }();
  return f16c && irans::HasAvx2();
#endif
}

#ifdef KVTRIE_FAST_AVX2

// QuantizeHead and the squared error after rounding to fp16 in one pass, 8 channels at a time
// (D % 8 == 0). Same quantizer and reconstruction as QuantizeHead.
__attribute__((target("avx2,f16c"))) double QuantizeHeadFp16(const float* x, size_t T, size_t D,
                                                             uint8_t pred, const float* mean,
                                                             const float* zeros, float step,
                                                             float dz, int32_t* q, float* rec,
                                                             float* max_abs) {
  const __m256 inv = _mm256_set1_ps(1.0f / step), vs = _mm256_set1_ps(step);
  const __m256 vdz = _mm256_set1_ps(dz), half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
  const __m256 maxq = _mm256_set1_ps(static_cast<float>(kMaxQ)), sign = _mm256_set1_ps(-0.0f);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256 mx = _mm256_setzero_ps();
  for (size_t t = 0; t < T; ++t) {
    const float* p = pred == kPredTemporal ? (t ? rec + (t - 1) * D : zeros)
                     : pred == kPredMean   ? mean
                     : pred == kPredToken  ? mean + t * D
                                           : zeros;
    for (size_t d = 0; d < D; d += 8) {
      const size_t i = t * D + d;
      const __m256 xv = _mm256_loadu_ps(x + i), pv = _mm256_loadu_ps(p + d);
      const __m256 u = _mm256_mul_ps(_mm256_sub_ps(xv, pv), inv);
      __m256 a = _mm256_add_ps(_mm256_sub_ps(_mm256_andnot_ps(sign, u), vdz), half);
      a = _mm256_min_ps(_mm256_max_ps(a, zero), maxq);
      const __m256i qi = _mm256_sign_epi32(_mm256_cvttps_epi32(a), _mm256_castps_si256(u));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), qi);
      const __m256 r = _mm256_add_ps(pv, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), vs));
      _mm256_storeu_ps(rec + i, r);
      const __m256 rt =
          _mm256_cvtph_ps(_mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256 e = _mm256_sub_ps(xv, rt);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
      acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(lo, lo));
      acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(hi, hi));
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, e));
    }
  }
  alignas(32) double dd[4];
  _mm256_store_pd(dd, _mm256_add_pd(acc0, acc1));
  alignas(32) float m[8];
  _mm256_store_ps(m, mx);
  for (float v : m) *max_abs = std::max(*max_abs, v);
  return dd[0] + dd[1] + dd[2] + dd[3];
}
#endif

// Symbols to q as floats, without the buckets (their symbols get a placeholder).
void DirectValuesScalar(const uint8_t* sym, size_t n, float* qf) {
  for (size_t i = 0; i < n; ++i) qf[i] = static_cast<float>(UnZigZag(sym[i]));
}

#ifdef KVTRIE_FAST_AVX2
__attribute__((target("avx2"))) void DirectValuesAvx2(const uint8_t* sym, size_t n, float* qf) {
  const __m256i one = _mm256_set1_epi32(1);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i z =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sym + i)));
    const __m256i q =
        _mm256_xor_si256(_mm256_srli_epi32(z, 1),
                         _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_and_si256(z, one)));
    _mm256_storeu_ps(qf + i, _mm256_cvtepi32_ps(q));
  }
  DirectValuesScalar(sym + i, n - i, qf + i);
}

// x' = prediction + q * step for one head, 8 channels at a time (same IEEE operations as Recon).
__attribute__((target("avx2"))) void ReconHeadAvx2(const float* qf, size_t T, size_t D,
                                                   uint8_t pred, const float* mean,
                                                   const float* zeros, float step, float* rec) {
  const __m256 vs = _mm256_set1_ps(step);
  for (size_t t = 0; t < T; ++t) {
    const float* p = pred == kPredTemporal ? (t ? rec + (t - 1) * D : zeros)
                     : pred == kPredMean   ? mean
                     : pred == kPredToken  ? mean + t * D
                                           : zeros;
    const float* qr = qf + t * D;
    float* rr = rec + t * D;
    size_t d = 0;
    for (; d + 8 <= D; d += 8) {
      _mm256_storeu_ps(rr + d, _mm256_add_ps(_mm256_loadu_ps(p + d),
                                             _mm256_mul_ps(_mm256_loadu_ps(qr + d), vs)));
    }
    for (; d < D; ++d) rr[d] = p[d] + qr[d] * step;
  }
}
#endif

void ReconHeadScalar(const float* qf, size_t T, size_t D, uint8_t pred, const float* mean,
                     const float* zeros, float step, float* rec) {
  for (size_t t = 0; t < T; ++t) {
    const float* p = pred == kPredTemporal ? (t ? rec + (t - 1) * D : zeros)
                     : pred == kPredMean   ? mean
                     : pred == kPredToken  ? mean + t * D
                                           : zeros;
    for (size_t d = 0; d < D; ++d) rec[t * D + d] = p[d] + qf[t * D + d] * step;
  }
}

void ReconHead(const float* qf, size_t T, size_t D, uint8_t pred, const float* mean,
               const float* zeros, float step, float* rec) {
#ifdef KVTRIE_FAST_AVX2
  if (irans::HasAvx2()) return ReconHeadAvx2(qf, T, D, pred, mean, zeros, step, rec);
#endif
  ReconHeadScalar(qf, T, D, pred, mean, zeros, step, rec);
}

void DirectValues(const uint8_t* sym, size_t n, float* qf) {
#ifdef KVTRIE_FAST_AVX2
  if (irans::HasAvx2()) return DirectValuesAvx2(sym, n, qf);
#endif
  DirectValuesScalar(sym, n, qf);
}

void KltForward(const float* x, const float* pred, const float* u, size_t T, size_t D, float* z) {
  for (size_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    const float* pt = pred + t * D;
    float* zt = z + t * D;
    for (size_t j = 0; j < D; ++j) zt[j] = 0.0f;
    for (size_t i = 0; i < D; ++i) {
      const float e = xt[i] - pt[i];
      const float* row = u + i * D;
      for (size_t j = 0; j < D; ++j) zt[j] += row[j] * e;
    }
  }
}

void KltReconHead(const float* qf, const float* pred, const float* u, size_t T, size_t D,
                  float step, float* scratch, float* rec) {
  for (size_t t = 0; t < T; ++t) {
    // acc[i] = sum over j ascending of U[i][j] s[j], with the outputs in the inner loop; `rec`
    // holds acc until the prediction is added.
    for (size_t j = 0; j < D; ++j) scratch[j] = qf[t * D + j] * step;
    float* acc = rec + t * D;
    for (size_t i = 0; i < D; ++i) acc[i] = 0.0f;
    for (size_t j = 0; j < D; ++j) {
      const float sj = scratch[j];
      for (size_t i = 0; i < D; ++i) acc[i] += u[i * D + j] * sj;
    }
    for (size_t i = 0; i < D; ++i) acc[i] = pred[t * D + i] + acc[i];
  }
}

}  // namespace fast
}  // namespace internal
}  // namespace kvtrie
