// Client-side encoding of Put blocks (client/put_encode.h).
#include "client/put_encode.h"

#include "absl/strings/str_cat.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"

namespace kvtrie {

absl::Status CheckClientEncoding(const PutOptions& options) {
  const bool fast = options.profile == v1::EncodingSpec::PROFILE_FAST ||
                    options.profile == v1::EncodingSpec::PROFILE_UNSPECIFIED;
  if (options.layers_per_message != 0) {
    return absl::InvalidArgumentError(
        "encode_on_client: a Put of layers_per_message > 0 is sent dense (whole blocks only)");
  }
  switch (options.encoding) {
    case v1::ENCODING_RAW:
      return absl::OkStatus();
    case v1::ENCODING_LOSSLESS:
      if (fast) return absl::OkStatus();
      break;
    case v1::ENCODING_RESIDUAL:
      if (fast && options.target_rel_rms > 0) return absl::OkStatus();
      if (fast) {
        return absl::InvalidArgumentError(
            "encode_on_client: RESIDUAL needs target_rel_rms > 0 (the server's default is not "
            "known to the client)");
      }
      break;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("encode_on_client: encoding ", v1::Encoding_Name(options.encoding),
                   " of profile ", v1::EncodingSpec::Profile_Name(options.profile),
                   " cannot be encoded by the client (ENCODING_RAW, or ENCODING_LOSSLESS or "
                   "ENCODING_RESIDUAL of PROFILE_FAST can)"));
}

absl::StatusOr<EncodedBlock> EncodePutBlock(const KvDump& kv, const BlockGeometry& g, size_t b,
                                            const PutOptions& options, const PredictorState* state,
                                            std::vector<uint8_t>* scratch) {
  scratch->resize(g.num_bytes());
  GatherBlock(g, kv.num_tokens(), kv.k.data(), kv.v.data(), b, absl::MakeSpan(*scratch));
  EncodeOptions o;
  o.encoding = static_cast<Encoding>(options.encoding);
  o.profile = Profile::kFast;
  o.target_rel_rms = options.target_rel_rms;
  o.learned_lossless = options.learned_lossless;
  const size_t off = b * g.block_tokens;
  const std::vector<int32_t> tokens(kv.token_ids.begin() + off,
                                    kv.token_ids.begin() + off + g.block_tokens);
  PredictionContext ctx;
  if (o.encoding == Encoding::kResidual || o.encoding == Encoding::kLossless) ctx.learned = state;
  ctx.tokens = tokens;
  ctx.first_position = static_cast<uint32_t>(off);
  ctx.previous_token = off == 0 ? -1 : static_cast<int32_t>(kv.token_ids[off - 1]);
  return EncodeBlock(g, *scratch, o, ctx);
}

}  // namespace kvtrie
