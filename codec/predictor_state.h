// codec/predictor_state.h
//
// Learned predictor state of one (namespace, model): what the store learns from the KV blocks it
// holds, so that the residual encoding predicts a block from its token ids and positions instead of
// from zero (issue 11; the paper's layer 2, Magarshak 2026 §2). A KV cache is a deterministic
// function of the tokens: layer 0's K and V depend only on (token, position) — K through RoPE — and
// deeper layers keep much of what the token, its neighbours and the lower layers explain.
//
// CONTRACT (shared by the codec and the store; the interface below is fixed, the contents of a
// state are the codec's business):
//   - A PredictorState is IMMUTABLE once built. It is identified inside its (namespace, model) by
//     `version()` (1, 2, 3, ... ; 0 means "no state"). Every encoded block that was coded against
//     a state names that version in its envelope (BlockHeader::predictor_version); decoding such a
//     block needs exactly that state (PredictionContext::learned with the same version), else
//     FAILED_PRECONDITION naming the version.
//   - A state may hold: per-token mean vectors E[kv_l | token] for every (layer, K/V, head)
//     (dense or sparse, with a memory cap; keys stored BEFORE RoPE and rotated at the token's
//     absolute position when predicting), (previous token, token) pair means where there is data,
//     pre-RoPE per-channel key means, ridge-fitted cross-layer linear predictors, per-plane
//     decorrelating transforms (KLT), and the RoPE base it detected. Its geometry (layers, KV
//     heads, head_dim, dtype) is fixed; block_tokens is not part of it.
//   - Never shared across namespaces: a table learned from one tenant's prompts would leak them.
//
// Serialized form (Serialize/Parse): self-describing bytes with a magic, a format version and a
// CRC-32C over everything; the store persists it through its record layer and the service sends
// it to clients (GetPredictor). Parse of anything malformed is DATA_LOSS, never a crash.
//
// Thread-safety: a PredictorState is immutable and safe to share (std::shared_ptr<const>).
// A PredictorLearner is not thread-safe; its owner serializes calls (the store runs it on a
// background thread, never on a Put's critical path).
#ifndef KVTRIE_CODEC_PREDICTOR_STATE_H_
#define KVTRIE_CODEC_PREDICTOR_STATE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

// PredictorState::fingerprint() of the state whose serialized bytes are `bytes` (XXH3-64 of them,
// 1 where that is 0), without parsing them.
uint64_t PredictorStateFingerprint(absl::string_view bytes);

class PredictorState {
 public:
  virtual ~PredictorState() = default;

  // Errors: DATA_LOSS naming what is wrong (magic, version, CRC, a length) for malformed bytes.
  static absl::StatusOr<std::shared_ptr<const PredictorState>> Parse(absl::string_view bytes);

  virtual std::string Serialize() const = 0;

  virtual uint32_t version() const = 0;
  // XXH3-64 of Serialize()'s bytes (never 0): names the state itself, where version() is only a
  // per-(namespace, model) counter. A block coded against the state carries it (block_codec.h).
  virtual uint64_t fingerprint() const = 0;
  // Geometry the state predicts (block_tokens is 0: any block length).
  virtual const BlockGeometry& geometry() const = 0;
  // In-memory size in bytes (what the store's predictor budget counts).
  virtual size_t memory_bytes() const = 0;
  // Tokens of KV the state was fitted on.
  virtual uint64_t tokens_learned() const = 0;
  // Distinct token ids with a learned mean.
  virtual uint32_t tokens_in_table() const = 0;
  // One line for Stats/Inspect, e.g. "v3: 512 tokens, 2,113 pairs, linear, klt, 412 KB".
  virtual std::string Describe() const = 0;

  // ---- What the codec predicts with (added by the codec half of issue 11) ----
  // RoPE base the state's keys were de-rotated with (10000, 500000), or 0 when keys are stored as
  // given (not rotated).
  virtual double rope_base() const = 0;
  // The token-mean prediction of a block of tokens.size() tokens whose tokens[0] is at absolute
  // position `first_position`: out[layer][K/V][head][t][channel] floats (num_elements() of the
  // state's geometry with block_tokens = tokens.size()). Keys are the pre-RoPE mean rotated at
  // position first_position + t; a token without a learned mean gets the mean over every token.
  // Deterministic: the same floats on every IEEE machine (no libm; the codec's decoders rely on
  // it).
  virtual void PredictTokenMean(absl::Span<const int32_t> tokens, uint32_t first_position,
                                float* out) const = 0;
  // (previous token, token) pairs with a learned prediction.
  virtual uint32_t pairs_in_table() const = 0;
  // The learned prediction the codec codes against (Predictor::kTokenMean): as PredictTokenMean,
  // but token t whose (previous token, token) pair the state has — the previous token of t = 0 is
  // `previous_token`, -1 = none — gets the pair's mean shrunk toward the token mean,
  // n / (n + k) of the way (n the pair's count, k per (layer, K/V) from the within- and
  // between-pair variances the learner saw). Encoder and decoder must pass the same tokens,
  // first_position and previous_token.
  virtual void Predict(absl::Span<const int32_t> tokens, uint32_t first_position,
                       int32_t previous_token, float* out) const = 0;

  // ---- Cross-layer linear predictors (Predictor::kTokenMeanLinear; state format 2) ----
  // Plane p = layer * 2 + (0 = K, 1 = V) is predicted from the two planes before it in block
  // order, its inputs: V_l from K_l and V_{l-1}; K_l from V_{l-1} and K_{l-1} (plane 1 from plane
  // 0 only; plane 0 has none). Per (plane, head) a ridge-fitted D x (n_in * D) matrix W maps the
  // inputs' residuals (reconstruction minus Predict, same head, same token; keys de-rotated to
  // pre-RoPE) to the plane's residual (pre-RoPE for keys, then rotated at the token's position).
  // Size: sum over planes with weights of kv_heads * head_dim * n_in * head_dim fp16 (Llama-3-8B:
  // 63 planes * 8 * 128 * 256 * 2 bytes = 33 MB; stories260K 20 KB).
  // True if plane `plane` has weights (false for plane 0 and for states without them).
  virtual bool HasLinear(size_t plane) const = 0;
  // Adds the linear prediction to `inout` ([kv_heads][T][head_dim] floats: plane `plane`'s
  // Predict output, T = tokens of the block, tokens[0] at `first_position`). `in1`, `in2`: the
  // residuals of planes plane-1 and plane-2 ([kv_heads][T][head_dim], block domain: keys after
  // RoPE), in2 null for plane 1. Encoder and decoder must pass the same floats (the decoder's
  // reconstruction rounded to the dtype, minus Predict). Deterministic (float32, fixed order, no
  // libm). Does nothing if !HasLinear(plane).
  virtual void PredictLinear(size_t plane, uint32_t first_position, size_t T, const float* in1,
                             const float* in2, float* inout) const = 0;
  // Bytes of the linear weights (0 without them).
  virtual size_t linear_bytes() const = 0;

  // ---- Per-plane decorrelating transforms (KLT; state format 2) ----
  // Per (plane, head) an orthonormal head_dim x head_dim basis U (eigenvectors of the learned
  // residual's covariance): the FAST codec may quantize z = U^T e instead of the residual e of a
  // learned head and reconstruct e' = U z'. Orthonormal, so ||e - e'|| = ||z - z'|| (to float
  // rounding): the error target means the same in both domains. Size: planes with a basis x
  // kv_heads x head_dim^2 float32 (stories260K: 10 x 4 x 64 x 4 = 10 KB; Llama-3-8B 64 x 8 x
  // 128^2 x 4 = 33.5 MB).
  // Plane `plane`'s bases, [kv_heads][head_dim][head_dim] row-major U[i][j] (column j the j-th
  // basis vector), or null when it has none.
  virtual const float* Klt(size_t plane) const = 0;
  virtual size_t klt_bytes() const = 0;
};

// What the learner may keep and fit.
struct LearnerOptions {
  // Cap on the learner's accumulators plus the state it fits (bytes). Token and pair entries
  // beyond the cap are not added (the most frequent kept); the fit never exceeds it.
  size_t max_bytes = 64ull << 20;
  // Cross-layer linear predictors (PredictorState::HasLinear): fitted at Fit by ridge regression
  // on a bounded uniform sample of the observed blocks (reservoir, at most `linear_sample_bytes`
  // of KV, inside max_bytes), since their target is the residual after the state being fitted.
  // The ridge lambda (relative to the mean input variance) is chosen per (plane, head) from
  // {1e-3, 1e-2, 0.1, 0.3, 1, 3} on a held-out fifth of the sampled blocks (training data only);
  // a head whose held-out error is not 1 % below the token mean's keeps zero weights. The inputs
  // are fitted as the decoder sees them (closed loop): quantized with the step a plane gets at
  // `linear_fit_rel_rms` (the TQ3 error by default), so key planes that quantize to zero give 0.
  bool fit_linear = true;
  // Per-plane decorrelating transforms (PredictorState::Klt), from the same sample: per (plane,
  // head) the eigenvectors of the training fifths' residual covariance (after the linear
  // prediction where the plane has it); a plane keeps them if the held-out fifth's L1 norm of
  // the transformed residual is 1 % below the residual's.
  bool fit_klt = true;
  // Both are fitted only when their bytes fit in half of what max_bytes leaves after the
  // learner's accumulators (else the state has neither).
  size_t linear_sample_bytes = 8u << 20;
  double linear_fit_rel_rms = 0.173;
};

// Accumulates statistics of stored blocks and fits immutable states from them.
class PredictorLearner {
 public:
  virtual ~PredictorLearner() = default;

  // `geometry.block_tokens` is the block length Observe expects. Errors: INVALID_ARGUMENT for an
  // invalid geometry.
  static absl::StatusOr<std::unique_ptr<PredictorLearner>> Create(const BlockGeometry& geometry,
                                                                  const LearnerOptions& options);

  // Adds one block: `kv` dense in geometry.dtype, layout [layers][2][kv_heads][block_tokens]
  // [head_dim] (exactly geometry.num_bytes() bytes; K after RoPE, as workers store it); `tokens`
  // its block_tokens token ids; `first_position` the absolute position of tokens[0] in its prefix
  // (block index * block_tokens); `previous_token` the id before tokens[0], or -1 at the start of a
  // prefix. Non-finite values are skipped. Errors: INVALID_ARGUMENT for wrong sizes.
  virtual absl::Status Observe(absl::Span<const uint8_t> kv, absl::Span<const int32_t> tokens,
                               uint32_t first_position, int32_t previous_token) = 0;

  // Fits a state from everything observed so far and names it `version` (> 0). Errors:
  // FAILED_PRECONDITION if nothing was observed; INVALID_ARGUMENT for version 0.
  virtual absl::StatusOr<std::shared_ptr<const PredictorState>> Fit(uint32_t version) const = 0;

  virtual uint64_t tokens_observed() const = 0;
  virtual size_t memory_bytes() const = 0;
};

namespace internal {
// OK if `state` predicts blocks of `geometry` (layers, KV heads, head_dim, dtype; any
// block_tokens), else INVALID_ARGUMENT naming both: "learned: predictor state version 3 predicts
// ..., the block is ...". What every coder that codes against a state checks first.
absl::Status CheckLearnedGeometry(const PredictorState& state, const BlockGeometry& geometry);
}  // namespace internal

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_PREDICTOR_STATE_H_
