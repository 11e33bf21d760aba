#include "codec/lloyd_max.h"

#include <array>
#include <cmath>
#include <mutex>

namespace kvtrie {
namespace {

double Pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI); }
double Cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

LloydMaxQuantizer Design(int bits) {
  const int n = 1 << bits;
  std::vector<double> levels(n), thresholds(n + 1);
  for (int i = 0; i < n; ++i) levels[i] = -3.0 + 6.0 * (i + 0.5) / n;
  for (int iter = 0; iter < 2000; ++iter) {
    thresholds[0] = -INFINITY;
    thresholds[n] = INFINITY;
    for (int i = 1; i < n; ++i) thresholds[i] = 0.5 * (levels[i - 1] + levels[i]);
    for (int i = 0; i < n; ++i) {
      const double a = thresholds[i], b = thresholds[i + 1];
      const double p = Cdf(b) - Cdf(a);
      if (p > 0) levels[i] = (Pdf(a) - Pdf(b)) / p;
    }
  }
  // MSE = E[x^2] - sum_i p_i c_i^2 for centroid levels.
  double mse = 1.0;
  for (int i = 0; i < n; ++i) {
    mse -= (Cdf(thresholds[i + 1]) - Cdf(thresholds[i])) * levels[i] * levels[i];
  }
  LloydMaxQuantizer q;
  q.bits = bits;
  q.mse = mse;
  for (int i = 0; i < n; ++i) q.levels.push_back(static_cast<float>(levels[i]));
  for (int i = 1; i < n; ++i) q.thresholds.push_back(static_cast<float>(thresholds[i]));
  return q;
}

}  // namespace

const LloydMaxQuantizer& GaussianLloydMax(int bits) {
  static std::array<LloydMaxQuantizer, 9> table;
  static std::array<std::once_flag, 9> once;
  std::call_once(once[bits], [bits] { table[bits] = Design(bits); });
  return table[bits];
}

}  // namespace kvtrie
