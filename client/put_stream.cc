#include "client/put_stream.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/retry.h"
#include "client/status_reason.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

// Token ids in a header and the PutTokens messages after it.
size_t NumTokens(const std::vector<v1::PutRequest>& header) {
  size_t n = 0;
  for (const v1::PutRequest& m : header) {
    // The repeated field or the packed one (4 bytes an id), whichever the message carries.
    n += m.has_header() ? m.header().token_ids_size() + m.header().token_ids_packed().size() / 4
                        : m.tokens().token_ids_size() + m.tokens().token_ids_packed().size() / 4;
  }
  return n;
}

}  // namespace

PutStream::PutStream(Client* client, std::vector<v1::PutRequest> header, const BlockGeometry& g,
                     uint32_t first_block, uint32_t layers_per_message)
    : client_(client),
      header_(std::move(header)),
      g_(g),
      num_tokens_(NumTokens(header_)),
      first_block_(first_block),
      layers_per_message_(layers_per_message) {
  replayable_ = client_->options().retry.max_attempts > 1 &&
                client_->options().retry.max_put_stream_replay_bytes > 0;
  if (!Open()) status_ = Broken();
}

PutStream::~PutStream() { Cancel(); }

bool PutStream::Open() {
  writer_.reset();  // a finished call, before its context
  ctx_ = client_->NewContext();
  resp_.Clear();
  writer_ = client_->stub()->Put(ctx_.get(), &resp_);
  for (const v1::PutRequest& m : header_) {
    if (!writer_->Write(m)) return false;
  }
  for (const v1::PutRequest& m : sent_) {
    if (!writer_->Write(m)) return false;
  }
  return true;
}

bool PutStream::Send(const v1::PutRequest& req) {
  if (replayable_) {
    sent_bytes_ += req.block().kv().size();
    if (sent_bytes_ > client_->options().retry.max_put_stream_replay_bytes) {
      replayable_ = false;  // too big to keep: a failed Put goes to the caller
      sent_.clear();
      sent_.shrink_to_fit();
    } else {
      sent_.push_back(req);
    }
  }
  return writer_->Write(req);
}

bool PutStream::ShouldRetry(const absl::Status& s) const {
  return replayable_ && RetryablePutCode(s.code()) &&
         attempt_ < client_->options().retry.max_attempts;
}

absl::Status PutStream::Broken() {
  for (;;) {
    const grpc::Status gs = writer_->Finish();
    finished_ = true;
    if (gs.ok()) return absl::UnknownError("put: the server closed the stream before the commit");
    absl::Status s = FromGrpcStatus(gs);
    if (!ShouldRetry(s)) return s;
    absl::SleepFor(RetryBackoff(client_->options().retry, attempt_));
    ++attempt_;
    finished_ = false;
    if (Open()) return absl::OkStatus();
  }
}

absl::Status PutStream::WriteLayers(uint32_t layer_begin, uint32_t layer_end, size_t token_offset,
                                    size_t span_tokens, absl::Span<const uint8_t> k,
                                    absl::Span<const uint8_t> v) {
  if (!status_.ok()) return status_;
  if (finished_) return absl::FailedPreconditionError("put: the stream was committed or cancelled");
  if (layer_begin >= layer_end || layer_end > g_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer_begin: layers [", layer_begin, ", ", layer_end,
                     ") are not a range within num_layers=", g_.num_layers));
  }
  if (token_offset % g_.block_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_offset: ", token_offset, " is not a multiple of block_tokens=", g_.block_tokens));
  }
  if (token_offset + span_tokens > num_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("k: tokens [", token_offset, ", ",
                                                   token_offset + span_tokens,
                                                   ") run past the header's ", num_tokens_));
  }
  BlockGeometry sub = g_;
  sub.num_layers = layer_end - layer_begin;
  const size_t want =
      sub.num_layers * sub.num_kv_heads * span_tokens * sub.head_dim * DTypeBytes(sub.dtype);
  if (k.size() != want || v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("k: k has ", k.size(), " and v ", v.size(),
                                                   " bytes; ", sub.num_layers, " layers of ",
                                                   span_tokens, " tokens need ", want, " each"));
  }
  const size_t span_first = token_offset / g_.block_tokens;
  const size_t end = (token_offset + span_tokens) / g_.block_tokens;
  const uint32_t per_msg = layers_per_message_ ? layers_per_message_ : sub.num_layers;
  // One PutBlock message is reused, so its kv string keeps its capacity: no allocation (and no
  // fresh pages to fault in) per message. A whole layer range per message is gathered straight
  // into it; smaller messages are cut from one gathered block.
  v1::PutBlock* pb = req_.mutable_block();
  std::string* kv_bytes = pb->mutable_kv();
  if (per_msg < sub.num_layers) block_.resize(sub.num_bytes());
  for (size_t b = std::max<size_t>(first_block_, span_first); b < end; ++b) {
    if (per_msg >= sub.num_layers) {
      kv_bytes->resize(sub.num_bytes());
      GatherBlock(sub, span_tokens, k.data(), v.data(), b - span_first,
                  absl::MakeSpan(reinterpret_cast<uint8_t*>(kv_bytes->data()), kv_bytes->size()));
    } else {
      GatherBlock(sub, span_tokens, k.data(), v.data(), b - span_first, absl::MakeSpan(block_));
    }
    for (uint32_t l = 0; l < sub.num_layers; l += per_msg) {
      const uint32_t e = std::min(sub.num_layers, l + per_msg);
      pb->set_block_index(static_cast<uint32_t>(b));
      pb->set_layer_begin(layer_begin + l);
      pb->set_layer_end(layer_begin + e);
      if (per_msg < sub.num_layers) {
        kv_bytes->assign(reinterpret_cast<const char*>(block_.data()) + sub.layer_range_bytes(0, l),
                         sub.layer_range_bytes(l, e));
      }
      if (!Send(req_) && !(status_ = Broken()).ok()) return status_;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PutResponse> PutStream::Commit() {
  if (!status_.ok()) return status_;
  if (finished_) return absl::FailedPreconditionError("put: the stream was committed or cancelled");
  req_.Clear();
  req_.mutable_commit();
  for (;;) {
    writer_->Write(req_);  // a failed write shows in Finish
    writer_->WritesDone();
    const grpc::Status gs = writer_->Finish();
    finished_ = true;
    if (gs.ok()) break;
    const absl::Status s = FromGrpcStatus(gs);
    if (!ShouldRetry(s)) return status_ = s;
    absl::SleepFor(RetryBackoff(client_->options().retry, attempt_));
    ++attempt_;
    finished_ = false;
    // A write that fails while sending everything again shows in the next Finish.
    Open();
  }
  status_ = absl::FailedPreconditionError("put: the stream was committed");
  sent_.clear();
  return resp_;
}

void PutStream::Cancel() {
  if (finished_) return;
  ctx_->TryCancel();
  writer_->Finish();
  finished_ = true;
  status_ = absl::CancelledError("put: the stream was cancelled");
}

}  // namespace kvtrie
