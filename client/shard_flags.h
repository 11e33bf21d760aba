// client/shard_flags.h
//
// The sharding flags of the `kvtrie` CLI (client/sharded_client.h):
//   --shards=NAME=HOST:PORT,...   the shards, by stable name (e.g. kvtrie-0=10.0.0.5:50051,...)
//   --shards_dns=NAME             or a DNS name giving them: an SRV name (starts with '_', e.g.
//                                 _grpc._tcp.kvtrie.default.svc.cluster.local) or HOST:PORT (A
//                                 records, each named by its reverse name's first label)
//   --shards_refresh_seconds=S    re-resolve --shards_dns every S seconds (30)
//   --shard_down_backoff_ms=MS    a failed shard is skipped (its prefixes miss) for up to MS,
//                                 doubling per failure in a row up to 30x (1000)
//   --shard_probe_deadline_ms=MS  a call that waits MS has its shard health-checked with an MS
//                                 deadline; a shard that misses it has its calls cancelled
//                                 (misses) and is skipped until a check answers (250; 0: off)
//   --shard_probe_interval_ms=MS  a down shard is health-checked every MS (500)
//   --route_tokens=N              tokens of a prefix that pick its owner (16: the first block;
//                                 the same in every client of the shards)
//   --shard_warmup_seconds=S      after the shard names change, a miss asks the previous owner
//                                 once and copies to the new one, for S seconds (0: off)
//   --pin_replicas=N              2: pinned prefixes are copied to their second shard (1: off)
//   --all_shards                  stats: print each shard's answer beside the merged total
// With either membership flag, put/get/lookup/delete go to the prefix's owner (a lost shard is a
// miss, not an error), stats adds every shard's up and inspect prints every shard's node.
#ifndef KVTRIE_CLIENT_SHARD_FLAGS_H_
#define KVTRIE_CLIENT_SHARD_FLAGS_H_

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/sharded_client.h"

namespace kvtrie {

// True when --shards or --shards_dns is given.
bool ShardFlagsGiven();

// A ShardedClient from the flags, every shard connected with `base` (ns, timeout, TLS, token,
// retry). Errors: INVALID_ARGUMENT naming the flag (--shards and --shards_dns both given, a bad
// list, a value out of range); UNAVAILABLE when --shards_dns does not resolve.
absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClientFromFlags(const ClientOptions& base);

// `stats` over every shard: the merged total, and with --all_shards each shard's answer (or its
// error) under "shards". Fails only when no shard answers.
absl::StatusOr<nlohmann::json> ShardedStatsJson(ShardedClient& client);
// `inspect` on every shard: {"shards": {name: InspectResponse or {"error": ...}}}.
nlohmann::json ShardedInspectJson(ShardedClient& client, const std::string& model_id,
                                  uint64_t node_id);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_SHARD_FLAGS_H_
