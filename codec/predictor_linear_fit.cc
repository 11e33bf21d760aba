// internal::FitLinear (predictor_state_internal.h): ridge regression of each (plane, head)'s
// residual after the learned mean on the residuals of the two planes before it, as the decoder
// reconstructs them. Method and options: LearnerOptions (predictor_state.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "codec/predictor_state_internal.h"

namespace kvtrie {
namespace internal {
namespace {

constexpr double kLambdas[] = {1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0};
constexpr double kMinGain = 0.01;  // a head keeps its weights if held-out SSE drops by >= 1 %

// Solves (A + lambda I) W^T = B in place by Cholesky: A n x n (SPD after the ridge), B n x m;
// returns false if not positive definite.
bool SolveRidge(std::vector<double> a, size_t n, double lambda, const std::vector<double>& b,
                size_t m, std::vector<double>* x) {
  for (size_t i = 0; i < n; ++i) a[i * n + i] += lambda;
  for (size_t j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (size_t k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    if (!(d > 0)) return false;
    d = std::sqrt(d);
    a[j * n + j] = d;
    for (size_t i = j + 1; i < n; ++i) {
      double v = a[i * n + j];
      for (size_t k = 0; k < j; ++k) v -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = v / d;
    }
  }
  x->assign(n * m, 0.0);
  for (size_t c = 0; c < m; ++c) {
    std::vector<double> y(n);
    for (size_t i = 0; i < n; ++i) {  // L y = b
      double v = b[i * m + c];
      for (size_t k = 0; k < i; ++k) v -= a[i * n + k] * y[k];
      y[i] = v / a[i * n + i];
    }
    for (size_t i = n; i-- > 0;) {  // L^T x = y
      double v = y[i];
      for (size_t k = i + 1; k < n; ++k) v -= a[k * n + i] * (*x)[k * m + c];
      (*x)[i * m + c] = v / a[i * n + i];
    }
  }
  return true;
}

// Held-out SSE of y ~ W x from its sufficient statistics: yy - 2 sum(X .* B) + sum(X .* (A X)).
double HeldOutSse(const std::vector<double>& a, const std::vector<double>& b, double yy,
                  const std::vector<double>& x, size_t n, size_t m) {
  double cross = 0, quad = 0;
  for (size_t i = 0; i < n * m; ++i) cross += x[i] * b[i];
  for (size_t c = 0; c < m; ++c) {
    for (size_t i = 0; i < n; ++i) {
      double ax = 0;
      for (size_t k = 0; k < n; ++k) ax += a[i * n + k] * x[k * m + c];
      quad += x[i * m + c] * ax;
    }
  }
  return yy - 2 * cross + quad;
}

}  // namespace

void FitLinear(const std::vector<LinearSample>& samples, size_t block_tokens, double fit_rel_rms,
               StateData* data) {
  data->linear.clear();
  if (samples.size() < 5 || block_tokens == 0) return;
  const BlockGeometry g = [&] {
    BlockGeometry b = data->geometry;
    b.block_tokens = static_cast<uint32_t>(block_tokens);
    return b;
  }();
  const size_t T = block_tokens, D = g.head_dim, H = g.num_kv_heads, P = D / 2;
  const size_t planes = 2 * static_cast<size_t>(g.num_layers), pe = H * T * D;
  const std::shared_ptr<const PredictorState> base = MakeState(*data);
  std::vector<double> thetas(P, 0.0);
  for (size_t i = 0; i < P && data->rope_code != 0; ++i) {
    thetas[i] = std::pow(kRopeBaseOf[data->rope_code], -2.0 * i / static_cast<double>(D));
  }
  // Per sample: the residual r (clean: the target) and its simulated reconstruction rq (the
  // input), both pre-RoPE for keys, [plane][H][T][D].
  const size_t ns = samples.size();
  std::vector<std::vector<float>> r(ns), rq(ns);
  std::vector<float> x(g.num_elements()), pred(g.num_elements());
  for (size_t k = 0; k < ns; ++k) {
    const LinearSample& s = samples[k];
    ToFloat(g.dtype, s.kv.data(), x.size(), x.data());
    base->Predict(s.tokens, s.first_position, s.previous_token, pred.data());
    r[k].resize(x.size());
    rq[k].resize(x.size());
    for (size_t pl = 0; pl < planes; ++pl) {
      const float* xp = x.data() + pl * pe;
      double energy = 0;
      for (size_t i = 0; i < pe; ++i) energy += static_cast<double>(xp[i]) * xp[i];
      const double step = std::max(fit_rel_rms * std::sqrt(12.0 * energy / pe), 1e-30);
      for (size_t i = 0; i < pe; ++i) {
        const double e = xp[i] - pred[pl * pe + i];
        r[k][pl * pe + i] = static_cast<float>(e);
        rq[k][pl * pe + i] = static_cast<float>(std::nearbyint(e / step) * step);
      }
      if (pl % 2 == 1 || data->rope_code == 0) continue;
      for (size_t h = 0; h < H; ++h) {
        for (size_t t = 0; t < T; ++t) {
          const double pos = static_cast<double>(s.first_position) + static_cast<double>(t);
          for (float* v : {r[k].data(), rq[k].data()}) {
            float* o = v + pl * pe + (h * T + t) * D;
            for (size_t i = 0; i < P; ++i) {
              const double c = std::cos(pos * thetas[i]), sn = std::sin(pos * thetas[i]);
              const double a = o[2 * i], b = o[2 * i + 1];
              o[2 * i] = static_cast<float>(c * a + sn * b);
              o[2 * i + 1] = static_cast<float>(-sn * a + c * b);
            }
          }
        }
      }
    }
  }
  bool any = false;
  std::vector<std::vector<uint16_t>> linear(planes);
  for (size_t pl = 1; pl < planes; ++pl) {
    const size_t ni = LinearInputs(pl), n = ni * D;
    std::vector<uint16_t> w(LinearSize(g, pl), 0);
    bool plane_gains = false;
    for (size_t h = 0; h < H; ++h) {
      // [0] training, [1] held out (every fifth sample).
      std::vector<double> a[2], b[2];
      double yy[2] = {0, 0};
      for (int f = 0; f < 2; ++f) a[f].assign(n * n, 0.0), b[f].assign(n * D, 0.0);
      std::vector<double> feat(n);
      for (size_t k = 0; k < ns; ++k) {
        const int f = k % 5 == 4;
        for (size_t t = 0; t < T; ++t) {
          for (size_t j = 0; j < ni; ++j) {
            const float* in = rq[k].data() + (pl - 1 - j) * pe + (h * T + t) * D;
            for (size_t d = 0; d < D; ++d) feat[j * D + d] = in[d];
          }
          const float* y = r[k].data() + pl * pe + (h * T + t) * D;
          for (size_t i = 0; i < n; ++i) {
            if (feat[i] == 0) continue;
            for (size_t c = 0; c < n; ++c) a[f][i * n + c] += feat[i] * feat[c];
            for (size_t c = 0; c < D; ++c) b[f][i * D + c] += feat[i] * y[c];
          }
          for (size_t c = 0; c < D; ++c) yy[f] += static_cast<double>(y[c]) * y[c];
        }
      }
      double trace = 0;
      for (size_t i = 0; i < n; ++i) trace += a[0][i * n + i];
      if (!(trace > 0) || !(yy[1] > 0)) continue;
      double best = yy[1] * (1 - kMinGain);
      std::vector<double> sol, best_sol;
      for (double lambda : kLambdas) {
        if (!SolveRidge(a[0], n, lambda * trace / n, b[0], D, &sol)) continue;
        const double sse = HeldOutSse(a[1], b[1], yy[1], sol, n, D);
        if (sse < best) best = sse, best_sol = sol;
      }
      if (best_sol.empty()) continue;
      plane_gains = true;
      for (size_t o = 0; o < D; ++o) {
        for (size_t i = 0; i < n; ++i) {
          const float v = static_cast<float>(best_sol[i * D + o]);
          w[(h * D + o) * n + i] =
              FloatToHalf(std::isfinite(v) ? std::clamp(v, -65504.0f, 65504.0f) : 0.0f);
        }
      }
    }
    if (plane_gains) linear[pl] = std::move(w), any = true;
  }
  if (any) data->linear = std::move(linear);
}

void SymmetricEigen(std::vector<double> a, size_t n, std::vector<double>* values,
                    std::vector<double>* vectors) {
  std::vector<double> v(n * n, 0.0);
  for (size_t i = 0; i < n; ++i) v[i * n + i] = 1.0;
  for (int sweep = 0; sweep < 50; ++sweep) {
    double off = 0, diag = 0;
    for (size_t i = 0; i < n; ++i) {
      diag += a[i * n + i] * a[i * n + i];
      for (size_t j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    }
    if (off <= 1e-30 * diag || off == 0) break;
    for (size_t p = 0; p < n; ++p) {
      for (size_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (apq == 0) continue;
        // The rotation that zeroes a[p][q] (Golub & Van Loan 8.5.2).
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (size_t k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (size_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        for (size_t k = 0; k < n; ++k) {
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return a[x * n + x] > a[y * n + y]; });
  values->resize(n);
  vectors->assign(n * n, 0.0);
  for (size_t j = 0; j < n; ++j) {
    (*values)[j] = a[order[j] * n + order[j]];
    for (size_t i = 0; i < n; ++i) (*vectors)[i * n + j] = v[i * n + order[j]];
  }
}

void FitKlt(const std::vector<LinearSample>& samples, size_t block_tokens, double fit_rel_rms,
            StateData* data) {
  data->klt.clear();
  if (samples.size() < 5 || block_tokens == 0) return;
  BlockGeometry g = data->geometry;
  g.block_tokens = static_cast<uint32_t>(block_tokens);
  const size_t T = block_tokens, D = g.head_dim, H = g.num_kv_heads;
  const size_t planes = 2 * static_cast<size_t>(g.num_layers), pe = H * T * D;
  const std::shared_ptr<const PredictorState> base = MakeState(*data);
  // [plane][head]: covariance of the training samples; held-out |e| and |U^T e| sums.
  std::vector<std::vector<double>> cov(planes * H, std::vector<double>(D * D, 0.0));
  std::vector<float> x(g.num_elements()), pred(g.num_elements()), rq(g.num_elements());
  std::vector<float> lin(pe);
  std::vector<std::vector<float>> held;  // held-out residuals, per sample [planes][pe]
  for (size_t k = 0; k < samples.size(); ++k) {
    const LinearSample& s = samples[k];
    ToFloat(g.dtype, s.kv.data(), x.size(), x.data());
    base->Predict(s.tokens, s.first_position, s.previous_token, pred.data());
    std::vector<float> e(g.num_elements());
    for (size_t pl = 0; pl < planes; ++pl) {
      const float* xp = x.data() + pl * pe;
      const float* pp = pred.data() + pl * pe;
      double energy = 0;
      for (size_t i = 0; i < pe; ++i) energy += static_cast<double>(xp[i]) * xp[i];
      const double step = std::max(fit_rel_rms * std::sqrt(12.0 * energy / pe), 1e-30);
      for (size_t i = 0; i < pe; ++i) {
        rq[pl * pe + i] = static_cast<float>(std::nearbyint((xp[i] - pp[i]) / step) * step);
      }
      std::copy(pp, pp + pe, lin.begin());
      if (base->HasLinear(pl)) {
        base->PredictLinear(pl, s.first_position, T, rq.data() + (pl - 1) * pe,
                            pl >= 2 ? rq.data() + (pl - 2) * pe : nullptr, lin.data());
      }
      for (size_t i = 0; i < pe; ++i) e[pl * pe + i] = xp[i] - lin[i];
    }
    if (k % 5 == 4) {
      held.push_back(std::move(e));
      continue;
    }
    for (size_t pl = 0; pl < planes; ++pl) {
      for (size_t h = 0; h < H; ++h) {
        std::vector<double>& c = cov[pl * H + h];
        for (size_t t = 0; t < T; ++t) {
          const float* r = e.data() + pl * pe + (h * T + t) * D;
          for (size_t i = 0; i < D; ++i)
            for (size_t j = 0; j < D; ++j) c[i * D + j] += static_cast<double>(r[i]) * r[j];
        }
      }
    }
  }
  bool any = false;
  std::vector<std::vector<float>> klt(planes);
  std::vector<double> values, vectors;
  for (size_t pl = 0; pl < planes; ++pl) {
    std::vector<float> u(H * D * D);
    double l1e = 0, l1z = 0;
    for (size_t h = 0; h < H; ++h) {
      SymmetricEigen(cov[pl * H + h], D, &values, &vectors);
      for (size_t i = 0; i < D * D; ++i) u[h * D * D + i] = static_cast<float>(vectors[i]);
      for (const std::vector<float>& e : held) {
        for (size_t t = 0; t < T; ++t) {
          const float* r = e.data() + pl * pe + (h * T + t) * D;
          for (size_t j = 0; j < D; ++j) {
            double z = 0;
            for (size_t i = 0; i < D; ++i) z += u[(h * D + i) * D + j] * r[i];
            l1z += std::fabs(z);
            l1e += std::fabs(r[j]);
          }
        }
      }
    }
    if (l1z < (1 - kMinGain) * l1e) klt[pl] = std::move(u), any = true;
  }
  if (any) data->klt = std::move(klt);
}

}  // namespace internal
}  // namespace kvtrie
