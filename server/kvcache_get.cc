#include <algorithm>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/decode_chain.h"
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

// Reads of a Get retried when a block's centroid was deleted concurrently.
constexpr int kGetRetries = 3;

}  // namespace

grpc::Status KvCacheService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                                 grpc::ServerWriter<v1::GetResponse>* writer) {
  MessageGetSink sink(writer);
  return GetStream(context, request, &sink);
}

grpc::Status KvCacheService::PrepareGetSlot(const v1::GetRequest& request, const BlockRead& b,
                                            const BlockGeometry& g, GetSlot* slot) {
  slot->owner.reset();
  slot->dense = {};
  slot->independent = false;
  absl::StatusOr<std::shared_ptr<const std::string>> payload =
      store_->ReadPayload(request.namespace_(), request.model_id(), b);
  if (!payload.ok()) return ToGrpcStatus(payload.status());
  slot->payload = *std::move(payload);
  // The payload is verified (hot: when it was made; cold: just now), so no second CRC pass.
  absl::StatusOr<BlockHeader> h = ParseVerifiedBlock(*slot->payload);
  if (!h.ok() || !(h->geometry == g) || b.reference_node_id != 0) return grpc::Status::OK;
  if (h->encoding == Encoding::kRaw && h->profile == Profile::kCompact &&
      h->payload.size() == g.num_bytes()) {
    slot->owner = slot->payload;
    slot->dense =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(h->payload.data()), h->payload.size());
  } else if (h->profile == Profile::kFast && h->reference_node_id == 0 &&
             h->predictor_version == 0) {
    // (A block coded against a learned state decodes on the chain: the store holds the state.)
    slot->independent = true;
  }
  return grpc::Status::OK;
}

void KvCacheService::DecodeGetSlot(const BlockGeometry& g, GetSlot* slot) {
  std::shared_ptr<uint8_t[]> buffer(new uint8_t[g.num_bytes()]);
  const absl::Span<uint8_t> out(buffer.get(), g.num_bytes());
  if (!DecodeVerifiedBlock(*slot->payload, out).ok()) return;  // the chain's path reports it
  slot->dense = out;
  slot->owner = std::move(buffer);
}

KvCacheService::GetCall::GetCall(KvCacheService* service, grpc::ServerContextBase* context,
                                 v1::GetRequest request)
    : service_(service), context_(context), request_(std::move(request)) {}

KvCacheService::GetCall::~GetCall() {
  if (decoding_.valid()) decoding_.wait();  // it writes into next_
}

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
  if (auto s = TokensOf(*request, &scratch_, &tokens_); !s.ok()) return s;
  if (request->node_id() != 0) {  // the path to a node (a centroid): its tokens, root first
    absl::StatusOr<std::vector<uint32_t>> path =
        store->PathTokens(request->namespace_(), request->model_id(), request->node_id());
    if (!path.ok()) return ToGrpcStatus(path.status());
    scratch_ = *std::move(path);
    tokens_ = scratch_;
  }
  absl::StatusOr<GetResult> got =
      store->Get(request->namespace_(), request->model_id(), tokens_, request->max_blocks());
  if (!got.ok()) return ToGrpcStatus(got.status());
  got_ = *std::move(got);
  const uint32_t bt = got_.model.geometry.block_tokens;
  if (!got_.model.model_id.empty()) {
    ToModelSpec(got_.model, header->mutable_header()->mutable_model());
  }
  header->mutable_header()->set_matched_blocks(static_cast<uint32_t>(got_.blocks.size()));
  header->mutable_header()->set_matched_tokens(static_cast<uint32_t>(got_.blocks.size()) * bt);
  const BlockGeometry& g = got_.model.geometry;
  chain_.emplace(g, nullptr);  // the store reads the centroids
  const size_t layer_bytes = g.num_layers ? g.layer_range_bytes(0, 1) : 1;
  layers_per_message_ =
      static_cast<uint32_t>(std::max<uint64_t>(1, options.max_get_message_bytes / layer_bytes));
  window_ = static_cast<size_t>(service_->codec_pool_->threads());
  return grpc::Status::OK;
}

v1::GetBlock KvCacheService::GetCall::MetaOf(size_t i) const {
  const BlockRead& b = got_.blocks[i];
  v1::GetBlock meta;
  meta.set_block_index(static_cast<uint32_t>(i));
  meta.set_node_id(b.node_id);
  meta.set_encoding(static_cast<v1::Encoding>(b.encoding));
  meta.set_reference_node_id(b.reference_node_id);
  meta.set_predictor_version(b.predictor_version);
  return meta;
}

grpc::Status KvCacheService::GetCall::Prepare(size_t begin, std::vector<GetSlot>* slots) {
  slots->clear();
  for (size_t i = begin; i < std::min(got_.blocks.size(), begin + window_); ++i) {
    GetSlot& slot = slots->emplace_back();
    slot.index = i;
    if (auto s = service_->PrepareGetSlot(request_, got_.blocks[i], got_.model.geometry, &slot);
        !s.ok()) {
      return s;
    }
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::GetCall::Next(Message* out, bool* end) {
  *end = false;
  const grpc::Status gone(grpc::StatusCode::CANCELLED, "client gone");
  const BlockGeometry& g = got_.model.geometry;
  if (residual_) {  // the stored payloads as they are, without a copy
    if (next_block_ >= got_.blocks.size()) {
      *end = true;
      return grpc::Status::OK;
    }
    if (context_->IsCancelled()) return gone;
    const size_t i = next_block_++;
    absl::StatusOr<std::shared_ptr<const std::string>> payload =
        service_->store_->ReadPayload(request_.namespace_(), request_.model_id(), got_.blocks[i]);
    if (!payload.ok()) return ToGrpcStatus(payload.status());
    out->block = MetaOf(i);
    out->block.set_layer_begin(0);
    out->block.set_layer_end(g.num_layers);
    out->encoded = true;
    out->bytes = **payload;
    out->owner = *std::move(payload);
    return grpc::Status::OK;
  }
  // RECONSTRUCTED. Blocks go out in windows of the codec pool's size: while window k is
  // written (the blocks that need their parent or a centroid decoded in order, here), the pool
  // decodes the independent blocks of window k + 1. Raw blocks are sent from their payloads.
  ThreadPool* pool = service_->codec_pool_.get();
  if (!started_) {
    started_ = true;
    if (auto s = Prepare(0, &current_); !s.ok()) return s;
    for (GetSlot& slot : current_) {
      if (slot.independent && slot.owner == nullptr) DecodeGetSlot(g, &slot);
    }
  }
  for (;;) {
    if (begin_ >= got_.blocks.size()) {
      *end = true;
      return grpc::Status::OK;
    }
    if (!window_open_) {  // the next window: read, and its independent blocks decoded beside
      window_open_ = true;
      prepared_ = Prepare(begin_ + window_, &next_);
      todo_.clear();
      if (prepared_.ok()) {
        for (GetSlot& slot : next_) {
          if (slot.independent && slot.owner == nullptr) todo_.push_back(&slot);
        }
      }
      // (With one codec thread they are decoded after this window is written.)
      if (pool->threads() > 1 && !todo_.empty()) {
        decoding_ = std::async(std::launch::async, [this, pool, &g] {
          pool->ParallelFor(todo_.size(), [&](size_t k) { DecodeGetSlot(g, todo_[k]); });
        });
      }
    }
    if (pos_ < current_.size()) {
      GetSlot& slot = current_[pos_];
      if (layer_ == 0) {  // the block's first message: the block is made ready
        if (context_->IsCancelled()) return gone;
        if (slot.owner == nullptr) {
          grpc::Status s =
              service_->DecodeOnChain(request_, tokens_, slot.index, &got_, &*chain_, &slot);
          if (!s.ok()) return s;
        } else {
          chain_->NextDenseShared(slot.owner, slot.dense);
        }
      }
      const uint32_t l = layer_;
      const uint32_t l_end = std::min(g.num_layers, l + layers_per_message_);
      out->block = MetaOf(slot.index);
      out->block.set_layer_begin(l);
      out->block.set_layer_end(l_end);
      const absl::Span<const uint8_t> part =
          slot.dense.subspan(g.layer_range_bytes(0, l), g.layer_range_bytes(l, l_end));
      out->encoded = false;
      out->bytes = absl::string_view(reinterpret_cast<const char*>(part.data()), part.size());
      out->owner = slot.owner;
      layer_ = l_end;
      if (layer_ >= g.num_layers) {
        slot = GetSlot();  // release this call's hold on the buffers
        ++pos_;
        layer_ = 0;
      }
      return grpc::Status::OK;
    }
    // Window written: the next one is current.
    if (decoding_.valid()) {
      decoding_.get();
    } else {
      for (GetSlot* slot : todo_) DecodeGetSlot(g, slot);
    }
    todo_.clear();
    if (!prepared_.ok()) return prepared_;
    std::swap(current_, next_);
    pos_ = 0;
    layer_ = 0;
    begin_ += window_;
    window_open_ = false;
  }
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

grpc::Status KvCacheService::DecodeOnChain(const v1::GetRequest& request,
                                           absl::Span<const uint32_t> tokens, size_t i,
                                           GetResult* got, DecodeChain* chain, GetSlot* slot) {
  const BlockGeometry& g = got->model.geometry;
  std::shared_ptr<uint8_t[]> buffer(new uint8_t[g.num_bytes()]);
  const absl::Span<uint8_t> out(buffer.get(), g.num_bytes());
  const BlockRead& b = got->blocks[i];
  chain->SetOutputOwner(buffer);
  absl::Status s =
      store_->ReadAndDecodeBlock(request.namespace_(), request.model_id(), b, chain, out);
  // ABORTED: the block changed since the Get listed it and its listed encoding can not be
  // decoded any more (the centroid it is a residual of was deleted while the Get ran, and could
  // not be kept for it: it listed while the Delete was under way). Delete
  // first re-encodes its dependents as bit-exact standalone copies under the same node ids,
  // so read the rest of the prefix again and decode the same node (bounded). Everything else a
  // Get listed is read as listed (the store's snapshot reads, trie/kv_store.h).
  for (int retry = 0; absl::IsAborted(s) && retry < kGetRetries; ++retry) {
    absl::StatusOr<GetResult> again =
        store_->Get(request.namespace_(), request.model_id(), tokens, request.max_blocks());
    if (!again.ok()) break;
    if (again->blocks.size() <= i || again->blocks[i].node_id != b.node_id) {
      // The block itself went (a Delete of its prefix): what this Get promised is gone.
      return grpc::Status(grpc::StatusCode::ABORTED,
                          absl::StrCat("token_ids: blocks [", i, ", ", got->blocks.size(),
                                       ") were deleted while this Get streamed them; retry"));
    }
    for (size_t j = i; j < again->blocks.size() && j < got->blocks.size() &&
                       again->blocks[j].node_id == got->blocks[j].node_id;
         ++j) {
      got->blocks[j] = again->blocks[j];
    }
    chain->SetOutputOwner(buffer);
    s = store_->ReadAndDecodeBlock(request.namespace_(), request.model_id(), got->blocks[i], chain,
                                   out);
  }
  if (!s.ok()) return ToGrpcStatus(s);
  slot->dense = out;
  slot->owner = std::move(buffer);
  return grpc::Status::OK;
}

}  // namespace kvtrie
