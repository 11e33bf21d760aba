#include "client/shard_flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/proto_json.h"

ABSL_FLAG(std::string, shards, "",
          "the shards as NAME=HOST:PORT,... (NAME: the stable identity a prefix is routed by, "
          "e.g. kvtrie-0); every call of a prefix goes to its owner");
ABSL_FLAG(std::string, shards_dns, "",
          "or a DNS name giving the shards: an SRV name (_grpc._tcp.kvtrie.NS.svc.cluster.local) "
          "or HOST:PORT (A records, named by their reverse name)");
ABSL_FLAG(int, shards_refresh_seconds, 30, "re-resolve --shards_dns every this many seconds");
ABSL_FLAG(int, shard_down_backoff_ms, 1000,
          "a shard that failed is skipped (its prefixes miss) for up to this long, doubling per "
          "failure in a row up to 30x");
ABSL_FLAG(int, shard_probe_deadline_ms, 250,
          "a call that waits this long has its shard health-checked with this deadline (its "
          "own, not --timeout_ms's); a shard that misses it has its calls cancelled (misses) "
          "and is skipped until a check answers (0 = no checks)");
ABSL_FLAG(int, shard_probe_interval_ms, 500, "how often a down shard is health-checked");
ABSL_FLAG(int, route_tokens, 16,
          "tokens of a prefix that pick its owner shard (the first block; the same in every "
          "client)");
ABSL_FLAG(int, shard_warmup_seconds, 0,
          "for this long after the shard names change, a miss on a prefix's new owner asks its "
          "previous owner once and copies what it gets to the new one (0 = off)");
ABSL_FLAG(int, pin_replicas, 1,
          "2: a pinned prefix is also copied to (and pinned on) its second shard in rendezvous "
          "order, and a miss on its owner asks that shard, so it survives one lost shard "
          "(1 = off)");
ABSL_FLAG(bool, all_shards, false, "stats: print each shard's answer beside the merged total");

namespace kvtrie {

bool ShardFlagsGiven() {
  return !absl::GetFlag(FLAGS_shards).empty() || !absl::GetFlag(FLAGS_shards_dns).empty();
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClientFromFlags(const ClientOptions& base) {
  ShardedClientOptions o;
  o.client = base;
  o.shards = absl::GetFlag(FLAGS_shards);
  o.shards_dns = absl::GetFlag(FLAGS_shards_dns);
  if (!o.shards.empty() && !o.shards_dns.empty()) {
    return absl::InvalidArgumentError("--shards, --shards_dns: give one of them");
  }
  const int refresh = absl::GetFlag(FLAGS_shards_refresh_seconds);
  const int backoff = absl::GetFlag(FLAGS_shard_down_backoff_ms);
  const int route = absl::GetFlag(FLAGS_route_tokens);
  if (refresh < 1) return absl::InvalidArgumentError("--shards_refresh_seconds: must be >= 1");
  if (backoff < 0) return absl::InvalidArgumentError("--shard_down_backoff_ms: must be >= 0");
  if (route < 1) return absl::InvalidArgumentError("--route_tokens: must be >= 1");
  const int warmup = absl::GetFlag(FLAGS_shard_warmup_seconds);
  if (warmup < 0) return absl::InvalidArgumentError("--shard_warmup_seconds: must be >= 0");
  o.warmup_window = absl::Seconds(warmup);
  o.pin_replicas = absl::GetFlag(FLAGS_pin_replicas);
  // Copies (warm-up, replicas) are of what Get returned: stored lossless, not rounded again.
  o.warmup_put.encoding = v1::ENCODING_LOSSLESS;
  o.router.refresh_interval = absl::Seconds(refresh);
  o.router.route_tokens = static_cast<size_t>(route);
  o.down_initial_backoff = absl::Milliseconds(backoff);
  o.down_max_backoff = DefaultDownMaxBackoff(o.down_initial_backoff);
  const int probe_deadline = absl::GetFlag(FLAGS_shard_probe_deadline_ms);
  const int probe_interval = absl::GetFlag(FLAGS_shard_probe_interval_ms);
  if (probe_deadline < 0) {
    return absl::InvalidArgumentError("--shard_probe_deadline_ms: must be >= 0");
  }
  if (probe_interval < 1) {
    return absl::InvalidArgumentError("--shard_probe_interval_ms: must be >= 1");
  }
  o.health.probe_deadline = absl::Milliseconds(probe_deadline);
  o.health.probe_interval = absl::Milliseconds(probe_interval);
  absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
  if (!c.ok() && c.status().code() == absl::StatusCode::kInvalidArgument) {
    return absl::InvalidArgumentError(absl::StrCat("--", c.status().message()));
  }
  return c;
}

absl::StatusOr<nlohmann::json> ShardedStatsJson(ShardedClient& client) {
  std::vector<v1::StatsResponse> answered;
  nlohmann::json shards = nlohmann::json::object();
  absl::Status last = absl::OkStatus();
  for (const ShardedClient::ShardStats& s : client.StatsAll()) {
    if (s.status.ok()) {
      answered.push_back(s.stats);
      shards[s.shard.name] = ProtoToJson(s.stats);
    } else {
      last = s.status;
      shards[s.shard.name] = {{"error", absl::StrCat(absl::StatusCodeToString(s.status.code()),
                                                     ": ", s.status.message())}};
    }
  }
  if (answered.empty()) return last;
  nlohmann::json out = ProtoToJson(MergeStats(answered));
  out["shards_answered"] = answered.size();
  out["shards_total"] = shards.size();
  if (absl::GetFlag(FLAGS_all_shards)) out["shards"] = shards;
  return out;
}

nlohmann::json ShardedInspectJson(ShardedClient& client, const std::string& model_id,
                                  uint64_t node_id) {
  nlohmann::json shards = nlohmann::json::object();
  for (const ShardedClient::ShardInspect& s : client.InspectAll(model_id, node_id)) {
    shards[s.shard.name] =
        s.status.ok()
            ? ProtoToJson(s.inspect)
            : nlohmann::json{{"error", absl::StrCat(absl::StatusCodeToString(s.status.code()), ": ",
                                                    s.status.message())}};
  }
  return {{"shards", shards}};
}

}  // namespace kvtrie
