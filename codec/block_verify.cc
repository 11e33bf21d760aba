// VerifyEncodedBlock (codec/block_verify.h): the structure of an encoded Put's block, checked
// without decoding. Byte layouts: codec/block_codec.h, codec/FORMAT.md.
#include "codec/block_verify.h"

#include <zstd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "codec/fast_lossless.h"
#include "codec/fast_lossless_learned.h"
#include "codec/fast_residual.h"
#include "codec/fast_residual_format.h"
#include "codec/fast_residual_kernels.h"
#include "codec/predictor_state.h"
#include "codec/rans_interleaved.h"

namespace kvtrie {
namespace {

using internal::fast::BucketBits;
using internal::fast::kBuckets;
using internal::fast::kPredMean;
using internal::fast::kPredToken;
namespace ff = internal::fast_format;

absl::Status Bad(absl::string_view what) { return absl::InvalidArgumentError(what); }

uint32_t Load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The geometry and dtype of the block against the model's.
absl::Status CheckGeometry(const BlockGeometry& model, const BlockGeometry& block) {
  const struct {
    const char* name;
    uint32_t block, model;
  } fields[] = {{"num_layers", block.num_layers, model.num_layers},
                {"num_kv_heads", block.num_kv_heads, model.num_kv_heads},
                {"block_tokens", block.block_tokens, model.block_tokens},
                {"head_dim", block.head_dim, model.head_dim}};
  for (const auto& f : fields) {
    if (f.block != f.model) {
      return Bad(absl::StrCat(f.name, ": the block has ", f.block, ", the model ", f.model));
    }
  }
  if (block.dtype != model.dtype) {
    return Bad(absl::StrCat("dtype: the block is ", DTypeName(block.dtype), ", the model ",
                            DTypeName(model.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckFastLossless(const BlockGeometry& g, const BlockHeader& h) {
  if (h.params.size() == 1 &&
      static_cast<uint8_t>(h.params[0]) == kFastLosslessLearnedParamsVersion) {
    if (h.predictor_version == 0) return Bad("params: the learned mode (5) names no state version");
    absl::Status s = CheckFastLosslessLearnedLayout(g, h.payload);
    return s.ok() ? s : Bad(s.message());
  }
  if (h.predictor_version != 0) {
    return Bad("predictor_version: the fast LOSSLESS params (4) take no state");
  }
  if (h.params.size() != 1 || static_cast<uint8_t>(h.params[0]) != kFastLosslessParamsVersion) {
    return Bad("params: not the fast LOSSLESS params (one byte, 4 or 5)");
  }
  const size_t eb = DTypeBytes(g.dtype), n = g.num_elements();
  if (h.payload.size() < 4) return Bad("payload: truncated before the zstd frame length");
  const uint32_t frame = Load32(h.payload.data());
  if (frame > h.payload.size() - 4) {
    return Bad(absl::StrCat("payload: the zstd frame (", frame, " bytes) runs past the payload (",
                            h.payload.size() - 4, " bytes after its length)"));
  }
  if (h.payload.size() - 4 - frame != (eb - 1) * n) {
    return Bad(absl::StrCat("payload: ", h.payload.size() - 4 - frame,
                            " bytes of low byte planes after the zstd frame, the block needs ",
                            (eb - 1) * n));
  }
  const char* f = h.payload.data() + 4;
  const size_t whole = ZSTD_findFrameCompressedSize(f, frame);
  if (ZSTD_isError(whole) || whole != frame) {
    return Bad(absl::StrCat("payload: the zstd frame is not one whole frame of ", frame, " bytes"));
  }
  const unsigned long long content = ZSTD_getFrameContentSize(f, frame);
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != n) {
    return Bad(absl::StrCat("payload: the zstd frame holds ", content, " bytes, the block has ", n,
                            " elements"));
  }
  return absl::OkStatus();
}

// One bitmap of 2L plane bits; bits past 2L must be 0.
absl::Status ReadPlaneBitmap(absl::string_view* in, size_t planes, const char* name,
                             std::vector<uint8_t>* bits) {
  const size_t bytes = (planes + 7) / 8;
  if (in->size() < bytes) return Bad(absl::StrCat("params: truncated in the ", name, " bitmap"));
  bits->assign(planes, 0);
  for (size_t pl = 0; pl < bytes * 8; ++pl) {
    const bool bit = (static_cast<uint8_t>((*in)[pl / 8]) >> (pl % 8)) & 1;
    if (pl >= planes && bit) {
      return Bad(absl::StrCat("params: the ", name, " bitmap names plane ", pl, " of ", planes));
    }
    if (pl < planes) (*bits)[pl] = bit;
  }
  in->remove_prefix(bytes);
  return absl::OkStatus();
}

absl::Status CheckFastResidual(const BlockGeometry& g, const BlockHeader& h,
                               const PredictorState* learned) {
  const size_t H = g.num_kv_heads, D = g.head_dim, planes = 2 * size_t{g.num_layers};
  const size_t pe = H * g.block_tokens * D;
  absl::string_view params = h.params;
  if (params.size() < 6) return Bad("params: truncated before the lane layout");
  if (static_cast<uint8_t>(params[0]) != internal::kFastResidualParamsVersion) {
    return Bad(absl::StrCat("params: version ", static_cast<uint8_t>(params[0]), ", expected ",
                            internal::kFastResidualParamsVersion));
  }
  const uint8_t flags = static_cast<uint8_t>(params[1]);
  constexpr uint8_t kKnown = ff::kFlagSharedTables | ff::kFlagZeroPlanes | ff::kFlagAllLearned |
                             ff::kFlagWideCodes | ff::kFlagLinearPlanes | ff::kFlagKltPlanes;
  if ((flags & ~kKnown) != 0 || params[3] != 0 ||
      ((flags & ff::kFlagWideCodes) && (flags & (ff::kFlagAllLearned | ff::kFlagLinearPlanes))) ||
      ((flags & ff::kFlagLinearPlanes) && !(flags & ff::kFlagAllLearned))) {
    return Bad(absl::StrCat("params: bad flags ", flags));
  }
  const int lanes = static_cast<uint8_t>(params[2]);
  const size_t per_segment =
      static_cast<uint8_t>(params[4]) | (static_cast<size_t>(static_cast<uint8_t>(params[5])) << 8);
  absl::string_view in = params.substr(6);
  std::vector<uint8_t> zero(planes, 0), linear(planes, 0), klt(planes, 0);
  if (flags & ff::kFlagZeroPlanes) {
    if (auto s = ReadPlaneBitmap(&in, planes, "zero-plane", &zero); !s.ok()) return s;
  }
  if (flags & ff::kFlagLinearPlanes) {
    if (auto s = ReadPlaneBitmap(&in, planes, "linear-plane", &linear); !s.ok()) return s;
  }
  if (flags & ff::kFlagKltPlanes) {
    if (auto s = ReadPlaneBitmap(&in, planes, "KLT-plane", &klt); !s.ok()) return s;
  }
  size_t coded = 0;
  bool side_coded[2] = {false, false};
  for (size_t pl = 0; pl < planes; ++pl) {
    if (zero[pl]) continue;
    ++coded;
    side_coded[pl % 2] = true;
  }
  if (lanes < 1 || lanes > irans::kMaxLanes || (lanes & (lanes - 1)) || pe % lanes != 0) {
    return Bad(absl::StrCat("params: ", lanes, " lanes (a power of two <= ", irans::kMaxLanes,
                            " dividing the plane's ", pe, " elements)"));
  }
  if (per_segment < 1 ||
      per_segment > std::min(std::max<size_t>(coded, 1), ff::kMaxSegmentPlanes)) {
    return Bad(
        absl::StrCat("params: ", per_segment, " planes per segment of ", coded, " coded planes"));
  }
  const bool all_learned = flags & ff::kFlagAllLearned, wide = flags & ff::kFlagWideCodes;
  const size_t pred_bytes = all_learned ? 0 : wide ? (H + 1) / 2 : (H + 3) / 4;
  size_t num_means = 0;
  uint64_t num_bits = 0;
  bool uses_learned = false;
  std::vector<uint8_t> escapable(planes, 0);  // a plane whose table has a bucket symbol
  std::vector<irans::Table> tables(planes);
  for (size_t pl = 0; pl < planes; ++pl) {
    const size_t step_bytes = zero[pl] ? 0 : 2;
    if (in.size() < step_bytes + pred_bytes) {
      return Bad(absl::StrCat("params: truncated at plane ", pl));
    }
    if (!zero[pl]) {
      const float step =
          Bf16ToFloat(static_cast<uint8_t>(in[0]) | (static_cast<uint8_t>(in[1]) << 8));
      if (!(step > 0) || !std::isfinite(step)) {
        return Bad(absl::StrCat("params: plane ", pl, " has step ", step));
      }
    }
    for (size_t hd = 0; hd < H; ++hd) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(in.data()) + step_bytes;
      const uint8_t c = all_learned ? (linear[pl] ? ff::kPredLinear : uint8_t{kPredToken})
                        : wide      ? (p[hd / 2] >> (4 * (hd % 2))) & 15
                                    : (p[hd / 4] >> (2 * (hd % 4))) & 3;
      if (c > ff::kPredLinear || (wide && H % 2 && hd + 1 == H && (p[hd / 2] >> 4) != 0)) {
        return Bad(absl::StrCat("params: plane ", pl, " head ", hd, " has predictor code ", c));
      }
      if (c >= kPredToken) {
        uses_learned = true;
        if (learned != nullptr && c == ff::kPredLinear && !learned->HasLinear(pl)) {
          return Bad(absl::StrCat("params: plane ", pl, " head ", hd,
                                  " uses a linear predictor predictor state version ",
                                  learned->version(), " has no weights for"));
        }
        if (learned != nullptr && klt[pl] && learned->Klt(pl) == nullptr) {
          return Bad(absl::StrCat("params: plane ", pl, " is coded in a KLT basis predictor ",
                                  "state version ", learned->version(), " has none for"));
        }
      }
      num_means += c == kPredMean;
    }
    in.remove_prefix(step_bytes + pred_bytes);
    if (zero[pl]) continue;
    uint64_t nbits = 0;
    for (int shift = 0;; shift += 7) {
      if (in.empty() || shift > 35) {
        return Bad(absl::StrCat("params: plane ", pl, " has a bad bucket bit count"));
      }
      const uint8_t b = static_cast<uint8_t>(in[0]);
      in.remove_prefix(1);
      nbits |= static_cast<uint64_t>(b & 127) << shift;
      if (!(b & 128)) break;
    }
    if (nbits > pe * BucketBits(kBuckets - 1)) {
      return Bad(absl::StrCat("params: plane ", pl, " has ", nbits, " bucket bits, more than ",
                              pe * BucketBits(kBuckets - 1), " possible"));
    }
    num_bits += nbits;
    if (flags & ff::kFlagSharedTables) continue;
    if (auto s = irans::ReadTable(&in, &tables[pl]); !s.ok()) {
      return Bad(absl::StrCat("params: plane ", pl, ": ", s.message()));
    }
  }
  if (flags & ff::kFlagSharedTables) {
    for (int k = 0; k < 2; ++k) {
      if (!side_coded[k]) continue;
      irans::Table t;
      if (auto s = irans::ReadTable(&in, &t); !s.ok()) {
        return Bad(absl::StrCat("params: the shared ", k ? "V" : "K", " table: ", s.message()));
      }
    }
  }
  if (in.size() != num_means * D * 2) {
    return Bad(absl::StrCat("params: ", in.size(), " bytes of channel means, ", num_means,
                            " channel-mean heads need ", num_means * D * 2));
  }
  if (uses_learned && h.predictor_version == 0) {
    return Bad("params: a learned predictor in a block that names no predictor_version");
  }
  // Payload: segment sizes, each segment's lane states and words, then the bucket bits.
  const absl::string_view payload = h.payload;
  const size_t ns = coded == 0 ? 0 : (coded + per_segment - 1) / per_segment;
  if (payload.size() / 4 < ns) {
    return Bad(
        absl::StrCat("payload: ", payload.size(), " bytes, too short for ", ns, " segment sizes"));
  }
  size_t at = 4 * ns;
  for (size_t sg = 0; sg < ns; ++sg) {
    const uint32_t size = Load32(payload.data() + 4 * sg);
    if (size > payload.size() - at) {
      return Bad(absl::StrCat("segment ", sg, " (", size, " bytes) runs past the payload"));
    }
    if (size < 4u * lanes) {
      return Bad(absl::StrCat("segment ", sg, " lane ", size / 4, " runs past the segment (", size,
                              " bytes hold ", size / 4, " of ", lanes, " lane states)"));
    }
    if ((size - 4u * lanes) % 2 != 0) {
      return Bad(absl::StrCat("segment ", sg, " ends in half a word"));
    }
    for (int j = 0; j < lanes; ++j) {
      if (Load32(payload.data() + at + 4 * j) < irans::kLow) {
        return Bad(absl::StrCat("segment ", sg, " lane ", j, " starts below 2^16"));
      }
    }
    const size_t planes_here = std::min(per_segment, coded - sg * per_segment);
    const uint64_t words = (size - 4u * lanes) / 2;
    if (words > planes_here * pe) {  // a symbol reads at most one word
      return Bad(absl::StrCat("segment ", sg, " has ", words, " words for ", planes_here * pe,
                              " symbols"));
    }
    at += size;
  }
  if (payload.size() - at != (num_bits + 7) / 8) {
    return Bad(absl::StrCat("payload: ", payload.size() - at,
                            " bytes of bucket bits after the segments, the planes need ",
                            (num_bits + 7) / 8));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockHeader> Verify(const BlockGeometry& model, absl::string_view encoded,
                                   const PredictorState* learned,
                                   const FindPredictorState* find_state) {
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok()) {
    absl::string_view m = h.status().message();
    absl::ConsumePrefix(&m, "encoded block: ");
    return Bad(m);
  }
  if (auto s = CheckGeometry(model, h->geometry); !s.ok()) return s;
  const bool fast = h->profile == Profile::kFast;
  const bool accepted =
      h->encoding == Encoding::kRaw ||
      (fast && (h->encoding == Encoding::kLossless || h->encoding == Encoding::kResidual));
  if (!accepted) {
    return Bad(absl::StrCat(
        "encoding: ", EncodingName(h->encoding), fast ? " of the fast profile" : "",
        h->encoding == Encoding::kResidual || h->encoding == Encoding::kLossless
            ? " of the compact profile"
            : "",
        " is not accepted in a Put (RAW, LOSSLESS fast and RESIDUAL fast are: their blocks "
        "decode without another block)"));
  }
  if (h->reference_node_id != 0) {
    return Bad(absl::StrCat("reference_node_id: ", h->reference_node_id,
                            ", must be 0 (centroid coding is the server's)"));
  }
  if (find_state != nullptr && h->predictor_version != 0) {
    absl::StatusOr<const PredictorState*> found = (*find_state)(h->predictor_version);
    if (!found.ok()) return found.status();
    learned = *found;
  }
  if (learned != nullptr && learned->version() != h->predictor_version) {
    return absl::InternalError(absl::StrCat("verify: given predictor state version ",
                                            learned->version(), " for a block naming ",
                                            h->predictor_version));
  }
  if (learned != nullptr && h->predictor_fingerprint != 0 &&
      learned->fingerprint() != h->predictor_fingerprint) {
    return Bad(
        absl::StrCat("predictor_fingerprint: the block was coded against a state with "
                     "fingerprint ",
                     absl::Hex(h->predictor_fingerprint, absl::kZeroPad16), "; version ",
                     h->predictor_version, " here is another state (fingerprint ",
                     absl::Hex(learned->fingerprint(), absl::kZeroPad16), ")"));
  }
  absl::Status s;
  switch (h->encoding) {
    case Encoding::kRaw:
      if (!h->params.empty()) return Bad("params: RAW has none");
      if (h->payload.size() != model.num_bytes()) {
        return Bad(absl::StrCat("payload: ", h->payload.size(), " bytes of RAW, the block needs ",
                                model.num_bytes()));
      }
      break;
    case Encoding::kLossless:
      s = CheckFastLossless(model, *h);
      break;
    default:
      s = CheckFastResidual(model, *h, learned);
      break;
  }
  if (!s.ok()) return s;
  return h;
}

}  // namespace

absl::StatusOr<BlockHeader> VerifyEncodedBlock(const BlockGeometry& model,
                                               absl::string_view encoded,
                                               const PredictorState* learned) {
  return Verify(model, encoded, learned, nullptr);
}

absl::StatusOr<BlockHeader> VerifyEncodedBlock(const BlockGeometry& model,
                                               absl::string_view encoded,
                                               FindPredictorState find_state) {
  return Verify(model, encoded, nullptr, &find_state);
}

}  // namespace kvtrie
