#include "codec/rotation.h"

#include <cmath>

namespace kvtrie {
namespace {

uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void WalshHadamard(float* v, size_t n) {
  for (size_t h = 1; h < n; h <<= 1) {
    for (size_t i = 0; i < n; i += 2 * h) {
      for (size_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
}

}  // namespace

bool IsRotatableDim(size_t n) { return n >= 1 && n <= 65536 && (n & (n - 1)) == 0; }

RandomizedHadamard::RandomizedHadamard(size_t n, uint64_t seed)
    : n_(n), scale_(1.0f / std::sqrt(static_cast<float>(n))), signs_(n) {
  uint64_t state = seed;
  for (size_t i = 0; i < n; ++i) signs_[i] = (SplitMix64(state) >> 63) ? -1.0f : 1.0f;
}

void RandomizedHadamard::Forward(float* v) const {
  for (size_t i = 0; i < n_; ++i) v[i] *= signs_[i];
  WalshHadamard(v, n_);
  for (size_t i = 0; i < n_; ++i) v[i] *= scale_;
}

void RandomizedHadamard::Inverse(float* v) const {
  WalshHadamard(v, n_);
  for (size_t i = 0; i < n_; ++i) v[i] *= scale_ * signs_[i];
}

}  // namespace kvtrie
