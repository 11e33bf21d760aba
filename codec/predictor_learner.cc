// PredictorLearner (predictor_state.h): per-token and per-(previous token, token) sums of the
// KV vectors it observes, keys de-rotated (pre-RoPE); Fit turns them into an immutable state.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/predictor_state.h"
#include "codec/predictor_state_internal.h"

namespace kvtrie {
namespace {

using internal::kNumRopeCodes;
using internal::kRopeBaseOf;

// Tokens observed before the learner picks the RoPE hypothesis: until then it accumulates token
// keys under every hypothesis, and no pairs.
constexpr uint64_t kDetectTokens = 512;
constexpr size_t kMapNodeBytes = 48;  // an unordered_map node and its bucket, about

class Learner final : public PredictorLearner {
 public:
  Learner(const BlockGeometry& g, const LearnerOptions& o) : g_(g), o_(o) {
    V_ = internal::VectorSize(g);
    K_ = V_ / 2;
    planes_ = 2 * g.num_layers;
    for (int r = 0; r < kNumRopeCodes; ++r) {
      thetas_[r].assign(g.head_dim / 2, 0.0);
      if (r == 0) continue;
      for (size_t i = 0; i < g.head_dim / 2; ++i) {
        thetas_[r][i] = std::pow(kRopeBaseOf[r], -2.0 * i / static_cast<double>(g.head_dim));
      }
    }
    // Half of the cap for token entries, half for pairs: accumulators while learning (keys under
    // every RoPE hypothesis until decided) plus the entry of a fitted state.
    const size_t token_entry = 8 * K_ * (1 + kNumRopeCodes) + 12 + kMapNodeBytes + (8 + 2 * V_);
    const size_t pair_entry = 4 * V_ + 8 * planes_ + 12 + kMapNodeBytes + (12 + 2 * V_);
    // The linear fit's reservoir of blocks comes off the top (at most a quarter of the cap).
    if (o_.fit_linear || o_.fit_klt) {
      const size_t sample_bytes = std::min(o_.linear_sample_bytes, o_.max_bytes / 4);
      max_samples_ = sample_bytes / (g.num_bytes() + 4 * g.block_tokens + sizeof(LinearSample));
    }
    const size_t half = (o_.max_bytes - max_samples_ * (g.num_bytes() + 4 * g.block_tokens +
                                                        sizeof(LinearSample))) /
                        2;
    const size_t fixed = sizeof(*this) + 2 * token_entry;  // the all-token entry, slack
    max_entries_ = half > fixed ? (half - fixed) / token_entry : 0;
    max_pairs_ = half / pair_entry;
    AddEntry();  // the all-token entry
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
    std::vector<double> vec(V_), keys[kNumRopeCodes];
    for (auto& k : keys) k.resize(K_);
    for (size_t t = 0; t < T; ++t) {
      // Token t's vector; skipped if any value is not finite.
      bool finite = true;
      for (size_t l = 0; l < g_.num_layers; ++l) {
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
      ++observed_;
      if (!finite) continue;
      const double pos = static_cast<double>(first_position) + static_cast<double>(t);
      for (int r = 0; r < kNumRopeCodes; ++r) {
        if (rope_code_ >= 0 && r != rope_code_) continue;
        for (size_t l = 0; l < g_.num_layers; ++l) {
          for (size_t h = 0; h < H; ++h) {
            const double* k = vec.data() + ((l * 2) * H + h) * D;
            double* o = keys[r].data() + (l * H + h) * D;
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
      Accumulate(0, vec, keys);
      const int32_t id = tokens[t];
      auto it = index_.find(id);
      if (it == index_.end() && counts_.size() < 1 + max_entries_) {
        it = index_.emplace(id, AddEntry()).first;
        entry_ids_.push_back(id);
      }
      if (it != index_.end()) Accumulate(it->second, vec, keys);
      const int32_t prev = t ? tokens[t - 1] : previous_token;
      if (rope_code_ >= 0 && prev >= 0) AccumulatePair(internal::PairKey(prev, id), vec, keys);
    }
    if (rope_code_ < 0 && observed_ >= kDetectTokens) Decide();
    Sample(kv, tokens, first_position, previous_token);
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<const PredictorState>> Fit(uint32_t version) const override;

  uint64_t tokens_observed() const override { return observed_; }
  size_t memory_bytes() const override {
    size_t key_bytes = 0;
    for (const auto& k : key_sums_) key_bytes += k.capacity() * 8;
    return sizeof(*this) + sums_.capacity() * 8 + key_bytes + counts_.capacity() * 8 +
           entry_ids_.capacity() * 4 + index_.size() * kMapNodeBytes + pair_keys_.capacity() * 8 +
           pair_n_.capacity() * 4 + pair_sums_.capacity() * 4 + pair_sq_.capacity() * 8 +
           pair_index_.size() * kMapNodeBytes +
           samples_.capacity() * (sizeof(LinearSample) + g_.num_bytes() + 4 * g_.block_tokens);
  }

 private:
  using LinearSample = internal::LinearSample;

  // Reservoir sampling (Algorithm R, a fixed-seed splitmix64): samples_ is a uniform sample of
  // every block observed, of at most max_samples_ blocks.
  void Sample(absl::Span<const uint8_t> kv, absl::Span<const int32_t> tokens,
              uint32_t first_position, int32_t previous_token) {
    ++blocks_seen_;
    if (max_samples_ == 0) return;
    size_t slot = samples_.size();
    if (slot >= max_samples_) {
      rng_ += 0x9e3779b97f4a7c15ull;
      uint64_t z = rng_;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      slot = static_cast<size_t>(z % blocks_seen_);
      if (slot >= max_samples_) return;
    } else {
      if (samples_.capacity() == 0) samples_.reserve(max_samples_);
      samples_.emplace_back();
    }
    LinearSample& s = samples_[slot];
    s.kv.assign(kv.begin(), kv.end());
    s.tokens.assign(tokens.begin(), tokens.end());
    s.first_position = first_position;
    s.previous_token = previous_token;
  }

  // Grows `v` to `n` elements, its capacity never past `limit`.
  template <typename T>
  static void GrowTo(std::vector<T>* v, size_t n, size_t limit) {
    if (n > v->capacity()) v->reserve(std::max(n, std::min(2 * v->capacity(), limit)));
    v->resize(n, T{});
  }

  size_t AddEntry() {
    const size_t e = counts_.size(), cap = 1 + max_entries_;
    GrowTo(&counts_, e + 1, cap);
    GrowTo(&sums_, sums_.size() + K_, cap * K_);  // the value halves
    for (int r = 0; r < kNumRopeCodes; ++r) {
      if (rope_code_ >= 0 && r != rope_code_) continue;
      GrowTo(&key_sums_[r], key_sums_[r].size() + K_, cap * K_);
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

  // Pair sums are [layers][2][H * D] (keys pre-RoPE), plus per-plane sums of squares.
  void AccumulatePair(uint64_t key, const std::vector<double>& vec,
                      const std::vector<double>* keys) {
    auto it = pair_index_.find(key);
    if (it == pair_index_.end()) {
      if (pair_n_.size() >= max_pairs_) return;
      const size_t p = pair_n_.size();
      GrowTo(&pair_keys_, p + 1, max_pairs_);
      GrowTo(&pair_n_, p + 1, max_pairs_);
      GrowTo(&pair_sums_, (p + 1) * V_, max_pairs_ * V_);
      GrowTo(&pair_sq_, (p + 1) * planes_, max_pairs_ * planes_);
      pair_keys_[p] = key;
      it = pair_index_.emplace(key, p).first;
    }
    const size_t p = it->second;
    ++pair_n_[p];
    const size_t HD = static_cast<size_t>(g_.num_kv_heads) * g_.head_dim;
    float* s = pair_sums_.data() + p * V_;
    double* sq = pair_sq_.data() + p * planes_;
    const std::vector<double>& k = keys[rope_code_];
    for (size_t l = 0; l < g_.num_layers; ++l) {
      for (size_t i = 0; i < HD; ++i) {
        const double kv = k[l * HD + i], vv = vec[(l * 2 + 1) * HD + i];
        s[(l * 2) * HD + i] += static_cast<float>(kv);
        s[(l * 2 + 1) * HD + i] += static_cast<float>(vv);
        sq[2 * l] += kv * kv;
        sq[2 * l + 1] += vv * vv;
      }
    }
  }

  // Mean of entry e, [layers][2][H * D] (keys pre-RoPE under `rope`).
  void EntryMean(size_t e, int rope, std::vector<double>* out) const {
    const size_t HD = static_cast<size_t>(g_.num_kv_heads) * g_.head_dim;
    const double n = std::max<uint64_t>(counts_[e], 1);
    const double* s = sums_.data() + e * K_;
    const double* k = key_sums_[rope].data() + e * K_;
    out->resize(V_);
    for (size_t l = 0; l < g_.num_layers; ++l) {
      for (size_t i = 0; i < HD; ++i) {
        (*out)[(l * 2) * HD + i] = k[l * HD + i] / n;
        (*out)[(l * 2 + 1) * HD + i] = s[l * HD + i] / n;
      }
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
  size_t V_ = 0, K_ = 0, planes_ = 0;
  size_t max_entries_ = 0, max_pairs_ = 0;
  std::vector<double> thetas_[kNumRopeCodes];
  int rope_code_ = -1;  // -1 until decided
  uint64_t observed_ = 0;
  std::unordered_map<int32_t, size_t> index_;        // token id -> entry (entry 0 = every token)
  std::vector<int32_t> entry_ids_;                   // entry e + 1's token id
  std::vector<uint64_t> counts_;                     // per entry
  std::vector<double> sums_;                         // per entry x K_: the value halves
  std::vector<double> key_sums_[kNumRopeCodes];      // per entry x K_, pre-RoPE per hypothesis
  std::unordered_map<uint64_t, size_t> pair_index_;  // PairKey -> pair
  std::vector<uint64_t> pair_keys_;
  std::vector<uint32_t> pair_n_;
  std::vector<float> pair_sums_;  // per pair x V_
  std::vector<double> pair_sq_;   // per pair x planes: sum of squares
  size_t max_samples_ = 0;
  uint64_t blocks_seen_ = 0, rng_ = 0x6b767472696531ull;
  std::vector<LinearSample> samples_;  // for the linear fit
};

absl::StatusOr<std::shared_ptr<const PredictorState>> Learner::Fit(uint32_t version) const {
  if (version == 0) return absl::InvalidArgumentError("version: must be > 0");
  if (counts_.empty() || counts_[0] == 0) {
    return absl::FailedPreconditionError("learner: nothing observed");
  }
  const int rope = rope_code_ >= 0 ? rope_code_ : BestRope();
  const size_t HD = static_cast<size_t>(g_.num_kv_heads) * g_.head_dim;
  // Token entries by count (most frequent first), as many as the cap allows.
  std::vector<size_t> order(entry_ids_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return counts_[a + 1] > counts_[b + 1]; });
  const size_t used = memory_bytes();
  size_t room = o_.max_bytes > used ? o_.max_bytes - used : 0;
  const size_t state_entry = 8 + 2 * V_, state_pair = 12 + 2 * V_;
  // The linear weights (fp16 plus a float copy) and KLT bases come off the room first, if they
  // fit in half of it; else they are not fitted (e.g. Llama-3-8B under the default 64 MiB).
  size_t extra = 0;
  const size_t H = g_.num_kv_heads, D = g_.head_dim;
  for (size_t p = 1; p < planes_ && o_.fit_linear; ++p) extra += 6 * internal::LinearSize(g_, p);
  if (o_.fit_klt) extra += 4 * planes_ * H * D * D;
  const bool fit_extra = extra <= room / 2;
  if (fit_extra) room -= extra;
  const size_t keep = std::min(order.size(), room >= state_entry ? room / state_entry - 1 : 0);
  order.resize(keep);
  room -= std::min(room, (keep + 1) * state_entry);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return entry_ids_[a] < entry_ids_[b]; });
  internal::StateData d;
  d.geometry = g_;
  d.geometry.block_tokens = 0;
  d.version = version;
  d.rope_code = rope;
  d.tokens_learned = observed_;
  auto to_half = [](double v) {
    float m = static_cast<float>(v);
    if (!std::isfinite(m)) m = 0;
    return FloatToHalf(std::clamp(m, -65504.0f, 65504.0f));
  };
  std::vector<double> mean;
  std::unordered_map<int32_t, std::vector<double>> token_mean;  // kept tokens, for the pairs
  EntryMean(0, rope, &mean);
  for (double v : mean) d.means.push_back(to_half(v));
  for (size_t i : order) {
    d.ids.push_back(entry_ids_[i]);
    d.counts.push_back(static_cast<uint32_t>(std::min<uint64_t>(counts_[i + 1], UINT32_MAX)));
    EntryMean(i + 1, rope, &mean);
    for (double v : mean) d.means.push_back(to_half(v));
    token_mean[entry_ids_[i]] = mean;
  }
  // Pairs: shrink each pair's mean toward its token's mean by n / (n + k_plane), with k = the
  // within-pair variance over the between-pair variance (empirical Bayes, per (layer, K/V)).
  const size_t np = pair_n_.size();
  std::vector<double> within(planes_, 0), dof(planes_, 0), between(planes_, 0), nb(planes_, 0);
  std::vector<double> k(planes_, INFINITY);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t p = 0; p < np; ++p) {
      const uint32_t n = pair_n_[p];
      if (n < 2) continue;
      auto tm = token_mean.find(static_cast<int32_t>(static_cast<uint32_t>(pair_keys_[p])));
      if (tm == token_mean.end()) continue;
      const float* s = pair_sums_.data() + p * V_;
      for (size_t pl = 0; pl < planes_; ++pl) {
        double sq = 0, dev = 0;
        for (size_t i = 0; i < HD; ++i) {
          const double m = s[pl * HD + i] / n;
          sq += m * m;
          const double e = m - tm->second[pl * HD + i];
          dev += e * e;
        }
        if (pass == 0) {
          within[pl] += std::max(0.0, pair_sq_[p * planes_ + pl] - n * sq);
          dof[pl] += static_cast<double>(n - 1) * HD;
        } else {
          const double w = dof[pl] > 0 ? within[pl] / dof[pl] : 0;
          between[pl] += dev / HD - w / n;
          nb[pl] += 1;
        }
      }
    }
  }
  for (size_t pl = 0; pl < planes_; ++pl) {
    if (nb[pl] == 0 || dof[pl] == 0) continue;
    const double w = within[pl] / dof[pl], b = between[pl] / nb[pl];
    k[pl] = b > 0 ? std::clamp(w / b, 1e-3, 1e4) : INFINITY;
  }
  std::vector<size_t> porder;
  for (size_t p = 0; p < np; ++p) {
    if (token_mean.count(static_cast<int32_t>(static_cast<uint32_t>(pair_keys_[p])))) {
      porder.push_back(p);
    }
  }
  std::stable_sort(porder.begin(), porder.end(),
                   [&](size_t a, size_t b) { return pair_n_[a] > pair_n_[b]; });
  if (std::all_of(k.begin(), k.end(), [](double v) { return std::isinf(v); })) porder.clear();
  porder.resize(std::min(porder.size(), room / state_pair));
  std::sort(porder.begin(), porder.end(),
            [&](size_t a, size_t b) { return pair_keys_[a] < pair_keys_[b]; });
  for (size_t p : porder) {
    const uint32_t n = pair_n_[p];
    const std::vector<double>& tm =
        token_mean[static_cast<int32_t>(static_cast<uint32_t>(pair_keys_[p]))];
    const float* s = pair_sums_.data() + p * V_;
    d.pairs.push_back(pair_keys_[p]);
    d.pair_counts.push_back(n);
    for (size_t pl = 0; pl < planes_; ++pl) {
      const double w = std::isinf(k[pl]) ? 0.0 : n / (n + k[pl]);
      for (size_t i = 0; i < HD; ++i) {
        const double t = tm[pl * HD + i];
        d.pair_means.push_back(to_half(t + w * (s[pl * HD + i] / n - t)));
      }
    }
  }
  if (fit_extra && o_.fit_linear) {
    internal::FitLinear(samples_, g_.block_tokens, o_.linear_fit_rel_rms, &d);
  }
  if (fit_extra && o_.fit_klt) {
    internal::FitKlt(samples_, g_.block_tokens, o_.linear_fit_rel_rms, &d);
  }
  return internal::MakeState(std::move(d));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PredictorLearner>> PredictorLearner::Create(
    const BlockGeometry& geometry, const LearnerOptions& options) {
  if (auto s = geometry.Validate(); !s.ok()) return s;
  return std::unique_ptr<PredictorLearner>(new Learner(geometry, options));
}

}  // namespace kvtrie
