// codec/predictor_state_internal.h
//
// What a fitted PredictorState holds (predictor_state.cc builds and serializes it; the learner,
// predictor_learner.cc, fits it). Internal to the codec. Serialized layout: codec/FORMAT.md.
#ifndef KVTRIE_CODEC_PREDICTOR_STATE_INTERNAL_H_
#define KVTRIE_CODEC_PREDICTOR_STATE_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "codec/block_geometry.h"
#include "codec/predictor_state.h"

namespace kvtrie {
namespace internal {

// RoPE codes: 0 = keys not rotated, 1 = base 10000, 2 = base 500000.
inline constexpr int kNumRopeCodes = 3;
inline constexpr double kRopeBaseOf[kNumRopeCodes] = {0.0, 10000.0, 500000.0};

// Values of one token's vector: [layers][2][kv_heads][head_dim] (keys pre-RoPE).
inline size_t VectorSize(const BlockGeometry& g) {
  return static_cast<size_t>(g.num_layers) * 2 * g.num_kv_heads * g.head_dim;
}

inline uint64_t PairKey(int32_t previous, int32_t token) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(previous)) << 32) |
         static_cast<uint32_t>(token);
}

struct StateData {
  BlockGeometry geometry;  // block_tokens 0
  uint32_t version = 0;
  int rope_code = 0;
  uint64_t tokens_learned = 0;
  std::vector<int32_t> ids;      // ascending token ids
  std::vector<uint32_t> counts;  // per id
  std::vector<uint16_t> means;   // (1 + ids) x VectorSize fp16: the all-token mean, then per id
  std::vector<uint64_t> pairs;   // ascending PairKey(previous, token)
  std::vector<uint32_t> pair_counts;
  // pairs x VectorSize fp16: the pair's prediction (its mean shrunk toward the token mean).
  std::vector<uint16_t> pair_means;
  // Cross-layer linear weights (format 2), per plane (layer * 2 + K/V): empty, or
  // kv_heads x head_dim x (LinearInputs(plane) * head_dim) finite fp16, row-major
  // [head][output channel][input j * head_dim + input channel], input j = plane - 1 - j.
  // Either empty (no weights at all) or 2 * layers entries.
  std::vector<std::vector<uint16_t>> linear;
  // Per-plane decorrelating transforms (format 2), per plane: empty, or kv_heads x head_dim x
  // head_dim finite float32 U[h][i][j], orthonormal, column j the j-th basis vector (z = U^T e).
  // Either empty or 2 * layers entries.
  std::vector<std::vector<float>> klt;
};

// Input planes of plane p's linear predictor: p - 1 and p - 2, those >= 0.
inline size_t LinearInputs(size_t plane) { return plane >= 2 ? 2 : plane; }
inline size_t LinearSize(const BlockGeometry& g, size_t plane) {
  return static_cast<size_t>(g.num_kv_heads) * g.head_dim * LinearInputs(plane) * g.head_dim;
}

std::shared_ptr<const PredictorState> MakeState(StateData data);

// One observed block kept for the linear fit (the learner's reservoir sample).
struct LinearSample {
  std::vector<uint8_t> kv;  // geometry.num_bytes(), block layout, K after RoPE
  std::vector<int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
};

// Fits data->linear (predictor_linear_fit.cc; LearnerOptions documents the method) from
// `samples` of blocks of `block_tokens` tokens, against the state `data` describes without
// weights. Leaves data->linear empty when no head gains or there are fewer than 5 samples.
void FitLinear(const std::vector<LinearSample>& samples, size_t block_tokens, double fit_rel_rms,
               StateData* data);

// Fits data->klt (predictor_linear_fit.cc): per (plane, head) the eigenvectors of the covariance
// of the residual after the learned prediction (codes 3 / 4 as the codec computes it, block
// domain: keys after RoPE) over `samples`, by cyclic Jacobi. Leaves it empty for < 5 samples.
void FitKlt(const std::vector<LinearSample>& samples, size_t block_tokens, double fit_rel_rms,
            StateData* data);

// Eigen-decomposition of the symmetric n x n matrix `a` (row-major, destroyed) by cyclic Jacobi
// rotations: `vectors` n x n row-major with column j the unit eigenvector of eigenvalue
// values[j], sorted by decreasing eigenvalue. Orthonormal to rounding.
void SymmetricEigen(std::vector<double> a, size_t n, std::vector<double>* values,
                    std::vector<double>* vectors);

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_PREDICTOR_STATE_INTERNAL_H_
