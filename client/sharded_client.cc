#include "client/sharded_client.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace kvtrie {

bool LostShardCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

v1::StatsResponse MergeStats(absl::Span<const v1::StatsResponse> stats) {
  using google::protobuf::FieldDescriptor;
  v1::StatsResponse out;
  const google::protobuf::Descriptor* d = out.GetDescriptor();
  const google::protobuf::Reflection* r = out.GetReflection();
  double elements = 0, lossy_k = 0, lossy_v = 0;  // for the recomputed ratios and means
  for (const v1::StatsResponse& s : stats) {
    if (s.bits_per_component() > 0) elements += 8.0 * s.bytes_stored() / s.bits_per_component();
    lossy_k += s.mean_rel_rms_error_k() * s.lossy_nodes();
    lossy_v += s.mean_rel_rms_error_v() * s.lossy_nodes();
    // Histograms: the same buckets on every server; counts summed.
    for (auto [into, from] :
         {std::pair{out.mutable_path_surprisal_histogram(), &s.path_surprisal_histogram()},
          std::pair{out.mutable_branch_distance_histogram(), &s.branch_distance_histogram()}}) {
      for (int b = 0; b < from->size(); ++b) {
        if (b >= into->size()) {
          *into->Add() = from->Get(b);
        } else {
          into->Mutable(b)->set_count(into->Get(b).count() + from->Get(b).count());
        }
      }
    }
    for (int i = 0; i < d->field_count(); ++i) {
      const FieldDescriptor* f = d->field(i);
      const bool is_max = f->name().rfind("max_", 0) == 0;
      if (f->is_repeated()) continue;  // the histograms, above
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64) {
        const uint64_t a = r->GetUInt64(out, f), b = r->GetUInt64(s, f);
        r->SetUInt64(&out, f, is_max ? std::max(a, b) : a + b);
      } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE) {
        r->SetDouble(&out, f, std::max(r->GetDouble(out, f), r->GetDouble(s, f)));
      }
    }
  }
  out.set_compression_ratio(
      out.bytes_stored() > 0 ? static_cast<double>(out.bytes_logical()) / out.bytes_stored() : 0);
  out.set_bits_per_component(elements > 0 ? 8.0 * out.bytes_stored() / elements : 0);
  out.set_mean_rel_rms_error_k(out.lossy_nodes() > 0 ? lossy_k / out.lossy_nodes() : 0);
  out.set_mean_rel_rms_error_v(out.lossy_nodes() > 0 ? lossy_v / out.lossy_nodes() : 0);
  return out;
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Create(
    const ShardedClientOptions& options) {
  if (options.shards.empty() == options.shards_dns.empty()) {
    return absl::InvalidArgumentError("shards, shards_dns: give exactly one of them");
  }
  if (options.pin_replicas < 1 || options.pin_replicas > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("pin_replicas: ", options.pin_replicas, " (must be 1 or 2)"));
  }
  if (options.health.probe_deadline < absl::ZeroDuration() ||
      options.health.probe_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("health: probe_deadline must be >= 0 and probe_interval > 0");
  }
  std::unique_ptr<ShardedClient> c(new ShardedClient(options));
  c->health_ = std::make_unique<ShardHealth>(options.health);
  if (!options.shards.empty()) {
    absl::StatusOr<std::vector<Shard>> list = ParseShardList(options.shards);
    if (!list.ok()) return list.status();
    absl::StatusOr<std::unique_ptr<ShardRouter>> r =
        ShardRouter::FromList(*std::move(list), options.router);
    if (!r.ok()) return r.status();
    c->router_ = *std::move(r);
  } else {
    std::shared_ptr<ShardResolver> resolver = options.resolver;
    if (resolver == nullptr) resolver = NewSystemResolver();
    absl::StatusOr<std::unique_ptr<ShardRouter>> r =
        ShardRouter::FromDns(options.shards_dns, std::move(resolver), options.router);
    if (!r.ok()) return r.status();
    c->router_ = *std::move(r);
  }
  return c;
}

std::shared_ptr<Client> ShardedClient::Acquire(const Shard& shard) {
  absl::MutexLock lock(&mu_);
  Entry& e = entries_[shard.name];
  if (e.client == nullptr || e.target != shard.target) {
    // New shard, or its address changed (a restarted pod): a fresh channel, a fresh start.
    ClientOptions o = options_.client;
    o.target = shard.target;
    e.target = shard.target;
    e.client = Client::Create(o);  // creates a channel; connects lazily (no I/O here)
    e.down_until = absl::InfinitePast();
    e.failures_in_a_row = 0;
    health_->Track(shard.name, e.client);
  }
  if (absl::Now() < e.down_until || health_->IsDown(shard.name)) return nullptr;
  return e.client;
}

void ShardedClient::CountMiss(Call call) {
  absl::MutexLock lock(&mu_);
  ++counters_.lost_calls;
  if (call == Call::kPut) ++counters_.puts_skipped;
}

bool ShardedClient::Lost(const Shard& shard, const absl::Status& s, Call call) {
  if (s.ok() || !LostShardCode(s.code())) {
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      entries_[shard.name].failures_in_a_row = 0;
    }
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    Entry& e = entries_[shard.name];
    ++counters_.shard_failures;
    if (call != Call::kAdmin) ++counters_.lost_calls;
    if (call == Call::kPut) ++counters_.puts_skipped;
    const int n = std::min(++e.failures_in_a_row, 20);
    absl::Duration d = options_.down_initial_backoff;
    for (int i = 1; i < n && d < options_.down_max_backoff; ++i) d *= 2;
    d = std::min(d, options_.down_max_backoff);
    static thread_local absl::BitGen gen;
    e.down_until = absl::Now() + d * absl::Uniform(gen, 0.5, 1.0);
  }
  health_->MarkDown(shard.name);  // skipped past its backoff too, until a check answers
  router_->ReportFailure();
  return true;
}

Shard ShardedClient::OwnerOf(const std::string& model_id, absl::Span<const uint32_t> token_ids) {
  return router_->Owner(options_.client.ns, model_id, token_ids);
}

absl::StatusOr<v1::LookupResponse> ShardedClient::Lookup(const std::string& model_id,
                                                         absl::Span<const uint32_t> token_ids) {
  const Shard owner = OwnerOf(model_id, token_ids);
  std::shared_ptr<Client> c = Acquire(owner);
  if (c == nullptr) {
    CountMiss(Call::kRead);
    v1::LookupResponse replica;
    ReplicaLookup(model_id, token_ids, &replica);
    return replica;
  }
  absl::StatusOr<v1::LookupResponse> r = c->Lookup(model_id, token_ids);
  const bool lost = Lost(owner, r.status(), Call::kRead);
  if (!lost && !r.ok()) return r;
  if ((lost || r->matched_tokens() == 0) && options_.warmup_window > absl::ZeroDuration()) {
    std::optional<Shard> prev =
        router_->PreviousOwner(options_.client.ns, model_id, token_ids, options_.warmup_window);
    std::shared_ptr<Client> p = prev ? Acquire(*prev) : nullptr;
    if (p != nullptr) {
      absl::StatusOr<v1::LookupResponse> w = p->Lookup(model_id, token_ids);
      Lost(*prev, w.status(), Call::kAdmin);
      if (w.ok() && w->matched_tokens() > 0) {
        absl::MutexLock lock(&mu_);
        ++counters_.warmup_hits;
        return w;
      }
    }
  }
  if (v1::LookupResponse replica;
      (lost || r->matched_tokens() == 0) && ReplicaLookup(model_id, token_ids, &replica)) {
    return replica;
  }
  if (lost) return v1::LookupResponse();
  return r;
}

absl::StatusOr<v1::PutResponse> ShardedClient::Put(const KvDump& kv, const PutOptions& options) {
  const Shard owner = OwnerOf(kv.model_id, kv.token_ids);
  std::shared_ptr<Client> c = Acquire(owner);
  if (c == nullptr) {
    CountMiss(Call::kPut);
    return v1::PutResponse();
  }
  absl::StatusOr<v1::PutResponse> r = c->Put(kv, options);
  if (Lost(owner, r.status(), Call::kPut)) return v1::PutResponse();
  return r;
}

absl::StatusOr<std::unique_ptr<ShardedPutStream>> ShardedClient::OpenPut(
    const KvDump& header, const PutOptions& options) {
  const BlockGeometry g{header.num_layers, header.num_kv_heads, options.block_tokens,
                        header.head_dim, header.dtype};
  if (absl::Status s = g.Validate(); !s.ok()) return s;
  const Shard owner = OwnerOf(header.model_id, header.token_ids);
  std::shared_ptr<Client> c = Acquire(owner);
  std::unique_ptr<PutStream> stream;
  if (c == nullptr) {
    CountMiss(Call::kPut);
  } else {
    absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(header, options);
    if (!s.ok() && !Lost(owner, s.status(), Call::kPut)) return s.status();
    if (s.ok()) stream = *std::move(s);
  }
  return std::unique_ptr<ShardedPutStream>(
      new ShardedPutStream(this, owner, std::move(c), std::move(stream), g));
}

bool ShardedPutStream::Lost(const absl::Status& s) {
  if (!sharded_->Lost(owner_, s, ShardedClient::Call::kPut)) return false;
  stream_->Cancel();
  stream_.reset();
  return true;
}

absl::Status ShardedPutStream::WriteLayers(uint32_t layer_begin, uint32_t layer_end,
                                           size_t token_offset, size_t span_tokens,
                                           absl::Span<const uint8_t> k,
                                           absl::Span<const uint8_t> v) {
  if (stream_ == nullptr) return absl::OkStatus();
  absl::Status s = stream_->WriteLayers(layer_begin, layer_end, token_offset, span_tokens, k, v);
  if (!s.ok() && Lost(s)) return absl::OkStatus();
  return s;
}

absl::StatusOr<v1::PutResponse> ShardedPutStream::Commit() {
  if (stream_ == nullptr) return v1::PutResponse();
  absl::StatusOr<v1::PutResponse> r = stream_->Commit();
  if (!r.ok() && Lost(r.status())) return v1::PutResponse();
  if (r.ok()) sharded_->Lost(owner_, absl::OkStatus(), ShardedClient::Call::kPut);
  return r;
}

void ShardedPutStream::Cancel() {
  if (stream_ != nullptr) stream_->Cancel();
}

absl::StatusOr<KvDump> ShardedClient::Get(const std::string& model_id,
                                          absl::Span<const uint32_t> token_ids,
                                          const GetOptions& options) {
  KvDump out;
  if (absl::Status s = GetInto(model_id, token_ids, options, &out); !s.ok()) return s;
  return out;
}

absl::Status ShardedClient::GetInto(const std::string& model_id,
                                    absl::Span<const uint32_t> token_ids, const GetOptions& options,
                                    KvDump* out) {
  const Shard owner = OwnerOf(model_id, token_ids);
  auto miss = [out] {
    out->token_ids.clear();
    out->surprisal_bits.clear();
    out->k.clear();
    out->v.clear();
    return absl::OkStatus();
  };
  std::shared_ptr<Client> c = Acquire(owner);
  if (c == nullptr) {
    CountMiss(Call::kRead);
    if (ReplicaGet(model_id, token_ids, options, out)) return absl::OkStatus();
    return miss();
  }
  absl::Status s = c->GetInto(model_id, token_ids, options, out);
  const bool lost = Lost(owner, s, Call::kRead);
  if (!lost && !s.ok()) return s;
  if ((lost || out->token_ids.empty()) && options_.warmup_window > absl::ZeroDuration() &&
      WarmUpGet(model_id, token_ids, options, owner, out)) {
    return absl::OkStatus();
  }
  if ((lost || out->token_ids.empty()) && ReplicaGet(model_id, token_ids, options, out)) {
    return absl::OkStatus();
  }
  if (lost) return miss();
  return s;
}

bool ShardedClient::ReplicaLookup(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                                  v1::LookupResponse* out) {
  Shard second;
  std::shared_ptr<Client> p = AcquireSecond(model_id, token_ids, &second);
  if (p == nullptr) return false;
  absl::StatusOr<v1::LookupResponse> w = p->Lookup(model_id, token_ids);
  Lost(second, w.status(), Call::kAdmin);
  if (!w.ok() || w->matched_tokens() == 0) return false;
  CountReplica(&Counters::replica_hits);
  *out = *std::move(w);
  return true;
}

bool ShardedClient::ReplicaGet(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                               const GetOptions& options, KvDump* out) {
  Shard second;
  std::shared_ptr<Client> p = AcquireSecond(model_id, token_ids, &second);
  if (p == nullptr) return false;
  absl::Status w = p->GetInto(model_id, token_ids, options, out);
  Lost(second, w, Call::kAdmin);
  if (!w.ok() || out->token_ids.empty()) {
    out->token_ids.clear();
    out->surprisal_bits.clear();
    out->k.clear();
    out->v.clear();
    return false;
  }
  CountReplica(&Counters::replica_hits);
  return true;
}

void ShardedClient::CountReplica(uint64_t Counters::*counter) {
  absl::MutexLock lock(&mu_);
  ++(counters_.*counter);
}

std::shared_ptr<Client> ShardedClient::AcquireSecond(const std::string& model_id,
                                                     absl::Span<const uint32_t> token_ids,
                                                     Shard* second) {
  if (options_.pin_replicas < 2) return nullptr;
  std::optional<Shard> s = router_->SecondOwner(options_.client.ns, model_id, token_ids);
  if (!s) return nullptr;
  *second = *s;
  return Acquire(*s);
}

void ShardedClient::PinReplica(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                               uint64_t ttl_seconds, bool unpin, bool extend_only, Client* owner) {
  Shard second;
  std::shared_ptr<Client> p = AcquireSecond(model_id, token_ids, &second);
  if (options_.pin_replicas < 2 || router_->Shards().size() < 2) return;
  if (p == nullptr) {
    CountReplica(&Counters::replica_failures);
    return;
  }
  if (!unpin) {  // copy what the owner stores (reconstructed), without surprisal
    if (owner == nullptr) {
      CountReplica(&Counters::replica_failures);
      return;
    }
    absl::StatusOr<KvDump> kv = owner->Get(model_id, token_ids);
    if (!kv.ok() || kv->token_ids.empty()) {
      CountReplica(&Counters::replica_failures);
      return;
    }
    kv->surprisal_bits.clear();
    absl::StatusOr<v1::PutResponse> put = p->Put(*kv, options_.warmup_put);
    Lost(second, put.status(), Call::kAdmin);
    if (!put.ok()) {
      CountReplica(&Counters::replica_failures);
      return;
    }
  }
  absl::StatusOr<v1::PinResponse> pin =
      p->Pin(model_id, token_ids, ttl_seconds, unpin, extend_only);
  Lost(second, pin.status(), Call::kAdmin);
  if (!pin.ok()) {
    CountReplica(&Counters::replica_failures);
  } else if (!unpin) {
    CountReplica(&Counters::replica_copies);
  }
}

bool ShardedClient::WarmUpGet(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                              const GetOptions& options, const Shard& owner, KvDump* out) {
  std::optional<Shard> prev =
      router_->PreviousOwner(options_.client.ns, model_id, token_ids, options_.warmup_window);
  std::shared_ptr<Client> p = prev ? Acquire(*prev) : nullptr;
  if (p == nullptr) return false;
  absl::Status s = p->GetInto(model_id, token_ids, options, out);
  Lost(*prev, s, Call::kAdmin);
  if (!s.ok() || out->token_ids.empty()) {
    out->token_ids.clear();
    out->surprisal_bits.clear();
    out->k.clear();
    out->v.clear();
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    ++counters_.warmup_hits;
  }
  // Copy it to the new owner, without surprisal (a Get does not return it). Not a layer range:
  // its KvDump holds some layers only, and stored as the model it would register the model on the
  // new owner with that many layers and serve them as the whole KV.
  const bool whole = options.layer_begin == 0 && options.layer_end == 0;
  std::shared_ptr<Client> o = whole ? Acquire(owner) : nullptr;
  if (o != nullptr) {
    std::vector<float> surprisal;
    surprisal.swap(out->surprisal_bits);
    absl::StatusOr<v1::PutResponse> r = o->Put(*out, options_.warmup_put);
    surprisal.swap(out->surprisal_bits);
    Lost(owner, r.status(), Call::kAdmin);
    if (r.ok()) {
      absl::MutexLock lock(&mu_);
      ++counters_.warmup_copies;
    }
  }
  return true;
}

absl::StatusOr<v1::DeleteResponse> ShardedClient::Delete(const std::string& model_id,
                                                         absl::Span<const uint32_t> token_ids,
                                                         bool erase) {
  const Shard owner = OwnerOf(model_id, token_ids);
  std::shared_ptr<Client> c = Acquire(owner);
  absl::StatusOr<v1::DeleteResponse> r =
      c == nullptr ? absl::StatusOr<v1::DeleteResponse>(absl::UnavailableError(
                         absl::StrCat("shard ", owner.name, " is down; not deleted there")))
                   : c->Delete(model_id, token_ids, erase);
  if (c != nullptr) Lost(owner, r.status(), Call::kAdmin);
  // Inside the warm-up window the previous owner's copy must go too, or the next Get that
  // misses on the new owner would copy the deleted KV back.
  if (std::optional<Shard> prev =
          router_->PreviousOwner(options_.client.ns, model_id, token_ids, options_.warmup_window)) {
    if (std::shared_ptr<Client> p = Acquire(*prev)) {
      absl::StatusOr<v1::DeleteResponse> d = p->Delete(model_id, token_ids, erase);
      Lost(*prev, d.status(), Call::kAdmin);
    }
  }
  Shard second;  // a replicated copy must not outlive its delete, even when the owner is down
  if (std::shared_ptr<Client> p = AcquireSecond(model_id, token_ids, &second)) {
    absl::StatusOr<v1::DeleteResponse> d = p->Delete(model_id, token_ids, erase);
    Lost(second, d.status(), Call::kAdmin);
    if (!d.ok()) CountReplica(&Counters::replica_failures);
  } else if (options_.pin_replicas >= 2 && router_->Shards().size() >= 2) {
    CountReplica(&Counters::replica_failures);
  }
  return r;
}

absl::StatusOr<v1::PinResponse> ShardedClient::Pin(const std::string& model_id,
                                                   absl::Span<const uint32_t> token_ids,
                                                   uint64_t ttl_seconds, bool unpin,
                                                   bool extend_only) {
  std::shared_ptr<Client> c;
  absl::StatusOr<v1::PinResponse> r =
      PinOn(model_id, token_ids, ttl_seconds, unpin, extend_only, &c);
  if (r.ok()) PinReplica(model_id, token_ids, ttl_seconds, unpin, extend_only, c.get());
  return r;
}

absl::StatusOr<v1::PinResponse> ShardedClient::PinOwner(const std::string& model_id,
                                                        absl::Span<const uint32_t> token_ids,
                                                        uint64_t ttl_seconds, bool unpin,
                                                        bool extend_only) {
  std::shared_ptr<Client> c;
  return PinOn(model_id, token_ids, ttl_seconds, unpin, extend_only, &c);
}

absl::StatusOr<v1::PinResponse> ShardedClient::PinOn(const std::string& model_id,
                                                     absl::Span<const uint32_t> token_ids,
                                                     uint64_t ttl_seconds, bool unpin,
                                                     bool extend_only,
                                                     std::shared_ptr<Client>* owner_client) {
  const Shard owner = OwnerOf(model_id, token_ids);
  std::shared_ptr<Client> c = Acquire(owner);
  if (c == nullptr) {
    return absl::UnavailableError(absl::StrCat("shard ", owner.name, " is down; nothing pinned"));
  }
  absl::StatusOr<v1::PinResponse> r = c->Pin(model_id, token_ids, ttl_seconds, unpin, extend_only);
  Lost(owner, r.status(), Call::kAdmin);
  *owner_client = std::move(c);
  return r;
}

std::vector<ShardedClient::ShardStats> ShardedClient::StatsAll(const std::string& ns_override) {
  std::vector<ShardStats> out;
  for (const Shard& shard : router_->Shards()) {
    ShardStats one{shard, absl::OkStatus(), {}};
    std::shared_ptr<Client> c = Acquire(shard);
    if (c == nullptr) {
      one.status = absl::UnavailableError(absl::StrCat("shard ", shard.name, " is down"));
    } else {
      absl::StatusOr<v1::StatsResponse> r = c->Stats(ns_override);
      Lost(shard, r.status(), Call::kAdmin);
      if (r.ok())
        one.stats = *std::move(r);
      else
        one.status = r.status();
    }
    out.push_back(std::move(one));
  }
  return out;
}

std::vector<ShardedClient::ShardInspect> ShardedClient::InspectAll(const std::string& model_id,
                                                                   uint64_t node_id) {
  std::vector<ShardInspect> out;
  for (const Shard& shard : router_->Shards()) {
    ShardInspect one{shard, absl::OkStatus(), {}};
    std::shared_ptr<Client> c = Acquire(shard);
    if (c == nullptr) {
      one.status = absl::UnavailableError(absl::StrCat("shard ", shard.name, " is down"));
    } else {
      absl::StatusOr<v1::InspectResponse> r = c->Inspect(model_id, node_id);
      Lost(shard, r.status(), Call::kAdmin);
      if (r.ok())
        one.inspect = *std::move(r);
      else
        one.status = r.status();
    }
    out.push_back(std::move(one));
  }
  return out;
}

ShardedClient::Counters ShardedClient::counters() const {
  const ShardHealth::Counters h = health_->counters();
  absl::MutexLock lock(&mu_);
  Counters c = counters_;
  c.probes = h.probes;
  c.probe_failures = h.probe_failures;
  c.calls_cancelled = h.calls_cancelled;
  return c;
}

bool ShardedClient::IsDown(const std::string& shard_name) const {
  if (health_->IsDown(shard_name)) return true;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(shard_name);
  return it != entries_.end() && absl::Now() < it->second.down_until;
}

ShardedClient::ShardState ShardedClient::State(const std::string& shard_name) const {
  ShardState out;
  out.health_down = health_->IsDown(shard_name);
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(shard_name);
  if (it == entries_.end()) return out;
  out.failures_in_a_row = it->second.failures_in_a_row;
  out.down_for = std::max(absl::ZeroDuration(), it->second.down_until - absl::Now());
  return out;
}

}  // namespace kvtrie
