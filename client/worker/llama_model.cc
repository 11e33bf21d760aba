#include "client/worker/llama_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/worker/gguf.h"

namespace kvtrie::worker {
namespace {

// run.c rmsnorm: o = weight * x / sqrt(mean(x^2) + eps).
void RmsNorm(float* o, const float* x, const float* weight, size_t n, float eps) {
  float ss = 0.0f;
  for (size_t j = 0; j < n; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(n);
  ss += eps;
  ss = 1.0f / std::sqrt(ss);
  for (size_t j = 0; j < n; ++j) o[j] = weight[j] * (ss * x[j]);
}

// run.c matmul: xout[d] = W[d][n] @ x[n].
void MatMul(float* xout, const float* x, const float* w, size_t n, size_t d) {
  for (size_t i = 0; i < d; ++i) {
    const float* row = w + i * n;
    float val = 0.0f;
    for (size_t j = 0; j < n; ++j) val += row[j] * x[j];
    xout[i] = val;
  }
}

// run.c softmax, in place.
void Softmax(float* x, size_t n) {
  float max_val = x[0];
  for (size_t i = 1; i < n; ++i) max_val = std::max(max_val, x[i]);
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_val);
    sum += x[i];
  }
  for (size_t i = 0; i < n; ++i) x[i] /= sum;
}

// Loads tensor `name` and checks it holds `rows` x `cols` (ne = {cols, rows}; cols alone if
// rows == 0).
absl::StatusOr<std::vector<float>> LoadTensor(const GgufFile& gguf, const std::string& name,
                                              uint64_t cols, uint64_t rows) {
  const GgufTensorInfo* t = gguf.FindTensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("GGUF tensor ", name, ": absent"));
  std::vector<uint64_t> want =
      rows == 0 ? std::vector<uint64_t>{cols} : std::vector<uint64_t>{cols, rows};
  if (t->ne != want) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF tensor ", name, ": shape [",
                                                   absl::StrJoin(t->ne, ","), "], expected [",
                                                   absl::StrJoin(want, ","), "]"));
  }
  return gguf.TensorAsFloat(name);
}

// Rounds K and V to `dtype` (round to nearest even) in place.
void RoundTo(DType dtype, std::vector<float>& k, std::vector<float>& v) {
  uint16_t buf[1];
  for (std::vector<float>* x : {&k, &v}) {
    for (float& f : *x) {
      FromFloat(dtype, &f, 1, buf);
      ToFloat(dtype, buf, 1, &f);
    }
  }
}

}  // namespace

double SurprisalBits(absl::Span<const float> logits, uint32_t token) {
  double max_val = -std::numeric_limits<double>::infinity();
  for (float l : logits) max_val = std::max(max_val, static_cast<double>(l));
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_val);
  const double log_p = static_cast<double>(logits[token]) - max_val - std::log(sum);
  return -log_p / std::log(2.0);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  absl::StatusOr<GgufFile> gguf = GgufFile::Open(path);
  if (!gguf.ok()) return gguf.status();
  absl::StatusOr<std::string> arch = gguf->GetString("general.architecture");
  if (!arch.ok()) return arch.status();
  if (*arch != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": general.architecture is \"", *arch, "\", only \"llama\" runs"));
  }
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->model_id_ = std::filesystem::path(path).stem().string();
  LlamaConfig& c = m->config_;
  struct UintKey {
    const char* key;
    uint32_t* out;
  };
  for (const UintKey& k : {UintKey{"llama.embedding_length", &c.dim},
                           UintKey{"llama.feed_forward_length", &c.hidden_dim},
                           UintKey{"llama.block_count", &c.num_layers},
                           UintKey{"llama.attention.head_count", &c.num_heads},
                           UintKey{"llama.context_length", &c.context_length}}) {
    absl::StatusOr<uint64_t> v = gguf->GetUint(k.key);
    if (!v.ok()) return v.status();
    *k.out = static_cast<uint32_t>(*v);
  }
  absl::StatusOr<uint64_t> kv_heads = gguf->GetUint("llama.attention.head_count_kv");
  c.num_kv_heads = kv_heads.ok() ? static_cast<uint32_t>(*kv_heads) : c.num_heads;
  if (absl::StatusOr<double> eps = gguf->GetFloat("llama.attention.layer_norm_rms_epsilon");
      eps.ok()) {
    c.rms_norm_eps = static_cast<float>(*eps);
  }
  if (absl::StatusOr<double> theta = gguf->GetFloat("llama.rope.freq_base"); theta.ok()) {
    c.rope_theta = static_cast<float>(*theta);
  }
  if (c.num_heads == 0 || c.num_kv_heads == 0 || c.dim % c.num_heads != 0 ||
      c.num_heads % c.num_kv_heads != 0 || c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": llama.attention.head_count ", c.num_heads, ", head_count_kv ", c.num_kv_heads,
        " and embedding_length ", c.dim, " do not make an even head_dim with whole GQA groups"));
  }

  absl::StatusOr<Tokenizer> tok = Tokenizer::FromGguf(*gguf);
  if (!tok.ok()) return tok.status();
  m->tokenizer_ = std::make_unique<Tokenizer>(std::move(*tok));
  c.vocab_size = static_cast<uint32_t>(m->tokenizer_->vocab_size());

  const uint32_t d = c.dim, kvd = c.kv_dim(), h = c.hidden_dim;
  auto load = [&](const std::string& name, uint64_t cols, uint64_t rows,
                  std::vector<float>* out) -> absl::Status {
    absl::StatusOr<std::vector<float>> t = LoadTensor(*gguf, name, cols, rows);
    if (!t.ok()) return t.status();
    *out = std::move(*t);
    return absl::OkStatus();
  };
  if (auto s = load("token_embd.weight", d, c.vocab_size, &m->token_embd_); !s.ok()) return s;
  if (auto s = load("output_norm.weight", d, 0, &m->output_norm_); !s.ok()) return s;
  if (gguf->FindTensor("output.weight") != nullptr) {
    if (auto s = load("output.weight", d, c.vocab_size, &m->output_); !s.ok()) return s;
  } else {
    m->output_ = m->token_embd_;
  }
  m->layers_.resize(c.num_layers);
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    struct Spec {
      const char* name;
      uint64_t cols, rows;
      std::vector<float>* out;
    };
    for (const Spec& s :
         {Spec{"attn_norm.weight", d, 0, &L.attn_norm}, Spec{"attn_q.weight", d, d, &L.wq},
          Spec{"attn_k.weight", d, kvd, &L.wk}, Spec{"attn_v.weight", d, kvd, &L.wv},
          Spec{"attn_output.weight", d, d, &L.wo}, Spec{"ffn_norm.weight", d, 0, &L.ffn_norm},
          Spec{"ffn_gate.weight", d, h, &L.w1}, Spec{"ffn_down.weight", h, d, &L.w2},
          Spec{"ffn_up.weight", d, h, &L.w3}}) {
      if (auto st = load(p + s.name, s.cols, s.rows, s.out); !st.ok()) return st;
    }
  }
  return m;
}

Sequence::Sequence(const LlamaModel* model, size_t capacity, DType kv_dtype)
    : model_(model),
      cfg_(model->config()),
      capacity_(capacity == 0 ? model->config().context_length : capacity),
      kv_dtype_(kv_dtype) {
  const size_t cache = static_cast<size_t>(cfg_.num_layers) * cfg_.kv_dim() * capacity_;
  k_.assign(cache, 0.0f);
  v_.assign(cache, 0.0f);
  x_.resize(cfg_.dim);
  xb_.resize(cfg_.dim);
  xb2_.resize(cfg_.dim);
  hb_.resize(cfg_.hidden_dim);
  hb2_.resize(cfg_.hidden_dim);
  q_.resize(cfg_.dim);
  kcur_.resize(cfg_.kv_dim());
  vcur_.resize(cfg_.kv_dim());
  att_.resize(capacity_);
}

absl::Status Sequence::LoadPrefix(const KvDump& prefix) {
  if (!tokens_.empty()) {
    return absl::FailedPreconditionError("LoadPrefix: the sequence already holds tokens");
  }
  const uint32_t hd = cfg_.head_dim();
  if (prefix.num_layers != cfg_.num_layers || prefix.num_kv_heads != cfg_.num_kv_heads ||
      prefix.head_dim != hd) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix: num_layers/num_kv_heads/head_dim ", prefix.num_layers, "/", prefix.num_kv_heads,
        "/", prefix.head_dim, ", model has ", cfg_.num_layers, "/", cfg_.num_kv_heads, "/", hd));
  }
  if (IsByteDType(prefix.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix: dtype ", DTypeName(prefix.dtype),
        ": the reference worker computes with fp16, bf16 or fp32 KV, not FP8 / uint8 caches"));
  }
  const size_t n = prefix.num_tokens();
  if (n > capacity_) {
    return absl::OutOfRangeError(
        absl::StrCat("prefix: ", n, " tokens exceed capacity ", capacity_));
  }
  const size_t elems = static_cast<size_t>(cfg_.num_layers) * cfg_.kv_dim() * n;
  const size_t bytes = elems * DTypeBytes(prefix.dtype);
  if (prefix.k.size() != bytes || prefix.v.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("prefix: k/v hold ", prefix.k.size(), "/",
                                                   prefix.v.size(), " bytes, expected ", bytes));
  }
  for (uint32_t t : prefix.token_ids) {
    if (t >= cfg_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prefix: token_ids: id ", t, " >= vocab"));
    }
  }
  const size_t row = static_cast<size_t>(n) * hd;  // one (layer, head) plane
  const size_t eb = DTypeBytes(prefix.dtype);
  for (size_t lh = 0; lh < static_cast<size_t>(cfg_.num_layers) * cfg_.num_kv_heads; ++lh) {
    ToFloat(prefix.dtype, prefix.k.data() + lh * row * eb, row, &k_[lh * capacity_ * hd]);
    ToFloat(prefix.dtype, prefix.v.data() + lh * row * eb, row, &v_[lh * capacity_ * hd]);
  }
  tokens_ = prefix.token_ids;
  if (prefix.surprisal_bits.size() == n) {
    surprisal_bits_ = prefix.surprisal_bits;
  } else {
    surprisal_bits_.assign(n, std::numeric_limits<float>::quiet_NaN());
    if (n > 0) surprisal_bits_[0] = 0.0f;
  }
  logits_.clear();
  return absl::OkStatus();
}

absl::Status Sequence::Extend(absl::Span<const uint32_t> tokens) {
  if (tokens_.size() + tokens.size() > capacity_) {
    return absl::OutOfRangeError(absl::StrCat("Extend: ", tokens_.size(), " + ", tokens.size(),
                                              " tokens exceed capacity ", capacity_));
  }
  for (uint32_t t : tokens) {
    if (t >= cfg_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Extend: token id ", t, " >= vocab_size ", cfg_.vocab_size));
    }
  }
  for (uint32_t t : tokens) {
    float s = tokens_.empty() ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    if (!logits_.empty()) s = static_cast<float>(SurprisalBits(logits_, t));
    const size_t pos = tokens_.size();
    Forward(t, pos, /*write_cache=*/true);
    tokens_.push_back(t);
    surprisal_bits_.push_back(s);
  }
  return absl::OkStatus();
}

absl::Status Sequence::RecomputeLastLogits() {
  if (tokens_.empty()) return absl::FailedPreconditionError("RecomputeLastLogits: no tokens");
  Forward(tokens_.back(), tokens_.size() - 1, /*write_cache=*/false);
  return absl::OkStatus();
}

absl::Status Sequence::Truncate(size_t num_tokens) {
  if (num_tokens > tokens_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("Truncate: ", num_tokens, " > num_tokens ", tokens_.size()));
  }
  tokens_.resize(num_tokens);
  surprisal_bits_.resize(num_tokens);
  logits_.clear();
  return absl::OkStatus();
}

uint32_t Sequence::Greedy() const {
  return static_cast<uint32_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
}

KvDump Sequence::ToKvDump(DType dtype, size_t end) const {
  end = std::min(end, tokens_.size());
  const uint32_t hd = cfg_.head_dim();
  KvDump d;
  d.model_id = model_->model_id();
  d.num_layers = cfg_.num_layers;
  d.num_kv_heads = cfg_.num_kv_heads;
  d.head_dim = hd;
  d.dtype = dtype;
  d.token_ids.assign(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(end));
  d.surprisal_bits.assign(surprisal_bits_.begin(),
                          surprisal_bits_.begin() + static_cast<std::ptrdiff_t>(end));
  const size_t eb = DTypeBytes(dtype);
  const size_t planes = static_cast<size_t>(cfg_.num_layers) * cfg_.num_kv_heads;
  const size_t row = end * hd;
  d.k.resize(planes * row * eb);
  d.v.resize(planes * row * eb);
  for (size_t lh = 0; lh < planes; ++lh) {
    FromFloat(dtype, &k_[lh * capacity_ * hd], row, d.k.data() + lh * row * eb);
    FromFloat(dtype, &v_[lh * capacity_ * hd], row, d.v.data() + lh * row * eb);
  }
  return d;
}

void Sequence::Forward(uint32_t token, size_t pos, bool write_cache) {
  const LlamaConfig& c = cfg_;
  const size_t dim = c.dim, hd = c.head_dim(), kvd = c.kv_dim(), hidden = c.hidden_dim;
  const size_t kv_mul = c.num_heads / c.num_kv_heads;
  float* x = x_.data();
  std::copy_n(&model_->token_embd_[static_cast<size_t>(token) * dim], dim, x);

  for (size_t l = 0; l < c.num_layers; ++l) {
    const LlamaModel::Layer& L = model_->layers_[l];
    RmsNorm(xb_.data(), x, L.attn_norm.data(), dim, c.rms_norm_eps);
    MatMul(q_.data(), xb_.data(), L.wq.data(), dim, dim);
    MatMul(kcur_.data(), xb_.data(), L.wk.data(), dim, kvd);
    MatMul(vcur_.data(), xb_.data(), L.wv.data(), dim, kvd);
    // RoPE on adjacent pairs (run.c): rotate (v[i], v[i+1]) by pos * theta^(-(i % hd) / hd).
    for (size_t i = 0; i < dim; i += 2) {
      const size_t head_dim = i % hd;
      const float freq =
          1.0f / std::pow(c.rope_theta, static_cast<float>(head_dim) / static_cast<float>(hd));
      const float val = static_cast<float>(pos) * freq;
      const float fcr = std::cos(val), fci = std::sin(val);
      const int rotn = i < kvd ? 2 : 1;
      for (int r = 0; r < rotn; ++r) {
        float* vec = r == 0 ? q_.data() : kcur_.data();
        const float v0 = vec[i], v1 = vec[i + 1];
        vec[i] = v0 * fcr - v1 * fci;
        vec[i + 1] = v0 * fci + v1 * fcr;
      }
    }
    if (kv_dtype_ != DType::kFp32) RoundTo(kv_dtype_, kcur_, vcur_);
    if (write_cache) {
      for (size_t h = 0; h < c.num_kv_heads; ++h) {
        std::copy_n(&kcur_[h * hd], hd, &k_[Index(l, h, pos)]);
        std::copy_n(&vcur_[h * hd], hd, &v_[Index(l, h, pos)]);
      }
    }
    // Multi-head attention over positions [0, pos]; position pos uses the fresh K/V.
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (size_t h = 0; h < c.num_heads; ++h) {
      const float* q = &q_[h * hd];
      const size_t kvh = h / kv_mul;
      float* att = att_.data();
      for (size_t t = 0; t <= pos; ++t) {
        const float* kt = t == pos ? &kcur_[kvh * hd] : &k_[Index(l, kvh, t)];
        float score = 0.0f;
        for (size_t i = 0; i < hd; ++i) score += q[i] * kt[i];
        att[t] = score * scale;
      }
      Softmax(att, pos + 1);
      float* xb = &xb_[h * hd];
      std::fill_n(xb, hd, 0.0f);
      for (size_t t = 0; t <= pos; ++t) {
        const float* vt = t == pos ? &vcur_[kvh * hd] : &v_[Index(l, kvh, t)];
        const float a = att[t];
        for (size_t i = 0; i < hd; ++i) xb[i] += a * vt[i];
      }
    }
    MatMul(xb2_.data(), xb_.data(), L.wo.data(), dim, dim);
    for (size_t i = 0; i < dim; ++i) x[i] += xb2_[i];
    // SwiGLU FFN: w2(silu(w1(x)) * w3(x)).
    RmsNorm(xb_.data(), x, L.ffn_norm.data(), dim, c.rms_norm_eps);
    MatMul(hb_.data(), xb_.data(), L.w1.data(), dim, hidden);
    MatMul(hb2_.data(), xb_.data(), L.w3.data(), dim, hidden);
    for (size_t i = 0; i < hidden; ++i) {
      float val = hb_[i];
      val *= 1.0f / (1.0f + std::exp(-val));
      hb_[i] = val * hb2_[i];
    }
    MatMul(xb_.data(), hb_.data(), L.w2.data(), hidden, dim);
    for (size_t i = 0; i < dim; ++i) x[i] += xb_[i];
  }
  RmsNorm(x, x, model_->output_norm_.data(), dim, c.rms_norm_eps);
  logits_.resize(c.vocab_size);
  MatMul(logits_.data(), x, model_->output_.data(), dim, c.vocab_size);
  ++tokens_computed_;
}

}  // namespace kvtrie::worker
