// DecodeFastResidual (fast_residual.h): the FAST residual decoder. Byte layout and how a GPU
// decoder reads it: codec/FORMAT.md.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "codec/fast_residual.h"
#include "codec/fast_residual_format.h"
#include "codec/fast_residual_kernels.h"
#include "codec/little_endian.h"
#include "codec/predictor_state.h"
#include "codec/rans.h"
#include "codec/rans_interleaved.h"
#include "codec/residual_kernels.h"

namespace kvtrie {
namespace internal {

using namespace fast;         // NOLINT: the profile's own kernels
using namespace fast_format;  // NOLINT: its params layout
using residual::Dims;

// ---- decoder --------------------------------------------------------------------------------

namespace {

struct PlaneInfo {
  float step = 0;
  size_t preds = 0;        // offset into the predictor array
  size_t means = 0;        // index of its first mean head in the means array
  uint64_t bits = 0;       // bucket offset bits of the plane
  uint64_t bits_at = 0;    // where they start in the bit stream
  bool escapable = false;  // the table gives a bucket symbol a nonzero frequency
  irans::Table table;
};

// q of a plane as floats: the direct symbols, then every bucket symbol from its offset bits.
absl::Status PlaneValues(const uint8_t* sym, size_t n, const PlaneInfo& pi, const uint8_t* bits,
                         float* qf) {
  DirectValues(sym, n, qf);
  if (!pi.escapable)
    return pi.bits == 0 ? absl::OkStatus() : absl::DataLossError("fast residual: unused bits");
  uint64_t pos = pi.bits_at;
  const uint64_t end = pi.bits_at + pi.bits;
  // The bucket symbols in element order: 16 at a time from a bit mask (their bits are in order).
  auto bucket = [&](size_t i) -> bool {
    const int b = sym[i] - kDirect;
    const int nb = BucketBits(b);
    if (end - pos < static_cast<uint64_t>(nb)) return false;
    const uint32_t z = kBucket.base[b] + ReadBits(bits, pos, nb);
    pos += nb;
    qf[i] = static_cast<float>(UnZigZag(z));
    return true;
  };
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sym + i));
    for (uint32_t m = static_cast<uint32_t>(
             _mm_movemask_epi8(_mm_cmpgt_epi8(v, _mm_set1_epi8(kDirect - 1))));
         m != 0; m &= m - 1) {
      if (!bucket(i + __builtin_ctz(m))) {
        return absl::DataLossError("fast residual: bucket bits past the plane's");
      }
    }
  }
#endif
  for (; i < n; ++i) {
    if (sym[i] >= kDirect && !bucket(i)) {
      return absl::DataLossError("fast residual: bucket bits past the plane's");
    }
  }
  if (pos != end) return absl::DataLossError("fast residual: unused bucket bits");
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeFastResidual(const BlockGeometry& g, absl::string_view params,
                                absl::string_view payload, absl::Span<uint8_t> out,
                                const PredictionContext& context) {
  const Dims n(g);
  const size_t pe = n.plane_elems(), he = n.head_elems(), planes = n.L * 2;
  const size_t eb = DTypeBytes(g.dtype);
  if (out.size() != g.num_bytes()) return absl::InvalidArgumentError("out: wrong size");
  if (params.size() < 6 || static_cast<uint8_t>(params[0]) != kFastResidualParamsVersion ||
      (static_cast<uint8_t>(params[1]) & ~(kFlagSharedTables | kFlagZeroPlanes | kFlagAllLearned |
                                           kFlagWideCodes | kFlagLinearPlanes | kFlagKltPlanes)) !=
          0 ||
      params[3] != 0) {
    return absl::DataLossError("fast residual params: bad version or flags");
  }
  const uint8_t flags = static_cast<uint8_t>(params[1]);
  if (((flags & kFlagWideCodes) && (flags & (kFlagAllLearned | kFlagLinearPlanes))) ||
      ((flags & kFlagLinearPlanes) && !(flags & kFlagAllLearned))) {
    return absl::DataLossError("fast residual params: bad version or flags");
  }
  const bool wide = flags & kFlagWideCodes;
  Layout lo;
  lo.lanes = static_cast<uint8_t>(params[2]);
  lo.planes_per_segment =
      static_cast<uint8_t>(params[4]) | (static_cast<size_t>(static_cast<uint8_t>(params[5])) << 8);
  const bool shared_tables = static_cast<uint8_t>(params[1]) & kFlagSharedTables;
  const bool all_learned = static_cast<uint8_t>(params[1]) & kFlagAllLearned;
  absl::string_view in = params.substr(6);
  std::vector<uint8_t> zero(planes, 0);
  if (static_cast<uint8_t>(params[1]) & kFlagZeroPlanes) {
    const size_t bytes = (planes + 7) / 8;
    if (in.size() < bytes) return absl::DataLossError("fast residual params: truncated");
    for (size_t pl = 0; pl < bytes * 8; ++pl) {
      const bool bit = (static_cast<uint8_t>(in[pl / 8]) >> (pl % 8)) & 1;
      if (pl >= planes && bit) return absl::DataLossError("fast residual params: bad zero planes");
      if (pl < planes) zero[pl] = bit;
    }
    in.remove_prefix(bytes);
  }
  std::vector<uint8_t> linear_plane(planes, 0);  // with kFlagLinearPlanes: every head code 4
  if (flags & kFlagLinearPlanes) {
    const size_t bytes = (planes + 7) / 8;
    if (in.size() < bytes) return absl::DataLossError("fast residual params: truncated");
    for (size_t pl = 0; pl < bytes * 8; ++pl) {
      const bool bit = (static_cast<uint8_t>(in[pl / 8]) >> (pl % 8)) & 1;
      if (pl >= planes && bit)
        return absl::DataLossError("fast residual params: bad linear planes");
      if (pl < planes) linear_plane[pl] = bit;
    }
    in.remove_prefix(bytes);
  }
  std::vector<uint8_t> klt_plane(planes, 0);  // with kFlagKltPlanes: learned heads in the KLT
  if (flags & kFlagKltPlanes) {
    const size_t bytes = (planes + 7) / 8;
    if (in.size() < bytes) return absl::DataLossError("fast residual params: truncated");
    for (size_t pl = 0; pl < bytes * 8; ++pl) {
      const bool bit = (static_cast<uint8_t>(in[pl / 8]) >> (pl % 8)) & 1;
      if (pl >= planes && bit) return absl::DataLossError("fast residual params: bad KLT planes");
      if (pl < planes) klt_plane[pl] = bit;
    }
    in.remove_prefix(bytes);
  }
  std::vector<size_t> coded;
  bool side_coded[2] = {false, false};
  for (size_t pl = 0; pl < planes; ++pl) {
    if (zero[pl]) continue;
    coded.push_back(pl);
    side_coded[pl % 2] = true;
  }
  const size_t nc = coded.size();
  if (lo.lanes < 1 || lo.lanes > irans::kMaxLanes || (lo.lanes & (lo.lanes - 1)) || pe % lo.lanes ||
      lo.planes_per_segment < 1 ||
      lo.planes_per_segment > std::min(std::max<size_t>(nc, 1), kMaxSegmentPlanes)) {
    return absl::DataLossError("fast residual params: bad lane layout");
  }
  std::vector<PlaneInfo> info(planes);
  std::vector<uint8_t> preds(planes * n.H);
  size_t num_means = 0;
  bool uses_learned = false, uses_linear = false;
  uint64_t num_bits = 0;
  for (size_t pl = 0; pl < planes; ++pl) {
    PlaneInfo& pi = info[pl];
    const size_t pred_bytes = all_learned ? 0 : wide ? (n.H + 1) / 2 : (n.H + 3) / 4;
    const size_t step_bytes = zero[pl] ? 0 : 2;
    if (in.size() < step_bytes + pred_bytes) {
      return absl::DataLossError("fast residual params: truncated");
    }
    if (zero[pl]) {
      pi.step = 1.0f;  // unused: every q is 0
    } else {
      pi.step = Bf16ToFloat(static_cast<uint8_t>(in[0]) | (static_cast<uint8_t>(in[1]) << 8));
    }
    if (!(pi.step > 0) || !std::isfinite(pi.step)) {
      return absl::DataLossError("fast residual params: bad step");
    }
    pi.preds = pl * n.H;
    pi.means = num_means;
    for (size_t h = 0; h < n.H; ++h) {
      const uint8_t c = all_learned ? (linear_plane[pl] ? kPredLinear : uint8_t{kPredToken})
                        : wide
                            ? (static_cast<uint8_t>(in[step_bytes + h / 2]) >> (4 * (h % 2))) & 15
                            : (static_cast<uint8_t>(in[step_bytes + h / 4]) >> (2 * (h % 4))) & 3;
      if (c > kPredLinear || (wide && n.H % 2 && h + 1 == n.H &&
                              (static_cast<uint8_t>(in[step_bytes + h / 2]) >> 4) != 0)) {
        return absl::DataLossError("fast residual params: unknown predictor");
      }
      if (c >= kPredToken && (context.learned == nullptr || context.tokens.size() != n.T)) {
        return absl::DataLossError(
            "fast residual params: a learned predictor in a block that names no predictor state");
      }
      if (c == kPredLinear && !context.learned->HasLinear(pl)) {
        return absl::DataLossError(absl::StrCat(
            "fast residual params: a linear predictor on plane ", pl,
            " that predictor state version ", context.learned->version(), " has no weights for"));
      }
      if (c >= kPredToken && klt_plane[pl] && context.learned->Klt(pl) == nullptr) {
        return absl::DataLossError(absl::StrCat("fast residual params: a KLT on plane ", pl,
                                                " that predictor state version ",
                                                context.learned->version(), " has no basis for"));
      }
      uses_learned |= c >= kPredToken;
      uses_linear |= c == kPredLinear;
      preds[pl * n.H + h] = c;
      num_means += c == kPredMean;
    }
    in.remove_prefix(step_bytes + pred_bytes);
    if (zero[pl]) continue;  // no bucket bits, no table
    uint64_t nbits = 0;
    for (int shift = 0;; shift += 7) {
      if (in.empty() || shift > 35) return absl::DataLossError("fast residual params: bad count");
      const uint8_t b = static_cast<uint8_t>(in[0]);
      in.remove_prefix(1);
      nbits |= static_cast<uint64_t>(b & 127) << shift;
      if (!(b & 128)) break;
    }
    if (nbits > pe * BucketBits(kBuckets - 1)) {
      return absl::DataLossError("fast residual params: bad bucket bit count");
    }
    pi.bits = nbits;
    pi.bits_at = num_bits;
    num_bits += nbits;
    if (shared_tables) continue;
    if (auto s = irans::ReadTable(&in, &pi.table); !s.ok()) return s;
  }
  if (shared_tables) {
    irans::Table side[2];
    for (int k = 0; k < 2; ++k) {
      if (!side_coded[k]) continue;
      if (auto s = irans::ReadTable(&in, &side[k]); !s.ok()) return s;
    }
    for (size_t pl : coded) info[pl].table = side[pl % 2];
  }
  for (size_t pl : coded) {
    PlaneInfo& pi = info[pl];
    for (int sym = kDirect; sym < pi.table.num_symbols; ++sym)
      pi.escapable |= pi.table.freq[sym] > 0;
  }
  if (in.size() != num_means * n.D * 2) {
    return absl::DataLossError("fast residual params: channel means do not match");
  }
  std::vector<float> means(num_means * n.D);
  for (size_t i = 0; i < means.size(); ++i) {
    means[i] =
        HalfToFloat(static_cast<uint8_t>(in[2 * i]) | (static_cast<uint8_t>(in[2 * i + 1]) << 8));
  }
  std::vector<float> learned_local;  // per-thread buffer (fast_residual_kernels.h Reused)
  float* learned = nullptr;
  if (uses_learned) {
    learned = Reused(kSlotDecLearned, g.num_elements(), &learned_local);
    context.learned->Predict(context.tokens, context.first_position, context.previous_token,
                             learned);
  }
  // Payload.
  const size_t ns = nc == 0 ? 0 : lo.num_segments(nc);
  if (payload.size() < 4 * ns) return absl::DataLossError("fast residual payload: truncated");
  std::vector<size_t> seg_at(ns + 1);
  seg_at[0] = 4 * ns;
  for (size_t sg = 0; sg < ns; ++sg) {
    uint32_t size;
    std::memcpy(&size, payload.data() + 4 * sg, 4);
    if (size > payload.size() - seg_at[sg]) {
      return absl::DataLossError("fast residual payload: segment past the end");
    }
    seg_at[sg + 1] = seg_at[sg] + size;
  }
  if (payload.size() - seg_at[ns] != (num_bits + 7) / 8) {
    return absl::DataLossError("fast residual payload: bucket bits do not match");
  }
  std::vector<uint8_t> bits(payload.size() - seg_at[ns] + 8, 0);  // padded for ReadBits
  std::memcpy(bits.data(), payload.data() + seg_at[ns], payload.size() - seg_at[ns]);
  // Per-thread scratch (every element is written before it is read): no allocation or zeroing
  // per block.
  thread_local std::vector<irans::DecodeTable> dtab;
  thread_local std::vector<uint8_t> symbols;
  thread_local std::vector<float> rec, qf;
  if (dtab.size() < lo.planes_per_segment) dtab.resize(lo.planes_per_segment);
  if (symbols.size() < lo.planes_per_segment * pe) symbols.resize(lo.planes_per_segment * pe);
  if (rec.size() < he) rec.resize(he);
  if (qf.size() < pe) qf.resize(pe);
  std::vector<const irans::DecodeTable*> dtp(lo.planes_per_segment);
  std::vector<float> zeros(n.D, 0.0f), klt_scratch(n.D);
  // With a linear head, planes are reconstructed in plane order after every symbol is decoded
  // (plane p's prediction needs planes p-1 and p-2): q of every plane, the residuals.
  std::vector<float> all_q, residual, linear;
  if (uses_linear) {
    all_q.assign(g.num_elements(), 0.0f);
    residual.resize(g.num_elements());
    linear.resize(pe);
  }
  // x' = prediction + q * step of plane pl from its q.
  auto reconstruct = [&](size_t pl, const float* q) {
    const PlaneInfo& pi = info[pl];
    size_t mean_i = pi.means;
    bool lin = false;
    for (size_t h = 0; h < n.H; ++h) lin |= preds[pi.preds + h] == kPredLinear;
    if (lin) {
      std::memcpy(linear.data(), learned + pl * pe, pe * sizeof(float));
      context.learned->PredictLinear(
          pl, context.first_position, n.T, residual.data() + (pl - 1) * pe,
          pl >= 2 ? residual.data() + (pl - 2) * pe : nullptr, linear.data());
    }
    for (size_t h = 0; h < n.H; ++h) {
      const uint8_t pr = preds[pi.preds + h];
      const float* m = pr == kPredMean     ? means.data() + (mean_i++) * n.D
                       : pr == kPredToken  ? learned + pl * pe + h * he
                       : pr == kPredLinear ? linear.data() + h * he
                                           : zeros.data();
      if (klt_plane[pl] && pr >= kPredToken) {
        KltReconHead(q + h * he, m, context.learned->Klt(pl) + h * n.D * n.D, n.T, n.D, pi.step,
                     klt_scratch.data(), rec.data());
      } else {
        ReconHead(q + h * he, n.T, n.D, KernelCode(pr), m, zeros.data(), pi.step, rec.data());
      }
      uint8_t* o = out.data() + (pl * pe + h * he) * eb;
      FromFloat(g.dtype, rec.data(), he, o);
      if (!uses_linear) continue;
      ToFloat(g.dtype, o, he, rec.data());
      float* r = residual.data() + pl * pe + h * he;
      const float* lm = learned + pl * pe + h * he;
      for (size_t i = 0; i < he; ++i) r[i] = rec[i] - lm[i];
    }
  };
  for (size_t sg = 0; sg < ns; ++sg) {
    const size_t first = sg * lo.planes_per_segment;
    const size_t count = std::min(lo.planes_per_segment, nc - first);
    for (size_t k = 0; k < count; ++k) {
      irans::BuildDecodeTable(info[coded[first + k]].table, &dtab[k]);
      dtp[k] = &dtab[k];
    }
    if (auto s = irans::DecodeSegment(payload.substr(seg_at[sg], seg_at[sg + 1] - seg_at[sg]),
                                      lo.lanes, pe, absl::MakeConstSpan(dtp).subspan(0, count),
                                      absl::MakeSpan(symbols).subspan(0, count * pe));
        !s.ok()) {
      return s;
    }
    for (size_t k = 0; k < count; ++k) {
      const size_t pl = coded[first + k];
      float* q = uses_linear ? all_q.data() + pl * pe : qf.data();
      if (auto s = PlaneValues(symbols.data() + k * pe, pe, info[pl], bits.data(), q); !s.ok()) {
        return s;
      }
      if (!uses_linear) reconstruct(pl, q);
    }
  }
  if (uses_linear) {
    for (size_t pl = 0; pl < planes; ++pl) reconstruct(pl, all_q.data() + pl * pe);
  } else if (nc < planes) {
    std::fill(qf.begin(), qf.begin() + pe, 0.0f);
    for (size_t pl = 0; pl < planes; ++pl)
      if (zero[pl]) reconstruct(pl, qf.data());
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvtrie
