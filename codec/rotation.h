// codec/rotation.h
//
// Randomized Hadamard rotation of head_dim-sized vectors: y = H (s ⊙ x) / sqrt(n), with H the
// n x n Walsh–Hadamard matrix and s a ±1 vector drawn from `seed`. Orthonormal, so it preserves
// norms and squared errors; it spreads an outlier channel over all channels, which makes the
// coordinates close to Gaussian (what Lloyd-Max codebooks assume) and evens out per-channel scales.
// n must be a power of two (head_dim 64 / 128 / 8 ...); other sizes are not rotatable.
// Source: Ailon & Chazelle's fast Johnson–Lindenstrauss transform; as used by QuaRot and
// TurboQuant (Zandieh et al. 2025, §3) for KV quantization.
#ifndef KVTRIE_CODEC_ROTATION_H_
#define KVTRIE_CODEC_ROTATION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtrie {

// True if `n` is a power of two in [1, 65536].
bool IsRotatableDim(size_t n);

class RandomizedHadamard {
 public:
  // REQUIRES: IsRotatableDim(n).
  RandomizedHadamard(size_t n, uint64_t seed);
  // In place on v[0..n).
  void Forward(float* v) const;
  void Inverse(float* v) const;

 private:
  size_t n_;
  float scale_;               // 1 / sqrt(n)
  std::vector<float> signs_;  // ±1
};

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_ROTATION_H_
