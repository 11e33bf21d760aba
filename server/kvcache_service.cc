#include "server/kvcache_service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "server/grpc_status.h"
#include "server/request_checks.h"

namespace kvtrie {
namespace {

using service_checks::CheckName;
using service_checks::CheckTokens;
using service_checks::Invalid;
using service_checks::TokensOf;
using service_checks::ToModelSpec;

// Pins longer than this are refused (a larger TTL would overflow the expiry time).
constexpr uint64_t kMaxPinTtlSeconds = 100ull * 366 * 24 * 3600;

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
    return Invalid("model.dtype: required (DTYPE_FP16, DTYPE_BF16 or DTYPE_FP32)");
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

void ToNodeInfo(const NodeView& v, v1::NodeInfo* out) {
  out->set_node_id(v.node_id);
  out->set_parent_id(v.parent_id);
  out->set_depth(v.depth);
  out->set_token_offset(v.token_offset);
  out->mutable_token_ids()->Add(v.token_ids.begin(), v.token_ids.end());
  out->mutable_surprisal_bits()->Add(v.surprisal_bits.begin(), v.surprisal_bits.end());
  out->set_path_surprisal_bits(v.path_surprisal_bits);
  out->set_rel_rms_error_k(v.rel_rms_error_k);
  out->set_rel_rms_error_v(v.rel_rms_error_v);
  out->set_bytes_logical(v.bytes_logical);
  out->set_bytes_stored(v.bytes_stored);
  out->set_encoding(v.depth == 0 ? v1::ENCODING_UNSPECIFIED
                                 : static_cast<v1::Encoding>(v.encoding));
  out->set_num_children(v.num_children);
  out->set_hits(v.hits);
  out->set_reference_node_id(v.reference_node_id);
  out->set_dependents(v.dependents);
  out->set_distance_to_reference_bits(v.distance_to_reference_bits);
  out->set_predictor_version(v.predictor_version);
}

void ToHistogram(const uint64_t (&counts)[kHistogramBuckets],
                 google::protobuf::RepeatedPtrField<v1::HistogramBucket>* out) {
  for (int i = 0; i < kHistogramBuckets; ++i) {
    v1::HistogramBucket* b = out->Add();
    b->set_upper_bits(HistogramUpperBits(i));
    b->set_count(counts[i]);
  }
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
  if (e.bits() > 8) {
    return Invalid(absl::StrCat("encoding.bits: ", e.bits(), " is not in [1, 8]"));
  }
  if (e.bits() > 0) out->turboquant_bits = static_cast<int>(e.bits());
  if (e.profile() == v1::EncodingSpec::PROFILE_FAST) {
    out->profile = Profile::kFast;
  } else if (e.profile() != v1::EncodingSpec::PROFILE_COMPACT) {
    return Invalid(absl::StrCat("encoding.profile: ", static_cast<int>(e.profile()),
                                " is not supported by this server"));
  }
  return grpc::Status::OK;
}

}  // namespace

KvCacheService::KvCacheService(KvStore* store, const ServiceOptions& options)
    : store_(store),
      options_(options),
      put_limits_(options.put_limits),
      codec_pool_(std::make_unique<ThreadPool>(std::max(1, options.codec_threads))) {}

KvCacheService::~KvCacheService() = default;

uint32_t KvCacheService::TokenCount(const v1::LookupRequest& r) {
  return static_cast<uint32_t>(r.token_ids_size() + r.token_ids_packed().size() / 4);
}

uint32_t KvCacheService::TokenCount(const v1::GetRequest& r) {
  return static_cast<uint32_t>(r.token_ids_size() + r.token_ids_packed().size() / 4);
}

grpc::Status KvCacheService::Lookup(grpc::ServerContext*, const v1::LookupRequest* request,
                                    v1::LookupResponse* response) {
  return LookupIn(request->namespace_(), *request, response);
}

grpc::Status KvCacheService::LookupIn(const std::string& ns, const v1::LookupRequest& request,
                                      v1::LookupResponse* response) {
  if (auto s = CheckName("namespace", ns, false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request.model_id(), true); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", TokenCount(request), options_.max_tokens); !s.ok())
    return s;
  std::vector<uint32_t> scratch;
  absl::Span<const uint32_t> tokens;
  if (auto s = TokensOf(request, &scratch, &tokens); !s.ok()) return s;
  MatchResult m = store_->Lookup(ns, request.model_id(), tokens);
  response->set_block_tokens(m.block_tokens);
  response->set_matched_blocks(static_cast<uint32_t>(m.node_ids.size()));
  response->set_matched_tokens(static_cast<uint32_t>(m.node_ids.size()) * m.block_tokens);
  response->mutable_node_ids()->Add(m.node_ids.begin(), m.node_ids.end());
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Put(grpc::ServerContext* context,
                                 grpc::ServerReader<v1::PutRequest>* reader,
                                 v1::PutResponse* response) {
  return PutStream(context, reader, response);
}

grpc::Status KvCacheService::PutStream(grpc::ServerContext* context,
                                       grpc::ServerReaderInterface<v1::PutRequest>* reader,
                                       v1::PutResponse* response) {
  // Admitted before the first message: a slot, the idle deadline, then the namespace's bytes.
  absl::StatusOr<std::unique_ptr<PutLimits::Stream>> stream =
      put_limits_.Admit([context] { context->TryCancel(); });
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  const auto cut_short = [&] {
    if ((*stream)->idle_cancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          absl::StrCat("put: no message for --put_idle_timeout_seconds=",
                                       absl::ToDoubleSeconds(options_.put_limits.idle_timeout),
                                       "; nothing stored"));
    }
    return Invalid(
        "commit: the stream ended without a PutCommit (cut short or cancelled); nothing stored");
  };
  v1::PutRequest request;
  if (!reader->Read(&request)) {
    if ((*stream)->idle_cancelled()) return cut_short();
    return Invalid(
        "header: the stream ended before its header (or its first message did not parse: "
        "namespace and model.model_id must be valid UTF-8)");
  }
  (*stream)->Touch();
  if (!request.has_header()) return Invalid("header: the first PutRequest must be a header");
  const v1::PutHeader h = std::move(*request.mutable_header());
  if (auto s = CheckName("namespace", h.namespace_(), false); !s.ok()) return s;
  (*stream)->SetNamespace(h.namespace_());
  ModelInfo model;
  if (auto s = ToModelInfo(h.model(), &model); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", h.token_ids_size(), options_.max_tokens); !s.ok()) return s;
  EncodeOptions encode;
  if (auto s = ToEncodeOptions(h.encoding(), options_.default_encoding, &encode); !s.ok()) return s;
  std::vector<uint32_t> token_ids;
  if (auto s = AppendTokens("token_ids", h.token_ids(), h.token_ids_packed(), options_.max_tokens,
                            &token_ids);
      !s.ok()) {
    return s;
  }
  std::vector<float> surprisal(h.surprisal_bits().begin(), h.surprisal_bits().end());
  // PutTokens: more token ids and surprisal, before the first block.
  bool more = reader->Read(&request);
  while (more && request.has_tokens()) {
    (*stream)->Touch();
    const v1::PutTokens& t = request.tokens();
    if (auto s = AppendTokens("tokens.token_ids", t.token_ids(), t.token_ids_packed(),
                              options_.max_tokens, &token_ids);
        !s.ok()) {
      return s;
    }
    if (surprisal.size() + t.surprisal_bits_size() > options_.max_tokens) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("tokens.surprisal_bits: more than the server's "
                                       "--max_tokens=",
                                       options_.max_tokens, " values in one Put"));
    }
    surprisal.insert(surprisal.end(), t.surprisal_bits().begin(), t.surprisal_bits().end());
    more = reader->Read(&request);
  }
  // The whole Put's dense bytes, reserved (or waited for) before its first block, so concurrent
  // Puts queue here rather than fail mid-stream.
  const uint64_t whole = static_cast<uint64_t>(token_ids.size() / model.geometry.block_tokens) *
                         model.geometry.num_bytes();
  if (absl::Status s = (*stream)->ReserveWhole(whole, [context] { return context->IsCancelled(); });
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<std::unique_ptr<PutSession>> session =
      store_->BeginPut(h.namespace_(), model, std::move(token_ids), std::move(surprisal), encode);
  if (!session.ok()) return ToGrpcStatus(session.status());
  // Read() also returns false when the client cancels, and IsCancelled() may not know yet: only
  // an explicit PutCommit tells a complete stream from a cut one.
  bool committed = false;
  for (; more; more = reader->Read(&request)) {
    (*stream)->Touch();
    if (committed) return Invalid("commit: a message followed the PutCommit; nothing stored");
    if (request.has_commit()) {
      committed = true;
      (*stream)->Committed();
      continue;
    }
    if (request.has_header()) return Invalid("header: sent twice in one Put stream");
    if (request.has_tokens()) {
      return Invalid("tokens: a PutTokens after a block; every token id must come first");
    }
    if (!request.has_block()) return Invalid("block: a PutRequest after the header is empty");
    v1::PutBlock& b = *request.mutable_block();
    const auto kv =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.kv().data()), b.kv().size());
    if (absl::Status s = (*stream)->Reserve(kv.size()); !s.ok()) return ToGrpcStatus(s);
    // A whole block of an encoding that stores any value: the session keeps the parsed bytes
    // (no copy). Lossy blocks are copied: their values are checked below.
    const bool whole =
        b.layer_begin() == 0 && (b.layer_end() == 0 || b.layer_end() == model.geometry.num_layers);
    absl::Status s =
        whole && !IsLossyEncoding(encode.encoding)
            ? (*session)->AddBlock(b.block_index(), std::move(*b.mutable_kv()))
            : (*session)->AddLayers(b.block_index(), b.layer_begin(), b.layer_end(), kv);
    if (!s.ok()) return ToGrpcStatus(s);
    if (IsLossyEncoding(encode.encoding) && b.layer_begin() < model.geometry.num_layers) {
      if (absl::Status s = CheckFinite(model.geometry, b.layer_begin(), kv); !s.ok()) {
        return Invalid(absl::StrCat("kv: block ", b.block_index(), " ", s.message(), "; ",
                                    EncodingName(encode.encoding),
                                    " needs finite values (lossless and raw store any value "
                                    "exactly); nothing stored"));
      }
    }
  }
  if (!committed || context->IsCancelled()) return cut_short();
  absl::StatusOr<PutSummary> summary = (*session)->Finish();
  if (!summary.ok()) return ToGrpcStatus(summary.status());
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
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Stats(grpc::ServerContext*, const v1::StatsRequest* request,
                                   v1::StatsResponse* response) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  const StoreStats s = store_->Stats(request->namespace_());
  response->set_namespaces(s.namespaces);
  response->set_models(s.models);
  response->set_nodes(s.nodes);
  response->set_blocks_stored(s.blocks_stored);
  response->set_blocks_deduplicated(s.blocks_deduplicated);
  response->set_bytes_logical(s.bytes_logical);
  response->set_bytes_stored(s.bytes_stored);
  response->set_compression_ratio(s.bytes_stored ? double(s.bytes_logical) / s.bytes_stored : 0);
  response->set_bits_per_component(s.elements ? 8.0 * s.bytes_stored / s.elements : 0);
  response->set_max_depth(s.max_depth);
  response->set_lookups(s.lookups);
  response->set_lookup_hits(s.lookup_hits);
  response->set_gets(s.gets);
  response->set_puts(s.puts);
  response->set_deletes(s.deletes);
  response->set_lossy_nodes(s.lossy_nodes);
  if (s.lossy_nodes > 0) {
    response->set_mean_rel_rms_error_k(s.sum_rel_rms_error_k / s.lossy_nodes);
    response->set_mean_rel_rms_error_v(s.sum_rel_rms_error_v / s.lossy_nodes);
  }
  response->set_max_rel_rms_error(s.max_rel_rms_error);
  response->set_hot_nodes(s.hot_nodes);
  response->set_hot_bytes(s.hot_bytes);
  response->set_cold_nodes(s.cold_nodes);
  response->set_cold_bytes(s.cold_bytes);
  response->set_disk_bytes(s.disk_bytes);
  response->set_pinned_nodes(s.pinned_nodes);
  response->set_memory_budget_bytes(s.memory_budget_bytes);
  response->set_disk_budget_bytes(s.disk_budget_bytes);
  response->set_demotions(s.demotions);
  response->set_demoted_bytes(s.demoted_bytes);
  response->set_promotions(s.promotions);
  response->set_cold_reads(s.cold_reads);
  response->set_cold_read_bytes(s.cold_read_bytes);
  response->set_evictions_disk(s.evictions_disk);
  response->set_evicted_bytes(s.evicted_bytes);
  response->set_evictions_data_loss(s.evictions_data_loss);
  response->set_evictions_deleted(s.evictions_deleted);
  response->set_pins_expired(s.pins_expired);
  response->set_puts_rejected_disk_full(s.puts_rejected_disk_full);
  response->set_centroids(s.cluster.centroids);
  response->set_residual_nodes(s.cluster.residual_nodes);
  response->set_near_dup_groups(s.cluster.near_dup_groups);
  response->set_near_dup_candidates_tried(s.cluster.candidates_tried);
  response->set_near_dup_gated_by_distance(s.cluster.gated_by_distance);
  response->set_near_dup_not_smaller(s.cluster.residual_not_smaller);
  response->set_position_shifted_skipped(s.cluster.position_shifted_skipped);
  response->set_position_shifted_coded(s.cluster.position_shifted_coded);
  ToHistogram(s.cluster.path_surprisal_histogram, response->mutable_path_surprisal_histogram());
  ToHistogram(s.cluster.branch_distance_histogram, response->mutable_branch_distance_histogram());
  response->set_predictor_versions(s.predictor_versions);
  response->set_predictor_state_bytes(s.predictor_state_bytes);
  response->set_predictor_memory_bytes(s.predictor_memory_bytes);
  response->set_predictor_tokens_learned(s.predictor_tokens_learned);
  response->set_blocks_on_learned(s.blocks_on_learned);
  response->set_predictor_fits(s.predictor_fits);
  response->set_predictor_observations(s.predictor_observations);
  response->set_predictor_observations_dropped(s.predictor_observations_dropped);
  response->set_predictor_versions_freed(s.predictor_versions_freed);
  response->set_predictor_bytes_saved(s.predictor_bytes_saved);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Inspect(grpc::ServerContext*, const v1::InspectRequest* request,
                                     v1::InspectResponse* response) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  absl::StatusOr<InspectResult> r =
      store_->Inspect(request->namespace_(), request->model_id(), request->node_id());
  if (!r.ok()) return ToGrpcStatus(r.status());
  ToModelSpec(r->model, response->mutable_model());
  ToNodeInfo(r->node, response->mutable_node());
  for (const NodeView& c : r->children) ToNodeInfo(c, response->add_children());
  for (const PredictorVersionView& p : r->predictors) {
    v1::PredictorInfo* out = response->add_predictors();
    out->set_version(p.version);
    out->set_state_bytes(p.state_bytes);
    out->set_memory_bytes(p.memory_bytes);
    out->set_tokens_learned(p.tokens_learned);
    out->set_dependents(p.dependents);
    out->set_latest(p.latest);
    out->set_error(p.error);
    out->set_description(p.description);
    out->set_bytes_saved(p.bytes_saved);
  }
  if (request->distance_to_node_id() != 0) {
    absl::StatusOr<double> d =
        store_->TrieDistance(request->namespace_(), request->model_id(), request->node_id(),
                             request->distance_to_node_id());
    if (!d.ok()) return ToGrpcStatus(d.status());
    response->set_trie_distance_bits(*d);
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Delete(grpc::ServerContext*, const v1::DeleteRequest* request,
                                    v1::DeleteResponse* response) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", request->token_ids_size(), options_.max_tokens); !s.ok())
    return s;
  auto r = store_->Delete(request->namespace_(), request->model_id(), request->token_ids());
  if (!r.ok()) return ToGrpcStatus(r.status());
  response->set_nodes_deleted(r->first);
  response->set_bytes_freed(r->second);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Pin(grpc::ServerContext*, const v1::PinRequest* request,
                                 v1::PinResponse* response) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", request->token_ids_size(), options_.max_tokens); !s.ok())
    return s;
  if (request->ttl_seconds() > kMaxPinTtlSeconds) {
    return Invalid(absl::StrCat("ttl_seconds: ", request->ttl_seconds(),
                                " is more than 100 years (", kMaxPinTtlSeconds,
                                "); use 0 to pin until unpinned"));
  }
  auto r = store_->Pin(request->namespace_(), request->model_id(), request->token_ids(),
                       request->ttl_seconds(), request->unpin());
  if (!r.ok()) return ToGrpcStatus(r.status());
  response->set_node_id(*r);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::GetPredictor(grpc::ServerContext* context,
                                          const v1::GetPredictorRequest* request,
                                          grpc::ServerWriter<v1::PredictorChunk>* writer) {
  return GetPredictorStream(context, request, writer);
}

grpc::Status KvCacheService::GetPredictorStream(
    grpc::ServerContext* context, const v1::GetPredictorRequest* request,
    grpc::ServerWriterInterface<v1::PredictorChunk>* writer) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  if (request->version() == 0) {
    return Invalid(
        "version: required (>= 1): the learned predictor state a RESIDUAL block names "
        "in GetBlock.predictor_version");
  }
  absl::StatusOr<std::string> state =
      store_->GetPredictor(request->namespace_(), request->model_id(), request->version());
  if (!state.ok()) return ToGrpcStatus(state.status());
  const uint32_t crc = Crc32c(*state);
  const size_t chunk = std::max<uint64_t>(1, options_.max_get_message_bytes);
  v1::PredictorChunk msg;
  for (size_t off = 0; off == 0 || off < state->size(); off += chunk) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    msg.set_version(request->version());
    msg.set_total_bytes(state->size());
    msg.set_crc32c(crc);
    msg.set_offset(off);
    msg.set_data(state->data() + off, std::min(chunk, state->size() - off));
    if (!writer->Write(msg)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    if (state->empty()) break;
  }
  return grpc::Status::OK;
}

}  // namespace kvtrie
