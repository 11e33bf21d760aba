#include "codec/baselines.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "codec/lloyd_max.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace {

constexpr float kMaxHalf = 65504.0f;

float RoundHalf(float f) { return HalfToFloat(FloatToHalf(std::clamp(f, -kMaxHalf, kMaxHalf))); }

void PutHalf(std::string* out, float f) {
  const uint16_t h = FloatToHalf(std::clamp(f, -kMaxHalf, kMaxHalf));
  out->push_back(static_cast<char>(h & 0xff));
  out->push_back(static_cast<char>(h >> 8));
}

float GetHalf(absl::string_view in, size_t i) {
  return HalfToFloat(static_cast<uint8_t>(in[2 * i]) | (static_cast<uint8_t>(in[2 * i + 1]) << 8));
}

// Packs `bits`-bit codes (bits <= 8) little-endian, first code in the lowest bits.
class BitPacker {
 public:
  explicit BitPacker(std::string* out) : out_(out) {}
  void Put(uint32_t code, int bits) {
    acc_ |= static_cast<uint64_t>(code) << fill_;
    fill_ += bits;
    while (fill_ >= 8) {
      out_->push_back(static_cast<char>(acc_ & 0xff));
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  void Flush() {
    if (fill_ > 0) out_->push_back(static_cast<char>(acc_ & 0xff));
    acc_ = 0;
    fill_ = 0;
  }

 private:
  std::string* out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

uint32_t GetCode(absl::string_view in, size_t index, int bits) {
  const size_t bit = index * bits;
  uint32_t v = static_cast<uint8_t>(in[bit / 8]);
  if (bit / 8 + 1 < in.size())
    v |= static_cast<uint32_t>(static_cast<uint8_t>(in[bit / 8 + 1])) << 8;
  return (v >> (bit % 8)) & ((1u << bits) - 1);
}

size_t PackedBytes(size_t count, int bits) { return (count * bits + 7) / 8; }

// ---- int8 per vector ----

void EncodeInt8(const BlockGeometry& g, const float* x, LossyOutput* out) {
  const size_t D = g.head_dim, nv = g.num_elements() / D;
  std::string codes;
  codes.reserve(g.num_elements());
  for (size_t v = 0; v < nv; ++v) {
    const float* xv = x + v * D;
    float m = 0;
    for (size_t d = 0; d < D; ++d) m = std::max(m, std::fabs(xv[d]));
    const float scale = RoundHalf(m / 127.0f);
    PutHalf(&out->payload, scale);
    for (size_t d = 0; d < D; ++d) {
      const float q = scale > 0 ? std::clamp(std::nearbyint(xv[d] / scale), -127.0f, 127.0f) : 0.0f;
      codes.push_back(static_cast<char>(static_cast<int8_t>(q)));
      out->recon[v * D + d] = q * scale;
    }
  }
  out->payload += codes;
}

absl::Status DecodeInt8(const BlockGeometry& g, absl::string_view payload, float* out) {
  const size_t D = g.head_dim, nv = g.num_elements() / D;
  if (payload.size() != 2 * nv + g.num_elements()) {
    return absl::DataLossError("int8 payload: wrong size");
  }
  const char* codes = payload.data() + 2 * nv;
  for (size_t v = 0; v < nv; ++v) {
    const float scale = GetHalf(payload, v);
    if (!std::isfinite(scale)) return absl::DataLossError("int8 payload: bad scale");
    for (size_t d = 0; d < D; ++d) {
      out[v * D + d] = static_cast<float>(static_cast<int8_t>(codes[v * D + d])) * scale;
    }
  }
  return absl::OkStatus();
}

// ---- KIVI 2-bit ----

// Calls fn(first_element, stride, count) for every group: keys per channel, values per token.
template <typename Fn>
void ForEachKiviGroup(const BlockGeometry& g, Fn fn) {
  const size_t H = g.num_kv_heads, T = g.block_tokens, D = g.head_dim;
  for (size_t l = 0; l < g.num_layers; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < H; ++h) {
        const size_t base = ((l * 2 + kv) * H + h) * T * D;
        if (kv == 0) {
          for (size_t d = 0; d < D; ++d) fn(base + d, D, T);
        } else {
          for (size_t t = 0; t < T; ++t) fn(base + t * D, 1, D);
        }
      }
    }
  }
}

void EncodeKivi(const BlockGeometry& g, const float* x, LossyOutput* out) {
  std::vector<uint8_t> codes(g.num_elements());
  ForEachKiviGroup(g, [&](size_t first, size_t stride, size_t count) {
    float lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < count; ++i) {
      lo = std::min(lo, x[first + i * stride]);
      hi = std::max(hi, x[first + i * stride]);
    }
    const float mn = RoundHalf(lo);
    const float scale = RoundHalf((hi - mn) / 3.0f);
    PutHalf(&out->payload, mn);
    PutHalf(&out->payload, scale);
    for (size_t i = 0; i < count; ++i) {
      const size_t e = first + i * stride;
      const float q =
          scale > 0 ? std::clamp(std::nearbyint((x[e] - mn) / scale), 0.0f, 3.0f) : 0.0f;
      codes[e] = static_cast<uint8_t>(q);
      out->recon[e] = mn + q * scale;
    }
  });
  BitPacker packer(&out->payload);
  for (uint8_t c : codes) packer.Put(c, 2);
  packer.Flush();
}

absl::Status DecodeKivi(const BlockGeometry& g, absl::string_view payload, float* out) {
  size_t groups = 0;
  ForEachKiviGroup(g, [&](size_t, size_t, size_t) { ++groups; });
  if (payload.size() != 4 * groups + PackedBytes(g.num_elements(), 2)) {
    return absl::DataLossError("kivi2 payload: wrong size");
  }
  const absl::string_view codes = payload.substr(4 * groups);
  size_t gi = 0;
  bool ok = true;
  ForEachKiviGroup(g, [&](size_t first, size_t stride, size_t count) {
    const float mn = GetHalf(payload, 2 * gi), scale = GetHalf(payload, 2 * gi + 1);
    ++gi;
    ok = ok && std::isfinite(mn) && std::isfinite(scale);
    for (size_t i = 0; i < count; ++i) {
      const size_t e = first + i * stride;
      out[e] = mn + static_cast<float>(GetCode(codes, e, 2)) * scale;
    }
  });
  return ok ? absl::OkStatus() : absl::DataLossError("kivi2 payload: bad min or scale");
}

// ---- TurboQuant-style ----

absl::Status EncodeTurboQuant(const BlockGeometry& g, const float* x, const EncodeOptions& o,
                              LossyOutput* out) {
  const int bits = o.turboquant_bits;
  if (bits < 1 || bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat("turboquant_bits: ", bits, " not in [1, 8]"));
  }
  const size_t D = g.head_dim, nv = g.num_elements() / D;
  if (!IsRotatableDim(D)) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim: ", D, " is not a power of two"));
  }
  const LloydMaxQuantizer& lm = GaussianLloydMax(bits);
  const RandomizedHadamard rot(D, o.rotation_seed);
  const float sqrt_d = std::sqrt(static_cast<float>(D));
  out->params.push_back(static_cast<char>(bits));
  for (int i = 0; i < 4; ++i)
    out->params.push_back(static_cast<char>((o.rotation_seed >> (8 * i)) & 0xff));
  std::string codes;
  BitPacker packer(&codes);
  std::vector<float> y(D);
  for (size_t v = 0; v < nv; ++v) {
    const float* xv = x + v * D;
    double sq = 0;
    for (size_t d = 0; d < D; ++d) sq += static_cast<double>(xv[d]) * xv[d];
    const float norm = RoundHalf(static_cast<float>(std::sqrt(sq)));
    PutHalf(&out->payload, norm);
    const float inv = norm > 0 ? sqrt_d / norm : 0.0f;
    for (size_t d = 0; d < D; ++d) y[d] = xv[d] * inv;
    rot.Forward(y.data());
    for (size_t d = 0; d < D; ++d) {
      const uint32_t c = lm.Quantize(y[d]);
      packer.Put(c, bits);
      y[d] = lm.levels[c] * (norm / sqrt_d);
    }
    rot.Inverse(y.data());
    std::copy_n(y.data(), D, out->recon.data() + v * D);
  }
  packer.Flush();
  out->payload += codes;
  return absl::OkStatus();
}

absl::Status DecodeTurboQuant(const BlockGeometry& g, absl::string_view params,
                              absl::string_view payload, float* out) {
  if (params.size() != 5) return absl::DataLossError("turboquant params: wrong size");
  const int bits = static_cast<uint8_t>(params[0]);
  uint32_t seed = 0;
  for (int i = 0; i < 4; ++i)
    seed |= static_cast<uint32_t>(static_cast<uint8_t>(params[1 + i])) << (8 * i);
  const size_t D = g.head_dim, nv = g.num_elements() / D;
  if (bits < 1 || bits > 8 || !IsRotatableDim(D)) {
    return absl::DataLossError("turboquant params: bad bits or head_dim");
  }
  if (payload.size() != 2 * nv + PackedBytes(g.num_elements(), bits)) {
    return absl::DataLossError("turboquant payload: wrong size");
  }
  const LloydMaxQuantizer& lm = GaussianLloydMax(bits);
  const RandomizedHadamard rot(D, seed);
  const float sqrt_d = std::sqrt(static_cast<float>(D));
  const absl::string_view codes = payload.substr(2 * nv);
  for (size_t v = 0; v < nv; ++v) {
    const float norm = GetHalf(payload, v);
    if (!std::isfinite(norm)) return absl::DataLossError("turboquant payload: bad norm");
    float* y = out + v * D;
    for (size_t d = 0; d < D; ++d)
      y[d] = lm.levels[GetCode(codes, v * D + d, bits)] * (norm / sqrt_d);
    rot.Inverse(y);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeBaseline(Encoding encoding, const BlockGeometry& g, const float* x,
                            const EncodeOptions& o, LossyOutput* out) {
  out->params.clear();
  out->payload.clear();
  out->recon.assign(g.num_elements(), 0.0f);
  switch (encoding) {
    case Encoding::kInt8:
      EncodeInt8(g, x, out);
      return absl::OkStatus();
    case Encoding::kKivi2:
      EncodeKivi(g, x, out);
      return absl::OkStatus();
    case Encoding::kTurboQuant:
      return EncodeTurboQuant(g, x, o, out);
    default:
      return absl::InvalidArgumentError("encoding: not a baseline");
  }
}

absl::Status DecodeBaseline(Encoding encoding, const BlockGeometry& g, absl::string_view params,
                            absl::string_view payload, float* out) {
  switch (encoding) {
    case Encoding::kInt8:
      if (!params.empty()) return absl::DataLossError("int8 params: expected none");
      return DecodeInt8(g, payload, out);
    case Encoding::kKivi2:
      if (!params.empty()) return absl::DataLossError("kivi2 params: expected none");
      return DecodeKivi(g, payload, out);
    case Encoding::kTurboQuant:
      return DecodeTurboQuant(g, params, payload, out);
    default:
      return absl::DataLossError("encoding: not a baseline");
  }
}

}  // namespace internal
}  // namespace kvtrie
