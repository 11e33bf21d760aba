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

// One block of a Get on its way to the wire: its stored payload, and what is sent for it.
struct KvCacheService::GetSlot {
  size_t index = 0;
  std::shared_ptr<const std::string> payload;
  // Set when the block is ready to send: a view of the payload (raw) or of a decoded buffer.
  std::shared_ptr<const void> owner;
  absl::Span<const uint8_t> dense;
  bool independent = false;  // decodes without the parent or a reference (fast profile)
};

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
  } else if (h->profile == Profile::kFast && h->reference_node_id == 0) {
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

grpc::Status KvCacheService::GetStream(grpc::ServerContext* context, const v1::GetRequest* request,
                                       GetSink* sink) {
  if (auto s = CheckName("namespace", request->namespace_(), false); !s.ok()) return s;
  if (auto s = CheckName("model_id", request->model_id(), true); !s.ok()) return s;
  if (auto s = CheckTokens("token_ids", TokenCount(*request), options_.max_tokens); !s.ok())
    return s;
  if (!v1::GetMode_IsValid(request->mode())) {
    return Invalid(absl::StrCat("mode: unknown value ", static_cast<int>(request->mode())));
  }
  const bool residual = request->mode() == v1::GET_MODE_RESIDUAL;
  std::vector<uint32_t> scratch;
  absl::Span<const uint32_t> tokens;
  if (auto s = TokensOf(*request, &scratch, &tokens); !s.ok()) return s;
  if (request->node_id() != 0) {  // the path to a node (a centroid): its tokens, root first
    absl::StatusOr<std::vector<uint32_t>> path =
        store_->PathTokens(request->namespace_(), request->model_id(), request->node_id());
    if (!path.ok()) return ToGrpcStatus(path.status());
    scratch = *std::move(path);
    tokens = scratch;
  }
  absl::StatusOr<GetResult> got =
      store_->Get(request->namespace_(), request->model_id(), tokens, request->max_blocks());
  if (!got.ok()) return ToGrpcStatus(got.status());
  v1::GetResponse header;
  const uint32_t bt = got->model.geometry.block_tokens;
  if (!got->model.model_id.empty())
    ToModelSpec(got->model, header.mutable_header()->mutable_model());
  header.mutable_header()->set_matched_blocks(static_cast<uint32_t>(got->blocks.size()));
  header.mutable_header()->set_matched_tokens(static_cast<uint32_t>(got->blocks.size()) * bt);
  if (!sink->WriteHeader(header)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
  const grpc::Status gone(grpc::StatusCode::CANCELLED, "client gone");

  const BlockGeometry& g = got->model.geometry;
  auto meta_of = [&](size_t i) {
    const BlockRead& b = got->blocks[i];
    v1::GetBlock meta;
    meta.set_block_index(static_cast<uint32_t>(i));
    meta.set_node_id(b.node_id);
    meta.set_encoding(static_cast<v1::Encoding>(b.encoding));
    meta.set_reference_node_id(b.reference_node_id);
    return meta;
  };
  if (residual) {  // the stored payloads as they are, without a copy
    for (size_t i = 0; i < got->blocks.size(); ++i) {
      if (context->IsCancelled()) return gone;
      absl::StatusOr<std::shared_ptr<const std::string>> payload =
          store_->ReadPayload(request->namespace_(), request->model_id(), got->blocks[i]);
      if (!payload.ok()) return ToGrpcStatus(payload.status());
      v1::GetBlock meta = meta_of(i);
      meta.set_layer_begin(0);
      meta.set_layer_end(g.num_layers);
      const absl::string_view bytes = **payload;
      if (!sink->WriteBlock(meta, /*encoded=*/true, bytes, *std::move(payload))) return gone;
    }
    return grpc::Status::OK;
  }

  // RECONSTRUCTED. Blocks go out in windows of the codec pool's size: while this thread writes
  // window k (decoding in order the blocks that need their parent or a centroid), the pool
  // decodes the independent blocks of window k + 1. Raw blocks are sent from their payloads.
  DecodeChain chain(g, nullptr);  // the store reads the centroids
  const size_t layer_bytes = g.num_layers ? g.layer_range_bytes(0, 1) : 1;
  const uint32_t layers_per_message =
      static_cast<uint32_t>(std::max<uint64_t>(1, options_.max_get_message_bytes / layer_bytes));
  const size_t window = static_cast<size_t>(codec_pool_->threads());
  std::vector<GetSlot> current, next;
  auto prepare = [&](size_t begin, std::vector<GetSlot>* slots) -> grpc::Status {
    slots->clear();
    for (size_t i = begin; i < std::min(got->blocks.size(), begin + window); ++i) {
      GetSlot& slot = slots->emplace_back();
      slot.index = i;
      if (auto s = PrepareGetSlot(*request, got->blocks[i], g, &slot); !s.ok()) return s;
    }
    return grpc::Status::OK;
  };
  // Writes the blocks of `slots` in order; a block not ready yet is decoded here, on the chain.
  auto write = [&](std::vector<GetSlot>* slots) -> grpc::Status {
    for (GetSlot& slot : *slots) {
      const size_t i = slot.index;
      if (context->IsCancelled()) return gone;
      if (slot.owner == nullptr) {
        grpc::Status s = DecodeOnChain(*request, tokens, i, &*got, &chain, &slot);
        if (!s.ok()) return s;
      } else {
        chain.NextDenseShared(slot.owner, slot.dense);
      }
      v1::GetBlock meta = meta_of(i);
      for (uint32_t l = 0; l < g.num_layers; l += layers_per_message) {
        const uint32_t end = std::min(g.num_layers, l + layers_per_message);
        meta.set_layer_begin(l);
        meta.set_layer_end(end);
        const absl::Span<const uint8_t> part =
            slot.dense.subspan(g.layer_range_bytes(0, l), g.layer_range_bytes(l, end));
        if (!sink->WriteBlock(
                meta, /*encoded=*/false,
                absl::string_view(reinterpret_cast<const char*>(part.data()), part.size()),
                slot.owner)) {
          return gone;
        }
      }
      slot = GetSlot();  // release the buffers
    }
    return grpc::Status::OK;
  };
  if (auto s = prepare(0, &current); !s.ok()) return s;
  for (GetSlot& slot : current) {
    if (slot.independent && slot.owner == nullptr) DecodeGetSlot(g, &slot);
  }
  for (size_t begin = 0; begin < got->blocks.size(); begin += window) {
    grpc::Status prepared = prepare(begin + window, &next);
    std::vector<GetSlot*> todo;
    if (prepared.ok()) {
      for (GetSlot& slot : next) {
        if (slot.independent && slot.owner == nullptr) todo.push_back(&slot);
      }
    }
    // The decodes of the next window run beside this thread's writes (with one codec thread,
    // after them).
    std::future<void> decoding;
    if (codec_pool_->threads() > 1 && !todo.empty()) {
      decoding = std::async(std::launch::async, [&] {
        codec_pool_->ParallelFor(todo.size(), [&](size_t k) { DecodeGetSlot(g, todo[k]); });
      });
    }
    const grpc::Status written = write(&current);
    if (decoding.valid()) {
      decoding.get();
    } else if (written.ok()) {
      for (GetSlot* slot : todo) DecodeGetSlot(g, slot);
    }
    if (!written.ok()) return written;
    if (!prepared.ok()) return prepared;
    std::swap(current, next);
  }
  return grpc::Status::OK;
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
  // ABORTED: the centroid this block is a residual of was deleted while the Get ran. Delete
  // first re-encodes its dependents as bit-exact standalone copies under the same node ids,
  // so read the rest of the prefix again and decode the same node (bounded).
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
