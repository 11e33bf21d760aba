#include "codec/block_geometry.h"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"

namespace kvtrie {

size_t DTypeBytes(DType dtype) {
  if (dtype == DType::kFp32) return 4;
  return IsByteDType(dtype) ? 1 : 2;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
    case DType::kFp32:
      return "fp32";
    case DType::kFp8E4m3:
      return "fp8_e4m3";
    case DType::kFp8E5m2:
      return "fp8_e5m2";
    case DType::kUint8:
      return "uint8";
  }
  return "unknown";
}

bool IsValidDType(uint32_t value) { return value >= 1 && value <= 6; }

absl::Status BlockGeometry::Validate() const {
  constexpr uint32_t kMax = 65535;
  auto check = [](absl::string_view field, uint32_t v) -> absl::Status {
    if (v == 0 || v > kMax) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": must be in [1, ", kMax, "], got ", v));
    }
    return absl::OkStatus();
  };
  if (auto s = check("num_layers", num_layers); !s.ok()) return s;
  if (auto s = check("num_kv_heads", num_kv_heads); !s.ok()) return s;
  if (auto s = check("block_tokens", block_tokens); !s.ok()) return s;
  if (auto s = check("head_dim", head_dim); !s.ok()) return s;
  if (!IsValidDType(static_cast<uint32_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: unknown value ", static_cast<int>(dtype)));
  }
  // Each dimension fits 16 bits, so the product fits 128 bits; a block must fit kMaxBlockBytes so
  // that every size computed from it fits size_t.
  const unsigned __int128 bytes = static_cast<unsigned __int128>(num_layers) * 2 * num_kv_heads *
                                  block_tokens * head_dim * DTypeBytes(dtype);
  if (bytes > kMaxBlockBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers: a block of num_layers=", num_layers, " x 2 x num_kv_heads=", num_kv_heads,
        " x block_tokens=", block_tokens, " x head_dim=", head_dim, " x ", DTypeBytes(dtype),
        " bytes exceeds the limit of ", kMaxBlockBytes, " bytes per block"));
  }
  return absl::OkStatus();
}

std::string BlockGeometry::DebugString() const {
  return absl::StrCat("num_layers=", num_layers, " num_kv_heads=", num_kv_heads,
                      " block_tokens=", block_tokens, " head_dim=", head_dim,
                      " dtype=", DTypeName(dtype));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                       // below the smallest normal half: subnormal
    // Adding 0.5f aligns the mantissa so float rounding yields the subnormal half directly.
    float a;
    std::memcpy(&a, &abs, 4);
    a += 0.5f;
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return sign | static_cast<uint16_t>(r - 0x3f000000u);
  }
  uint32_t mant_odd = (abs >> 13) & 1;
  uint32_t r = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round-to-even
  return sign | static_cast<uint16_t>(r >> 13);
}

uint16_t FloatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // nan
  x += 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

float Fp8E4m3ToFloat(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  if (exp == 0xf && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // subnormal: m/8 * 2^-6
  return sign * std::ldexp(1.0f + mant / 8.0f, exp - 7);
}

float Fp8E5m2ToFloat(uint8_t b) { return HalfToFloat(static_cast<uint16_t>(b) << 8); }

namespace {

// The one-byte code of `dtype` nearest to `f` (ties to the even code), saturating to the
// largest finite magnitude; NaN to a NaN code. A linear scan: no hot path reaches it.
uint8_t NearestByteCode(DType dtype, float f) {
  if (dtype == DType::kUint8) {
    if (!(f > 0)) return 0;  // NaN too
    if (f >= 255) return 255;
    return static_cast<uint8_t>(std::nearbyint(f));
  }
  if (std::isnan(f)) return dtype == DType::kFp8E4m3 ? 0x7f : 0x7e;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  uint8_t best = 0;
  float best_err = std::numeric_limits<float>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    const float v = dtype == DType::kFp8E4m3 ? Fp8E4m3ToFloat(static_cast<uint8_t>(c))
                                             : Fp8E5m2ToFloat(static_cast<uint8_t>(c));
    if (!std::isfinite(v)) continue;
    const float err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (c & 1) == 0))
      best = static_cast<uint8_t>(c), best_err = err;
  }
  return sign | best;
}

// fp16 <-> float for many elements at once. With F16C (checked at run time; the build targets
// baseline x86-64) eight elements convert per instruction; any group holding a half inf/nan or a
// float nan takes the scalar path, so the results are bit-identical to HalfToFloat / FloatToHalf
// for every input (F16C would quiet signalling nans where the scalar code keeps them).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVTRIE_HAVE_F16C_DISPATCH 1
__attribute__((target("f16c,avx"))) void HalfToFloatF16c(const uint16_t* s, size_t n, float* d) {
  size_t i = 0;
  const __m128i exp_mask = _mm_set1_epi16(0x7c00);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask)) != 0) {
      for (size_t j = i; j < i + 8; ++j) d[j] = HalfToFloat(s[j]);
      continue;
    }
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = HalfToFloat(s[i]);
}

__attribute__((target("f16c,avx"))) void FloatToHalfF16c(const float* s, size_t n, uint16_t* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(s + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
      for (size_t j = i; j < i + 8; ++j) d[j] = FloatToHalf(s[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) d[i] = FloatToHalf(s[i]);
}

// F16C and AVX in CPUID leaf 1 (ECX bits 29 and 28), and the OS saving YMM state (OSXSAVE,
// then XCR0 bits 1-2). Written out because clang 14 lacks __builtin_cpu_supports("f16c").
bool DetectF16c() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned kOsxsave = 1u << 27, kAvx = 1u << 28, kF16c = 1u << 29;
  if ((c & (kOsxsave | kAvx | kF16c)) != (kOsxsave | kAvx | kF16c)) return false;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 6) == 6;
}

bool HasF16c() {
  static const bool has = DetectF16c();
  return has;
}
#endif

}  // namespace

void ToFloat(DType dtype, const void* src, size_t n, float* dst) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kFp16: {
      const auto* s = static_cast<const uint16_t*>(src);
#ifdef KVTRIE_HAVE_F16C_DISPATCH
      if (HasF16c()) return HalfToFloatF16c(s, n, dst);
#endif
      for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
    case DType::kBf16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        dst[i] = dtype == DType::kUint8     ? static_cast<float>(s[i])
                 : dtype == DType::kFp8E4m3 ? Fp8E4m3ToFloat(s[i])
                                            : Fp8E5m2ToFloat(s[i]);
      }
      return;
    }
  }
}

void FromFloat(DType dtype, const float* src, size_t n, void* dst) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kFp16: {
      auto* d = static_cast<uint16_t*>(dst);
#ifdef KVTRIE_HAVE_F16C_DISPATCH
      if (HasF16c()) return FloatToHalfF16c(src, n, d);
#endif
      for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kBf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8: {
      auto* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = NearestByteCode(dtype, src[i]);
      return;
    }
  }
}

}  // namespace kvtrie
