#include "server/kvcache_service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/predictor_state.h"
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
  out->set_error_client_reported(v.error_client_reported);
  out->set_retained(v.retained);
  out->set_lossy(v.lossy);
  out->set_target_rel_rms(v.target_rel_rms);
}

void ToHistogram(const uint64_t (&counts)[kHistogramBuckets],
                 google::protobuf::RepeatedPtrField<v1::HistogramBucket>* out) {
  for (int i = 0; i < kHistogramBuckets; ++i) {
    v1::HistogramBucket* b = out->Add();
    b->set_upper_bits(HistogramUpperBits(i));
    b->set_count(counts[i]);
  }
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
  PutCall call(store_, options_, &put_limits_, context);
  v1::PutRequest request;
  for (PutCall::Next next = call.Start(); next != PutCall::Next::kDone;) {
    if (next == PutCall::Next::kRead) {
      next = reader->Read(&request) ? call.OnMessage(&request) : call.OnEnd();
    } else {  // kReserve: this thread waits
      next = call.OnReserved(call.stream()->ReserveWhole(
          call.reserve_bytes(), [context] { return context->IsCancelled(); }));
    }
  }
  if (call.status().ok()) *response = std::move(*call.response());
  return call.status();
}

std::unique_ptr<PutCall> KvCacheService::NewPut(grpc::ServerContextBase* context) {
  return std::make_unique<PutCall>(store_, options_, &put_limits_, context);
}

grpc::Status KvCacheService::Stats(grpc::ServerContext*, const v1::StatsRequest* request,
                                   v1::StatsResponse* response) {
  return StatsIn(request->namespace_(), /*whole_server_if_empty=*/true, response);
}

grpc::Status KvCacheService::StatsIn(const std::string& ns, bool whole_server_if_empty,
                                     v1::StatsResponse* response) {
  if (auto s = CheckName("namespace", ns, false); !s.ok()) return s;
  const StoreStats s = whole_server_if_empty ? store_->Stats(ns) : store_->NamespaceStats(ns);
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
  response->set_lossy_recoded_nodes(s.lossy_recoded_nodes);
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
  response->set_centroids_reelected(s.centroids_reelected);
  response->set_retained_nodes(s.retained_nodes);
  response->set_retained_bytes(s.retained_bytes);
  response->set_cluster_pass_rounds(s.cluster_pass_rounds);
  response->set_cluster_pass_recoded(s.cluster_pass_recoded);
  response->set_cluster_pass_bytes_saved(s.cluster_pass_bytes_saved);
  response->set_cluster_pass_reelected(s.cluster_pass_reelected);
  response->set_ngram_entries(s.cluster.ngram_entries);
  ToHistogram(s.cluster.path_surprisal_histogram, response->mutable_path_surprisal_histogram());
  ToHistogram(s.cluster.branch_distance_histogram, response->mutable_branch_distance_histogram());
  response->set_predictor_versions(s.predictor_versions);
  response->set_predictor_state_bytes(s.predictor_state_bytes);
  response->set_predictor_memory_bytes(s.predictor_memory_bytes);
  response->set_predictor_tokens_learned(s.predictor_tokens_learned);
  response->set_blocks_on_learned(s.blocks_on_learned);
  response->set_client_reported_error_nodes(s.client_reported_error_nodes);
  response->set_predictor_fits(s.predictor_fits);
  response->set_predictor_observations(s.predictor_observations);
  response->set_predictor_observations_dropped(s.predictor_observations_dropped);
  response->set_predictor_versions_freed(s.predictor_versions_freed);
  response->set_predictor_bytes_saved(s.predictor_bytes_saved);
  response->set_predictor_encoded_observations(s.predictor_encoded_observations);
  response->set_predictor_encoded_dropped(s.predictor_encoded_dropped);
  if (ns.empty() && whole_server_if_empty) {
    response->set_inflight_put_bytes(put_limits_.total_inflight_bytes());
    response->set_open_put_streams(put_limits_.open_streams());
  } else {
    response->set_inflight_put_bytes(put_limits_.inflight_bytes(ns));
  }
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
  auto r = store_->Delete(request->namespace_(), request->model_id(), request->token_ids(),
                          request->erase());
  if (!r.ok()) return ToGrpcStatus(r.status());
  response->set_nodes_deleted(r->nodes_deleted);
  response->set_bytes_freed(r->bytes_freed);
  response->set_bytes_rewritten(r->bytes_rewritten);
  response->set_centroids_reelected(r->centroids_reelected);
  response->set_centroids_retained(r->centroids_retained);
  response->set_nodes_retained(r->nodes_retained);
  response->set_erase_bytes_rewritten(r->erase_bytes_rewritten);
  response->set_erased(r->compacted);
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
  if (request->extend_only() && request->unpin()) {
    return Invalid("extend_only: set together with unpin (a lease cannot remove a pin)");
  }
  auto r = store_->Pin(request->namespace_(), request->model_id(), request->token_ids(),
                       request->ttl_seconds(), request->unpin(), request->extend_only());
  if (!r.ok()) return ToGrpcStatus(r.status());
  response->set_node_id(*r);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::GetPredictor(grpc::ServerContext* context,
                                          const v1::GetPredictorRequest* request,
                                          grpc::ServerWriter<v1::PredictorChunk>* writer) {
  return GetPredictorStream(context, request, writer);
}

grpc::Status KvCacheService::ReadPredictor(const v1::GetPredictorRequest& request,
                                           std::string* state) {
  if (auto s = CheckName("namespace", request.namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request.model_id(), true); !s.ok()) return s;
  if (request.version() == 0) {
    return Invalid(
        "version: required (>= 1): the learned predictor state a RESIDUAL block names "
        "in GetBlock.predictor_version");
  }
  absl::StatusOr<std::string> got =
      store_->GetPredictor(request.namespace_(), request.model_id(), request.version());
  if (!got.ok()) return ToGrpcStatus(got.status());
  *state = *std::move(got);
  return grpc::Status::OK;
}

size_t KvCacheService::PredictorChunks(const std::string& state) const {
  const size_t chunk = std::max<uint64_t>(1, options_.max_get_message_bytes);
  return state.empty() ? 1 : (state.size() + chunk - 1) / chunk;  // an empty state: one chunk
}

void KvCacheService::PredictorChunkAt(const v1::GetPredictorRequest& request,
                                      const std::string& state, uint32_t crc, size_t k,
                                      v1::PredictorChunk* msg) const {
  const size_t chunk = std::max<uint64_t>(1, options_.max_get_message_bytes);
  const size_t off = k * chunk;
  msg->set_version(request.version());
  msg->set_total_bytes(state.size());
  msg->set_crc32c(crc);
  // The fingerprint hashes the whole state: once, in the first chunk.
  msg->set_fingerprint(k == 0 ? PredictorStateFingerprint(state) : 0);
  msg->set_offset(off);
  msg->set_data(state.data() + off, std::min(chunk, state.size() - off));
}

grpc::Status KvCacheService::GetPredictorStream(
    grpc::ServerContext* context, const v1::GetPredictorRequest* request,
    grpc::ServerWriterInterface<v1::PredictorChunk>* writer) {
  std::string state;
  if (grpc::Status s = ReadPredictor(*request, &state); !s.ok()) return s;
  const uint32_t crc = Crc32c(state);
  v1::PredictorChunk msg;
  for (size_t k = 0; k < PredictorChunks(state); ++k) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    PredictorChunkAt(*request, state, crc, k, &msg);
    if (!writer->Write(msg)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
  }
  return grpc::Status::OK;
}

}  // namespace kvtrie
