#include "server/guarded_service.h"

#include <chrono>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

grpc::Status Exhausted(std::string message) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::move(message));
}

}  // namespace

// Hands KvCacheService the Put stream with the header's namespace replaced by the caller's, and
// admits the Put (auth, quotas) when the header arrives. A refusal ends the stream for the inner
// service; Put() then returns the refusal instead of the inner status.
class GuardedService::PutReader final : public grpc::ServerReaderInterface<v1::PutRequest> {
 public:
  PutReader(GuardedService* guard, grpc::ServerContext* context,
            grpc::ServerReaderInterface<v1::PutRequest>* inner)
      : guard_(guard), context_(context), inner_(inner) {}
  ~PutReader() override {
    if (admitted_) {
      if (counters_ != nullptr) counters_->put_streams.fetch_sub(1);
      if (guard_->metrics_ != nullptr) guard_->metrics_->AddPutStreams(caller_.ns, -1);
    }
  }

  void SendInitialMetadata() override { inner_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* sz) override { return inner_->NextMessageSize(sz); }
  bool Read(v1::PutRequest* msg) override {
    if (!status_.ok()) return false;
    if (!inner_->Read(msg)) return false;
    if (seen_header_) return true;
    seen_header_ = true;
    if (!msg->has_header()) return true;  // the inner service names the error
    status_ = guard_->auth_->Authorize(*context_, msg->header().namespace_(), &caller_);
    if (!status_.ok()) return false;
    msg->mutable_header()->set_namespace_(caller_.ns);
    if (caller_.tenant != nullptr) counters_ = guard_->CountersOf(caller_.ns);
    status_ = guard_->AdmitPut(caller_, msg->header());
    if (!status_.ok()) return false;
    admitted_ = true;
    if (guard_->metrics_ != nullptr) guard_->metrics_->AddPutStreams(caller_.ns, 1);
    return true;
  }

  const grpc::Status& status() const { return status_; }
  bool seen_header() const { return seen_header_; }
  const Caller& caller() const { return caller_; }
  NamespaceCounters* counters() const { return counters_; }

 private:
  GuardedService* const guard_;
  grpc::ServerContext* const context_;
  grpc::ServerReaderInterface<v1::PutRequest>* const inner_;
  grpc::Status status_;
  bool seen_header_ = false;
  bool admitted_ = false;
  Caller caller_;
  NamespaceCounters* counters_ = nullptr;
};

// Passes Get's messages through and remembers the header's matched token count.
class GuardedService::GetWriter final : public GetSink {
 public:
  explicit GetWriter(GetSink* inner) : inner_(inner) {}
  bool WriteHeader(const v1::GetResponse& header) override {
    matched_tokens_ = header.header().matched_tokens();
    return inner_->WriteHeader(header);
  }
  bool WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                  std::shared_ptr<const void> owner) override {
    return inner_->WriteBlock(block, encoded, bytes, std::move(owner));
  }
  uint32_t matched_tokens() const { return matched_tokens_; }

 private:
  GetSink* const inner_;
  uint32_t matched_tokens_ = 0;
};

GuardedService::GuardedService(KvCacheService* inner, const Authenticator* auth, KvStore* store,
                               Metrics* metrics)
    : inner_(inner), auth_(auth), store_(store), metrics_(metrics) {
  // Get's responses are framed by hand (server/get_sink.h) so its payloads go out uncopied: the
  // method is served as a split stream whose responses are grpc::ByteBuffers. The wire format is
  // the proto's; only this server's side of the serialization changes.
  grpc::Service::MarkMethodStreamed(
      kGetMethodIndex,
      new grpc::internal::SplitServerStreamingHandler<v1::GetRequest, grpc::ByteBuffer>(
          [this](grpc::ServerContext* context,
                 grpc::ServerSplitStreamer<v1::GetRequest, grpc::ByteBuffer>* stream) {
            return StreamedGet(context, stream);
          }));
}

GuardedService::NamespaceCounters* GuardedService::CountersOf(const std::string& ns) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<NamespaceCounters>& c = counters_[ns];
  if (c == nullptr) c = std::make_unique<NamespaceCounters>();
  return c.get();
}

template <typename Body>
grpc::Status GuardedService::Guard(const char* method, grpc::ServerContext* context,
                                   const std::string& requested_ns, Body body) {
  const auto start = std::chrono::steady_clock::now();
  Caller caller;
  grpc::Status s = auth_->Authorize(*context, requested_ns, &caller);
  bool authorized = s.ok();
  if (authorized) s = body(caller);
  if (metrics_ != nullptr) {
    if (!authorized) metrics_->RecordAuthFailure(s.error_code());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // An unauthorized call is labelled with no namespace of its own (it could name any).
    metrics_->RecordCall(method, authorized ? &caller.ns : nullptr, s.error_code(), seconds);
  }
  return s;
}

grpc::Status GuardedService::AdmitPut(const Caller& caller, const v1::PutHeader& header) {
  if (caller.tenant == nullptr) return grpc::Status::OK;  // auth off: no quotas
  const Quota q = caller.table->QuotaOf(caller.ns);
  if (q.put_streams > 0) {
    NamespaceCounters* c = CountersOf(caller.ns);
    const int64_t open = c->put_streams.fetch_add(1);
    if (open >= q.put_streams) {
      c->put_streams.fetch_sub(1);
      if (metrics_ != nullptr) metrics_->RecordQuotaRejection(caller.ns, "put_streams");
      return Exhausted(absl::StrCat("quota put_streams: namespace '", caller.ns, "' has ", open,
                                    " Put streams in flight, its quota is ", q.put_streams));
    }
  } else {
    CountersOf(caller.ns)->put_streams.fetch_add(1);
  }
  grpc::Status s = grpc::Status::OK;
  if (q.stored_bytes > 0 || q.nodes > 0) {
    const StoreStats st = store_->Stats(caller.ns);
    const uint32_t bt = header.model().block_tokens() ? header.model().block_tokens() : 16;
    const uint64_t blocks = static_cast<uint64_t>(header.token_ids_size()) / bt;
    if (q.stored_bytes > 0 && st.bytes_stored >= q.stored_bytes) {
      if (metrics_ != nullptr) metrics_->RecordQuotaRejection(caller.ns, "stored_bytes");
      s = Exhausted(absl::StrCat("quota stored_bytes: namespace '", caller.ns, "' stores ",
                                 st.bytes_stored, " bytes, its quota is ", q.stored_bytes));
    } else if (q.nodes > 0 && st.nodes + blocks > q.nodes) {
      // Only near the quota: blocks already stored are deduplicated and add no node.
      const MatchResult m =
          store_->Lookup(caller.ns, header.model().model_id(), header.token_ids());
      const uint64_t added = blocks - std::min<uint64_t>(blocks, m.node_ids.size());
      if (st.nodes + added > q.nodes) {
        if (metrics_ != nullptr) metrics_->RecordQuotaRejection(caller.ns, "nodes");
        s = Exhausted(absl::StrCat("quota nodes: namespace '", caller.ns, "' holds ", st.nodes,
                                   " nodes, this Put adds ", added, ", its quota is ", q.nodes));
      }
    }
  }
  if (!s.ok()) CountersOf(caller.ns)->put_streams.fetch_sub(1);
  return s;
}

grpc::Status GuardedService::Lookup(grpc::ServerContext* context, const v1::LookupRequest* request,
                                    v1::LookupResponse* response) {
  return Guard("Lookup", context, request->namespace_(), [&](const Caller& caller) {
    grpc::Status s = inner_->LookupIn(caller.ns, *request, response);
    if (s.ok()) {
      if (metrics_ != nullptr) {
        metrics_->RecordMatch(caller.ns, KvCacheService::TokenCount(*request),
                              response->matched_tokens());
      }
      if (caller.tenant != nullptr) {
        NamespaceCounters* c = CountersOf(caller.ns);
        c->lookups++;
        if (response->matched_blocks() > 0) c->lookup_hits++;
      }
    }
    return s;
  });
}

grpc::Status GuardedService::Put(grpc::ServerContext* context,
                                 grpc::ServerReader<v1::PutRequest>* reader,
                                 v1::PutResponse* response) {
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s;
  std::optional<std::string> ns;  // none: refused before it had a namespace
  {
    PutReader guarded(this, context, reader);
    s = inner_->PutStream(context, &guarded, response);
    if (!guarded.status().ok()) s = guarded.status();
    const bool authorized = guarded.seen_header() &&
                            guarded.status().error_code() != grpc::StatusCode::UNAUTHENTICATED &&
                            guarded.status().error_code() != grpc::StatusCode::PERMISSION_DENIED;
    if (authorized) ns = guarded.caller().ns;
    if (!authorized && metrics_ != nullptr && guarded.seen_header()) {
      metrics_->RecordAuthFailure(s.error_code());
    }
    if (s.ok()) {
      if (metrics_ != nullptr) metrics_->RecordPut(*ns, *response);
      if (NamespaceCounters* c = guarded.counters(); c != nullptr) {
        c->puts++;
        c->blocks_stored += response->blocks_stored();
        c->blocks_deduplicated += response->blocks_deduplicated();
      }
    }
  }
  if (metrics_ != nullptr) {
    metrics_->RecordCall(
        "Put", ns ? &*ns : nullptr, s.error_code(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return s;
}

grpc::Status GuardedService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                                 grpc::ServerWriter<v1::GetResponse>* writer) {
  v1::GetRequest r = *request;
  MessageGetSink sink(writer);
  return GuardedGet(context, &r, &sink);
}

grpc::Status GuardedService::StreamedGet(
    grpc::ServerContext* context,
    grpc::ServerSplitStreamer<v1::GetRequest, grpc::ByteBuffer>* stream) {
  v1::GetRequest request;
  if (!stream->Read(&request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "request: did not parse (proto3 string fields such as namespace and "
                        "model_id must be valid UTF-8)");
  }
  ByteBufferGetSink sink(stream);
  return GuardedGet(context, &request, &sink);
}

grpc::Status GuardedService::GuardedGet(grpc::ServerContext* context, v1::GetRequest* request,
                                        GetSink* sink) {
  const std::string requested_ns = request->namespace_();
  return Guard("Get", context, requested_ns, [&](const Caller& caller) {
    request->set_namespace_(caller.ns);
    GetWriter w(sink);
    grpc::Status s = inner_->GetStream(context, request, &w);
    if (s.ok() && request->node_id() == 0) {
      if (metrics_ != nullptr) {
        metrics_->RecordMatch(caller.ns, KvCacheService::TokenCount(*request), w.matched_tokens());
      }
    }
    if (s.ok() && caller.tenant != nullptr) CountersOf(caller.ns)->gets++;
    return s;
  });
}

grpc::Status GuardedService::Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                   v1::StatsResponse* response) {
  return Guard("Stats", context, request->namespace_(), [&](const Caller& caller) {
    v1::StatsRequest r = *request;
    r.set_namespace_(caller.ns);
    grpc::Status s = inner_->Stats(context, &r, response);
    if (!s.ok() || caller.admin()) return s;
    // A tenant sees its namespace's own counters, never the server-wide ones (they would tell it
    // about other tenants' traffic).
    NamespaceCounters* c = CountersOf(caller.ns);
    response->set_lookups(c->lookups);
    response->set_lookup_hits(c->lookup_hits);
    response->set_gets(c->gets);
    response->set_puts(c->puts);
    response->set_deletes(c->deletes);
    response->set_blocks_stored(c->blocks_stored);
    response->set_blocks_deduplicated(c->blocks_deduplicated);
    for (auto clear :
         {&v1::StatsResponse::clear_demotions, &v1::StatsResponse::clear_demoted_bytes,
          &v1::StatsResponse::clear_promotions, &v1::StatsResponse::clear_cold_reads,
          &v1::StatsResponse::clear_cold_read_bytes, &v1::StatsResponse::clear_evictions_disk,
          &v1::StatsResponse::clear_evicted_bytes, &v1::StatsResponse::clear_evictions_data_loss,
          &v1::StatsResponse::clear_evictions_deleted, &v1::StatsResponse::clear_pins_expired,
          &v1::StatsResponse::clear_puts_rejected_disk_full}) {
      (response->*clear)();
    }
    return s;
  });
}

grpc::Status GuardedService::Inspect(grpc::ServerContext* context,
                                     const v1::InspectRequest* request,
                                     v1::InspectResponse* response) {
  return Guard("Inspect", context, request->namespace_(), [&](const Caller& caller) {
    v1::InspectRequest r = *request;
    r.set_namespace_(caller.ns);
    return inner_->Inspect(context, &r, response);
  });
}

grpc::Status GuardedService::Delete(grpc::ServerContext* context, const v1::DeleteRequest* request,
                                    v1::DeleteResponse* response) {
  return Guard("Delete", context, request->namespace_(), [&](const Caller& caller) {
    v1::DeleteRequest r = *request;
    r.set_namespace_(caller.ns);
    grpc::Status s = inner_->Delete(context, &r, response);
    if (s.ok() && caller.tenant != nullptr) CountersOf(caller.ns)->deletes++;
    return s;
  });
}

grpc::Status GuardedService::Pin(grpc::ServerContext* context, const v1::PinRequest* request,
                                 v1::PinResponse* response) {
  return Guard("Pin", context, request->namespace_(), [&](const Caller& caller) {
    v1::PinRequest r = *request;
    r.set_namespace_(caller.ns);
    return inner_->Pin(context, &r, response);
  });
}

}  // namespace kvtrie
