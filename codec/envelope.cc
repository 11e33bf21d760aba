#include "codec/envelope.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "codec/crc32c.h"
#include "codec/little_endian.h"
#include "xxhash.h"

namespace kvtrie {
namespace {

using internal::GetLE;
using internal::PutLE;

constexpr char kMagic[4] = {'K', 'V', 'B', '1'};
constexpr uint8_t kFormatVersion = 1;
constexpr size_t kFlagsOffset = 7;       // u8 flags, after magic, format_version, encoding, dtype
constexpr size_t kFixedHeader = 24;      // through the reference node id
constexpr size_t kVersionOffset = 24;    // u32 predictor version, with flags bit 1
constexpr uint8_t kFlagFastProfile = 1;  // envelope flags bit 0: Profile::kFast
constexpr uint8_t kFlagPredictorVersion = 2;  // bit 1: a u32 predictor version follows the node id
constexpr uint8_t kFlagContentChecksum = 4;   // bit 2: a u64 XXH3-64 of the decoded block follows
constexpr uint8_t kFlagStateFingerprint = 8;  // bit 3: a u64 state fingerprint follows the version
constexpr uint8_t kFlagShiftedReference = 0x80;  // bit 7: reference_shift.h prefix in params

}  // namespace

bool IsValidEncoding(uint32_t value) { return value >= 1 && value <= 6; }

bool IsLossyEncoding(Encoding encoding) {
  return encoding == Encoding::kResidual || encoding == Encoding::kInt8 ||
         encoding == Encoding::kKivi2 || encoding == Encoding::kTurboQuant;
}

absl::string_view EncodingName(Encoding encoding) {
  switch (encoding) {
    case Encoding::kRaw:
      return "raw";
    case Encoding::kLossless:
      return "lossless";
    case Encoding::kResidual:
      return "residual";
    case Encoding::kInt8:
      return "int8";
    case Encoding::kKivi2:
      return "kivi2";
    case Encoding::kTurboQuant:
      return "turboquant";
  }
  return "unknown";
}

absl::string_view PredictorName(Predictor predictor) {
  switch (predictor) {
    case Predictor::kNone:
      return "none";
    case Predictor::kChannelMean:
      return "channel_mean";
    case Predictor::kTemporal:
      return "temporal";
    case Predictor::kParent:
      return "parent";
    case Predictor::kCentroid:
      return "centroid";
    case Predictor::kExternal:
      return "external";
    case Predictor::kTokenMean:
      return "token_mean";
    case Predictor::kTokenMeanLinear:
      return "token_mean_linear";
  }
  return "unknown";
}

namespace internal {
std::string WriteEnvelope(Encoding encoding, const BlockGeometry& geometry,
                          uint64_t reference_node_id, absl::string_view params,
                          absl::string_view payload, Profile profile, uint32_t predictor_version,
                          const ReferenceShift* shift) {
  const bool shifted = shift != nullptr && shift->enabled;
  std::string out;
  out.reserve(kFixedHeader + 16 + params.size() + payload.size());
  out.append(kMagic, 4);
  PutLE<uint8_t>(&out, kFormatVersion);
  PutLE<uint8_t>(&out, static_cast<uint8_t>(encoding));
  PutLE<uint8_t>(&out, static_cast<uint8_t>(geometry.dtype));
  PutLE<uint8_t>(&out, (profile == Profile::kFast ? kFlagFastProfile : 0) |
                           (predictor_version != 0 ? kFlagPredictorVersion : 0) |
                           (shifted ? kFlagShiftedReference : 0));
  PutLE<uint16_t>(&out, static_cast<uint16_t>(geometry.num_layers));
  PutLE<uint16_t>(&out, static_cast<uint16_t>(geometry.num_kv_heads));
  PutLE<uint16_t>(&out, static_cast<uint16_t>(geometry.block_tokens));
  PutLE<uint16_t>(&out, static_cast<uint16_t>(geometry.head_dim));
  PutLE<uint64_t>(&out, reference_node_id);
  if (predictor_version != 0) PutLE<uint32_t>(&out, predictor_version);
  std::string prefix;
  if (shifted) AppendReferenceShift(*shift, &prefix);
  PutLE<uint32_t>(&out, static_cast<uint32_t>(prefix.size() + params.size()));
  out.append(prefix);
  out.append(params.data(), params.size());
  PutLE<uint32_t>(&out, static_cast<uint32_t>(payload.size()));
  out.append(payload.data(), payload.size());
  PutLE<uint32_t>(&out, Crc32c(out));
  return out;
}

std::string AddEnvelopeChecks(absl::string_view encoded, uint64_t fingerprint,
                              const uint64_t* content_checksum) {
  uint8_t flags = static_cast<uint8_t>(encoded[kFlagsOffset]);
  const bool has_version = (flags & kFlagPredictorVersion) != 0;
  size_t pos = kFixedHeader + (has_version ? 4 : 0);
  std::string extra;
  if (has_version && fingerprint != 0) {
    PutLE<uint64_t>(&extra, fingerprint);
    flags |= kFlagStateFingerprint;
  }
  if (content_checksum != nullptr) {
    PutLE<uint64_t>(&extra, *content_checksum);
    flags |= kFlagContentChecksum;
  }
  std::string out;
  out.reserve(encoded.size() + extra.size());
  out.append(encoded.data(), pos);
  out[kFlagsOffset] = static_cast<char>(flags);
  out.append(extra);
  out.append(encoded.data() + pos, encoded.size() - pos - 4);
  PutLE<uint32_t>(&out, Crc32c(out));
  return out;
}

uint64_t ContentChecksum(absl::Span<const uint8_t> block) {
  return XXH3_64bits(block.data(), block.size());
}
}  // namespace internal

namespace {

absl::StatusOr<BlockHeader> ParseEnvelope(absl::string_view encoded, bool check_crc) {
  if (encoded.size() < kFixedHeader + 12) {
    return absl::DataLossError(
        absl::StrCat("encoded block: truncated (", encoded.size(), " bytes)"));
  }
  if (std::memcmp(encoded.data(), kMagic, 4) != 0) {
    return absl::DataLossError("encoded block: bad magic");
  }
  const uint32_t stored_crc = GetLE<uint32_t>(encoded.data() + encoded.size() - 4);
  const uint32_t actual_crc =
      check_crc ? Crc32c(encoded.substr(0, encoded.size() - 4)) : stored_crc;
  if (stored_crc != actual_crc) {
    return absl::DataLossError(absl::StrCat("encoded block: CRC-32C mismatch (stored ",
                                            absl::Hex(stored_crc), ", computed ",
                                            absl::Hex(actual_crc), ")"));
  }
  const char* p = encoded.data();
  BlockHeader h;
  h.format_version = static_cast<uint8_t>(p[4]);
  if (h.format_version != kFormatVersion) {
    return absl::DataLossError(
        absl::StrCat("encoded block: unsupported format_version ", h.format_version));
  }
  const uint8_t encoding = static_cast<uint8_t>(p[5]);
  const uint8_t dtype = static_cast<uint8_t>(p[6]);
  if (!IsValidEncoding(encoding)) {
    return absl::DataLossError(absl::StrCat("encoded block: unknown encoding ", encoding));
  }
  if (!IsValidDType(dtype)) {
    return absl::DataLossError(absl::StrCat("encoded block: unknown dtype ", dtype));
  }
  const uint8_t flags = static_cast<uint8_t>(p[kFlagsOffset]);
  if (flags & ~(kFlagFastProfile | kFlagPredictorVersion | kFlagContentChecksum |
                kFlagStateFingerprint | kFlagShiftedReference)) {
    return absl::DataLossError(absl::StrCat("encoded block: unknown flags ", flags));
  }
  if ((flags & kFlagFastProfile) && encoding != static_cast<uint8_t>(Encoding::kResidual) &&
      encoding != static_cast<uint8_t>(Encoding::kLossless)) {
    return absl::DataLossError("encoded block: fast profile of an encoding that has none");
  }
  if (IsByteDType(static_cast<DType>(dtype)) &&
      (IsLossyEncoding(static_cast<Encoding>(encoding)) ||
       (flags & (kFlagPredictorVersion | kFlagShiftedReference)))) {
    // The encoder never writes these (EncodeBlock refuses them): a forged or damaged block.
    return absl::DataLossError(absl::StrCat(
        "encoded block: dtype ", DTypeName(static_cast<DType>(dtype)), " with encoding ",
        EncodingName(static_cast<Encoding>(encoding)),
        (flags & (kFlagPredictorVersion | kFlagShiftedReference)) ? " and a learned or shifted "
                                                                    "prediction"
                                                                  : "",
        ": one-byte dtypes are stored RAW or LOSSLESS only"));
  }
  h.profile = (flags & kFlagFastProfile) ? Profile::kFast : Profile::kCompact;
  h.encoding = static_cast<Encoding>(encoding);
  h.geometry.dtype = static_cast<DType>(dtype);
  h.geometry.num_layers = GetLE<uint16_t>(p + 8);
  h.geometry.num_kv_heads = GetLE<uint16_t>(p + 10);
  h.geometry.block_tokens = GetLE<uint16_t>(p + 12);
  h.geometry.head_dim = GetLE<uint16_t>(p + 14);
  if (!h.geometry.Validate().ok()) {
    return absl::DataLossError("encoded block: invalid geometry " + h.geometry.DebugString());
  }
  h.reference_node_id = GetLE<uint64_t>(p + 16);
  const size_t body_end = encoded.size() - 4;
  size_t pos = kFixedHeader;
  if (flags & kFlagPredictorVersion) {
    if (encoded.size() < kFixedHeader + 16) {
      return absl::DataLossError("encoded block: truncated predictor version");
    }
    h.predictor_version = GetLE<uint32_t>(p + pos);
    pos += 4;
    if (h.predictor_version == 0) {
      return absl::DataLossError("encoded block: predictor version flag with version 0");
    }
    if (h.encoding != Encoding::kResidual &&
        !(h.encoding == Encoding::kLossless && (flags & kFlagFastProfile))) {
      return absl::DataLossError(
          "encoded block: predictor version on an encoding other than RESIDUAL and fast LOSSLESS");
    }
  }
  if (flags & kFlagStateFingerprint) {
    if (!(flags & kFlagPredictorVersion)) {
      return absl::DataLossError("encoded block: a state fingerprint without a predictor version");
    }
    if (body_end - pos < 8 + 8) {
      return absl::DataLossError("encoded block: truncated state fingerprint");
    }
    h.predictor_fingerprint = GetLE<uint64_t>(p + pos);
    pos += 8;
    if (h.predictor_fingerprint == 0) {
      return absl::DataLossError("encoded block: state fingerprint flag with fingerprint 0");
    }
  }
  if (flags & kFlagContentChecksum) {
    if (body_end - pos < 8 + 8) {
      return absl::DataLossError("encoded block: truncated content checksum");
    }
    h.has_content_checksum = true;
    h.content_checksum = GetLE<uint64_t>(p + pos);
    pos += 8;
  }
  const uint32_t params_len = GetLE<uint32_t>(p + pos);
  pos += 4;
  if (params_len > body_end - pos || body_end - pos - params_len < 4) {
    return absl::DataLossError("encoded block: params_len past the end");
  }
  h.params = encoded.substr(pos, params_len);
  pos += params_len;
  if (flags & kFlagShiftedReference) {
    if ((flags & kFlagFastProfile) || h.reference_node_id == 0 ||
        (h.encoding != Encoding::kResidual && h.encoding != Encoding::kLossless)) {
      return absl::DataLossError(
          "encoded block: a shifted reference without a reference or with an encoding that "
          "has none");
    }
    absl::StatusOr<ReferenceShift> shift = internal::ParseReferenceShift(h.geometry, &h.params);
    if (!shift.ok()) return shift.status();
    h.reference_shift = *shift;
  }
  const uint32_t payload_len = GetLE<uint32_t>(p + pos);
  pos += 4;
  if (payload_len != body_end - pos) {
    return absl::DataLossError(absl::StrCat("encoded block: payload_len ", payload_len,
                                            " does not match the ", body_end - pos,
                                            " bytes present"));
  }
  h.payload = encoded.substr(pos, payload_len);
  return h;
}

}  // namespace

absl::StatusOr<BlockHeader> ParseBlock(absl::string_view encoded) {
  return ParseEnvelope(encoded, /*check_crc=*/true);
}

absl::StatusOr<BlockHeader> ParseVerifiedBlock(absl::string_view encoded) {
  return ParseEnvelope(encoded, /*check_crc=*/false);
}

uint32_t PeekPredictorVersion(absl::string_view encoded) {
  if (encoded.size() < kVersionOffset + 4 ||
      !(static_cast<uint8_t>(encoded[kFlagsOffset]) & kFlagPredictorVersion)) {
    return 0;
  }
  return GetLE<uint32_t>(encoded.data() + kVersionOffset);
}

}  // namespace kvtrie
