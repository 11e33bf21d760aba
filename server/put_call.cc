#include "server/put_call.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "server/grpc_status.h"
#include "server/request_checks.h"

namespace kvtrie {
namespace {

using service_checks::CheckName;
using service_checks::CheckTokens;
using service_checks::Invalid;

// Appends the token ids of a PutHeader or PutTokens (`field`: "token_ids" or
// "tokens.token_ids"): the repeated field, or `packed` (4 bytes each, little-endian), not both;
// at most `max_tokens` in all.
grpc::Status AppendTokens(absl::string_view field,
                          const google::protobuf::RepeatedField<uint32_t>& ids,
                          const std::string& packed, uint32_t max_tokens,
                          std::vector<uint32_t>* out) {
  if (!ids.empty() && !packed.empty()) {
    return Invalid(
        absl::StrCat(field, "_packed: set together with ", field, "; send the ids in one of them"));
  }
  if (packed.size() % 4 != 0) {
    return Invalid(absl::StrCat(field, "_packed: ", packed.size(),
                                " bytes is not a whole number of 4-byte ids"));
  }
  const size_t n = ids.empty() ? packed.size() / 4 : static_cast<size_t>(ids.size());
  if (n > max_tokens || out->size() > max_tokens - n) {
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        out->empty()
            ? absl::StrCat(field, ": ", n, " tokens exceed the server's --max_tokens=", max_tokens)
            : absl::StrCat(field, ": more than the server's --max_tokens=", max_tokens,
                           " tokens in one Put"));
  }
  if (!ids.empty()) {
    out->insert(out->end(), ids.begin(), ids.end());
    return grpc::Status::OK;
  }
  if (n == 0) return grpc::Status::OK;  // memcpy's source may not be null, even for 0 bytes
  const size_t at = out->size();
  out->resize(at + n);
  std::memcpy(out->data() + at, packed.data(), packed.size());
  if constexpr (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__) {
    for (size_t i = at; i < out->size(); ++i) (*out)[i] = __builtin_bswap32((*out)[i]);
  }
  return grpc::Status::OK;
}

grpc::Status ToModelInfo(const v1::ModelSpec& spec, ModelInfo* out) {
  if (auto s = CheckName("model.model_id", spec.model_id(), true); !s.ok()) return s;
  if (spec.dtype() == v1::DTYPE_UNSPECIFIED) {
    return Invalid(
        "model.dtype: required (DTYPE_FP16, DTYPE_BF16, DTYPE_FP32, DTYPE_FP8_E4M3, "
        "DTYPE_FP8_E5M2 or DTYPE_UINT8)");
  }
  if (!IsValidDType(static_cast<uint32_t>(spec.dtype()))) {
    return Invalid(absl::StrCat("model.dtype: unknown value ", static_cast<int>(spec.dtype())));
  }
  out->model_id = spec.model_id();
  out->geometry.num_layers = spec.num_layers();
  out->geometry.num_kv_heads = spec.num_kv_heads();
  out->geometry.head_dim = spec.head_dim();
  out->geometry.block_tokens = spec.block_tokens() == 0 ? 16 : spec.block_tokens();
  out->geometry.dtype = static_cast<DType>(spec.dtype());
  if (absl::Status s = out->geometry.Validate(); !s.ok()) {
    return Invalid(absl::StrCat("model.", s.message()));
  }
  return grpc::Status::OK;
}

// The encoding of a Put: `defaults` (the server's) overridden by what the header names.
grpc::Status ToEncodeOptions(const v1::EncodingSpec& e, const EncodeOptions& defaults,
                             EncodeOptions* out) {
  *out = defaults;
  if (e.encoding() != v1::ENCODING_UNSPECIFIED) {
    if (!IsValidEncoding(static_cast<uint32_t>(e.encoding()))) {
      return Invalid(absl::StrCat("encoding.encoding: ",
                                  v1::Encoding_Name(e.encoding()).empty()
                                      ? absl::StrCat(static_cast<int>(e.encoding()))
                                      : v1::Encoding_Name(e.encoding()),
                                  " is not supported by this server"));
    }
    out->encoding = static_cast<Encoding>(e.encoding());
  }
  if (!(e.target_rel_rms() >= 0 && e.target_rel_rms() < 1)) {  // NaN fails too
    return Invalid(
        absl::StrCat("encoding.target_rel_rms: ", e.target_rel_rms(), " is not in [0, 1)"));
  }
  if (e.target_rel_rms() > 0 && e.target_rel_rms() < 1e-4) {
    return Invalid(absl::StrCat("encoding.target_rel_rms: ", e.target_rel_rms(),
                                " is below fp16 precision (1e-4); use ENCODING_LOSSLESS"));
  }
  if (e.target_rel_rms() > 0) out->target_rel_rms = e.target_rel_rms();
  if (!(e.target_bits_per_component() >= 0 && e.target_bits_per_component() <= 32)) {
    return Invalid(absl::StrCat("encoding.target_bits_per_component: ",
                                e.target_bits_per_component(), " is not in [0, 32]"));
  }
  out->target_bits_per_component = e.target_bits_per_component();
  if (!(e.surprisal_step_strength() >= 0 && e.surprisal_step_strength() <= 4)) {
    return Invalid(absl::StrCat("encoding.surprisal_step_strength: ", e.surprisal_step_strength(),
                                " is not in [0, 4]"));
  }
  out->surprisal_step_strength = e.surprisal_step_strength();
  out->learned_lossless = e.learned_lossless();
  if (e.bits() > 8) {
    return Invalid(absl::StrCat("encoding.bits: ", e.bits(), " is not in [1, 8]"));
  }
  if (e.bits() > 0) out->turboquant_bits = static_cast<int>(e.bits());
  // An unset profile is FAST (what clients encode themselves), unless the request asks for what
  // only COMPACT has (a bits budget, surprisal steps). It only means something for RESIDUAL and
  // LOSSLESS.
  const bool compact_only = e.target_bits_per_component() > 0 || e.surprisal_step_strength() > 0;
  if (e.profile() == v1::EncodingSpec::PROFILE_FAST ||
      (e.profile() == v1::EncodingSpec::PROFILE_UNSPECIFIED && !compact_only)) {
    out->profile = Profile::kFast;
  } else if (e.profile() == v1::EncodingSpec::PROFILE_COMPACT ||
             e.profile() == v1::EncodingSpec::PROFILE_UNSPECIFIED) {
    out->profile = Profile::kCompact;
  } else {
    return Invalid(absl::StrCat("encoding.profile: ", static_cast<int>(e.profile()),
                                " is not supported by this server"));
  }
  if (out->encoding != Encoding::kResidual && out->encoding != Encoding::kLossless) {
    out->profile = Profile::kCompact;  // the profile is not used: as before it existed
  }
  return grpc::Status::OK;
}

}  // namespace

PutCall::PutCall(KvStore* store, const ServiceOptions& options, PutLimits* limits,
                 grpc::ServerContextBase* context)
    : store_(store), options_(options), limits_(limits), context_(context) {}

PutCall::~PutCall() = default;

PutCall::Next PutCall::Fail(grpc::Status status) {
  status_ = std::move(status);
  phase_ = Phase::kDone;
  session_.reset();  // frees the buffered blocks, then the slot and the reserved bytes
  pending_.reset();
  stream_.reset();
  return Next::kDone;
}

uint64_t PutCall::WholeBytes() const {
  return static_cast<uint64_t>(token_ids_.size() / model_.geometry.block_tokens) *
         model_.geometry.num_bytes();
}

grpc::Status PutCall::CutShort() const {
  if (stream_ != nullptr && stream_->idle_cancelled()) {
    return grpc::Status(
        grpc::StatusCode::CANCELLED,
        absl::StrCat("put: no message for --put_idle_timeout_seconds=",
                     absl::ToDoubleSeconds(options_.put_limits.idle_timeout), "; nothing stored"));
  }
  return Invalid(
      "commit: the stream ended without a PutCommit (cut short or cancelled); nothing stored");
}

PutCall::Next PutCall::Read() {
  stream_->AwaitClient();  // the idle deadline runs only while the server waits for the client
  return Next::kRead;
}

PutCall::Next PutCall::Start(const std::string& peer) {
  // Admitted before the first message: a slot, the idle deadline, then the namespace's bytes.
  grpc::ServerContextBase* context = context_;
  absl::StatusOr<std::unique_ptr<PutLimits::Stream>> stream =
      limits_->Admit([context] { context->TryCancel(); }, peer);
  if (!stream.ok()) return Fail(ToGrpcStatus(stream.status()));
  stream_ = *std::move(stream);
  phase_ = Phase::kHeader;
  return Read();
}

grpc::Status PutCall::CheckSize(const v1::PutRequest& request) const {
  const uint64_t limit = options_.max_message_bytes;
  if (limit == 0) return grpc::Status::OK;
  const size_t bytes = request.ByteSizeLong();
  if (bytes <= limit) return grpc::Status::OK;
  const std::string over =
      absl::StrCat(bytes, " bytes exceeds the server's message limit of ", limit, " bytes");
  std::string message;
  if (request.has_header()) {
    message = absl::StrCat("header: ", over,
                           "; send token_ids (and surprisal_bits) in PutTokens messages after a "
                           "smaller header (the C++ client does)");
  } else if (request.has_tokens()) {
    message = absl::StrCat("tokens: ", over, "; send fewer token ids per PutTokens message");
  } else if (request.has_block()) {
    message =
        absl::StrCat("block: ", over, "; send the block in layer ranges (layer_begin, layer_end)");
  } else {
    message = absl::StrCat("request: ", over);
  }
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, message);
}

PutCall::Next PutCall::OnMessage(v1::PutRequest* request) {
  stream_->Touch();
  if (grpc::Status s = CheckSize(*request); !s.ok()) return Fail(s);
  switch (phase_) {
    case Phase::kHeader:
      return Header(request);
    case Phase::kTokens:
      return Tokens(request);
    case Phase::kBlocks:
      return Block(request);
    default:
      return Next::kDone;
  }
}

PutCall::Next PutCall::OnEnd() {
  switch (phase_) {
    case Phase::kHeader:
      if (stream_->idle_cancelled()) return Fail(CutShort());
      return Fail(
          Invalid("header: the stream ended before its header (or its first message did not parse: "
                  "namespace and model.model_id must be valid UTF-8)"));
    case Phase::kTokens:  // reserved and begun like a complete Put, so its errors come first
      pending_.reset();
      reserve_bytes_ = WholeBytes();
      return Next::kReserve;
    case Phase::kBlocks:
      return EndOfBlocks();
    default:
      return Next::kDone;
  }
}

PutCall::Next PutCall::Header(v1::PutRequest* request) {
  if (!request->has_header()) return Fail(Invalid("header: the first PutRequest must be a header"));
  const v1::PutHeader h = std::move(*request->mutable_header());
  if (auto s = CheckName("namespace", h.namespace_(), false); !s.ok()) return Fail(s);
  ns_ = h.namespace_();
  stream_->SetNamespace(ns_);
  if (auto s = ToModelInfo(h.model(), &model_); !s.ok()) return Fail(s);
  if (auto s = CheckTokens("token_ids", h.token_ids_size(), options_.max_tokens); !s.ok())
    return Fail(s);
  if (auto s = ToEncodeOptions(h.encoding(), options_.default_encoding, &encode_); !s.ok())
    return Fail(s);
  if (IsByteDType(model_.geometry.dtype) && IsLossyEncoding(encode_.encoding)) {
    // FP8 / uint8 blocks are stored bit-exact. A lossy server default gives way (the Put named
    // no encoding); a lossy encoding the Put names is refused.
    if (h.encoding().encoding() != v1::ENCODING_UNSPECIFIED) {
      return Fail(Invalid(absl::StrCat("model.dtype: ", DTypeName(model_.geometry.dtype),
                                       " blocks can be stored RAW or LOSSLESS only; "
                                       "encoding.encoding ",
                                       v1::Encoding_Name(h.encoding().encoding()), " is lossy")));
    }
    encode_.encoding = Encoding::kLossless;
    encode_.profile = Profile::kFast;
  }
  if (auto s = AppendTokens("token_ids", h.token_ids(), h.token_ids_packed(), options_.max_tokens,
                            &token_ids_);
      !s.ok()) {
    return Fail(s);
  }
  surprisal_.assign(h.surprisal_bits().begin(), h.surprisal_bits().end());
  phase_ = Phase::kTokens;
  return Read();
}

PutCall::Next PutCall::Tokens(v1::PutRequest* request) {
  if (!request->has_tokens()) {
    // The whole Put's dense bytes, reserved (or waited for) before its first block, so
    // concurrent Puts queue here rather than fail mid-stream.
    pending_ = std::move(*request);
    reserve_bytes_ = WholeBytes();
    return Next::kReserve;
  }
  // PutTokens: more token ids and surprisal, before the first block.
  const v1::PutTokens& t = request->tokens();
  if (auto s = AppendTokens("tokens.token_ids", t.token_ids(), t.token_ids_packed(),
                            options_.max_tokens, &token_ids_);
      !s.ok()) {
    return Fail(s);
  }
  if (surprisal_.size() + t.surprisal_bits_size() > options_.max_tokens) {
    return Fail(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat("tokens.surprisal_bits: more than the server's "
                                          "--max_tokens=",
                                          options_.max_tokens, " values in one Put")));
  }
  surprisal_.insert(surprisal_.end(), t.surprisal_bits().begin(), t.surprisal_bits().end());
  return Read();
}

PutCall::Next PutCall::OnReserved(const absl::Status& reserved) {
  if (phase_ != Phase::kTokens) return Next::kDone;
  if (!reserved.ok()) return Fail(ToGrpcStatus(reserved));
  absl::StatusOr<std::unique_ptr<PutSession>> session =
      store_->BeginPut(ns_, model_, std::move(token_ids_), std::move(surprisal_), encode_);
  if (!session.ok()) return Fail(ToGrpcStatus(session.status()));
  session_ = *std::move(session);
  phase_ = Phase::kBlocks;
  if (pending_ == std::nullopt) return EndOfBlocks();
  v1::PutRequest request = *std::move(pending_);
  pending_.reset();
  return Block(&request);
}

PutCall::Next PutCall::Block(v1::PutRequest* request) {
  if (committed_) return Fail(Invalid("commit: a message followed the PutCommit; nothing stored"));
  if (request->has_commit()) {
    committed_ = true;
    stream_->Committed();
    return Read();
  }
  if (request->has_header()) return Fail(Invalid("header: sent twice in one Put stream"));
  if (request->has_tokens()) {
    return Fail(Invalid("tokens: a PutTokens after a block; every token id must come first"));
  }
  if (!request->has_block()) return Fail(Invalid("block: a PutRequest after the header is empty"));
  v1::PutBlock& b = *request->mutable_block();
  if (b.payload_case() == v1::PutBlock::kEncoded) return EncodedBlock(&b);
  const auto kv =
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.kv().data()), b.kv().size());
  if (absl::Status s = stream_->Reserve(kv.size()); !s.ok()) return Fail(ToGrpcStatus(s));
  // A whole block of an encoding that stores any value: the session keeps the parsed bytes
  // (no copy). Lossy blocks are copied: their values are checked below.
  const BlockGeometry& g = model_.geometry;
  const bool whole = b.layer_begin() == 0 && (b.layer_end() == 0 || b.layer_end() == g.num_layers);
  absl::Status s = whole && !IsLossyEncoding(encode_.encoding)
                       ? session_->AddBlock(b.block_index(), std::move(*b.mutable_kv()))
                       : session_->AddLayers(b.block_index(), b.layer_begin(), b.layer_end(), kv);
  if (!s.ok()) return Fail(ToGrpcStatus(s));
  if (IsLossyEncoding(encode_.encoding) && b.layer_begin() < g.num_layers) {
    if (absl::Status s = CheckFinite(g, b.layer_begin(), kv); !s.ok()) {
      return Fail(Invalid(absl::StrCat("kv: block ", b.block_index(), " ", s.message(), "; ",
                                       EncodingName(encode_.encoding),
                                       " needs finite values (lossless and raw store any value "
                                       "exactly); nothing stored")));
    }
  }
  return Read();
}

PutCall::Next PutCall::EncodedBlock(v1::PutBlock* b) {
  const BlockGeometry& g = model_.geometry;
  if (b->layer_begin() != 0 || (b->layer_end() != 0 && b->layer_end() != g.num_layers)) {
    return Fail(Invalid(absl::StrCat("layer_begin: block ", b->block_index(), " is encoded: send ",
                                     "it whole (layers [0, ", g.num_layers, "), not [",
                                     b->layer_begin(), ", ", b->layer_end(), "))")));
  }
  if (absl::Status s = stream_->Reserve(b->encoded().size()); !s.ok()) {
    return Fail(ToGrpcStatus(s));
  }
  absl::Status s =
      session_->AddEncodedBlock(b->block_index(), std::move(*b->mutable_encoded()),
                                {b->rel_rms_error_k(), b->rel_rms_error_v(), b->max_abs_error()});
  if (!s.ok()) return Fail(ToGrpcStatus(s));
  return Read();
}

PutCall::Next PutCall::EndOfBlocks() {
  if (!committed_ || context_->IsCancelled()) return Fail(CutShort());
  absl::StatusOr<PutSummary> summary = session_->Finish();
  if (!summary.ok()) return Fail(ToGrpcStatus(summary.status()));
  v1::PutResponse* response = &response_;
  response->set_stored_tokens(summary->stored_tokens);
  response->set_tail_tokens_ignored(summary->tail_tokens_ignored);
  for (const BlockReport& r : summary->blocks) {
    v1::BlockResult* out = response->add_blocks();
    out->set_block_index(r.block_index);
    out->set_disposition(r.outcome == BlockOutcome::kStored ? v1::BLOCK_STORED
                         : r.outcome == BlockOutcome::kResidualOfCentroid
                             ? v1::BLOCK_RESIDUAL_OF_CENTROID
                             : v1::BLOCK_DEDUPLICATED);
    out->set_node_id(r.node_id);
    out->set_bytes_logical(r.bytes_logical);
    out->set_bytes_stored(r.bytes_stored);
    if (r.outcome != BlockOutcome::kDeduplicated) {
      out->set_encoding(static_cast<v1::Encoding>(r.encoding));
      out->set_bits_per_component(r.bits_per_component);
      out->set_rel_rms_error_k(r.rel_rms_error_k);
      out->set_rel_rms_error_v(r.rel_rms_error_v);
      out->set_max_abs_error(r.max_abs_error);
      response->set_blocks_stored(response->blocks_stored() + 1);
    } else {
      response->set_blocks_deduplicated(response->blocks_deduplicated() + 1);
    }
  }
  status_ = grpc::Status::OK;
  phase_ = Phase::kDone;
  session_.reset();
  stream_.reset();
  return Next::kDone;
}

}  // namespace kvtrie
