#include "codec/predictor_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec/crc32c.h"
#include "codec/residual_kernels.h"

namespace kvtrie {
namespace {

// Serialized state, format 1 (little-endian):
//   0   4  magic "KVPS"
//   4   1  format 1
//   5   1  dtype (DType)
//   6   1  rope code: 0 = keys not rotated, 1 = base 10000, 2 = base 500000
//   7   1  reserved 0
//   8   4  version (> 0)
//   12  2  num_layers   14  2  num_kv_heads   16  2  head_dim   18  2  reserved 0
//   20  8  tokens_learned
//   28  4  num_entries E
//   32     E x (i32 token id, u32 count): ids >= 0, strictly ascending
//   ..     (E + 1) x [layers][2][kv_heads][head_dim] fp16 means, the mean over every token first,
//          keys pre-RoPE; all finite
//   ..  4  CRC-32C of every byte before it
constexpr char kMagic[4] = {'K', 'V', 'P', 'S'};
constexpr uint8_t kFormat = 1;
constexpr size_t kHeader = 32;
constexpr double kRopeBaseOf[3] = {0.0, 10000.0, 500000.0};
// log(base), as literals so that every machine predicts with the same angles.
constexpr double kRopeLogBaseOf[3] = {0.0, 9.210340371976184, 13.122363377404328};
constexpr int kNumRopeCodes = 3;
// Tokens observed before the learner picks the RoPE hypothesis (it accumulates keys under every
// hypothesis until then).
constexpr uint64_t kDetectTokens = 4096;

template <typename T>
void PutLE(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
template <typename T>
T GetLE(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// Values of one token's vector: [layers][2][kv_heads][head_dim].
size_t VectorSize(const BlockGeometry& g) {
  return static_cast<size_t>(g.num_layers) * 2 * g.num_kv_heads * g.head_dim;
}

// cos, sin of `angle` (any finite double), deterministically: exact reduction mod 2 pi (fmod is
// exact), then the Taylor series at a quarter of the angle and two angle doublings.
void RopeCosSin(double angle, double* c, double* s) {
  constexpr double kTwoPi = 6.283185307179586;
  constexpr double kPi = 3.141592653589793;
  double r = std::fmod(angle, kTwoPi);
  if (r > kPi) r -= kTwoPi;
  if (r < -kPi) r += kTwoPi;
  double cc, ss;
  internal::residual::DetCosSin(r / 4.0, &cc, &ss);
  for (int k = 0; k < 2; ++k) {
    const double c2 = cc * cc - ss * ss, s2 = 2.0 * ss * cc;
    cc = c2;
    ss = s2;
  }
  *c = cc;
  *s = ss;
}

// theta_i = base^(-2i / D) per channel pair.
std::vector<double> RopeThetas(int rope_code, size_t D) {
  std::vector<double> th(D / 2, 0.0);
  for (size_t i = 0; i < D / 2; ++i) {
    th[i] = internal::residual::DetExp(-2.0 * static_cast<double>(i) / static_cast<double>(D) *
                                       kRopeLogBaseOf[rope_code]);
  }
  return th;
}

class TokenMeanState final : public PredictorState {
 public:
  TokenMeanState(const BlockGeometry& g, uint32_t version, int rope_code, uint64_t tokens_learned,
                 std::vector<int32_t> ids, std::vector<uint32_t> counts,
                 std::vector<uint16_t> means)
      : g_(g),
        version_(version),
        rope_code_(rope_code),
        tokens_learned_(tokens_learned),
        ids_(std::move(ids)),
        counts_(std::move(counts)),
        means_(std::move(means)),
        thetas_(RopeThetas(rope_code, g.head_dim)) {
    means_f_.resize(means_.size());
    ToFloat(DType::kFp16, means_.data(), means_.size(), means_f_.data());
  }

  std::string Serialize() const override {
    std::string out;
    out.reserve(kHeader + ids_.size() * 8 + means_.size() * 2 + 4);
    out.append(kMagic, 4);
    PutLE<uint8_t>(&out, kFormat);
    PutLE<uint8_t>(&out, static_cast<uint8_t>(g_.dtype));
    PutLE<uint8_t>(&out, static_cast<uint8_t>(rope_code_));
    PutLE<uint8_t>(&out, 0);
    PutLE<uint32_t>(&out, version_);
    PutLE<uint16_t>(&out, static_cast<uint16_t>(g_.num_layers));
    PutLE<uint16_t>(&out, static_cast<uint16_t>(g_.num_kv_heads));
    PutLE<uint16_t>(&out, static_cast<uint16_t>(g_.head_dim));
    PutLE<uint16_t>(&out, 0);
    PutLE<uint64_t>(&out, tokens_learned_);
    PutLE<uint32_t>(&out, static_cast<uint32_t>(ids_.size()));
    for (size_t i = 0; i < ids_.size(); ++i) {
      PutLE<uint32_t>(&out, static_cast<uint32_t>(ids_[i]));
      PutLE<uint32_t>(&out, counts_[i]);
    }
    for (uint16_t h : means_) PutLE<uint16_t>(&out, h);
    PutLE<uint32_t>(&out, Crc32c(out));
    return out;
  }

  uint32_t version() const override { return version_; }
  const BlockGeometry& geometry() const override { return g_; }
  size_t memory_bytes() const override {
    return sizeof(*this) + ids_.size() * 8 + means_.size() * 6 + thetas_.size() * 8;
  }
  uint64_t tokens_learned() const override { return tokens_learned_; }
  uint32_t tokens_in_table() const override { return static_cast<uint32_t>(ids_.size()); }
  std::string Describe() const override {
    return absl::StrFormat("v%u: %u tokens in table (learned from %u), token means, rope %s, %u KB",
                           version_, ids_.size(), tokens_learned_,
                           rope_code_ == 0 ? "none" : absl::StrCat(kRopeBaseOf[rope_code_]),
                           (memory_bytes() + 1023) / 1024);
  }
  double rope_base() const override { return kRopeBaseOf[rope_code_]; }

  void PredictTokenMean(absl::Span<const int32_t> tokens, uint32_t first_position,
                        float* out) const override {
    const size_t T = tokens.size(), D = g_.head_dim, H = g_.num_kv_heads, V = VectorSize(g_);
    std::vector<const float*> rows(T);
    for (size_t t = 0; t < T; ++t) {
      auto it = std::lower_bound(ids_.begin(), ids_.end(), tokens[t]);
      const size_t e = (it != ids_.end() && *it == tokens[t]) ? 1 + (it - ids_.begin()) : 0;
      rows[t] = means_f_.data() + e * V;
    }
    // cos / sin of every (token, pair) of the keys.
    std::vector<float> cs, sn;
    if (rope_code_ != 0) {
      cs.resize(T * (D / 2));
      sn.resize(T * (D / 2));
      for (size_t t = 0; t < T; ++t) {
        const double pos = static_cast<double>(first_position) + static_cast<double>(t);
        for (size_t i = 0; i < D / 2; ++i) {
          double c, s;
          RopeCosSin(pos * thetas_[i], &c, &s);
          cs[t * (D / 2) + i] = static_cast<float>(c);
          sn[t * (D / 2) + i] = static_cast<float>(s);
        }
      }
    }
    for (size_t l = 0; l < g_.num_layers; ++l) {
      for (size_t kv = 0; kv < 2; ++kv) {
        for (size_t h = 0; h < H; ++h) {
          const size_t off = ((l * 2 + kv) * H + h) * D;
          float* o = out + ((l * 2 + kv) * H + h) * T * D;
          for (size_t t = 0; t < T; ++t, o += D) {
            const float* m = rows[t] + off;
            if (kv == 1 || rope_code_ == 0) {
              std::memcpy(o, m, D * sizeof(float));
              continue;
            }
            const float* c = cs.data() + t * (D / 2);
            const float* s = sn.data() + t * (D / 2);
            for (size_t i = 0; i < D / 2; ++i) {
              const float a = m[2 * i], b = m[2 * i + 1];
              o[2 * i] = c[i] * a - s[i] * b;
              o[2 * i + 1] = s[i] * a + c[i] * b;
            }
            if (D % 2) o[D - 1] = m[D - 1];
          }
        }
      }
    }
  }

 private:
  const BlockGeometry g_;
  const uint32_t version_;
  const int rope_code_;
  const uint64_t tokens_learned_;
  const std::vector<int32_t> ids_;      // ascending
  const std::vector<uint32_t> counts_;  // per id
  const std::vector<uint16_t> means_;   // (1 + ids) x VectorSize fp16, the global mean first
  std::vector<float> means_f_;          // the same as floats
  const std::vector<double> thetas_;    // per channel pair
};

class TokenMeanLearner final : public PredictorLearner {
 public:
  TokenMeanLearner(const BlockGeometry& g, const LearnerOptions& o) : g_(g), o_(o) {
    V_ = VectorSize(g);
    K_ = V_ / 2;
    thetas_[0].assign(g.head_dim / 2, 0.0);
    for (int r = 1; r < kNumRopeCodes; ++r) {
      thetas_[r].resize(g.head_dim / 2);
      for (size_t i = 0; i < g.head_dim / 2; ++i) {
        thetas_[r][i] = std::pow(kRopeBaseOf[r], -2.0 * i / static_cast<double>(g.head_dim));
      }
    }
    max_entries_ = MaxEntries();
    AddEntry();  // the global entry
  }

  absl::Status Observe(absl::Span<const uint8_t> kv, absl::Span<const int32_t> tokens,
                       uint32_t first_position, int32_t previous_token) override {
    if (kv.size() != g_.num_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv: expected ", g_.num_bytes(), " bytes, got ", kv.size()));
    }
    if (tokens.size() != g_.block_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: expected ", g_.block_tokens, " token ids, got ", tokens.size()));
    }
    for (int32_t t : tokens) {
      if (t < 0) return absl::InvalidArgumentError(absl::StrCat("tokens: negative id ", t));
    }
    if (previous_token < -1) {
      return absl::InvalidArgumentError(absl::StrCat("previous_token: ", previous_token));
    }
    const size_t T = g_.block_tokens, D = g_.head_dim, H = g_.num_kv_heads;
    std::vector<float> x(g_.num_elements());
    ToFloat(g_.dtype, kv.data(), x.size(), x.data());
    std::vector<double> vec(V_), keys_alt[kNumRopeCodes];
    for (auto& k : keys_alt) k.resize(K_);
    for (size_t t = 0; t < T; ++t) {
      // Gather token t's vector; skip it if any value is not finite.
      bool finite = true;
      for (size_t l = 0; l < g_.num_layers && finite; ++l) {
        for (size_t side = 0; side < 2; ++side) {
          for (size_t h = 0; h < H; ++h) {
            const float* src = x.data() + (((l * 2 + side) * H + h) * T + t) * D;
            double* dst = vec.data() + ((l * 2 + side) * H + h) * D;
            for (size_t d = 0; d < D; ++d) {
              finite &= std::isfinite(src[d]);
              dst[d] = src[d];
            }
          }
        }
      }
      if (!finite) continue;
      const double pos = static_cast<double>(first_position) + static_cast<double>(t);
      // De-rotated keys under each hypothesis (only the chosen one once decided).
      for (int r = 0; r < kNumRopeCodes; ++r) {
        if (rope_code_ >= 0 && r != rope_code_) continue;
        for (size_t l = 0; l < g_.num_layers; ++l) {
          for (size_t h = 0; h < H; ++h) {
            const double* k = vec.data() + ((l * 2) * H + h) * D;
            double* o = keys_alt[r].data() + (l * H + h) * D;
            for (size_t i = 0; i < D / 2; ++i) {
              const double a = k[2 * i], b = k[2 * i + 1];
              const double c = std::cos(pos * thetas_[r][i]), s = std::sin(pos * thetas_[r][i]);
              o[2 * i] = c * a + s * b;  // the inverse of (c a - s b, s a + c b)
              o[2 * i + 1] = -s * a + c * b;
            }
            if (D % 2) o[D - 1] = k[D - 1];
          }
        }
      }
      Accumulate(0, vec, keys_alt);
      const int32_t id = tokens[t];
      auto it = index_.find(id);
      if (it == index_.end()) {
        if (!HasRoom()) {
          ++tokens_dropped_;
          ++observed_;
          continue;
        }
        it = index_.emplace(id, AddEntry()).first;
        entry_ids_.push_back(id);
      }
      Accumulate(it->second, vec, keys_alt);
      ++observed_;
    }
    if (rope_code_ < 0 && observed_ >= kDetectTokens) Decide();
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<const PredictorState>> Fit(uint32_t version) const override {
    if (version == 0) return absl::InvalidArgumentError("version: must be > 0");
    if (counts_.empty() || counts_[0] == 0) {
      return absl::FailedPreconditionError("learner: nothing observed");
    }
    const int rope = rope_code_ >= 0 ? rope_code_ : BestRope();
    // Entries by count (most frequent first), as many as the cap allows.
    std::vector<size_t> order(entry_ids_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return counts_[a + 1] > counts_[b + 1]; });
    const size_t state_entry = 8 + 6 * V_;
    const size_t used = memory_bytes();
    const size_t room = o_.max_bytes > used ? o_.max_bytes - used : 0;
    // The state holds the global entry and `keep` token entries.
    const size_t keep = std::min(order.size(), room >= state_entry ? room / state_entry - 1 : 0);
    order.resize(keep);
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return entry_ids_[a] < entry_ids_[b]; });
    std::vector<int32_t> ids;
    std::vector<uint32_t> counts;
    std::vector<uint16_t> means;
    means.reserve((keep + 1) * V_);
    auto append = [&](size_t e) {
      const double n = counts_[e];
      const double* s = sums_.data() + e * K_;
      const double* k = key_sums_[rope].data() + e * K_;
      const size_t H = g_.num_kv_heads, D = g_.head_dim;
      for (size_t l = 0; l < g_.num_layers; ++l) {
        for (size_t side = 0; side < 2; ++side) {
          for (size_t hd = 0; hd < H * D; ++hd) {
            const double v = side == 0 ? k[l * H * D + hd] : s[l * H * D + hd];
            float m = static_cast<float>(v / n);
            if (!std::isfinite(m)) m = 0;
            means.push_back(FloatToHalf(std::clamp(m, -65504.0f, 65504.0f)));
          }
        }
      }
    };
    append(0);
    for (size_t i : order) {
      ids.push_back(entry_ids_[i]);
      counts.push_back(static_cast<uint32_t>(std::min<uint64_t>(counts_[i + 1], UINT32_MAX)));
      append(i + 1);
    }
    BlockGeometry g = g_;
    g.block_tokens = 0;
    return std::shared_ptr<const PredictorState>(std::make_shared<TokenMeanState>(
        g, version, rope, observed_, std::move(ids), std::move(counts), std::move(means)));
  }

  uint64_t tokens_observed() const override { return observed_; }
  size_t memory_bytes() const override {
    size_t key_bytes = 0;
    for (const auto& k : key_sums_) key_bytes += k.capacity() * 8;
    return sizeof(*this) + sums_.capacity() * 8 + key_bytes + counts_.capacity() * 8 +
           entry_ids_.capacity() * 4 + index_.size() * kMapNodeBytes;
  }

 private:
  static constexpr size_t kMapNodeBytes = 48;  // an unordered_map node and its bucket, about

  // Entries the cap allows: the accumulators while learning (keys under every RoPE hypothesis
  // until decided) plus the entry in a fitted state.
  size_t MaxEntries() const {
    const size_t entry = 8 * K_ + 8 * K_ * kNumRopeCodes + 8 + 4 + kMapNodeBytes + (8 + 6 * V_);
    const size_t fixed = sizeof(*this) + 2 * entry;  // the global entry, slack
    return o_.max_bytes > fixed ? (o_.max_bytes - fixed) / entry : 0;
  }
  bool HasRoom() const { return counts_.size() < 1 + max_entries_; }

  // Grows `v` to `n` elements, its capacity never past the cap's.
  template <typename T>
  void GrowTo(std::vector<T>* v, size_t n, size_t per_entry) {
    if (n > v->capacity()) {
      const size_t limit = (1 + max_entries_) * per_entry;
      v->reserve(std::max(n, std::min(2 * v->capacity(), limit)));
    }
    v->resize(n, T{});
  }

  size_t AddEntry() {
    const size_t e = counts_.size();
    GrowTo(&counts_, e + 1, 1);
    GrowTo(&sums_, sums_.size() + K_, K_);  // the value halves
    for (int r = 0; r < kNumRopeCodes; ++r) {
      if (rope_code_ >= 0 && r != rope_code_) continue;
      GrowTo(&key_sums_[r], key_sums_[r].size() + K_, K_);
    }
    return e;
  }

  void Accumulate(size_t e, const std::vector<double>& vec, const std::vector<double>* keys) {
    ++counts_[e];
    double* s = sums_.data() + e * K_;
    const size_t HD = static_cast<size_t>(g_.num_kv_heads) * g_.head_dim;
    for (size_t l = 0; l < g_.num_layers; ++l) {
      const size_t off = (l * 2 + 1) * HD;
      for (size_t i = 0; i < HD; ++i) s[l * HD + i] += vec[off + i];
    }
    for (int r = 0; r < kNumRopeCodes; ++r) {
      if (key_sums_[r].empty()) continue;
      double* k = key_sums_[r].data() + e * K_;
      for (size_t i = 0; i < K_; ++i) k[i] += keys[r][i];
    }
  }

  // The hypothesis whose per-token key means explain the most energy (rotation keeps each
  // token's energy, so the largest sum of n * ||mean||^2 is the smallest within-token variance).
  int BestRope() const {
    int best = 0;
    double best_score = -1;
    for (int r = 0; r < kNumRopeCodes; ++r) {
      if (key_sums_[r].empty()) continue;
      double score = 0;
      for (size_t e = 1; e < counts_.size(); ++e) {
        const double* k = key_sums_[r].data() + e * K_;
        double sq = 0;
        for (size_t i = 0; i < K_; ++i) sq += k[i] * k[i];
        score += sq / std::max<uint64_t>(counts_[e], 1);
      }
      // Prefer "not rotated", then the smaller base, unless another is clearly better.
      if (score > best_score * (1 + 1e-9)) best_score = score, best = r;
    }
    return best;
  }

  void Decide() {
    rope_code_ = BestRope();
    for (int r = 0; r < kNumRopeCodes; ++r) {
      if (r != rope_code_) std::vector<double>().swap(key_sums_[r]);
    }
  }

  const BlockGeometry g_;
  const LearnerOptions o_;
  size_t V_ = 0, K_ = 0;
  std::vector<double> thetas_[kNumRopeCodes];
  size_t max_entries_ = 0;
  int rope_code_ = -1;  // -1 until decided
  uint64_t observed_ = 0, tokens_dropped_ = 0;
  std::unordered_map<int32_t, size_t> index_;    // token id -> entry (entry 0 = every token)
  std::vector<int32_t> entry_ids_;               // entry e + 1's token id
  std::vector<uint64_t> counts_;                 // per entry
  std::vector<double> sums_;                     // per entry x K_: the value halves
  std::vector<double> key_sums_[kNumRopeCodes];  // per entry x K_, pre-RoPE per hypothesis
};

}  // namespace

absl::StatusOr<std::shared_ptr<const PredictorState>> PredictorState::Parse(
    absl::string_view bytes) {
  if (bytes.size() < kHeader + 4) {
    return absl::DataLossError(
        absl::StrCat("predictor state: truncated (", bytes.size(), " bytes)"));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) {
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
  if (static_cast<uint8_t>(p[4]) != kFormat) {
    return absl::DataLossError(
        absl::StrCat("predictor state: unsupported format ", static_cast<uint8_t>(p[4])));
  }
  const uint8_t dtype = static_cast<uint8_t>(p[5]);
  if (!IsValidDType(dtype)) {
    return absl::DataLossError(absl::StrCat("predictor state: unknown dtype ", dtype));
  }
  const uint8_t rope = static_cast<uint8_t>(p[6]);
  if (rope >= kNumRopeCodes) {
    return absl::DataLossError(absl::StrCat("predictor state: unknown rope code ", rope));
  }
  if (p[7] != 0 || GetLE<uint16_t>(p + 18) != 0) {
    return absl::DataLossError("predictor state: reserved bytes not 0");
  }
  const uint32_t version = GetLE<uint32_t>(p + 8);
  if (version == 0) return absl::DataLossError("predictor state: version 0");
  BlockGeometry g;
  g.dtype = static_cast<DType>(dtype);
  g.num_layers = GetLE<uint16_t>(p + 12);
  g.num_kv_heads = GetLE<uint16_t>(p + 14);
  g.head_dim = GetLE<uint16_t>(p + 16);
  g.block_tokens = 1;
  if (!g.Validate().ok()) {
    return absl::DataLossError("predictor state: invalid geometry " + g.DebugString());
  }
  g.block_tokens = 0;
  const uint64_t tokens_learned = GetLE<uint64_t>(p + 20);
  const uint64_t entries = GetLE<uint32_t>(p + 28);
  const uint64_t V = VectorSize(g);
  const uint64_t body = bytes.size() - kHeader - 4;
  // body == entries * 8 + (entries + 1) * 2V, checked without overflow.
  const uint64_t per_entry = 8 + 2 * V;
  if (body < 2 * V || (body - 2 * V) % per_entry != 0 || (body - 2 * V) / per_entry != entries) {
    return absl::DataLossError(absl::StrCat("predictor state: ", entries, " entries of ", V,
                                            " values do not match the ", body, " bytes present"));
  }
  std::vector<int32_t> ids(entries);
  std::vector<uint32_t> counts(entries);
  const char* q = p + kHeader;
  for (uint64_t i = 0; i < entries; ++i, q += 8) {
    const uint32_t id = GetLE<uint32_t>(q);
    if (id > static_cast<uint32_t>(INT32_MAX) ||
        (i > 0 && static_cast<int32_t>(id) <= ids[i - 1])) {
      return absl::DataLossError(
          absl::StrCat("predictor state: token id ", id, " at entry ", i, " out of order"));
    }
    ids[i] = static_cast<int32_t>(id);
    counts[i] = GetLE<uint32_t>(q + 4);
  }
  std::vector<uint16_t> means((entries + 1) * V);
  for (size_t i = 0; i < means.size(); ++i, q += 2) {
    means[i] = GetLE<uint16_t>(q);
    if ((means[i] & 0x7c00) == 0x7c00) {
      return absl::DataLossError(absl::StrCat("predictor state: mean ", i, " is not finite"));
    }
  }
  return std::shared_ptr<const PredictorState>(std::make_shared<TokenMeanState>(
      g, version, rope, tokens_learned, std::move(ids), std::move(counts), std::move(means)));
}

absl::StatusOr<std::unique_ptr<PredictorLearner>> PredictorLearner::Create(
    const BlockGeometry& geometry, const LearnerOptions& options) {
  if (auto s = geometry.Validate(); !s.ok()) return s;
  return std::unique_ptr<PredictorLearner>(new TokenMeanLearner(geometry, options));
}

}  // namespace kvtrie
