#include "codec/block_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/baselines.h"
#include "codec/centroid_lossless.h"
#include "codec/fast_lossless.h"
#include "codec/fast_lossless_learned.h"
#include "codec/fast_residual.h"
#include "codec/lossless.h"
#include "codec/predictor_state.h"
#include "codec/residual_codec.h"

namespace kvtrie {
namespace {

constexpr char kLosslessHalfWords = 2;
constexpr char kLosslessCentroidDiff = 3;  // centroid_lossless.h; needs context.reference

}  // namespace

absl::Status CheckFinite(const BlockGeometry& g, uint32_t layer_begin,
                         absl::Span<const uint8_t> kv) {
  const size_t width = DTypeBytes(g.dtype);
  const size_t n = kv.size() / width;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = kv.data() + i * width;
    bool finite = true, nan = false;
    switch (g.dtype) {
      case DType::kFp16: {
        const uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
        finite = (h & 0x7c00) != 0x7c00;
        nan = !finite && (h & 0x03ff) != 0;
        break;
      }
      case DType::kBf16: {
        const uint16_t b = static_cast<uint16_t>(p[0] | (p[1] << 8));
        finite = (b & 0x7f80) != 0x7f80;
        nan = !finite && (b & 0x007f) != 0;
        break;
      }
      case DType::kFp32: {
        float f;
        std::memcpy(&f, p, 4);
        finite = std::isfinite(f);
        nan = std::isnan(f);
        break;
      }
      case DType::kFp8E4m3:
      case DType::kFp8E5m2:
      case DType::kUint8:
        break;  // stored as bytes (no lossy encoding takes them)
    }
    if (finite) continue;
    // Block layout: [layer][K/V][head][token][channel].
    size_t r = i;
    const size_t channel = r % g.head_dim;
    r /= g.head_dim;
    const size_t token = r % g.block_tokens;
    r /= g.block_tokens;
    const size_t head = r % g.num_kv_heads;
    r /= g.num_kv_heads;
    const size_t kv_index = r % 2;
    const size_t layer = layer_begin + r / 2;
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " ", kv_index == 0 ? "K" : "V",
                                                   " head ", head, " token ", token, " channel ",
                                                   channel, " is ", nan ? "NaN" : "infinite"));
  }
  return absl::OkStatus();
}

namespace {

// FromFloat of a lossy reconstruction: finite values beyond the dtype's range saturate to its
// largest finite value (a quantizer may overshoot the input's absmax by half a step). NaN stays.
void FromFloatSaturating(DType dtype, float* y, size_t n, void* out) {
  const float limit = MaxFiniteValue(dtype);
  for (size_t i = 0; i < n; ++i) {
    if (y[i] > limit) y[i] = limit;
    if (y[i] < -limit) y[i] = -limit;
  }
  FromFloat(dtype, y, n, out);
}

// Fills the error statistics of `result` from the original and decoded blocks (as floats).
void MeasureError(const BlockGeometry& g, const float* x, const float* y, EncodedBlock* result) {
  double err[2] = {0, 0}, energy[2] = {0, 0}, max_abs = 0;
  const size_t plane = g.plane_elements();
  for (size_t i = 0; i < g.num_elements(); ++i) {
    const size_t kv = (i / plane) % 2;
    const double e = static_cast<double>(x[i]) - y[i];
    err[kv] += e * e;
    energy[kv] += static_cast<double>(x[i]) * x[i];
    max_abs = std::max(max_abs, std::fabs(e));
  }
  result->rel_rms_error_k = energy[0] > 0 ? std::sqrt(err[0] / energy[0]) : std::sqrt(err[0]);
  result->rel_rms_error_v = energy[1] > 0 ? std::sqrt(err[1] / energy[1]) : std::sqrt(err[1]);
  result->max_abs_error = max_abs;
}

}  // namespace

namespace {

// EncodeBlock without the envelope's checks (flags bits 2 and 3). Sets *checksum to the content
// checksum of what the block decodes to when options.content_checksum.
absl::StatusOr<EncodedBlock> EncodeUnchecked(const BlockGeometry& geometry,
                                             absl::Span<const uint8_t> kv,
                                             const EncodeOptions& options,
                                             const PredictionContext& context, uint64_t* checksum) {
  if (auto s = geometry.Validate(); !s.ok()) return s;
  if (kv.size() != geometry.num_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("kv: expected ", geometry.num_bytes(),
                                                   " bytes for ", geometry.DebugString(), ", got ",
                                                   kv.size()));
  }
  if (IsByteDType(geometry.dtype)) {
    // FP8 and uint8 caches are stored bit-exact: the lossy coders' float models (steps, scales,
    // predictors) are not defined on them, and a learned or shifted prediction is float too.
    if (IsLossyEncoding(options.encoding)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype: ", DTypeName(geometry.dtype),
                       " blocks can be stored RAW or LOSSLESS only (encoding ",
                       EncodingName(options.encoding), " is lossy)"));
    }
    if (options.reference_shift.enabled) {
      return absl::InvalidArgumentError(absl::StrCat("reference_shift: ", DTypeName(geometry.dtype),
                                                     " blocks are not predicted from a "
                                                     "shifted (RoPE-rotated) reference"));
    }
  }
  const absl::string_view raw(reinterpret_cast<const char*>(kv.data()), kv.size());
  EncodedBlock result;
  // Lossless encodings decode to `kv` itself; the lossy ones overwrite this below.
  if (options.content_checksum && !IsLossyEncoding(options.encoding)) {
    *checksum = internal::ContentChecksum(kv);
  }
  // A shifted reference: the codecs below see the window (reference_shift.h) as the reference.
  ReferenceShift shift = options.reference_shift;
  std::vector<uint8_t> window;
  PredictionContext shifted_context;
  if (shift.enabled) {
    if (options.profile != Profile::kCompact ||
        (options.encoding != Encoding::kResidual && options.encoding != Encoding::kLossless)) {
      return absl::InvalidArgumentError(
          "reference_shift: only the compact residual and lossless encodings predict from a "
          "shifted reference");
    }
    if (options.reference_node_id == 0 || context.reference.empty()) {
      return absl::InvalidArgumentError(
          "reference_shift: needs reference_node_id and the reference block");
    }
    if (context.reference.size() != kv.size() ||
        (shift.token_shift > 0 && !shift.tail && context.reference_parent.size() != kv.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reference_shift: the reference (", context.reference.size(), " bytes) and its parent (",
          context.reference_parent.size(), " bytes) must each have the block's ", kv.size()));
    }
    if (shift.log_rope_base < 0) {
      internal::DetectShiftRope(geometry, kv, context.reference, context.reference_parent, &shift);
    }
    if (auto s = internal::CheckReferenceShift(geometry, shift); !s.ok()) return s;
    window.resize(kv.size());
    if (auto s = internal::BuildShiftedReference(geometry, shift, context.reference,
                                                 context.reference_parent, absl::MakeSpan(window));
        !s.ok()) {
      return s;
    }
    shifted_context = context;
    shifted_context.reference = window;
    shifted_context.reference_parent = {};
  }
  const PredictionContext& ctx = shift.enabled ? shifted_context : context;
  if (options.profile == Profile::kFast && options.encoding == Encoding::kLossless) {
    std::string payload;
    CompressFastLossless(geometry, kv, &payload);
    uint8_t version = kFastLosslessParamsVersion;
    if (options.learned_lossless && context.learned != nullptr &&
        CanCodeFastLosslessLearned(geometry, *context.learned, context.tokens)) {
      // Against the learned state when that is smaller (bench/lossless.md: 1.6x vs 1.12x).
      std::string learned;
      CompressFastLosslessLearned(geometry, kv, *context.learned, context.tokens,
                                  context.first_position, context.previous_token, &learned);
      if (learned.size() < payload.size()) {
        payload = std::move(learned);
        version = kFastLosslessLearnedParamsVersion;
        result.predictor_version = context.learned->version();
      }
    }
    result.bytes =
        internal::WriteEnvelope(Encoding::kLossless, geometry, 0, std::string(1, version), payload,
                                Profile::kFast, result.predictor_version);
    result.bits_per_component = 8.0 * result.bytes.size() / geometry.num_elements();
    return result;
  }
  if (options.profile == Profile::kFast && options.encoding == Encoding::kResidual) {
    internal::FastOutput fast;
    absl::Status s = internal::EncodeFastResidual(geometry, kv, options, context, &fast);
    if (s.ok()) {
      result.predictor_version = fast.uses_learned ? context.learned->version() : 0;
      *checksum = fast.content_checksum;
      result.learned_bytes_saved = fast.uses_learned ? fast.learned_saved_bits / 8 : 0;
      result.bytes =
          internal::WriteEnvelope(Encoding::kResidual, geometry, 0, fast.params, fast.payload,
                                  Profile::kFast, result.predictor_version);
      result.bits_per_component = 8.0 * result.bytes.size() / geometry.num_elements();
      result.rel_rms_error_k = fast.rel_rms_error[0];
      result.rel_rms_error_v = fast.rel_rms_error[1];
      result.max_abs_error = fast.max_abs_error;
      std::memcpy(result.predictor_count, fast.predictor_count, sizeof(result.predictor_count));
      return result;
    }
    // A NaN or an infinity: the compact profile handles those.
    if (!absl::IsFailedPrecondition(s)) return s;
  }
  switch (options.encoding) {
    case Encoding::kRaw:
      result.bytes = internal::WriteEnvelope(Encoding::kRaw, geometry, 0, {}, raw);
      break;
    case Encoding::kLossless: {
      // params: empty = byte planes + zstd (any dtype); "\x02" = CompressHalfWords (2-byte dtypes).
      std::string payload;
      std::string params;
      if (!ctx.reference.empty() && options.reference_node_id != 0) {
        if (ctx.reference.size() != kv.size()) {
          return absl::InvalidArgumentError(absl::StrCat("reference: ", ctx.reference.size(),
                                                         " bytes, the block has ", kv.size()));
        }
        params = std::string(1, kLosslessCentroidDiff);
        CompressCentroidDiff(kv, ctx.reference, DTypeBytes(geometry.dtype), &payload);
        result.bytes =
            internal::WriteEnvelope(Encoding::kLossless, geometry, options.reference_node_id,
                                    params, payload, Profile::kCompact, 0, &shift);
        break;
      }
      if (DTypeBytes(geometry.dtype) == 2) {
        params = std::string(1, kLosslessHalfWords);
        CompressHalfWords(geometry, kv, &payload);
      } else {
        CompressBytePlanes(kv, DTypeBytes(geometry.dtype), &payload);
      }
      result.bytes = internal::WriteEnvelope(Encoding::kLossless, geometry, 0, params, payload);
      break;
    }
    case Encoding::kResidual:
    case Encoding::kInt8:
    case Encoding::kKivi2:
    case Encoding::kTurboQuant: {
      if (auto s = CheckFinite(geometry, 0, kv); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv: ", s.message(), "; encoding ", EncodingName(options.encoding),
                         " needs finite values (raw and lossless store any value exactly)"));
      }
      std::vector<float> x(geometry.num_elements());
      ToFloat(geometry.dtype, kv.data(), x.size(), x.data());
      internal::LossyOutput lossy;
      absl::Status s =
          options.encoding == Encoding::kResidual
              ? internal::EncodeResidual(geometry, x.data(), options, ctx, &lossy)
              : internal::EncodeBaseline(options.encoding, geometry, x.data(), options, &lossy);
      if (!s.ok()) return s;
      const int centroid = static_cast<int>(Predictor::kCentroid);
      const bool uses_reference =
          lossy.predictor_count[0][centroid] + lossy.predictor_count[1][centroid] > 0;
      const int token_mean = static_cast<int>(Predictor::kTokenMean);
      const bool uses_learned =
          lossy.predictor_count[0][token_mean] + lossy.predictor_count[1][token_mean] > 0;
      result.predictor_version = uses_learned ? context.learned->version() : 0;
      result.bytes = internal::WriteEnvelope(
          options.encoding, geometry, uses_reference ? options.reference_node_id : 0, lossy.params,
          lossy.payload, Profile::kCompact, result.predictor_version,
          uses_reference ? &shift : nullptr);
      // What the decoder returns: the reconstruction rounded to the dtype.
      std::vector<uint8_t> decoded(geometry.num_bytes());
      FromFloatSaturating(geometry.dtype, lossy.recon.data(), lossy.recon.size(), decoded.data());
      if (auto s = CheckFinite(geometry, 0, decoded); !s.ok()) {
        // Never store what would decode to a value the Put did not send.
        return absl::InvalidArgumentError(absl::StrCat(
            "kv: ", s.message(), " after encoding ", EncodingName(options.encoding),
            ": the block holds values outside the range this encoding can represent; use "
            "lossless"));
      }
      if (options.content_checksum && options.encoding == Encoding::kResidual) {
        *checksum = internal::ContentChecksum(decoded);
      } else if (options.content_checksum) {
        // The baselines' encoders keep no reconstruction that is bit-exact with their decoders':
        // hash what the decoder returns.
        std::vector<uint8_t> out(geometry.num_bytes());
        if (auto s = DecodeVerifiedBlock(result.bytes, absl::MakeSpan(out), ctx); !s.ok()) {
          return absl::InternalError(
              absl::StrCat("encode: the block does not decode: ", s.message()));
        }
        *checksum = internal::ContentChecksum(out);
      }
      ToFloat(geometry.dtype, decoded.data(), lossy.recon.size(), lossy.recon.data());
      MeasureError(geometry, x.data(), lossy.recon.data(), &result);
      // An error larger than the block's largest magnitude means the encoding's own fields (fp16
      // scales, norms, float arithmetic) could not hold the values: refuse rather than store it.
      float max_abs = 0;
      for (float v : x) max_abs = std::max(max_abs, std::fabs(v));
      if (max_abs > 0 && result.max_abs_error >= max_abs) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv: values up to ", max_abs, " are outside the range encoding ",
                         EncodingName(options.encoding), " can represent (error ",
                         result.max_abs_error, "); use lossless"));
      }
      std::memcpy(result.predictor_count, lossy.predictor_count, sizeof(result.predictor_count));
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("encoding: unknown value ", static_cast<int>(options.encoding)));
  }
  result.bits_per_component = 8.0 * result.bytes.size() / geometry.num_elements();
  return result;
}

}  // namespace

absl::StatusOr<EncodedBlock> EncodeBlock(const BlockGeometry& geometry,
                                         absl::Span<const uint8_t> kv, const EncodeOptions& options,
                                         const PredictionContext& context) {
  uint64_t checksum = 0;
  absl::StatusOr<EncodedBlock> result = EncodeUnchecked(geometry, kv, options, context, &checksum);
  if (!result.ok() || !options.content_checksum) return result;
  const uint64_t fingerprint = result->predictor_version != 0 ? context.learned->fingerprint() : 0;
  result->bytes = internal::AddEnvelopeChecks(result->bytes, fingerprint, &checksum);
  result->bits_per_component = 8.0 * result->bytes.size() / geometry.num_elements();
  return result;
}

namespace {

absl::Status DecodeParsed(const absl::StatusOr<BlockHeader>& h, absl::Span<uint8_t> out,
                          const PredictionContext& context);

// DecodeParsed, then the content checksum (flags bit 2) of what it wrote.
absl::Status DecodeChecked(const absl::StatusOr<BlockHeader>& h, absl::Span<uint8_t> out,
                           const PredictionContext& context) {
  if (absl::Status s = DecodeParsed(h, out, context); !s.ok()) return s;
  if (!h->has_content_checksum) return absl::OkStatus();
  const uint64_t actual = internal::ContentChecksum(out);
  if (actual != h->content_checksum) {
    return absl::DataLossError(absl::StrCat(
        "encoded block: content checksum mismatch (stored ", absl::Hex(h->content_checksum),
        ", decoded ", absl::Hex(actual), "): the block decodes to other values than were encoded"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeBlock(absl::string_view encoded, absl::Span<uint8_t> out,
                         const PredictionContext& context) {
  return DecodeChecked(ParseBlock(encoded), out, context);
}

absl::Status DecodeVerifiedBlock(absl::string_view encoded, absl::Span<uint8_t> out,
                                 const PredictionContext& context) {
  return DecodeChecked(ParseVerifiedBlock(encoded), out, context);
}

namespace {

absl::Status DecodeParsed(const absl::StatusOr<BlockHeader>& h, absl::Span<uint8_t> out,
                          const PredictionContext& context) {
  if (!h.ok()) return h.status();
  if (out.size() != h->geometry.num_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("out: block needs ", h->geometry.num_bytes(),
                                                   " bytes, buffer has ", out.size()));
  }
  if (h->predictor_version != 0) {
    if (context.learned == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("learned: the block is coded against predictor state version ",
                       h->predictor_version, " and no predictor state was given"));
    }
    if (context.learned->version() != h->predictor_version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "learned: the block is coded against predictor state version ", h->predictor_version,
          ", the given state is version ", context.learned->version()));
    }
    if (h->predictor_fingerprint != 0 &&
        context.learned->fingerprint() != h->predictor_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "learned: the block is coded against a predictor state version ", h->predictor_version,
          " with fingerprint ", absl::Hex(h->predictor_fingerprint),
          ", the given state has fingerprint ", absl::Hex(context.learned->fingerprint())));
    }
    if (context.tokens.size() != h->geometry.block_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tokens: the block is coded against predictor state version ", h->predictor_version,
          " and needs its ", h->geometry.block_tokens, " token ids, got ", context.tokens.size()));
    }
    if (auto s = internal::CheckLearnedGeometry(*context.learned, h->geometry); !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
  }
  std::vector<uint8_t> window;
  PredictionContext shifted_context;
  if (h->reference_shift.enabled) {
    if (h->encoding == Encoding::kLossless &&
        (h->params.size() != 1 || h->params[0] != kLosslessCentroidDiff)) {
      return absl::DataLossError("lossless params: a shifted reference outside centroid mode");
    }
    if (context.reference.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("reference: the block is coded against centroid node ", h->reference_node_id,
                       " and no reference block was given"));
    }
    window.resize(out.size());
    if (auto s = internal::BuildShiftedReference(h->geometry, h->reference_shift, context.reference,
                                                 context.reference_parent, absl::MakeSpan(window));
        !s.ok()) {
      return s;
    }
    shifted_context = context;
    shifted_context.reference = window;
    shifted_context.reference_parent = {};
  }
  const PredictionContext& ctx = h->reference_shift.enabled ? shifted_context : context;
  if (h->profile == Profile::kFast) {
    if (h->encoding == Encoding::kResidual) {
      return internal::DecodeFastResidual(
          h->geometry, h->params, h->payload, out,
          h->predictor_version != 0 ? context : PredictionContext{});
    }
    if (h->params.size() == 1 &&
        static_cast<uint8_t>(h->params[0]) == kFastLosslessLearnedParamsVersion) {
      if (h->predictor_version == 0) {
        return absl::DataLossError("lossless params: the learned mode names no predictor version");
      }
      return DecompressFastLosslessLearned(h->geometry, h->payload, *context.learned,
                                           context.tokens, context.first_position,
                                           context.previous_token, out);
    }
    if (h->params.size() != 1 || static_cast<uint8_t>(h->params[0]) != kFastLosslessParamsVersion) {
      return absl::DataLossError("lossless params: unknown fast mode");
    }
    if (h->predictor_version != 0) {
      return absl::DataLossError("lossless params: the byte-plane mode names a predictor version");
    }
    return DecompressFastLossless(h->geometry, h->payload, out);
  }
  switch (h->encoding) {
    case Encoding::kRaw:
      if (h->payload.size() != out.size()) {
        return absl::DataLossError(
            absl::StrCat("raw payload: ", h->payload.size(), " bytes, block needs ", out.size()));
      }
      std::memcpy(out.data(), h->payload.data(), out.size());
      return absl::OkStatus();
    case Encoding::kLossless:
      if (h->params.empty()) {
        return DecompressBytePlanes(h->payload, DTypeBytes(h->geometry.dtype), out);
      }
      if (h->params.size() == 1 && h->params[0] == kLosslessHalfWords) {
        return DecompressHalfWords(h->geometry, h->payload, out);
      }
      if (h->params.size() == 1 && h->params[0] == kLosslessCentroidDiff) {
        if (ctx.reference.empty()) {
          return absl::FailedPreconditionError(
              absl::StrCat("reference: the block is coded against centroid node ",
                           h->reference_node_id, " and no reference block was given"));
        }
        return DecompressCentroidDiff(h->payload, ctx.reference, DTypeBytes(h->geometry.dtype),
                                      out);
      }
      return absl::DataLossError("lossless params: unknown mode");
    case Encoding::kResidual:
    case Encoding::kInt8:
    case Encoding::kKivi2:
    case Encoding::kTurboQuant: {
      std::vector<float> y(h->geometry.num_elements());
      PredictionContext rctx = ctx;  // the shifted window when there is one
      if (h->predictor_version == 0) rctx.learned = nullptr;  // the block names no state
      absl::Status s =
          h->encoding == Encoding::kResidual
              ? internal::DecodeResidual(h->geometry, h->params, h->payload, rctx, y.data())
              : internal::DecodeBaseline(h->encoding, h->geometry, h->params, h->payload, y.data());
      if (!s.ok()) return s;
      FromFloatSaturating(h->geometry.dtype, y.data(), y.size(), out.data());
      return absl::OkStatus();
    }
  }
  return absl::DataLossError("encoded block: unknown encoding");
}

}  // namespace

}  // namespace kvtrie
