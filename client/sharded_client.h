// client/sharded_client.h
//
// kvtrie::ShardedClient — N kvtrie servers (shards) used as one cache. Every call for a prefix
// goes to its owner (client/shard_router.h: rendezvous hash of namespace, model_id and the first
// route_tokens token ids over the shard names), so a prefix, its extensions and near-duplicates
// sharing the first block live on one shard. The plain kvtrie::Client is unchanged; this class
// holds one Client per shard (created on first use, replaced when a shard's address changes).
//
// A lost shard is a miss, never an error: when the owner is down, past its deadline or refusing
// (a status LostShardCode says is the shard's, not the caller's), Lookup answers 0 matched
// tokens, Get an empty result, Put stores nothing (an empty PutResponse) and is counted in
// puts_skipped. The shard is then marked down for a jittered backoff (down_initial_backoff
// doubling to down_max_backoff): calls for its prefixes are misses at once, without waiting for
// a deadline, until the backoff ends and a health check of the shard has answered (`health`:
// client/shard_health.h). A shard that stops answering without closing its connection (SIGSTOP,
// a hung host) is found by those checks, which have a short deadline of their own: a call that
// has waited probe_deadline has its shard checked, and when the check misses, the call (and
// every other in flight there) is cancelled and answers a miss, so it costs ~2 x probe_deadline,
// not the call's deadline. A DNS membership is re-resolved after such a failure. Errors of the
// caller's own (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED,
// FAILED_PRECONDITION, ...) are returned as the plain Client returns them. Delete and Pin go to the
// owner and return its status as it is (a Delete on a lost shard is UNAVAILABLE: the caller must
// know it did not happen). A Put sent layer by layer (OpenPut, a ShardedPutStream) follows the
// Put's rule: a lost owner, when opened or on any write or the commit, drops the rest and commits
// an empty PutResponse.
//
// Stats and Inspect fan out to every shard (StatsAll, InspectAll); MergeStats adds them up.
// Thread-safe.
#ifndef KVTRIE_CLIENT_SHARDED_CLIENT_H_
#define KVTRIE_CLIENT_SHARDED_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/put_stream.h"
#include "client/shard_health.h"
#include "client/shard_router.h"

namespace kvtrie {

struct ShardedClientOptions {
  // Every shard's connection: ns, timeout (the deadline past which a shard is lost for the call),
  // TLS, token, codec_threads, retry. `target` is not used.
  ClientOptions client;
  // The membership, exactly one of: an explicit "name=host:port,..." list, or a DNS name (an SRV
  // name such as _grpc._tcp.kvtrie.default.svc.cluster.local, or host:port for A records)
  // resolved by `resolver` (null: the system's). CLI: --shards, --shards_dns.
  std::string shards;
  std::string shards_dns;
  std::shared_ptr<ShardResolver> resolver;
  ShardRouterOptions router;
  // How long a shard that failed is skipped: drawn from [d/2, d], d = min(down_initial_backoff x
  // 2^(failures in a row - 1), down_max_backoff). The CLI (--shard_down_backoff_ms) and Python
  // (down_backoff=) set the cap to DefaultDownMaxBackoff of the initial unless given.
  absl::Duration down_initial_backoff = absl::Seconds(1);
  absl::Duration down_max_backoff = absl::Seconds(30);
  // The background health checks of the shards (probe_deadline 250 ms, probe_interval 500 ms;
  // probe_deadline zero: off). CLI: --shard_probe_deadline_ms, --shard_probe_interval_ms.
  ShardHealthOptions health;
  // Warm-up (mcrouter's WarmUpRoute), off when zero: during this long after the shard names
  // change, a Lookup or Get that misses on (or loses) a prefix's new owner asks its previous
  // owner once; a Get answered there is also Put to the new owner with `warmup_put` (whose
  // block_tokens must be the model's), so the new owner is warm when the window ends. The copy
  // is of what Get returned (reconstructed: a lossy encoding is encoded again), without
  // surprisal; a Get of a layer range is not copied. CLI: --shard_warmup_seconds; Python:
  // warmup_window=.
  absl::Duration warmup_window = absl::ZeroDuration();
  // The copies' (warm-up and replica) Put: bit-exact by default (ENCODING_LOSSLESS,
  // PROFILE_FAST), so a copy of a lossy (RESIDUAL) prefix reads back identical to the owner's
  // reconstruction instead of being rounded a second time.
  PutOptions warmup_put = [] {
    PutOptions o;
    o.encoding = v1::ENCODING_LOSSLESS;
    o.profile = v1::EncodingSpec::PROFILE_FAST;
    return o;
  }();
  // Replication of pinned prefixes (1: off; 2: on). With 2, Pin also copies the prefix to its
  // second shard in rendezvous order (a Get from the owner Put there with `warmup_put`, then
  // pinned there), Delete and unpin reach both, and a Lookup or Get whose owner is lost or
  // answers a miss asks the second shard once: a pinned prefix (a system prompt) survives the
  // loss of one shard. A copy that fails is counted (replica_failures), not returned: Pin and
  // Delete return the owner's status. CLI: --pin_replicas.
  int pin_replicas = 1;
};

// The cap of the down backoff when only its start is configured: 30 x `initial`.
inline absl::Duration DefaultDownMaxBackoff(absl::Duration initial) { return initial * 30; }

// A status of a shard, not of the call: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
// ABORTED, CANCELLED, UNKNOWN, INTERNAL, DATA_LOSS.
bool LostShardCode(absl::StatusCode code);

// Stats of several shards added up: counters summed; max_* fields the largest; ratios
// (compression_ratio, bits_per_component) recomputed from the sums; mean errors weighted by
// lossy_nodes; histogram buckets summed bucket by bucket. `namespaces` and `models` are summed
// (one on two shards counts twice).
v1::StatsResponse MergeStats(absl::Span<const v1::StatsResponse> stats);

class ShardedPutStream;

class ShardedClient {
 public:
  // Errors: INVALID_ARGUMENT naming `shards` / `shards_dns` (neither or both given, a bad list);
  // UNAVAILABLE when shards_dns does not resolve now.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Create(const ShardedClientOptions& options);

  ShardedClient(const ShardedClient&) = delete;
  ShardedClient& operator=(const ShardedClient&) = delete;

  // As Client's, sent to the owner; a lost owner is a miss (see above).
  absl::StatusOr<v1::LookupResponse> Lookup(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids);
  absl::StatusOr<v1::PutResponse> Put(const KvDump& kv, const PutOptions& options = {});
  // As Client::OpenPut, on the owner of header's prefix; a lost owner (down now, or failing a
  // write or the commit later) makes the stream drop what follows and commit an empty
  // PutResponse (counted as a Put in lost_calls and puts_skipped). Errors: as Client::OpenPut's
  // (INVALID_ARGUMENT for a bad geometry or surprisal count). The stream must not outlive this.
  absl::StatusOr<std::unique_ptr<ShardedPutStream>> OpenPut(const KvDump& header,
                                                            const PutOptions& options = {});
  absl::StatusOr<KvDump> Get(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                             const GetOptions& options = {});
  absl::Status GetInto(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                       const GetOptions& options, KvDump* out);
  // `erase` goes to every copy it reaches (owner, warm-up predecessor, replica).
  absl::StatusOr<v1::DeleteResponse> Delete(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids,
                                            bool erase = false);
  // `extend_only`: as Client::Pin's, on the owner and the replica.
  absl::StatusOr<v1::PinResponse> Pin(const std::string& model_id,
                                      absl::Span<const uint32_t> token_ids,
                                      uint64_t ttl_seconds = 0, bool unpin = false,
                                      bool extend_only = false);
  // Pin on the owner only, never copied to the replica (a lease renewed per request).
  absl::StatusOr<v1::PinResponse> PinOwner(const std::string& model_id,
                                           absl::Span<const uint32_t> token_ids,
                                           uint64_t ttl_seconds = 0, bool unpin = false,
                                           bool extend_only = false);

  // One answer per shard of the current membership, sorted by name; a lost shard has its status
  // (and is marked down), the others their response.
  struct ShardStats {
    Shard shard;
    absl::Status status;
    v1::StatsResponse stats;
  };
  std::vector<ShardStats> StatsAll(const std::string& ns_override = "");
  struct ShardInspect {
    Shard shard;
    absl::Status status;
    v1::InspectResponse inspect;
  };
  // node_id is each shard's own (0 = the root of every shard's trie).
  std::vector<ShardInspect> InspectAll(const std::string& model_id, uint64_t node_id);

  // The owner of the prefix `token_ids` of (options.client.ns, model_id).
  Shard OwnerOf(const std::string& model_id, absl::Span<const uint32_t> token_ids);
  std::vector<Shard> shards() { return router_->Shards(); }
  // Replaces an explicit membership (e.g. a shard added, or restarted at another address).
  absl::Status SetShards(std::vector<Shard> shards) {
    return router_->SetShards(std::move(shards));
  }

  struct Counters {
    uint64_t lost_calls = 0;        // calls answered as a miss because the owner was lost
    uint64_t puts_skipped = 0;      // of them, Puts (nothing stored)
    uint64_t shard_failures = 0;    // calls that failed with a LostShardCode (marking a shard down)
    uint64_t warmup_hits = 0;       // Lookups and Gets answered by a previous owner
    uint64_t warmup_copies = 0;     // Gets so answered that were Put to the new owner
    uint64_t replica_copies = 0;    // pinned prefixes copied (and pinned) on their second shard
    uint64_t replica_hits = 0;      // Lookups and Gets answered by the second shard
    uint64_t replica_failures = 0;  // copies, unpins and deletes on the second shard that failed
    // Of the health checks (ShardHealth::Counters): sent, failed, calls they cancelled.
    uint64_t probes = 0;
    uint64_t probe_failures = 0;
    uint64_t calls_cancelled = 0;
  };
  Counters counters() const;
  bool IsDown(const std::string& shard_name) const;
  // One shard's failure state, as the calls see it (a shard never called: all zero).
  struct ShardState {
    int failures_in_a_row = 0;  // failed calls since its last answer (the backoff's exponent)
    absl::Duration down_for;    // what is left of its backoff (zero: none)
    bool health_down = false;   // skipped until a health check answers
  };
  ShardState State(const std::string& shard_name) const;

  const ShardedClientOptions& options() const { return options_; }

 private:
  friend class ShardedPutStream;
  explicit ShardedClient(const ShardedClientOptions& options) : options_(options) {}
  // The Client of `shard`, or null when it is marked down (the call is a miss).
  std::shared_ptr<Client> Acquire(const Shard& shard);
  enum class Call { kRead, kPut, kAdmin };  // kAdmin: Delete, Pin, Stats, Inspect (never a miss)
  // Records the outcome of a call to `shard` (a lost shard's status marks it down); returns true
  // when `s` is a lost shard's (a read or Put then becomes a miss).
  bool Lost(const Shard& shard, const absl::Status& s, Call call);
  void CountMiss(Call call);
  // The warm-up of a Get that missed on `owner` (see warmup_window): true when the previous owner
  // answered it into `out`.
  bool WarmUpGet(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                 const GetOptions& options, const Shard& owner, KvDump* out);
  // With pin_replicas 2: the Client of the prefix's second shard, or null (off, one shard, down).
  std::shared_ptr<Client> AcquireSecond(const std::string& model_id,
                                        absl::Span<const uint32_t> token_ids, Shard* second);
  // A miss (or lost owner) asks the second shard: true when it answered a hit into `out`.
  bool ReplicaLookup(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                     v1::LookupResponse* out);
  bool ReplicaGet(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                  const GetOptions& options, KvDump* out);
  // Pin (or unpin) the prefix's copy on its second shard, copying it from `owner` first.
  void PinReplica(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                  uint64_t ttl_seconds, bool unpin, bool extend_only, Client* owner);
  void CountReplica(uint64_t Counters::*counter);
  // The owner's Pin (the owner's Client in *owner_client when it was reached).
  absl::StatusOr<v1::PinResponse> PinOn(const std::string& model_id,
                                        absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                                        bool unpin, bool extend_only,
                                        std::shared_ptr<Client>* owner_client);

  struct Entry {
    std::string target;
    std::shared_ptr<Client> client;
    absl::Time down_until = absl::InfinitePast();
    int failures_in_a_row = 0;
  };
  const ShardedClientOptions options_;
  std::unique_ptr<ShardRouter> router_;
  mutable absl::Mutex mu_;  // guards entries_ and counters_ (never held across an RPC)
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by shard name
  Counters counters_ ABSL_GUARDED_BY(mu_);
  // After entries_: stopped (its checks ended) before the clients it watches are freed.
  std::unique_ptr<ShardHealth> health_;
};

// A Put of ShardedClient::OpenPut: PutStream's calls (client/put_stream.h) on the prefix's owner,
// or, once the owner is lost, nothing: writes return OK and Commit an empty PutResponse. Other
// errors are the PutStream's. Not thread-safe (as PutStream).
class ShardedPutStream {
 public:
  ShardedPutStream(const ShardedPutStream&) = delete;
  ShardedPutStream& operator=(const ShardedPutStream&) = delete;

  const BlockGeometry& geometry() const { return g_; }
  // True once the owner was lost (what follows is dropped).
  bool lost() const { return stream_ == nullptr; }
  absl::Status WriteLayers(uint32_t layer_begin, uint32_t layer_end, size_t token_offset,
                           size_t span_tokens, absl::Span<const uint8_t> k,
                           absl::Span<const uint8_t> v);
  absl::StatusOr<v1::PutResponse> Commit();
  void Cancel();

 private:
  friend class ShardedClient;
  ShardedPutStream(ShardedClient* sharded, Shard owner, std::shared_ptr<Client> client,
                   std::unique_ptr<PutStream> stream, const BlockGeometry& g)
      : sharded_(sharded),
        owner_(std::move(owner)),
        client_(std::move(client)),
        stream_(std::move(stream)),
        g_(g) {}
  // `s` failed: true (and the stream dropped) when it is a lost owner's status.
  bool Lost(const absl::Status& s);

  ShardedClient* const sharded_;
  const Shard owner_;
  std::shared_ptr<Client> client_;     // keeps the owner's Client alive for stream_
  std::unique_ptr<PutStream> stream_;  // null: the owner is lost
  const BlockGeometry g_;
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_SHARDED_CLIENT_H_
