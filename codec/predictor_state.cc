#include "codec/predictor_state.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec/crc32c.h"
#include "codec/det_math.h"
#include "codec/little_endian.h"
#include "codec/predictor_state_internal.h"
#include "xxhash.h"

namespace kvtrie {
namespace internal {
namespace {

// Serialized state, format 1 (little-endian; codec/FORMAT.md):
//   0   4  magic "KVPS"
//   4   1  format 1
//   5   1  dtype (DType)
//   6   1  rope code (kRopeBaseOf)
//   7   1  reserved 0
//   8   4  version (> 0)
//   12  2  num_layers   14  2  num_kv_heads   16  2  head_dim   18  2  reserved 0
//   20  8  tokens_learned
//   28  4  num_entries E
//   32     E x (i32 token id, u32 count): ids >= 0, strictly ascending
//   ..     (E + 1) x V fp16 means (V = layers * 2 * kv_heads * head_dim), the all-token mean first
//   ..  4  num_pairs P
//   ..     P x (i32 previous token, i32 token, u32 count): ids >= 0, (previous, token) ascending
//   ..     P x V fp16 pair predictions
//   (format 2 only; format 1 has none of it; M + K >= 1)
//   ..  2  M: planes with linear weights, 0 <= M < 2 * layers
//   ..     M x (u16 plane, ascending, in [1, 2 * layers); LinearSize(plane) fp16 finite weights)
//   ..  2  K: planes with a KLT, 0 <= K <= 2 * layers
//   ..     K x (u16 plane, ascending, < 2 * layers; kv_heads x head_dim^2 f32 finite, |v| <= 1)
//   ..  4  CRC-32C of every byte before it
// Every mean is finite; keys pre-RoPE.
constexpr char kMagic[4] = {'K', 'V', 'P', 'S'};
constexpr uint8_t kFormat = 1;        // no linear weights (what main wrote; still written so)
constexpr uint8_t kFormatLinear = 2;  // with linear weights
constexpr size_t kHeader = 32;
// log(base), as literals so that every machine predicts with the same angles.
constexpr double kRopeLogBaseOf[kNumRopeCodes] = {0.0, 9.210340371976184, 13.122363377404328};

// cos, sin of `angle` (any finite double), deterministically: exact reduction mod 2 pi (fmod is
// exact), then the Taylor series at a quarter of the angle and two angle doublings.
void RopeCosSin(double angle, double* c, double* s) {
  constexpr double kTwoPi = 6.283185307179586;
  constexpr double kPi = 3.141592653589793;
  double r = std::fmod(angle, kTwoPi);
  if (r > kPi) r -= kTwoPi;
  if (r < -kPi) r += kTwoPi;
  double cc, ss;
  DetCosSin(r / 4.0, &cc, &ss);
  for (int k = 0; k < 2; ++k) {
    const double c2 = cc * cc - ss * ss, s2 = 2.0 * ss * cc;
    cc = c2;
    ss = s2;
  }
  *c = cc;
  *s = ss;
}

class State final : public PredictorState {
 public:
  explicit State(StateData d) : d_(std::move(d)), V_(VectorSize(d_.geometry)) {
    const size_t D = d_.geometry.head_dim;
    thetas_.assign(D / 2, 0.0);
    for (size_t i = 0; i < D / 2; ++i) {
      thetas_[i] = DetExp(-2.0 * static_cast<double>(i) / static_cast<double>(D) *
                          kRopeLogBaseOf[d_.rope_code]);
    }
    // The weights as floats, transposed per head to [i][o] so that the product runs over the
    // outputs in the inner loop (vectorized; each output still sums over i ascending).
    linear_.resize(d_.linear.size());
    for (size_t p = 0; p < d_.linear.size(); ++p) {
      if (d_.linear[p].empty()) continue;
      const size_t n = LinearInputs(p) * D, H = d_.geometry.num_kv_heads;
      std::vector<float> w(d_.linear[p].size());
      ToFloat(DType::kFp16, d_.linear[p].data(), w.size(), w.data());
      linear_[p].resize(w.size());
      for (size_t h = 0; h < H; ++h)
        for (size_t o = 0; o < D; ++o)
          for (size_t i = 0; i < n; ++i) linear_[p][(h * n + i) * D + o] = w[(h * D + o) * n + i];
    }
    fingerprint_ = PredictorStateFingerprint(Serialize());
  }

  bool HasLinear(size_t plane) const override {
    return plane < linear_.size() && !linear_[plane].empty();
  }
  const float* Klt(size_t plane) const override {
    return plane < d_.klt.size() && !d_.klt[plane].empty() ? d_.klt[plane].data() : nullptr;
  }
  size_t klt_bytes() const override {
    size_t b = 0;
    for (const auto& u : d_.klt) b += 4 * u.size();
    return b;
  }
  size_t linear_bytes() const override {
    size_t b = 0;
    for (const auto& w : d_.linear) b += 2 * w.size();
    return b;
  }

  void PredictLinear(size_t plane, uint32_t first_position, size_t T, const float* in1,
                     const float* in2, float* inout) const override {
    if (!HasLinear(plane)) return;
    const BlockGeometry& g = d_.geometry;
    const size_t D = g.head_dim, H = g.num_kv_heads, P = D / 2, ni = LinearInputs(plane);
    const float* ins[2] = {in1, in2};
    const bool rope = d_.rope_code != 0;
    const std::vector<float>* cs_table = nullptr;
    const std::vector<float>* sn_table = nullptr;
    if (rope) CosSinTable(first_position, T, &cs_table, &sn_table);
    std::vector<float> x(ni * D), y(D);
    const float* w = linear_[plane].data();
    for (size_t h = 0; h < H; ++h, w += D * ni * D) {
      for (size_t t = 0; t < T; ++t) {
        const float* c = rope ? cs_table->data() + t * P : nullptr;
        const float* s = rope ? sn_table->data() + t * P : nullptr;
        for (size_t j = 0; j < ni; ++j) {
          const float* r = ins[j] + (h * T + t) * D;
          float* xj = x.data() + j * D;
          if (!rope || (plane - 1 - j) % 2 == 1) {
            std::memcpy(xj, r, D * sizeof(float));
            continue;
          }
          for (size_t i = 0; i < P; ++i) {  // the inverse rotation: pre-RoPE
            const float a = r[2 * i], b = r[2 * i + 1];
            xj[2 * i] = c[i] * a + s[i] * b;
            xj[2 * i + 1] = c[i] * b - s[i] * a;
          }
          if (D % 2) xj[D - 1] = r[D - 1];
        }
        // y[o] = sum over i ascending of W[o][i] x[i] (w is [i][o]).
        std::fill(y.begin(), y.end(), 0.0f);
        for (size_t i = 0; i < ni * D; ++i) {
          const float xi = x[i];
          const float* col = w + i * D;
          for (size_t o = 0; o < D; ++o) y[o] += col[o] * xi;
        }
        float* out = inout + (h * T + t) * D;
        if (!rope || plane % 2 == 1) {
          for (size_t o = 0; o < D; ++o) out[o] += y[o];
          continue;
        }
        for (size_t i = 0; i < P; ++i) {
          const float a = y[2 * i], b = y[2 * i + 1];
          out[2 * i] += c[i] * a - s[i] * b;
          out[2 * i + 1] += s[i] * a + c[i] * b;
        }
        if (D % 2) out[D - 1] += y[D - 1];
      }
    }
  }

  std::string Serialize() const override {
    std::string out;
    out.reserve(kHeader + d_.ids.size() * 8 + d_.means.size() * 2 + d_.pairs.size() * 12 +
                d_.pair_means.size() * 2 + 8);
    out.append(kMagic, 4);
    PutLE<uint8_t>(&out, kFormat);
    PutLE<uint8_t>(&out, static_cast<uint8_t>(d_.geometry.dtype));
    PutLE<uint8_t>(&out, static_cast<uint8_t>(d_.rope_code));
    PutLE<uint8_t>(&out, 0);
    PutLE<uint32_t>(&out, d_.version);
    PutLE<uint16_t>(&out, static_cast<uint16_t>(d_.geometry.num_layers));
    PutLE<uint16_t>(&out, static_cast<uint16_t>(d_.geometry.num_kv_heads));
    PutLE<uint16_t>(&out, static_cast<uint16_t>(d_.geometry.head_dim));
    PutLE<uint16_t>(&out, 0);
    PutLE<uint64_t>(&out, d_.tokens_learned);
    PutLE<uint32_t>(&out, static_cast<uint32_t>(d_.ids.size()));
    for (size_t i = 0; i < d_.ids.size(); ++i) {
      PutLE<uint32_t>(&out, static_cast<uint32_t>(d_.ids[i]));
      PutLE<uint32_t>(&out, d_.counts[i]);
    }
    for (uint16_t h : d_.means) PutLE<uint16_t>(&out, h);
    PutLE<uint32_t>(&out, static_cast<uint32_t>(d_.pairs.size()));
    for (size_t i = 0; i < d_.pairs.size(); ++i) {
      PutLE<uint32_t>(&out, static_cast<uint32_t>(d_.pairs[i] >> 32));
      PutLE<uint32_t>(&out, static_cast<uint32_t>(d_.pairs[i]));
      PutLE<uint32_t>(&out, d_.pair_counts[i]);
    }
    for (uint16_t h : d_.pair_means) PutLE<uint16_t>(&out, h);
    if (linear_bytes() > 0 || klt_bytes() > 0) {
      out[4] = static_cast<char>(kFormatLinear);
      size_t m = 0;
      for (const auto& w : d_.linear) m += !w.empty();
      PutLE<uint16_t>(&out, static_cast<uint16_t>(m));
      for (size_t p = 0; p < d_.linear.size(); ++p) {
        if (d_.linear[p].empty()) continue;
        PutLE<uint16_t>(&out, static_cast<uint16_t>(p));
        for (uint16_t h : d_.linear[p]) PutLE<uint16_t>(&out, h);
      }
      size_t k = 0;
      for (const auto& u : d_.klt) k += !u.empty();
      PutLE<uint16_t>(&out, static_cast<uint16_t>(k));
      for (size_t p = 0; p < d_.klt.size(); ++p) {
        if (d_.klt[p].empty()) continue;
        PutLE<uint16_t>(&out, static_cast<uint16_t>(p));
        for (float f : d_.klt[p]) {
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          PutLE<uint32_t>(&out, bits);
        }
      }
    }
    PutLE<uint32_t>(&out, Crc32c(out));
    return out;
  }

  uint32_t version() const override { return d_.version; }
  uint64_t fingerprint() const override { return fingerprint_; }
  const BlockGeometry& geometry() const override { return d_.geometry; }
  size_t memory_bytes() const override {
    return sizeof(*this) + d_.ids.size() * 8 + d_.means.size() * 2 + d_.pairs.size() * 12 +
           d_.pair_means.size() * 2 + thetas_.size() * 8 + 3 * linear_bytes() + klt_bytes();
  }
  uint64_t tokens_learned() const override { return d_.tokens_learned; }
  uint32_t tokens_in_table() const override { return static_cast<uint32_t>(d_.ids.size()); }
  uint32_t pairs_in_table() const override { return static_cast<uint32_t>(d_.pairs.size()); }
  std::string Describe() const override {
    size_t planes = 0;
    for (const auto& w : d_.linear) planes += !w.empty();
    return absl::StrFormat(
        "v%u: %u tokens, %u pairs (learned from %u tokens), rope %s, %s%u KB", d_.version,
        d_.ids.size(), d_.pairs.size(), d_.tokens_learned,
        d_.rope_code == 0 ? "none" : absl::StrCat(kRopeBaseOf[d_.rope_code]),
        std::string(planes ? absl::StrFormat("linear %u planes (%u KB), ", planes,
                                             (linear_bytes() + 1023) / 1024)
                           : "") +
            std::string(klt_bytes() ? absl::StrFormat("klt %u KB, ", (klt_bytes() + 1023) / 1024)
                                    : ""),
        (memory_bytes() + 1023) / 1024);
  }
  double rope_base() const override { return kRopeBaseOf[d_.rope_code]; }

  void PredictTokenMean(absl::Span<const int32_t> tokens, uint32_t first_position,
                        float* out) const override {
    std::vector<const uint16_t*> rows(tokens.size());
    for (size_t t = 0; t < tokens.size(); ++t) rows[t] = TokenRow(tokens[t]);
    Emit(rows, first_position, out);
  }

  void Predict(absl::Span<const int32_t> tokens, uint32_t first_position, int32_t previous_token,
               float* out) const override {
    std::vector<const uint16_t*> rows(tokens.size());
    for (size_t t = 0; t < tokens.size(); ++t) {
      const int32_t prev = t ? tokens[t - 1] : previous_token;
      rows[t] = nullptr;
      if (prev >= 0 && tokens[t] >= 0 && !d_.pairs.empty()) {
        const uint64_t key = PairKey(prev, tokens[t]);
        auto it = std::lower_bound(d_.pairs.begin(), d_.pairs.end(), key);
        if (it != d_.pairs.end() && *it == key) {
          rows[t] = d_.pair_means.data() + (it - d_.pairs.begin()) * V_;
        }
      }
      if (rows[t] == nullptr) rows[t] = TokenRow(tokens[t]);
    }
    Emit(rows, first_position, out);
  }

 private:
  const uint16_t* TokenRow(int32_t token) const {
    auto it = std::lower_bound(d_.ids.begin(), d_.ids.end(), token);
    const size_t e = (it != d_.ids.end() && *it == token) ? 1 + (it - d_.ids.begin()) : 0;
    return d_.means.data() + e * V_;
  }

  // out[l][kv][h][t][d] from token t's vector rows[t], keys rotated at first_position + t.
  void Emit(const std::vector<const uint16_t*>& rows, uint32_t first_position, float* out) const {
    const BlockGeometry& g = d_.geometry;
    const size_t T = rows.size(), D = g.head_dim, H = g.num_kv_heads, P = D / 2;
    std::vector<float> cs, sn;
    if (d_.rope_code != 0) {
      cs.resize(T * P);
      sn.resize(T * P);
      for (size_t t = 0; t < T; ++t) {
        const double pos = static_cast<double>(first_position) + static_cast<double>(t);
        for (size_t i = 0; i < P; ++i) {
          double c, s;
          RopeCosSin(pos * thetas_[i], &c, &s);
          cs[t * P + i] = static_cast<float>(c);
          sn[t * P + i] = static_cast<float>(s);
        }
      }
    }
    for (size_t l = 0; l < g.num_layers; ++l) {
      for (size_t kv = 0; kv < 2; ++kv) {
        for (size_t h = 0; h < H; ++h) {
          const size_t off = ((l * 2 + kv) * H + h) * D;
          float* o = out + off * T;
          for (size_t t = 0; t < T; ++t, o += D) {
            // The token's fp16 vector as floats (exact), straight into place (one pass).
            ToFloat(DType::kFp16, rows[t] + off, D, o);
            if (kv == 1 || d_.rope_code == 0) continue;
            const float* c = cs.data() + t * P;
            const float* s = sn.data() + t * P;
            for (size_t i = 0; i < P; ++i) {
              const float a = o[2 * i], b = o[2 * i + 1];
              o[2 * i] = c[i] * a - s[i] * b;
              o[2 * i + 1] = s[i] * a + c[i] * b;
            }
          }
        }
      }
    }
  }

  // cos, sin of positions first_position .. + T - 1, [T][D / 2], cached per thread (the encoder
  // and decoder ask once per plane).
  void CosSinTable(uint32_t first_position, size_t T, const std::vector<float>** cs,
                   const std::vector<float>** sn) const {
    struct Cache {
      uint64_t state = 0;  // State::id_ (never a pointer: a freed state's address is reused)
      uint32_t first = 0;
      std::vector<float> cs, sn;
    };
    thread_local Cache cache;
    const size_t P = d_.geometry.head_dim / 2;
    if (cache.state != id_ || cache.first != first_position || cache.cs.size() != T * P) {
      cache.state = 0;
      cache.cs.resize(T * P);
      cache.sn.resize(T * P);
      for (size_t t = 0; t < T; ++t) {
        const double pos = static_cast<double>(first_position) + static_cast<double>(t);
        for (size_t i = 0; i < P; ++i) {
          double c, s;
          RopeCosSin(pos * thetas_[i], &c, &s);
          cache.cs[t * P + i] = static_cast<float>(c);
          cache.sn[t * P + i] = static_cast<float>(s);
        }
      }
      cache.state = id_;
      cache.first = first_position;
    }
    *cs = &cache.cs;
    *sn = &cache.sn;
  }

  static inline std::atomic<uint64_t> next_id_{0};
  const uint64_t id_ = ++next_id_;  // unique per State in the process (the cos / sin cache key)
  const StateData d_;
  const size_t V_;
  std::vector<double> thetas_;              // per channel pair
  std::vector<std::vector<float>> linear_;  // d_.linear as floats
  uint64_t fingerprint_ = 0;                // XXH3-64 of Serialize()
};

absl::Status ReadMeans(const char** q, size_t n, std::vector<uint16_t>* out, const char* what) {
  out->resize(n);
  for (size_t i = 0; i < n; ++i, *q += 2) {
    (*out)[i] = GetLE<uint16_t>(*q);
    if (((*out)[i] & 0x7c00) == 0x7c00) {
      return absl::DataLossError(absl::StrCat("predictor state: ", what, " ", i, " not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<const PredictorState> MakeState(StateData data) {
  return std::make_shared<State>(std::move(data));
}

absl::Status CheckLearnedGeometry(const PredictorState& state, const BlockGeometry& g) {
  const BlockGeometry& sg = state.geometry();
  if (sg.num_layers != g.num_layers || sg.num_kv_heads != g.num_kv_heads ||
      sg.head_dim != g.head_dim || sg.dtype != g.dtype) {
    BlockGeometry shown = sg;
    shown.block_tokens = g.block_tokens;
    return absl::InvalidArgumentError(
        absl::StrCat("learned: predictor state version ", state.version(), " predicts ",
                     shown.DebugString(), ", the block is ", g.DebugString()));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::StatusOr<std::shared_ptr<const PredictorState>> PredictorState::Parse(
    absl::string_view bytes) {
  using internal::GetLE;
  if (bytes.size() < internal::kHeader + 8) {
    return absl::DataLossError(
        absl::StrCat("predictor state: truncated (", bytes.size(), " bytes)"));
  }
  if (std::memcmp(bytes.data(), internal::kMagic, 4) != 0) {
    return absl::DataLossError("predictor state: bad magic");
  }
  const uint32_t stored = GetLE<uint32_t>(bytes.data() + bytes.size() - 4);
  const uint32_t actual = Crc32c(bytes.substr(0, bytes.size() - 4));
  if (stored != actual) {
    return absl::DataLossError(absl::StrCat("predictor state: CRC-32C mismatch (stored ",
                                            absl::Hex(stored), ", computed ", absl::Hex(actual),
                                            ")"));
  }
  const char* p = bytes.data();
  const uint8_t format = static_cast<uint8_t>(p[4]);
  if (format != internal::kFormat && format != internal::kFormatLinear) {
    return absl::DataLossError(
        absl::StrCat("predictor state: unsupported format ", static_cast<uint8_t>(p[4])));
  }
  internal::StateData d;
  const uint8_t dtype = static_cast<uint8_t>(p[5]);
  if (!IsValidDType(dtype)) {
    return absl::DataLossError(absl::StrCat("predictor state: unknown dtype ", dtype));
  }
  const uint8_t rope = static_cast<uint8_t>(p[6]);
  if (rope >= internal::kNumRopeCodes) {
    return absl::DataLossError(absl::StrCat("predictor state: unknown rope code ", rope));
  }
  d.rope_code = rope;
  if (p[7] != 0 || GetLE<uint16_t>(p + 18) != 0) {
    return absl::DataLossError("predictor state: reserved bytes not 0");
  }
  d.version = GetLE<uint32_t>(p + 8);
  if (d.version == 0) return absl::DataLossError("predictor state: version 0");
  BlockGeometry& g = d.geometry;
  g.dtype = static_cast<DType>(dtype);
  g.num_layers = GetLE<uint16_t>(p + 12);
  g.num_kv_heads = GetLE<uint16_t>(p + 14);
  g.head_dim = GetLE<uint16_t>(p + 16);
  g.block_tokens = 1;
  if (!g.Validate().ok()) {
    return absl::DataLossError("predictor state: invalid geometry " + g.DebugString());
  }
  g.block_tokens = 0;
  d.tokens_learned = GetLE<uint64_t>(p + 20);
  const uint64_t V = internal::VectorSize(g);
  const char* q = p + internal::kHeader;
  const char* const end = bytes.data() + bytes.size() - 4;
  // Tokens: E * 8 + (E + 1) * 2V bytes, then at least the 4-byte pair count.
  const uint64_t entries = GetLE<uint32_t>(p + 28);
  uint64_t left = end - q;
  if (left < 2 * V + 4 || entries > (left - 2 * V - 4) / (8 + 2 * V)) {
    return absl::DataLossError(absl::StrCat("predictor state: ", entries, " token entries of ", V,
                                            " values past the end"));
  }
  d.ids.resize(entries);
  d.counts.resize(entries);
  for (uint64_t i = 0; i < entries; ++i, q += 8) {
    const uint32_t id = GetLE<uint32_t>(q);
    if (id > static_cast<uint32_t>(INT32_MAX) ||
        (i > 0 && static_cast<int32_t>(id) <= d.ids[i - 1])) {
      return absl::DataLossError(
          absl::StrCat("predictor state: token id ", id, " at entry ", i, " out of order"));
    }
    d.ids[i] = static_cast<int32_t>(id);
    d.counts[i] = GetLE<uint32_t>(q + 4);
  }
  if (auto s = internal::ReadMeans(&q, (entries + 1) * V, &d.means, "token mean"); !s.ok()) {
    return s;
  }
  // Pairs: P * 12 + P * 2V bytes, exactly what is left (format 1), or at most that (format 2).
  const uint64_t pairs = GetLE<uint32_t>(q);
  q += 4;
  left = end - q;
  if (format == internal::kFormatLinear) {
    if (left < 2 || pairs > (left - 2) / (12 + 2 * V)) {
      return absl::DataLossError(absl::StrCat("predictor state: ", pairs, " pairs past the end"));
    }
  } else if (left % (12 + 2 * V) != 0 || left / (12 + 2 * V) != pairs) {
    return absl::DataLossError(absl::StrCat("predictor state: ", pairs, " pairs do not match the ",
                                            left, " bytes present"));
  }
  d.pairs.resize(pairs);
  d.pair_counts.resize(pairs);
  for (uint64_t i = 0; i < pairs; ++i, q += 12) {
    const uint32_t prev = GetLE<uint32_t>(q), tok = GetLE<uint32_t>(q + 4);
    const uint64_t key = (static_cast<uint64_t>(prev) << 32) | tok;
    if (prev > static_cast<uint32_t>(INT32_MAX) || tok > static_cast<uint32_t>(INT32_MAX) ||
        (i > 0 && key <= d.pairs[i - 1])) {
      return absl::DataLossError(absl::StrCat("predictor state: pair (", prev, ", ", tok,
                                              ") at entry ", i, " out of order"));
    }
    d.pairs[i] = key;
    d.pair_counts[i] = GetLE<uint32_t>(q + 8);
  }
  if (auto s = internal::ReadMeans(&q, pairs * V, &d.pair_means, "pair mean"); !s.ok()) return s;
  if (format == internal::kFormatLinear) {
    const size_t planes = 2 * static_cast<size_t>(g.num_layers);
    const size_t m = GetLE<uint16_t>(q);
    q += 2;
    if (m >= planes) {
      return absl::DataLossError(absl::StrCat("predictor state: ", m, " linear planes"));
    }
    d.linear.resize(planes);
    size_t last = 0;
    for (size_t i = 0; i < m; ++i) {
      if (end - q < 2) return absl::DataLossError("predictor state: linear planes past the end");
      const size_t plane = GetLE<uint16_t>(q);
      q += 2;
      if (plane == 0 || plane >= planes || plane <= last) {
        return absl::DataLossError(
            absl::StrCat("predictor state: linear plane ", plane, " out of order"));
      }
      last = plane;
      const size_t n = internal::LinearSize(g, plane);
      if (static_cast<size_t>(end - q) / 2 < n) {
        return absl::DataLossError(
            absl::StrCat("predictor state: linear plane ", plane, " past the end"));
      }
      if (auto s = internal::ReadMeans(&q, n, &d.linear[plane], "linear weight"); !s.ok()) {
        return s;
      }
    }
    if (m == 0) d.linear.clear();
    if (end - q < 2) return absl::DataLossError("predictor state: KLT planes past the end");
    const size_t k = GetLE<uint16_t>(q);
    q += 2;
    if (k > planes || (m == 0 && k == 0)) {
      return absl::DataLossError(absl::StrCat("predictor state: ", k, " KLT planes"));
    }
    if (k > 0) d.klt.resize(planes);
    const size_t ku = static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.head_dim;
    for (size_t i = 0; i < k; ++i) {
      if (end - q < 2) return absl::DataLossError("predictor state: KLT planes past the end");
      const size_t plane = GetLE<uint16_t>(q);
      q += 2;
      if (plane >= planes || (i > 0 && plane <= last)) {
        return absl::DataLossError(
            absl::StrCat("predictor state: KLT plane ", plane, " out of order"));
      }
      last = plane;
      if (static_cast<size_t>(end - q) / 4 < ku) {
        return absl::DataLossError(
            absl::StrCat("predictor state: KLT plane ", plane, " past the end"));
      }
      d.klt[plane].resize(ku);
      for (size_t j = 0; j < ku; ++j, q += 4) {
        const uint32_t bits = GetLE<uint32_t>(q);
        float f;
        std::memcpy(&f, &bits, 4);
        if (!std::isfinite(f) || std::fabs(f) > 1.0f + 1e-3f) {
          return absl::DataLossError(
              absl::StrCat("predictor state: KLT plane ", plane, " value ", j, " out of range"));
        }
        d.klt[plane][j] = f;
      }
    }
    if (q != end) return absl::DataLossError("predictor state: bytes after the KLT bases");
  }
  return internal::MakeState(std::move(d));
}

uint64_t PredictorStateFingerprint(absl::string_view bytes) {
  const uint64_t h = XXH3_64bits(bytes.data(), bytes.size());
  return h == 0 ? 1 : h;  // 0 means "none" in an envelope
}

}  // namespace kvtrie
