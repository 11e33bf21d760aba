#include "server/guarded_service.h"

#include <chrono>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

grpc::Status Exhausted(std::string message) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::move(message));
}

}  // namespace

GuardedService::GuardedService(KvCacheService* inner, const Authenticator* auth, KvStore* store,
                               Metrics* metrics, const GuardedServiceOptions& options)
    : inner_(inner),
      auth_(auth),
      store_(store),
      metrics_(metrics),
      options_(options),
      handlers_(std::make_unique<TaskPool>(std::max(1, options.handler_threads))) {
  if (options_.get_idle_timeout > absl::ZeroDuration() ||
      options_.get_max_snapshot_age > absl::ZeroDuration() ||
      (options_.get_cut_folder_bytes > 0 && store_ != nullptr)) {
    watchdog_ = std::thread([this] { WatchLoop(); });
  }
}

GuardedService::~GuardedService() { StopHandlers(); }

void GuardedService::StopHandlers() {
  {
    absl::MutexLock lock(&writers_mu_);
    stop_watch_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  handlers_.reset();  // runs what is queued, joins
}

grpc::Status GuardedService::CheckSize(const grpc::ByteBuffer& request) const {
  if (options_.max_message_bytes == 0 || request.Length() <= options_.max_message_bytes) {
    return grpc::Status::OK;
  }
  return Exhausted(absl::StrCat(
      "request: ", request.Length(), " bytes exceeds the server's message limit of ",
      options_.max_message_bytes, " bytes; send token_ids_packed (4 bytes an id) or fewer ids"));
}

std::string GuardedService::PeerOf(const grpc::CallbackServerContext& context) const {
  if (auth_->enabled()) {  // a tenant's streams count together, from any host
    Caller caller;
    if (auth_->Authorize(context, "", &caller).ok() && caller.tenant != nullptr) {
      return absl::StrCat("tenant '", caller.tenant->name, "'");
    }
  }
  // "ipv4:10.1.2.3:5678" or "ipv6:[::1]:5678": the host without the port (each connection has
  // its own). Other transports (unix sockets: every client has the server's path) name no peer.
  std::string peer = context.peer();
  if (!absl::StartsWith(peer, "ipv4:") && !absl::StartsWith(peer, "ipv6:")) return "";
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && colon > 5) peer.resize(colon);
  return peer;
}

grpc::Status GuardedService::NotParsed() {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      "request: did not parse (proto3 string fields such as namespace and "
                      "model_id must be valid UTF-8)");
}

GuardedService::NamespaceCounters* GuardedService::CountersOf(const std::string& ns) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<NamespaceCounters>& c = counters_[ns];
  if (c == nullptr) c = std::make_unique<NamespaceCounters>();
  return c.get();
}

template <typename Body>
grpc::Status GuardedService::Guard(const char* method, grpc::ServerContextBase* context,
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

template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* GuardedService::Unary(const char* method,
                                                grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response, Body body) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // On the handler pool: a store call may wait for a lock, and gRPC's threads must not. The
  // request, the response and the context live until Finish.
  handlers_->Schedule([this, method, context, request, response, reactor, body] {
    if (grpc::Status s = CheckSize(*request); !s.ok()) {
      reactor->Finish(s);
      return;
    }
    Req req;
    grpc::ByteBuffer bytes = *request;  // shares the slices; Deserialize consumes its buffer
    if (!grpc::SerializationTraits<Req>::Deserialize(&bytes, &req).ok()) {
      reactor->Finish(NotParsed());
      return;
    }
    Resp resp;
    grpc::Status s = Guard(method, context, req.namespace_(),
                           [&](const Caller& caller) { return body(caller, &req, &resp); });
    if (s.ok()) {
      bool own_buffer = false;
      s = grpc::SerializationTraits<Resp>::Serialize(resp, response, &own_buffer);
    }
    reactor->Finish(s);
  });
  return reactor;
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
    const StoreStats st = store_->NamespaceStats(caller.ns);
    const uint32_t bt = header.model().block_tokens() ? header.model().block_tokens() : 16;
    // The header's token ids: the repeated field, or packed 4 bytes each little-endian (a
    // malformed packed field is refused by the service after this).
    std::vector<uint32_t> ids(header.token_ids().begin(), header.token_ids().end());
    if (ids.empty() && !header.token_ids_packed().empty()) {
      ids.resize(header.token_ids_packed().size() / 4);
      for (size_t i = 0; i < ids.size(); ++i) {
        const auto* p = reinterpret_cast<const uint8_t*>(header.token_ids_packed().data()) + 4 * i;
        ids[i] = p[0] | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
      }
    }
    const uint64_t blocks = static_cast<uint64_t>(ids.size()) / bt;
    if (q.stored_bytes > 0 && st.bytes_stored >= q.stored_bytes) {
      if (metrics_ != nullptr) metrics_->RecordQuotaRejection(caller.ns, "stored_bytes");
      s = Exhausted(absl::StrCat("quota stored_bytes: namespace '", caller.ns, "' stores ",
                                 st.bytes_stored, " bytes, its quota is ", q.stored_bytes));
    } else if (q.nodes > 0 && st.nodes + blocks > q.nodes) {
      // Only near the quota: blocks already stored are deduplicated and add no node.
      const MatchResult m = store_->Lookup(caller.ns, header.model().model_id(), ids);
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

grpc::ServerUnaryReactor* GuardedService::Lookup(grpc::CallbackServerContext* context,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return Unary<v1::LookupRequest, v1::LookupResponse>(
      "Lookup", context, request, response,
      [this](const Caller& caller, v1::LookupRequest* r, v1::LookupResponse* out) {
        grpc::Status s = inner_->LookupIn(caller.ns, *r, out);
        if (s.ok()) {
          if (metrics_ != nullptr) {
            metrics_->RecordMatch(caller.ns, KvCacheService::TokenCount(*r), out->matched_tokens());
          }
          if (caller.tenant != nullptr) {
            NamespaceCounters* c = CountersOf(caller.ns);
            c->lookups++;
            if (out->matched_blocks() > 0) c->lookup_hits++;
          }
        }
        return s;
      });
}

grpc::ServerUnaryReactor* GuardedService::Stats(grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) {
  return Unary<v1::StatsRequest, v1::StatsResponse>(
      "Stats", context, request, response,
      [this](const Caller& caller, v1::StatsRequest*, v1::StatsResponse* response) {
        // Only an admin (or anyone, with auth off) may ask for the whole server ("" to the store);
        // a tenant's "" is its own namespace like any other.
        grpc::Status s = inner_->StatsIn(caller.ns, caller.admin(), response);
        if (!s.ok() || caller.admin()) return s;
        // A tenant sees its namespace's own counters, never the server-wide ones (they would tell
        // it about other tenants' traffic).
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
              &v1::StatsResponse::clear_evicted_bytes,
              &v1::StatsResponse::clear_evictions_data_loss,
              &v1::StatsResponse::clear_evictions_deleted, &v1::StatsResponse::clear_pins_expired,
              &v1::StatsResponse::clear_puts_rejected_disk_full}) {
          (response->*clear)();
        }
        return s;
      });
}

grpc::ServerUnaryReactor* GuardedService::Inspect(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  return Unary<v1::InspectRequest, v1::InspectResponse>(
      "Inspect", context, request, response,
      [this](const Caller& caller, v1::InspectRequest* r, v1::InspectResponse* out) {
        r->set_namespace_(caller.ns);
        return inner_->Inspect(nullptr, r, out);
      });
}

grpc::ServerUnaryReactor* GuardedService::Delete(grpc::CallbackServerContext* context,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return Unary<v1::DeleteRequest, v1::DeleteResponse>(
      "Delete", context, request, response,
      [this](const Caller& caller, v1::DeleteRequest* r, v1::DeleteResponse* out) {
        r->set_namespace_(caller.ns);
        grpc::Status s = inner_->Delete(nullptr, r, out);
        if (s.ok() && caller.tenant != nullptr) CountersOf(caller.ns)->deletes++;
        return s;
      });
}

grpc::ServerUnaryReactor* GuardedService::Pin(grpc::CallbackServerContext* context,
                                              const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  return Unary<v1::PinRequest, v1::PinResponse>(
      "Pin", context, request, response,
      [this](const Caller& caller, v1::PinRequest* r, v1::PinResponse* out) {
        r->set_namespace_(caller.ns);
        return inner_->Pin(nullptr, r, out);
      });
}

}  // namespace kvtrie
