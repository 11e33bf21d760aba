// client/worker/llama_model.h
//
// A CPU Llama forward pass matching llama2.c `run.c` (Karpathy): RMSNorm (eps from GGUF
// `llama.attention.layer_norm_rms_epsilon`), grouped-query attention, RoPE with theta from GGUF
// `llama.rope.freq_base` (default 10000) applied to *adjacent pairs* (x[2i], x[2i+1]) of each
// head, SwiGLU feed-forward, final RMSNorm and classifier (`output.weight`, else tied to
// `token_embd.weight`). Weights are F32 or F16 GGUF tensors, held as float32. The GGUF stores Q/K
// rows in the adjacent-pair order llama.cpp's NORM RoPE uses, which is llama2.c's order: they are
// used as stored (checked against the dumps in tests/data).
//
// A Sequence holds one token sequence's KV cache in the dump layout of codec/kv_dump.h:
// K (after RoPE) and V, each [num_layers][num_kv_heads][capacity][head_dim] float32, and the
// per-token surprisal -log2 p(token_i | tokens_<i) in bits (0 for the first token, NaN where the
// logits of the previous token were not computed, e.g. the first token after a loaded prefix
// whose last logits were not recomputed).
// Thread-safety: a LlamaModel is immutable and shareable; a Sequence is not thread-safe.
#ifndef KVTRIE_CLIENT_WORKER_LLAMA_MODEL_H_
#define KVTRIE_CLIENT_WORKER_LLAMA_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/worker/tokenizer.h"
#include "codec/kv_dump.h"

namespace kvtrie::worker {

struct LlamaConfig {
  uint32_t dim = 0;         // d_model
  uint32_t hidden_dim = 0;  // FFN width
  uint32_t num_layers = 0;
  uint32_t num_heads = 0;  // query heads
  uint32_t num_kv_heads = 0;
  uint32_t vocab_size = 0;
  uint32_t context_length = 0;  // llama.context_length (the GGUF's; may exceed the trained one)
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  uint32_t head_dim() const { return dim / num_heads; }
  uint32_t kv_dim() const { return num_kv_heads * head_dim(); }
};

class LlamaModel {
 public:
  // Loads a Llama-architecture GGUF (general.architecture "llama"). `model_id` of the result is
  // the file name without extension. Errors: from GgufFile::Open; NOT_FOUND naming a missing
  // tensor or key; INVALID_ARGUMENT naming a tensor whose shape disagrees with the config;
  // UNIMPLEMENTED for quantized tensors.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& path);

  const LlamaConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& model_id() const { return model_id_; }

 private:
  friend class Sequence;
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo;  // wq [dim][dim], wk/wv [kv_dim][dim]
    std::vector<float> ffn_norm, w1, w2, w3;       // w1/w3 [hidden][dim], w2 [dim][hidden]
  };
  LlamaModel() = default;

  LlamaConfig config_;
  std::string model_id_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<float> token_embd_;  // [vocab][dim]
  std::vector<float> output_norm_;
  std::vector<float> output_;  // [vocab][dim]
  std::vector<Layer> layers_;
};

class Sequence {
 public:
  // REQUIRES: `model` outlives the Sequence. capacity 0 = config().context_length.
  // `kv_dtype` is the precision of the KV cache: each token's K/V are rounded to it when
  // computed (fp16 = what an fp16 inference engine holds, so a lossless round trip of its KV
  // through kvtrie reproduces the computation bit for bit); kFp32 keeps them unrounded.
  explicit Sequence(const LlamaModel* model, size_t capacity = 0, DType kv_dtype = DType::kFp32);

  size_t num_tokens() const { return tokens_.size(); }
  size_t capacity() const { return capacity_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  const std::vector<float>& surprisal_bits() const { return surprisal_bits_; }
  // Token forward passes run so far (Extend and RecomputeLastLogits each count one per token).
  size_t tokens_computed() const { return tokens_computed_; }

  // Takes externally supplied KV for a prefix (e.g. from kvtrie) instead of computing it (its
  // values are used as given, not rounded to kv_dtype).
  // `prefix` is in any dtype of codec/kv_dump.h; its surprisal_bits (if one per token) are kept.
  // REQUIRES: num_tokens() == 0. Errors: INVALID_ARGUMENT naming the field when num_layers,
  // num_kv_heads, head_dim, k/v sizes or token ids do not fit the model; OUT_OF_RANGE past
  // capacity.
  absl::Status LoadPrefix(const KvDump& prefix);

  // Runs `tokens` at positions num_tokens(), num_tokens()+1, ...: appends their K/V and
  // surprisal and leaves the logits after the last one in logits().
  // Errors: INVALID_ARGUMENT for a token id >= vocab_size; OUT_OF_RANGE past capacity.
  absl::Status Extend(absl::Span<const uint32_t> tokens);

  // Recomputes the logits after the last held token (one forward pass over the cache; the cache
  // is not modified: the token's own K/V are recomputed, the earlier ones read from the cache).
  // Needed after LoadPrefix to score or generate the next token. REQUIRES: num_tokens() > 0.
  absl::Status RecomputeLastLogits();

  // Drops the tokens from `num_tokens` on (their K/V and surprisal), so that another token can be
  // run at that position (e.g. each candidate of a next-token distribution in turn). logits()
  // are cleared: call RecomputeLastLogits or Extend before scoring. Errors: OUT_OF_RANGE if
  // num_tokens > this->num_tokens().
  absl::Status Truncate(size_t num_tokens);

  // Logits (vocab_size) for the next token; empty until Extend or RecomputeLastLogits ran.
  const std::vector<float>& logits() const { return logits_; }
  // argmax of logits() (lowest id on ties). REQUIRES: !logits().empty().
  uint32_t Greedy() const;

  // K/V of tokens [0, end) as a KvDump in `dtype` (end > num_tokens() means num_tokens()).
  KvDump ToKvDump(DType dtype = DType::kFp16, size_t end = SIZE_MAX) const;
  // Float view of K or V of (layer, kv_head, token): head_dim values.
  const float* k(size_t layer, size_t head, size_t pos) const {
    return &k_[Index(layer, head, pos)];
  }
  const float* v(size_t layer, size_t head, size_t pos) const {
    return &v_[Index(layer, head, pos)];
  }

 private:
  size_t Index(size_t layer, size_t head, size_t pos) const {
    return ((layer * cfg_.num_kv_heads + head) * capacity_ + pos) * cfg_.head_dim();
  }
  // Runs `token` at `pos`; writes its K/V into the cache iff `write_cache`; fills logits_.
  void Forward(uint32_t token, size_t pos, bool write_cache);

  const LlamaModel* model_;
  const LlamaConfig cfg_;
  const size_t capacity_;
  const DType kv_dtype_;
  std::vector<uint32_t> tokens_;
  std::vector<float> surprisal_bits_;
  size_t tokens_computed_ = 0;
  std::vector<float> k_, v_;  // [layer][kv_head][capacity][head_dim]
  std::vector<float> logits_;
  // Scratch (run.c RunState).
  std::vector<float> x_, xb_, xb2_, hb_, hb2_, q_, kcur_, vcur_, att_;
};

// -log2 softmax(logits)[token] in bits, computed in double.
double SurprisalBits(absl::Span<const float> logits, uint32_t token);

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_LLAMA_MODEL_H_
