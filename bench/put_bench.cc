// bench/put_bench.cc
//
// The Put path at 1 and 16 concurrent clients against Redis 7 with AOF everysec, in one run
// (issue 10: Put RAW >= Redis AOF SET at 1 and 16 clients, Put RESIDUAL fast >= 0.75 GB/s, a
// Put's peak memory). Starts kvtrie-server (tests/server_process.h, with --server_flags) and a
// redis-server with --appendonly yes --appendfsync everysec and one without persistence, on free
// loopback ports in temp dirs, stops them by PID. One prefix = --tokens (1 client) or --tokens16
// (each of 16 clients) tokens of Llama-3-8B-shaped KV, 2 MiB blocks [32][2][8][16][128] fp16 tiled
// from the real stories260K values of tests/data (as bench/speed_bench.cc). Both systems get the
// same pre-gathered raw blocks: kvtrie through a raw gRPC stub (one channel per client; one header,
// one PutBlock per block, the commit), Redis as pipelined SETs of one key per block (one
// connection per client). Each repeat uses fresh token ids and keys (nothing deduplicated) and
// runs every row in turn (interleaved). Per row: aggregate GB/s (all clients' bytes / wall
// time; only stored Puts count), p50 and p99 of the per-prefix latency over all clients and
// repeats, server CPU-seconds per GB (utime + stime of the server process from /proc), and the
// server's peak RSS growth during the row (VmHWM after the row, reset by clear_refs before it,
// minus VmRSS before it) per byte put. Medians and min-max over --repeats.
//
// Issue 19 (workers encode, the server stores) adds the rows of encoded Puts: `encoded` and
// `encoded_lossless` send blocks the bench encoded before the row (RESIDUAL fast at 0.1 / LOSSLESS
// fast, no learned state: codec/block_codec.h EncodeBlock) as PutBlock.encoded through the same
// raw stub, so the row is the server's work alone; `client` is a worker's whole Put through
// kvtrie::Client (encode_on_client, RESIDUAL fast 0.1, codec_threads = the cores: encode + send +
// commit), whose row also reports this process's CPU-seconds per GB. Every row reports logical GB/s
// (fp16 bytes represented), wire GB/s (block bytes sent: encoded or dense) and server CPU-seconds
// per logical and per wire GB.
//
//   put_bench [--tokens=2048] [--tokens16=512] [--clients=1,16] [--repeats=3]
//             [--modes=raw,residual,lossless,encoded,encoded_lossless,client]
//             [--server_flags=--codec_threads=2,...]
//             [--before_dir=BUILD_DIR]   (also the rows of an older kvtrie-server, interleaved)
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/speed_net.h"
#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// utime + stime of `pid` in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t p = s.rfind(')');
  if (p == std::string::npos) return 0;
  std::istringstream in(s.substr(p + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A "VmRSS:" or "VmHWM:" line of /proc/pid/status, bytes.
double StatusBytes(pid_t pid, const std::string& key) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) * 1024;
  }
  return 0;
}

void ResetPeakRss(pid_t pid) {
  std::ofstream("/proc/" + std::to_string(pid) + "/clear_refs") << "5";
}

struct Prefix {
  std::vector<uint32_t> tokens;
  std::vector<std::vector<uint8_t>> blocks;  // 2 MiB each, block layout
  std::vector<std::string> encoded;          // the same blocks pre-encoded (encoded modes)
};

// `p` in sequence layout, for kvtrie::Client::Put.
KvDump SequenceOf(const Prefix& p, const BlockGeometry& g) {
  KvDump d;
  d.model_id = "llama3-8b-shaped";
  d.num_layers = g.num_layers;
  d.num_kv_heads = g.num_kv_heads;
  d.head_dim = g.head_dim;
  d.dtype = g.dtype;
  d.token_ids.assign(p.tokens.begin(), p.tokens.end());
  const size_t n = p.blocks.size() * g.block_tokens;
  d.k.resize(static_cast<size_t>(g.num_layers) * g.num_kv_heads * n * g.head_dim * 2);
  d.v.resize(d.k.size());
  for (size_t b = 0; b < p.blocks.size(); ++b) {
    ScatterBlock(g, n, p.blocks[b], b, d.k.data(), d.v.data());
  }
  return d;
}

// One Put of `p` through a raw stub; empty on success, else the error.
// With `encoded`, the blocks go as p.encoded (PutBlock.encoded).
std::string PutPrefix(v1::KVCache::Stub* stub, const Prefix& p, const BlockGeometry& g,
                      v1::Encoding encoding, v1::EncodingSpec::Profile profile,
                      bool encoded = false) {
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> w(stub->Put(&ctx, &resp));
  v1::PutRequest req;
  v1::PutHeader* h = req.mutable_header();
  h->set_namespace_("put_bench");
  v1::ModelSpec* m = h->mutable_model();
  m->set_model_id("llama3-8b-shaped");
  m->set_num_layers(g.num_layers);
  m->set_num_kv_heads(g.num_kv_heads);
  m->set_head_dim(g.head_dim);
  m->set_block_tokens(g.block_tokens);
  m->set_dtype(v1::DTYPE_FP16);
  h->mutable_encoding()->set_encoding(encoding);
  h->mutable_encoding()->set_profile(profile);
  h->mutable_encoding()->set_target_rel_rms(0.1);
  h->mutable_token_ids()->Add(p.tokens.begin(), p.tokens.end());
  bool open = w->Write(req);
  for (size_t b = 0; open && b < p.blocks.size(); ++b) {
    req.Clear();
    v1::PutBlock* pb = req.mutable_block();
    pb->set_block_index(static_cast<uint32_t>(b));
    pb->set_layer_end(g.num_layers);
    if (encoded) {
      pb->set_encoded(p.encoded[b]);
    } else {
      pb->set_kv(p.blocks[b].data(), p.blocks[b].size());
    }
    open = w->Write(req);
  }
  if (open) {
    req.Clear();
    req.mutable_commit();
    open = w->Write(req);
  }
  w->WritesDone();
  grpc::Status s = w->Finish();
  if (!s.ok()) return s.error_message();
  if (resp.blocks_stored() != p.blocks.size()) return "not every block was stored";
  return "";
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

struct Row {
  std::vector<double> gbs, wire_gbs, cpu_per_gb, cpu_per_wire_gb, self_cpu_per_gb, rss_per_byte,
      latencies;
  int failures = 0;
  std::string error;
};

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  using namespace kvtrie;
  size_t tokens1 = 2048, tokens16 = 512;
  int repeats = 3;
  std::vector<int> client_counts = {1, 16};
  std::vector<std::string> mode_names = {"raw", "residual", "lossless"};
  std::vector<std::string> server_flags = {"--memory_bytes=1GiB"};
  std::string redis_bin = "/usr/bin/redis-server";
  std::string before_dir;  // a build folder of an older kvtrie-server, run beside this one
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) {
      return a.rfind(flag, 0) == 0 ? a.substr(std::strlen(flag)) : std::string("\x01");
    };
    if (std::string v = value("--tokens="); v != "\x01") {
      tokens1 = std::stoul(v);
    } else if (std::string v = value("--tokens16="); v != "\x01") {
      tokens16 = std::stoul(v);
    } else if (std::string v = value("--repeats="); v != "\x01") {
      repeats = std::stoi(v);
    } else if (std::string v = value("--clients="); v != "\x01") {
      client_counts.clear();
      for (absl::string_view c : absl::StrSplit(v, ','))
        client_counts.push_back(std::stoi(std::string(c)));
    } else if (std::string v = value("--modes="); v != "\x01") {
      mode_names = absl::StrSplit(v, ',');
    } else if (std::string v = value("--server_flags="); v != "\x01") {
      for (absl::string_view f : absl::StrSplit(v, ',', absl::SkipEmpty()))
        server_flags.emplace_back(f);
    } else if (std::string v = value("--before_dir="); v != "\x01") {
      before_dir = v;
    } else if (std::string v = value("--redis="); v != "\x01") {
      redis_bin = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  absl::StatusOr<KvDump> src = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/genesis_1-3");
  if (!src.ok()) return 1;
  // The largest prefix in sequence layout, tiled from the real values; shorter ones are its
  // first blocks.
  const size_t tokens_max = std::max(tokens1, tokens16) / 16 * 16;
  std::vector<uint8_t> k(g.num_layers * g.num_kv_heads * tokens_max * g.head_dim * 2), v(k.size());
  const size_t SN = src->num_tokens(), SD = src->head_dim, SH = src->num_kv_heads,
               SL = src->num_layers;
  for (int side = 0; side < 2; ++side) {
    auto* o = reinterpret_cast<uint16_t*>(side ? v.data() : k.data());
    const auto* s = reinterpret_cast<const uint16_t*>(side ? src->v.data() : src->k.data());
    for (size_t l = 0; l < g.num_layers; ++l)
      for (size_t h = 0; h < g.num_kv_heads; ++h)
        for (size_t t = 0; t < tokens_max; ++t)
          for (size_t d = 0; d < g.head_dim; ++d) {
            const size_t c = d / SD;
            *o++ =
                s[(((l + c) % SL * SH + (h + 3 * c) % SH) * SN + (t + 61 * c) % SN) * SD + d % SD];
          }
  }
  std::vector<std::vector<uint8_t>> all_blocks(tokens_max / 16,
                                               std::vector<uint8_t>(g.num_bytes()));
  for (size_t b = 0; b < all_blocks.size(); ++b) {
    GatherBlock(g, tokens_max, k.data(), v.data(), b, absl::MakeSpan(all_blocks[b]));
  }
  k = {};
  v = {};

  const std::string dir = kvtrie::testing::FreshDir("put_bench");
  absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> server =
      kvtrie::testing::ServerProcess::Start(dir + "/kvtrie", server_flags);
  if (!server.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  const pid_t spid = (*server)->pid();
  // --before_dir: the same rows on an older server (KVTRIE_SERVER_BINARY_DIR), interleaved.
  std::unique_ptr<kvtrie::testing::ServerProcess> before;
  if (!before_dir.empty()) {
    const char* old_env = std::getenv("KVTRIE_SERVER_BINARY_DIR");
    const std::string saved = old_env ? old_env : "";
    setenv("KVTRIE_SERVER_BINARY_DIR", before_dir.c_str(), 1);
    std::vector<std::string> flags;
    for (const std::string& f : server_flags) {
      if (f.rfind("--codec_threads", 0) != 0) flags.push_back(f);  // an older server lacks it
    }
    absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> b =
        kvtrie::testing::ServerProcess::Start(dir + "/kvtrie-before", flags);
    setenv("KVTRIE_SERVER_BINARY_DIR", saved.c_str(), 1);
    if (!b.ok()) {
      std::fprintf(stderr, "kvtrie-server (before): %s\n",
                   std::string(b.status().message()).c_str());
      return 1;
    }
    before = *std::move(b);
  }
  kvtrie::testing::RunCommand({"/bin/mkdir", "-p", dir + "/redis-aof"}, nullptr, nullptr);
  bench::Redis aof = bench::StartRedis(redis_bin, dir + "/redis-aof", true);
  kvtrie::testing::RunCommand({"/bin/mkdir", "-p", dir + "/redis-mem"}, nullptr, nullptr);
  bench::Redis mem = bench::StartRedis(redis_bin, dir + "/redis-mem", false);
  if (aof.fd < 0 || mem.fd < 0) {
    std::fprintf(stderr, "redis-server did not start\n");
    return 1;
  }
  const int max_clients = *std::max_element(client_counts.begin(), client_counts.end());
  std::vector<std::unique_ptr<v1::KVCache::Stub>> stubs, before_stubs;
  std::vector<int> redis_fds = {aof.fd}, mem_fds = {mem.fd};
  for (int c = 0; c < max_clients; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("kvtrie.put_bench.client", c);  // a channel (connection) of its own
    stubs.push_back(v1::KVCache::NewStub(
        grpc::CreateCustomChannel((*server)->target(), grpc::InsecureChannelCredentials(), args)));
    if (before) {
      before_stubs.push_back(v1::KVCache::NewStub(
          grpc::CreateCustomChannel(before->target(), grpc::InsecureChannelCredentials(), args)));
    }
    if (c > 0) redis_fds.push_back(bench::Connect(aof.port));
    if (c > 0) mem_fds.push_back(bench::Connect(mem.port));
  }
  enum class Kind { kDense, kEncoded, kClient };
  struct Mode {
    std::string name;
    v1::Encoding encoding;
    v1::EncodingSpec::Profile profile;
    Kind kind = Kind::kDense;
    std::vector<std::string> encoded = {};  // kEncoded: all_blocks, pre-encoded
  };
  std::vector<Mode> modes;
  // Blocks encoded before the rows, as a worker would have (no learned state).
  auto pre_encode = [&](Encoding e) {
    EncodeOptions o;
    o.encoding = e;
    o.profile = Profile::kFast;
    o.target_rel_rms = e == Encoding::kResidual ? 0.1 : 0;
    std::vector<std::string> out;
    for (const auto& b : all_blocks) {
      absl::StatusOr<EncodedBlock> eb = EncodeBlock(g, b, o);
      if (!eb.ok()) {
        std::fprintf(stderr, "encode: %s\n", std::string(eb.status().message()).c_str());
        std::exit(1);
      }
      out.push_back(std::move(eb->bytes));
    }
    return out;
  };
  for (const std::string& m : mode_names) {
    if (m == "raw") modes.push_back({"RAW", v1::ENCODING_RAW, v1::EncodingSpec::PROFILE_COMPACT});
    if (m == "residual")
      modes.push_back(
          {"RESIDUAL fast (0.1)", v1::ENCODING_RESIDUAL, v1::EncodingSpec::PROFILE_FAST});
    if (m == "lossless")
      modes.push_back({"LOSSLESS fast", v1::ENCODING_LOSSLESS, v1::EncodingSpec::PROFILE_FAST});
    if (m == "encoded")
      modes.push_back({"encoded RESIDUAL fast (0.1)", v1::ENCODING_RESIDUAL,
                       v1::EncodingSpec::PROFILE_FAST, Kind::kEncoded,
                       pre_encode(Encoding::kResidual)});
    if (m == "encoded_lossless")
      modes.push_back({"encoded LOSSLESS fast", v1::ENCODING_LOSSLESS,
                       v1::EncodingSpec::PROFILE_FAST, Kind::kEncoded,
                       pre_encode(Encoding::kLossless)});
    if (m == "client")
      modes.push_back({"kvtrie::Client encode_on_client RESIDUAL fast (0.1)", v1::ENCODING_RESIDUAL,
                       v1::EncodingSpec::PROFILE_FAST, Kind::kClient});
  }
  std::vector<std::unique_ptr<Client>> clients_cc;  // kClient rows: one channel each
  for (int c = 0; c < max_clients; ++c) {
    ClientOptions co;
    co.target = (*server)->target();
    co.ns = "put_bench";
    co.timeout = absl::Seconds(600);
    clients_cc.push_back(Client::Create(co));
  }
  std::map<std::string, Row> rows;
  std::vector<std::string> order;
  uint32_t next_token = 1;
  for (int rep = 0; rep < repeats; ++rep) {
    for (int clients : client_counts) {
      const size_t nb = (clients == 1 ? tokens1 : tokens16) / 16;
      std::vector<Prefix> prefixes(clients);
      for (Prefix& p : prefixes) {
        p.blocks.assign(all_blocks.begin(), all_blocks.begin() + static_cast<long>(nb));
      }
      const double bytes = static_cast<double>(clients) * nb * g.num_bytes();
      // `one(c, &wire)` puts client c's prefix and sets the block bytes it sent.
      auto run_row = [&](const std::string& name, pid_t pid,
                         const std::function<std::string(int, double*)>& one) {
        const std::string key =
            absl::StrCat(clients, " client", clients > 1 ? "s" : "", ", ", name);
        if (!rows.count(key)) order.push_back(key);
        Row& row = rows[key];
        const double rss0 = StatusBytes(pid, "VmRSS:");
        ResetPeakRss(pid);
        const double cpu0 = CpuSeconds(pid);
        const double self0 = CpuSeconds(getpid());
        std::vector<double> lat(clients), wire(clients, 0);
        std::vector<std::string> err(clients);
        const auto t0 = Clock::now();
        std::vector<std::thread> threads;
        for (int c = 0; c < clients; ++c) {
          threads.emplace_back([&, c] {
            const auto s0 = Clock::now();
            err[c] = one(c, &wire[c]);
            lat[c] = Since(s0);
          });
        }
        for (auto& t : threads) t.join();
        const double wall = Since(t0);
        const double cpu = CpuSeconds(pid) - cpu0;
        const double self_cpu = CpuSeconds(getpid()) - self0;
        const double hwm = StatusBytes(pid, "VmHWM:");
        for (int c = 0; c < clients; ++c) {
          if (!err[c].empty()) {
            ++row.failures;
            row.error = err[c];
          }
        }
        // Only what was stored counts (a refused Put's bytes are not throughput).
        const double stored =
            bytes *
            (clients - std::count_if(err.begin(), err.end(),
                                     [](const std::string& e) { return !e.empty(); })) /
            clients;
        double wire_stored = 0;
        for (int c = 0; c < clients; ++c) wire_stored += err[c].empty() ? wire[c] : 0;
        row.gbs.push_back(stored / wall / 1e9);
        row.wire_gbs.push_back(wire_stored / wall / 1e9);
        row.cpu_per_gb.push_back(stored > 0 ? cpu / (stored / 1e9) : 0);
        row.cpu_per_wire_gb.push_back(wire_stored > 0 ? cpu / (wire_stored / 1e9) : 0);
        row.self_cpu_per_gb.push_back(stored > 0 ? self_cpu / (stored / 1e9) : 0);
        row.rss_per_byte.push_back((hwm - rss0) / bytes);
        row.latencies.insert(row.latencies.end(), lat.begin(), lat.end());
      };
      for (const Mode& m : modes) {
        for (Prefix& p : prefixes) {
          p.tokens.resize(nb * 16);
          for (auto& t : p.tokens) t = next_token++;  // a new prefix: nothing deduplicated
          if (m.kind == Kind::kEncoded) {
            p.encoded.assign(m.encoded.begin(), m.encoded.begin() + static_cast<long>(nb));
          }
        }
        const double dense_wire = static_cast<double>(nb) * g.num_bytes();
        if (m.kind == Kind::kClient) {
          std::vector<KvDump> seq;
          for (const Prefix& p : prefixes) seq.push_back(SequenceOf(p, g));
          PutOptions po;
          po.encoding = m.encoding;
          po.profile = m.profile;
          po.target_rel_rms = 0.1;
          po.encode_on_client = true;
          run_row("kvtrie Put " + m.name, spid, [&](int c, double* wire) -> std::string {
            absl::StatusOr<v1::PutResponse> r = clients_cc[c]->Put(seq[c], po);
            if (!r.ok()) return std::string(r.status().message());
            if (r->blocks_stored() != nb) return "not every block was stored";
            for (const v1::BlockResult& b : r->blocks())
              *wire += static_cast<double>(b.bytes_stored());
            return "";
          });
          continue;
        }
        auto put = [&](v1::KVCache::Stub* stub, int c, double* wire) {
          const Prefix& p = prefixes[c];
          *wire = dense_wire;
          if (m.kind == Kind::kEncoded) {
            *wire = 0;
            for (const std::string& e : p.encoded) *wire += static_cast<double>(e.size());
          }
          return PutPrefix(stub, p, g, m.encoding, m.profile, m.kind == Kind::kEncoded);
        };
        run_row("kvtrie Put " + m.name, spid,
                [&](int c, double* wire) { return put(stubs[c].get(), c, wire); });
        if (before && m.kind == Kind::kDense) {
          run_row("kvtrie (before) Put " + m.name, before->pid(),
                  [&](int c, double* wire) { return put(before_stubs[c].get(), c, wire); });
        }
      }
      run_row("Redis (AOF everysec) SET", aof.pid, [&](int c, double* wire) {
        *wire = static_cast<double>(nb) * g.num_bytes();
        const std::string prefix = "r" + std::to_string(rep) + "c" + std::to_string(c) + "n" +
                                   std::to_string(clients) + ":";
        return bench::RedisSet(redis_fds[c], prefix, prefixes[c].blocks) ? "" : "SET failed";
      });
      run_row("Redis (no persistence) SET", mem.pid, [&](int c, double* wire) {
        *wire = static_cast<double>(nb) * g.num_bytes();
        const std::string prefix = "r" + std::to_string(rep) + "c" + std::to_string(c) + "n" +
                                   std::to_string(clients) + ":";
        return bench::RedisSet(mem_fds[c], prefix, prefixes[c].blocks) ? "" : "SET failed";
      });
    }
  }
  for (size_t c = 1; c < redis_fds.size(); ++c) close(redis_fds[c]);
  for (size_t c = 1; c < mem_fds.size(); ++c) close(mem_fds[c]);
  bench::StopRedis(&aof);
  bench::StopRedis(&mem);
  const double server_hwm = StatusBytes(spid, "VmHWM:");
  const int rc = (*server)->Stop();
  if (before) before->Stop();
  std::filesystem::remove_all(dir);  // GBs of RocksDB and AOF files
  std::printf(
      "## put_bench: %zu-token prefixes at 1 client, %zu-token prefixes at 16 (2 MiB blocks of "
      "Llama-3-8B-shaped KV), %d interleaved repeats; kvtrie-server %s\n\n",
      tokens1, tokens16, repeats, absl::StrJoin(server_flags, " ").c_str());
  std::printf(
      "| clients, path | logical GB/s median [min-max] | wire GB/s | p50 / p99 s per prefix | "
      "server CPU-s per logical GB | per wire GB | bench process CPU-s per GB | peak RSS growth / "
      "bytes put | failed |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& key : order) {
    const Row& r = rows[key];
    std::printf(
        "| %s | %.3f [%.3f-%.3f] | %.3f | %.3f / %.3f | %.2f | %.2f | %.2f | %.2f | %d%s%s |\n",
        key.c_str(), Quantile(r.gbs, 0.5), *std::min_element(r.gbs.begin(), r.gbs.end()),
        *std::max_element(r.gbs.begin(), r.gbs.end()), Quantile(r.wire_gbs, 0.5),
        Quantile(r.latencies, 0.5), Quantile(r.latencies, 0.99), Quantile(r.cpu_per_gb, 0.5),
        Quantile(r.cpu_per_wire_gb, 0.5), Quantile(r.self_cpu_per_gb, 0.5),
        Quantile(r.rss_per_byte, 0.5), r.failures, r.failures ? ": " : "", r.error.c_str());
  }
  std::printf(
      "\nkvtrie-server peak RSS at the end %.2f GiB (VmHWM since the last row's reset), exit "
      "status %d\n",
      server_hwm / (1 << 30), rc);
  return 0;
}
