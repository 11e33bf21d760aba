#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/kvcache_service.h"
#include "server/request_checks.h"

// KvCacheService's Get: the zero-copy, pipelined path (see server/kvcache_service.h).
namespace kvtrie {
namespace {

using service_checks::CheckName;
using service_checks::CheckTokens;
using service_checks::Invalid;
using service_checks::TokensOf;
using service_checks::ToModelSpec;

}  // namespace

grpc::Status KvCacheService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                                 grpc::ServerWriter<v1::GetResponse>* writer) {
  MessageGetSink sink(writer);
  return GetStream(context, request, &sink);
}

KvCacheService::GetCall::GetCall(KvCacheService* service, grpc::ServerContextBase* context,
                                 v1::GetRequest request)
    : service_(service), context_(context), request_(std::move(request)) {}

KvCacheService::GetCall::~GetCall() = default;  // the reader waits for its window

std::unique_ptr<KvCacheService::GetCall> KvCacheService::NewGet(grpc::ServerContextBase* context,
                                                                v1::GetRequest request) {
  return std::make_unique<GetCall>(this, context, std::move(request));
}

grpc::Status KvCacheService::GetCall::Start(v1::GetResponse* header) {
  const v1::GetRequest* request = &request_;
  const ServiceOptions& options = service_->options_;
  KvStore* store = service_->store_;
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", TokenCount(*request), options.max_tokens); !s.ok())
    return s;
  if (!v1::GetMode_IsValid(request->mode())) {
    return Invalid(absl::StrCat("mode: unknown value ", static_cast<int>(request->mode())));
  }
  residual_ = request->mode() == v1::GET_MODE_RESIDUAL;
  const bool ranged = request->layer_begin() != 0 || request->layer_end() != 0;
  if (residual_ && ranged) {
    return Invalid(absl::StrCat("layer_begin: a layer range [", request->layer_begin(), ", ",
                                request->layer_end(),
                                ") needs GET_MODE_RECONSTRUCTED (a RESIDUAL block is one whole "
                                "encoding)"));
  }
  if (request->layer_end() != 0 && request->layer_begin() >= request->layer_end()) {
    return Invalid(absl::StrCat("layer_begin: ", request->layer_begin(), " is not below layer_end ",
                                request->layer_end()));
  }
  if (auto s = TokensOf(*request, &scratch_, &tokens_); !s.ok()) return s;
  if (request->node_id() != 0) {  // the path to a node (a centroid): its tokens, root first
    absl::StatusOr<std::vector<uint32_t>> path =
        store->PathTokens(request->namespace_(), request->model_id(), request->node_id());
    if (!path.ok()) return ToGrpcStatus(path.status());
    scratch_ = *std::move(path);
    tokens_ = scratch_;
  }
  absl::StatusOr<std::unique_ptr<BlockReader>> reader =
      store->NewReader(request->namespace_(), request->model_id(), tokens_, request->max_blocks(),
                       residual_ ? BlockReader::Mode::kStored : BlockReader::Mode::kReconstructed,
                       service_->codec_pool_.get(), /*through_retained=*/request->node_id() != 0);
  if (!reader.ok()) return ToGrpcStatus(reader.status());
  reader_ = *std::move(reader);
  const GetResult& got = reader_->listing();
  const uint32_t bt = got.model.geometry.block_tokens;
  if (!got.model.model_id.empty()) {
    ToModelSpec(got.model, header->mutable_header()->mutable_model());
  }
  header->mutable_header()->set_matched_blocks(static_cast<uint32_t>(got.blocks.size()));
  header->mutable_header()->set_matched_tokens(static_cast<uint32_t>(got.blocks.size()) * bt);
  const BlockGeometry& g = got.model.geometry;
  if (request->layer_end() > g.num_layers && !got.model.model_id.empty()) {
    return Invalid(absl::StrCat("layer_end: ", request->layer_end(), " is past the model's ",
                                g.num_layers, " layers"));
  }
  layer_begin_ = request->layer_begin();
  layer_end_ = request->layer_end() != 0 ? request->layer_end() : g.num_layers;
  if (!got.blocks.empty() && layer_begin_ >= layer_end_) {
    return Invalid(absl::StrCat("layer_begin: ", layer_begin_, " is not below the model's ",
                                g.num_layers, " layers"));
  }
  const size_t layer_bytes = g.num_layers ? g.layer_range_bytes(0, 1) : 1;
  layers_per_message_ =
      static_cast<uint32_t>(std::max<uint64_t>(1, options.max_get_message_bytes / layer_bytes));
  return grpc::Status::OK;
}

v1::GetBlock KvCacheService::GetCall::MetaOf(size_t i) const {
  const BlockRead& b = reader_->listing().blocks[i];
  v1::GetBlock meta;
  meta.set_block_index(static_cast<uint32_t>(i));
  meta.set_node_id(b.node_id);
  meta.set_encoding(static_cast<v1::Encoding>(b.encoding));
  meta.set_reference_node_id(b.reference_node_id);
  meta.set_predictor_version(b.predictor_version);
  return meta;
}

grpc::Status KvCacheService::GetCall::Next(Message* out, bool* end) {
  *end = false;
  const grpc::Status gone(grpc::StatusCode::CANCELLED, "client gone");
  const BlockGeometry& g = reader_->listing().model.geometry;
  if (!sending_) {  // the block's first message: the reader makes it ready
    if (context_->IsCancelled()) return gone;
    bool last = false;
    if (absl::Status s = reader_->Next(&block_, &last); !s.ok()) return ToGrpcStatus(s);
    if (last) {
      *end = true;
      return grpc::Status::OK;
    }
    sending_ = true;
    layer_ = layer_begin_;
  }
  out->block = MetaOf(block_.index);
  if (residual_) {  // the stored payload as it is, without a copy
    out->block.set_layer_begin(0);
    out->block.set_layer_end(g.num_layers);
    out->encoded = true;
    out->bytes = block_.bytes;
    out->owner = std::move(block_.owner);
    sending_ = false;
    return grpc::Status::OK;
  }
  // RECONSTRUCTED: the dense block's requested layers, split above max_get_message_bytes.
  const uint32_t l = layer_;
  const uint32_t l_end = std::min(layer_end_, l + layers_per_message_);
  const size_t begin = g.layer_range_bytes(0, l), size = g.layer_range_bytes(l, l_end);
  out->block.set_layer_begin(l);
  out->block.set_layer_end(l_end);
  out->encoded = false;
  out->bytes = block_.bytes.substr(begin, size);
  out->owner = block_.owner;
  layer_ = l_end;
  if (layer_ >= layer_end_) {
    block_ = BlockReader::Block();  // release this call's hold on the buffer
    sending_ = false;
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::GetStream(grpc::ServerContext* context, const v1::GetRequest* request,
                                       GetSink* sink) {
  GetCall call(this, context, *request);
  v1::GetResponse header;
  if (grpc::Status s = call.Start(&header); !s.ok()) return s;
  const grpc::Status gone(grpc::StatusCode::CANCELLED, "client gone");
  if (!sink->WriteHeader(header)) return gone;
  for (;;) {
    GetCall::Message m;
    bool end = false;
    if (grpc::Status s = call.Next(&m, &end); !s.ok() || end) return s;
    if (!sink->WriteBlock(m.block, m.encoded, m.bytes, std::move(m.owner))) return gone;
  }
}

}  // namespace kvtrie
