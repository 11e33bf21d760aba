#include "codec/reference_shift.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/det_math.h"  // DetExp, DetCosSin: the same bits on every machine
#include "codec/little_endian.h"

namespace kvtrie {
namespace internal {
namespace {

constexpr uint8_t kFlagHalfSplit = 1;
constexpr uint8_t kBaseMask = 6;  // flags bits 1-2: the RoPE base code
constexpr uint8_t kFlagTail = 8;
constexpr float kMaxLogBase = 40.0f;

// cos and sin of a, |a| <= 2^16 * 1.6: Cody-Waite reduction by pi / 2 (fdlibm's 33-bit split, so
// k * kPio2Hi is exact for |k| < 2^20), then the series. IEEE operations only: the same bits on
// every machine.
void ReducedCosSin(double a, double* c, double* s) {
  constexpr double kTwoOverPi = 6.36619772367581382433e-01;
  constexpr double kPio2Hi = 1.57079632673412561417e+00;
  constexpr double kPio2Lo = 6.07710050650619224932e-11;
  const double k = std::floor(a * kTwoOverPi + 0.5);
  const double r = (a - k * kPio2Hi) - k * kPio2Lo;
  double cr, sr;
  DetCosSin(r, &cr, &sr);  // |r| <= pi / 4 + a little: the Taylor series
  switch (static_cast<int64_t>(k) & 3) {
    case 0:
      *c = cr, *s = sr;
      break;
    case 1:
      *c = -sr, *s = cr;
      break;
    case 2:
      *c = -cr, *s = -sr;
      break;
    default:
      *c = sr, *s = -cr;
      break;
  }
}

// The problem with `shift` for `geometry`, or "" when it can be coded.
std::string ShiftProblem(const BlockGeometry& g, const ReferenceShift& shift) {
  if (shift.token_shift >= g.block_tokens) {
    return absl::StrCat("token_shift ", shift.token_shift, " is not below block_tokens ",
                        g.block_tokens);
  }
  if (shift.rotation > kMaxShiftRotation || shift.rotation < -kMaxShiftRotation) {
    return absl::StrCat("rotation ", shift.rotation, " is beyond +-", kMaxShiftRotation);
  }
  if (!std::isfinite(shift.log_rope_base) || shift.log_rope_base < 0 ||
      shift.log_rope_base > kMaxLogBase) {
    return absl::StrCat("log_rope_base ", shift.log_rope_base, " is not 0 or in (0, ", kMaxLogBase,
                        "]");
  }
  if (shift.half_split && g.head_dim % 2 != 0) {
    return absl::StrCat("half_split pairing needs an even head_dim, not ", g.head_dim);
  }
  if (shift.tail && (shift.token_shift == 0 || shift.reference_parent_node_id != 0)) {
    return absl::StrCat("a tail window with token_shift ", shift.token_shift,
                        " and reference_parent_node_id ", shift.reference_parent_node_id,
                        " (needs token_shift > 0 and no parent)");
  }
  if (!shift.tail && (shift.token_shift > 0) != (shift.reference_parent_node_id != 0)) {
    return absl::StrCat("reference_parent_node_id ", shift.reference_parent_node_id,
                        " with token_shift ", shift.token_shift,
                        " (nonzero exactly when token_shift is)");
  }
  return "";
}

// Per channel pair i: the two channels it turns, and cos / sin of rotation * theta_i.
struct Turn {
  std::vector<uint32_t> first, second;
  std::vector<double> cos, sin;
};

Turn MakeTurn(uint32_t head_dim, int32_t rotation, float log_base, bool half_split) {
  Turn t;
  const uint32_t pairs = head_dim / 2;
  for (uint32_t i = 0; i < pairs; ++i) {
    t.first.push_back(half_split ? i : 2 * i);
    t.second.push_back(half_split ? i + pairs : 2 * i + 1);
    const double theta =
        DetExp(-2.0 * static_cast<double>(i) / static_cast<double>(head_dim) * log_base);
    double c, s;
    ReducedCosSin(static_cast<double>(rotation) * theta, &c, &s);
    t.cos.push_back(c);
    t.sin.push_back(s);
  }
  return t;
}

// `row` (head_dim floats) turned by `t` in place, each value clamped to +-limit (a turned pair
// keeps its norm, but one channel may grow past the dtype's largest finite value).
void TurnRow(const Turn& t, float limit, float* row) {
  auto clamp = [limit](double v) {
    return static_cast<float>(v > limit ? limit : v < -limit ? -limit : v);
  };
  for (size_t i = 0; i < t.first.size(); ++i) {
    const double a = row[t.first[i]], b = row[t.second[i]];
    row[t.first[i]] = clamp(t.cos[i] * a - t.sin[i] * b);
    row[t.second[i]] = clamp(t.sin[i] * a + t.cos[i] * b);
  }
}

// The window's source row of token j of head (l, kv, h): a pointer to head_dim elements.
const uint8_t* SourceRow(const BlockGeometry& g, const ReferenceShift& shift,
                         absl::Span<const uint8_t> reference,
                         absl::Span<const uint8_t> reference_parent, size_t head_offset,
                         uint32_t j) {
  const size_t w = DTypeBytes(g.dtype);
  const uint32_t s = shift.token_shift, T = g.block_tokens;
  size_t token;
  const uint8_t* base = reference.data();
  if (shift.tail) {
    token = j < s ? T - s + j : T - 1;
  } else if (j < s) {
    token = T - s + j;
    base = reference_parent.data();
  } else {
    token = j - s;
  }
  return base + (head_offset + token * g.head_dim) * w;
}

// Positions token j's source is turned by beyond `rotation` (tail fillers: their distance).
uint32_t ExtraTurn(const ReferenceShift& shift, uint32_t j) {
  return shift.tail && j >= shift.token_shift ? j - shift.token_shift + 1 : 0;
}

// The turn of each token of the block (index j), sharing tables between equal angles.
std::vector<Turn> MakeTurns(const BlockGeometry& g, const ReferenceShift& shift, float log_base,
                            bool half_split) {
  std::vector<Turn> turns;
  const uint32_t extras = shift.tail ? g.block_tokens - shift.token_shift : 0;
  for (uint32_t e = 0; e <= extras; ++e) {
    turns.push_back(
        MakeTurn(g.head_dim, shift.rotation + static_cast<int32_t>(e), log_base, half_split));
  }
  return turns;
}

}  // namespace

absl::Status CheckReferenceShift(const BlockGeometry& geometry, const ReferenceShift& shift) {
  const std::string problem = ShiftProblem(geometry, shift);
  if (problem.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("reference_shift: ", problem));
}

void AppendReferenceShift(const ReferenceShift& shift, std::string* out) {
  const uint8_t base = shift.log_rope_base == 0                    ? 0
                       : shift.log_rope_base == kLogRopeBase10000  ? 1
                       : shift.log_rope_base == kLogRopeBase500000 ? 2
                                                                   : 3;
  out->push_back(static_cast<char>((shift.half_split ? kFlagHalfSplit : 0) | (base << 1) |
                                   (shift.tail ? kFlagTail : 0)));
  auto varint = [out](uint64_t v) {
    for (; v >= 0x80; v >>= 7) out->push_back(static_cast<char>(0x80 | (v & 0x7f)));
    out->push_back(static_cast<char>(v));
  };
  varint(shift.token_shift);
  const int64_t r = shift.rotation;
  varint(r >= 0 ? static_cast<uint64_t>(r) << 1 : (static_cast<uint64_t>(-r) << 1) - 1);
  if (base == 3) {
    uint32_t bits;
    std::memcpy(&bits, &shift.log_rope_base, 4);
    PutLE<uint32_t>(out, bits);
  }
  varint(shift.reference_parent_node_id);
}

absl::StatusOr<ReferenceShift> ParseReferenceShift(const BlockGeometry& geometry,
                                                   absl::string_view* params) {
  absl::string_view p = *params;
  auto truncated = [] { return absl::DataLossError("reference shift: params truncated"); };
  // LEB128 of at most `max_bytes` bytes; false when truncated or longer.
  auto varint = [&p](int max_bytes, uint64_t* v) {
    *v = 0;
    for (int i = 0; i < max_bytes && !p.empty(); ++i) {
      const uint8_t byte = static_cast<uint8_t>(p.front());
      p.remove_prefix(1);
      *v |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if (!(byte & 0x80)) return true;
    }
    return false;
  };
  if (p.empty()) return truncated();
  const uint8_t flags = static_cast<uint8_t>(p.front());
  p.remove_prefix(1);
  if (flags & ~(kFlagHalfSplit | kBaseMask | kFlagTail)) {
    return absl::DataLossError(absl::StrCat("reference shift: unknown flags ", flags));
  }
  ReferenceShift s;
  s.enabled = true;
  s.half_split = (flags & kFlagHalfSplit) != 0;
  s.tail = (flags & kFlagTail) != 0;
  uint64_t token_shift, rotation, parent;
  if (!varint(3, &token_shift) || !varint(3, &rotation)) return truncated();
  if (token_shift >= geometry.block_tokens || rotation > 2ull * kMaxShiftRotation) {
    return absl::DataLossError(absl::StrCat("reference shift: token_shift ", token_shift,
                                            " or rotation code ", rotation, " out of range"));
  }
  s.token_shift = static_cast<uint32_t>(token_shift);
  s.rotation = (rotation & 1) ? -static_cast<int32_t>((rotation + 1) >> 1)
                              : static_cast<int32_t>(rotation >> 1);
  switch ((flags & kBaseMask) >> 1) {
    case 0:
      s.log_rope_base = 0;
      break;
    case 1:
      s.log_rope_base = kLogRopeBase10000;
      break;
    case 2:
      s.log_rope_base = kLogRopeBase500000;
      break;
    default: {
      if (p.size() < 4) return truncated();
      const uint32_t bits = GetLE<uint32_t>(p.data());
      std::memcpy(&s.log_rope_base, &bits, 4);
      p.remove_prefix(4);
      if (!(s.log_rope_base > 0)) {  // 0 has its own code; NaN and negatives are malformed
        return absl::DataLossError("reference shift: explicit RoPE base not above 1");
      }
    }
  }
  if (!varint(10, &parent)) return truncated();
  s.reference_parent_node_id = parent;
  if (const std::string problem = ShiftProblem(geometry, s); !problem.empty()) {
    return absl::DataLossError(absl::StrCat("reference shift: ", problem));
  }
  *params = p;
  return s;
}

void DetectShiftRope(const BlockGeometry& g, absl::Span<const uint8_t> kv,
                     absl::Span<const uint8_t> reference,
                     absl::Span<const uint8_t> reference_parent, ReferenceShift* shift) {
  struct Option {
    float log_base;
    bool half_split;
  };
  std::vector<Option> options = {
      {0.0f, false}, {kLogRopeBase10000, false}, {kLogRopeBase500000, false}};
  if (g.head_dim % 2 == 0 && g.head_dim >= 4) {
    options.push_back({options[1].log_base, true});
    options.push_back({options[2].log_base, true});
  }
  const size_t D = g.head_dim, T = g.block_tokens, w = DTypeBytes(g.dtype);
  std::vector<float> x(D), y(D);
  double none_sse = 0, best_sse = std::numeric_limits<double>::infinity();
  Option best = options[0];
  for (const Option& o : options) {
    const std::vector<Turn> turns = MakeTurns(g, *shift, o.log_base, o.half_split);
    double sse = 0;
    for (size_t l = 0; l < g.num_layers; ++l) {
      for (size_t h = 0; h < g.num_kv_heads; ++h) {
        const size_t head = (l * 2 * g.num_kv_heads + h) * T * D;  // the K plane's head h
        for (uint32_t j = 0; j < T; ++j) {
          ToFloat(g.dtype, kv.data() + (head + j * D) * w, D, x.data());
          ToFloat(g.dtype, SourceRow(g, *shift, reference, reference_parent, head, j), D, y.data());
          if (o.log_base > 0)
            TurnRow(turns[ExtraTurn(*shift, j)], MaxFiniteValue(g.dtype), y.data());
          for (size_t d = 0; d < D; ++d) {
            const double e = static_cast<double>(x[d]) - y[d];
            sse += e * e;
          }
        }
      }
    }
    if (o.log_base == 0) none_sse = sse;
    if (sse < best_sse) {
      best_sse = sse;
      best = o;
    }
  }
  if (best.log_base > 0 && !(best_sse < 0.98 * none_sse)) best = options[0];
  shift->log_rope_base = best.log_base;
  shift->half_split = best.half_split;
}

absl::Status BuildShiftedReference(const BlockGeometry& g, const ReferenceShift& shift,
                                   absl::Span<const uint8_t> reference,
                                   absl::Span<const uint8_t> reference_parent,
                                   absl::Span<uint8_t> out) {
  const size_t n = g.num_bytes();
  if (reference.size() != n || out.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("reference: ", reference.size(), " bytes (out ",
                                                   out.size(), "), the block has ", n));
  }
  if (shift.token_shift > 0 && !shift.tail) {
    if (reference_parent.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("reference_parent: the block is coded against a shifted centroid whose "
                       "parent (node ",
                       shift.reference_parent_node_id, ") was not given"));
    }
    if (reference_parent.size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference_parent: ", reference_parent.size(), " bytes, the block has ", n));
    }
  }
  const size_t D = g.head_dim, T = g.block_tokens, w = DTypeBytes(g.dtype);
  const bool turn_keys = shift.log_rope_base > 0;
  const std::vector<Turn> turns = MakeTurns(g, shift, shift.log_rope_base, shift.half_split);
  std::vector<float> row(D);
  for (size_t l = 0; l < g.num_layers; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < g.num_kv_heads; ++h) {
        const size_t head = ((l * 2 + kv) * g.num_kv_heads + h) * T * D;
        for (uint32_t j = 0; j < T; ++j) {
          const uint8_t* src = SourceRow(g, shift, reference, reference_parent, head, j);
          uint8_t* dst = out.data() + (head + j * D) * w;
          if (kv == 1 || !turn_keys) {
            std::memcpy(dst, src, D * w);
            continue;
          }
          ToFloat(g.dtype, src, D, row.data());
          TurnRow(turns[ExtraTurn(shift, j)], MaxFiniteValue(g.dtype), row.data());
          FromFloat(g.dtype, row.data(), D, dst);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvtrie
