// bench/speed_bench.cc
//
// The service's Get / Lookup / Put paths against Redis and the machine's limits, in one run
// (issue 10). Starts one kvtrie-server per --codec_threads value (tests/server_process.h; set
// KVTRIE_SERVER_BINARY_DIR to run another build's server, KVTRIE_SERVER_DROP_FLAGS=codec_threads
// for one that predates the flag) and two redis-servers on free loopback ports in temp dirs -- one
// without persistence (--save "" --appendonly no), one with --appendonly yes --appendfsync
// everysec -- and stops them by PID. One prefix = --tokens tokens of Llama-3-8B-shaped KV
// ([32][8][tokens][128] fp16 for K and for V, 128 KiB per token) tiled from the real stories260K
// values of tests/data. Each repeat uses fresh token ids (nothing is deduplicated) and runs,
// interleaved: memcpy of the prefix, one loopback TCP stream of the same bytes, then per server
// and per encoding (RAW; RESIDUAL 0.1 and LOSSLESS in the fast and the compact profile): Put,
// Get RECONSTRUCTED read by a raw stub (the service alone: messages counted, not assembled) and by
// kvtrie::Client (assembled into a KvDump), Get RESIDUAL read by a raw stub (the wire) and decoded
// by kvtrie::Client (--client_threads); Redis SET / GET of the same 2 MiB raw blocks (one key per
// block, pipelined). Then --clients concurrent Get RECONSTRUCTED of RAW (raw stubs, each its own
// channel) and Redis GETs (each its own connection), and Lookup of --lookup_tokens-token prefixes
// of a small model (1 layer, 1 head, head_dim 8: 512 B blocks) stored once, by kvtrie::Client
// (packed token ids) and by a raw stub with varint token_ids. GB/s are of logical (fp16) bytes,
// wall clock, median [min-max] of --repeats; server CPU seconds per GB from /proc/PID/stat.
//
//   speed_bench [--tokens=512] [--repeats=3] [--codec_threads=1,2] [--client_threads=1,2]
//               [--clients=4,16] [--lookup_tokens=1024,16384,131072,1048576] [--redis=PATH]
//               [--only=all|get|lookup] [--get_repeats=1] [--varint_tokens] [--modes=RAW,...]
//               [--learn_first] [--server_flag=--name=value ...]
// --server_flag: one more kvtrie-server flag (repeatable), e.g.
// --server_flag=--learn_predictors=false so that a Lookup run is not measured while the server
// learns from the stored prefix.
// --varint_tokens: token ids as varints (token_ids), for a server older than token_ids_packed.
// --learn_first: before the repeats, one RESIDUAL fast Put of other token ids per server, and a
// wait until the server published a learned state from it, so that every timed RESIDUAL Put is
// coded against a learned state (with learning on; fails when none appears within 60 s).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/speed_net.h"
#include "client/client.h"
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

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}
double Median(const std::vector<double>& v) { return Quantile(v, 0.5); }

// utime + stime of process `pid`, seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  if (fields.size() < 13) return 0;
  return (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
}

std::vector<int> IntList(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v = 0;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

// Get through a raw stub: the messages are read (parsed) and their bytes counted, nothing
// assembled. Returns the bytes of kv (RECONSTRUCTED) or encoded (RESIDUAL), -1 on an error.
bool packed_tokens = true;  // --varint_tokens: false

// The bytes of a Get's blocks, or -1. *learned (if given): its blocks that name a learned state.
double StubGet(v1::KVCache::Stub* stub, const std::string& ns, const std::string& model,
               const std::vector<uint32_t>& tokens, v1::GetMode mode, size_t* learned = nullptr) {
  v1::GetRequest req;
  req.set_namespace_(ns);
  req.set_model_id(model);
  if (packed_tokens) {
    req.mutable_token_ids_packed()->assign(reinterpret_cast<const char*>(tokens.data()),
                                           tokens.size() * 4);
  } else {
    req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  }
  req.set_mode(mode);
  grpc::ClientContext ctx;
  auto reader = stub->Get(&ctx, req);
  v1::GetResponse msg;
  double bytes = 0;
  while (reader->Read(&msg)) {
    bytes += msg.block().kv().size() + msg.block().encoded().size();
    if (learned != nullptr && msg.has_block() && msg.block().layer_begin() == 0 &&
        msg.block().predictor_version() != 0) {
      ++*learned;
    }
  }
  return reader->Finish().ok() ? bytes : -1;
}

std::unique_ptr<v1::KVCache::Stub> NewStub(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection of its own
  return v1::KVCache::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
}

struct Row {
  std::vector<double> gbs, seconds;
  // Totals over the repeats (CPU time is counted in 10 ms ticks: a sum is finer than a median).
  double server_cpu = 0, client_cpu = 0, gb = 0;
  bool has_server_cpu = false;
};

double SelfCpuSeconds() { return CpuSeconds(getpid()); }

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  using namespace kvtrie;
  using namespace kvtrie::bench;
  size_t tokens = 512;
  int repeats = 3, get_repeats = 1;
  bool learn_first = false;  // --learn_first
  std::string redis_bin = "/usr/bin/redis-server", only = "all", mode_filter;
  std::vector<std::string> server_flags;  // --server_flag, appended to every kvtrie-server
  std::vector<int> codec_threads = {1, 2}, client_threads = {1, 2}, clients = {4, 16},
                   lookup_tokens = {1024, 16384, 131072, 1048576};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--tokens=")) {
      tokens = std::stoul(v);
    } else if (const char* v = value("--repeats=")) {
      repeats = std::stoi(v);
    } else if (const char* v = value("--redis=")) {
      redis_bin = v;
    } else if (const char* v = value("--codec_threads=")) {
      codec_threads = IntList(v);
    } else if (const char* v = value("--client_threads=")) {
      client_threads = IntList(v);
    } else if (const char* v = value("--clients=")) {
      clients = IntList(v);
    } else if (const char* v = value("--lookup_tokens=")) {
      lookup_tokens = IntList(v);
    } else if (const char* v = value("--get_repeats=")) {
      get_repeats = std::stoi(v);
    } else if (const char* v = value("--modes=")) {
      mode_filter = v;
    } else if (const char* v = value("--server_flag=")) {
      server_flags.push_back(v);
    } else if (a == "--learn_first") {
      learn_first = true;
    } else if (a == "--varint_tokens") {
      packed_tokens = false;
    } else if (const char* v = value("--only=")) {
      only = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const bool run_get = only == "all" || only == "get";
  const bool run_lookup = only == "all" || only == "lookup";
  tokens -= tokens % 16;
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  const size_t nb = tokens / 16;
  absl::StatusOr<KvDump> src = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/genesis_1-3");
  if (!src.ok()) return 1;
  // The prefix in sequence layout, tiled from the real values.
  KvDump kv;
  kv.model_id = "llama3-8b-shaped";
  kv.num_layers = g.num_layers;
  kv.num_kv_heads = g.num_kv_heads;
  kv.head_dim = g.head_dim;
  kv.dtype = g.dtype;
  kv.token_ids.resize(tokens);
  kv.surprisal_bits.assign(tokens, 1.0f);
  const size_t plane = static_cast<size_t>(g.num_kv_heads) * tokens * g.head_dim;
  kv.k.resize(g.num_layers * plane * 2);
  kv.v.resize(g.num_layers * plane * 2);
  const size_t SN = src->num_tokens(), SD = src->head_dim, SH = src->num_kv_heads,
               SL = src->num_layers;
  for (int side = 0; side < 2; ++side) {
    auto* o = reinterpret_cast<uint16_t*>(side ? kv.v.data() : kv.k.data());
    const auto* s = reinterpret_cast<const uint16_t*>(side ? src->v.data() : src->k.data());
    for (size_t l = 0; l < g.num_layers; ++l)
      for (size_t h = 0; h < g.num_kv_heads; ++h)
        for (size_t t = 0; t < tokens; ++t)
          for (size_t d = 0; d < g.head_dim; ++d) {
            const size_t c = d / SD;
            *o++ =
                s[(((l + c) % SL * SH + (h + 3 * c) % SH) * SN + (t + 61 * c) % SN) * SD + d % SD];
          }
  }
  std::vector<std::vector<uint8_t>> blocks(nb, std::vector<uint8_t>(g.num_bytes()));
  for (size_t b = 0; b < nb; ++b) {
    GatherBlock(g, tokens, kv.k.data(), kv.v.data(), b, absl::MakeSpan(blocks[b]));
  }
  const double bytes = static_cast<double>(nb) * g.num_bytes();

  const double gb = bytes / 1e9;

  const std::string dir = kvtrie::testing::FreshDir("speed_bench");
  struct Server {
    int codec_threads;
    std::string name;
    std::unique_ptr<kvtrie::testing::ServerProcess> process;
    std::unique_ptr<Client> client;                   // kvtrie::Client, RECONSTRUCTED and Put
    std::map<int, std::unique_ptr<Client>> decoding;  // by client_threads
    std::unique_ptr<v1::KVCache::Stub> stub;
  };
  std::vector<Server> servers;
  for (int c : codec_threads) {
    Server s;
    s.codec_threads = c;
    s.name = absl::StrCat("kvtrie (codec_threads ", c, ")");
    std::vector<std::string> flags = {"--memory_bytes=8589934592",
                                      absl::StrCat("--codec_threads=", c), "--max_tokens=2097152"};
    flags.insert(flags.end(), server_flags.begin(), server_flags.end());
    absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> p =
        kvtrie::testing::ServerProcess::Start(absl::StrCat(dir, "/kvtrie", c), flags);
    if (!p.ok()) {
      std::fprintf(stderr, "kvtrie-server: %s\n", std::string(p.status().message()).c_str());
      return 1;
    }
    s.process = *std::move(p);
    ClientOptions base{.target = s.process->target(), .ns = "speed"};
    base.packed_token_ids = packed_tokens;
    s.client = Client::Create(base);
    for (int t : client_threads) {
      ClientOptions co = base;
      co.codec_threads = t;
      s.decoding[t] = Client::Create(co);
    }
    s.stub = NewStub(s.process->target());
    servers.push_back(std::move(s));
  }
  kvtrie::testing::RunCommand({"/bin/mkdir", "-p", dir + "/redis", dir + "/redis-aof"}, nullptr,
                              nullptr);
  Redis plain = StartRedis(redis_bin, dir + "/redis", false);
  Redis aof = StartRedis(redis_bin, dir + "/redis-aof", true);
  if (plain.fd < 0 || aof.fd < 0) {
    std::fprintf(stderr, "redis-server did not start\n");
    StopRedis(&plain);
    StopRedis(&aof);
    return 1;
  }

  std::map<std::string, Row> rows;
  std::vector<std::string> order;
  double self_cpu = SelfCpuSeconds();  // at the start of the op being timed
  auto add = [&](const std::string& row, double seconds, double cpu = -1, double n_gb = -1) {
    if (!rows.count(row)) order.push_back(row);
    if (n_gb < 0) n_gb = gb;
    Row& r = rows[row];
    r.gbs.push_back(seconds > 0 ? n_gb / seconds : 0);
    r.seconds.push_back(seconds);
    if (cpu >= 0) {
      r.server_cpu += cpu;
      r.has_server_cpu = true;
    }
    r.client_cpu += SelfCpuSeconds() - self_cpu;
    r.gb += n_gb;
  };
  std::vector<uint8_t> copy(kv.k.size());
  KvDump reused;  // GetInto's buffers, reused across Gets of the same size
  std::vector<uint8_t> redis_block(g.num_bytes());
  struct Mode {
    const char* name;
    v1::Encoding encoding;
    v1::EncodingSpec::Profile profile;
  };
  const Mode modes[] = {
      {"RAW", v1::ENCODING_RAW, v1::EncodingSpec::PROFILE_COMPACT},
      {"RESIDUAL fast (0.1)", v1::ENCODING_RESIDUAL, v1::EncodingSpec::PROFILE_FAST},
      {"LOSSLESS fast", v1::ENCODING_LOSSLESS, v1::EncodingSpec::PROFILE_FAST},
      {"RESIDUAL compact (0.1)", v1::ENCODING_RESIDUAL, v1::EncodingSpec::PROFILE_COMPACT},
      {"LOSSLESS compact", v1::ENCODING_LOSSLESS, v1::EncodingSpec::PROFILE_COMPACT},
  };
  // Per server: the token ids of the last RAW prefix (for the concurrent Gets).
  std::vector<std::vector<uint32_t>> raw_tokens(servers.size());
  uint32_t next_token = 1;
  bool failed = false;
  if (learn_first) {  // one RESIDUAL fast Put of other token ids, learned from before timing
    for (auto& t : kv.token_ids) t = next_token++;
    for (Server& s : servers) {
      absl::StatusOr<v1::PutResponse> put =
          s.client->Put(kv, {.encoding = v1::ENCODING_RESIDUAL,
                             .target_rel_rms = 0.1,
                             .profile = v1::EncodingSpec::PROFILE_FAST});
      uint64_t versions = 0;
      for (int wait = 0; put.ok() && versions == 0 && wait < 600; ++wait) {
        absl::StatusOr<v1::StatsResponse> st = s.client->Stats();
        versions = st.ok() ? st->predictor_versions() : 0;
        if (versions == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::fprintf(stderr, "%s: learned state versions after the warm-up Put: %llu\n",
                   s.name.c_str(), static_cast<unsigned long long>(versions));
      if (versions == 0) failed = true;
    }
  }
  for (int rep = 0; rep < repeats && run_get && !failed; ++rep) {
    self_cpu = SelfCpuSeconds();
    auto t0 = Clock::now();
    std::memcpy(copy.data(), kv.k.data(), kv.k.size());
    std::memcpy(copy.data(), kv.v.data(), kv.v.size());
    add("memcpy (1 thread)", Since(t0));
    add("loopback TCP, one stream", TcpStream(static_cast<size_t>(bytes)));
    for (const Mode& m : modes) {
      if (!mode_filter.empty() &&
          !absl::StrContains(absl::StrCat(",", mode_filter, ","), absl::StrCat(",", m.name, ","))) {
        continue;
      }
      for (auto& t : kv.token_ids) t = next_token++;  // a new prefix: nothing deduplicated
      for (size_t si = 0; si < servers.size() && !failed; ++si) {
        Server& s = servers[si];
        const pid_t pid = s.process->pid();
        const std::string p = s.name + " ";
        double cpu = CpuSeconds(pid);
        self_cpu = SelfCpuSeconds();
        t0 = Clock::now();
        absl::StatusOr<v1::PutResponse> put = s.client->Put(
            kv, {.encoding = m.encoding, .target_rel_rms = 0.1, .profile = m.profile});
        add(p + "Put " + m.name, Since(t0), CpuSeconds(pid) - cpu);
        if (learn_first) {  // the learner's work on this Put is not timed with the Gets
          std::string last;
          for (int same = 0, wait = 0; same < 5 && wait < 600; ++wait) {
            absl::StatusOr<v1::StatsResponse> st = s.client->Stats();
            const std::string key =
                st.ok() ? absl::StrCat(st->predictor_observations(), ",",
                                       st->predictor_observations_dropped(), ",",
                                       st->predictor_fits(), ",", st->predictor_versions())
                        : "";
            same = key == last ? same + 1 : 0;
            last = key;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          size_t learned = 0;
          StubGet(s.stub.get(), "speed", kv.model_id, kv.token_ids, v1::GET_MODE_RESIDUAL,
                  &learned);
          std::fprintf(stderr, "%s %s: %zu of %zu blocks coded against a learned state\n",
                       s.name.c_str(), m.name, learned, kv.token_ids.size() / g.block_tokens);
        }
        if (m.encoding == v1::ENCODING_RAW) raw_tokens[si] = kv.token_ids;
        for (int gr = 0; gr < get_repeats && !failed; ++gr) {
          cpu = CpuSeconds(pid);
          self_cpu = SelfCpuSeconds();
          t0 = Clock::now();
          const double wire =
              StubGet(s.stub.get(), "speed", kv.model_id, kv.token_ids, v1::GET_MODE_RECONSTRUCTED);
          add(p + "Get RECONSTRUCTED of " + m.name + ", raw stub", Since(t0),
              CpuSeconds(pid) - cpu);
          self_cpu = SelfCpuSeconds();
          t0 = Clock::now();
          absl::StatusOr<KvDump> back = s.client->Get(kv.model_id, kv.token_ids);
          add(p + "Get RECONSTRUCTED of " + m.name + ", kvtrie::Client Get (new KvDump)",
              Since(t0));
          self_cpu = SelfCpuSeconds();
          t0 = Clock::now();
          absl::Status into = s.client->GetInto(kv.model_id, kv.token_ids, {}, &reused);
          add(p + "Get RECONSTRUCTED of " + m.name + ", kvtrie::Client GetInto (reused KvDump)",
              Since(t0));
          bool ok = put.ok() && back.ok() && back->num_tokens() == tokens && wire == bytes &&
                    into.ok() && reused.k == back->k && reused.v == back->v;
          if (m.encoding != v1::ENCODING_RAW) {
            cpu = CpuSeconds(pid);
            self_cpu = SelfCpuSeconds();
            t0 = Clock::now();
            const double enc =
                StubGet(s.stub.get(), "speed", kv.model_id, kv.token_ids, v1::GET_MODE_RESIDUAL);
            add(p + "Get RESIDUAL of " + m.name + ", raw stub (wire; " +
                    absl::StrFormat("%.2f", enc > 0 ? bytes / enc : 0) + "x smaller)",
                Since(t0), CpuSeconds(pid) - cpu);
            ok &= enc > 0;
            for (auto& [threads, client] : s.decoding) {
              self_cpu = SelfCpuSeconds();
              t0 = Clock::now();
              absl::Status here = client->GetInto(kv.model_id, kv.token_ids,
                                                  {.mode = v1::GET_MODE_RESIDUAL}, &reused);
              add(absl::StrCat(p, "Get RESIDUAL of ", m.name, " + kvtrie::Client decode (", threads,
                               " thread", threads > 1 ? "s" : "", ", GetInto)"),
                  Since(t0));
              ok &= here.ok() && back.ok() && reused.k == back->k && reused.v == back->v;
            }
          }
          if (!ok) {
            std::fprintf(stderr, "kvtrie %s %s: %s %s\n", s.name.c_str(), m.name,
                         put.ok() ? "" : std::string(put.status().message()).c_str(),
                         back.ok() ? "" : std::string(back.status().message()).c_str());
            failed = true;
          }
        }
      }
    }
    for (Redis* r : {&plain, &aof}) {
      const std::string name = r == &plain ? "Redis (no persistence)" : "Redis (AOF everysec)";
      const std::string prefix = "r" + std::to_string(rep) + ":";
      double cpu = CpuSeconds(r->pid);
      self_cpu = SelfCpuSeconds();
      t0 = Clock::now();
      const bool set_ok = RedisSet(r->fd, prefix, blocks);
      add(name + " SET", Since(t0), CpuSeconds(r->pid) - cpu);
      cpu = CpuSeconds(r->pid);
      self_cpu = SelfCpuSeconds();
      t0 = Clock::now();
      const bool get_ok = RedisGet(r->fd, prefix, nb, &redis_block);
      add(name + " GET", Since(t0), CpuSeconds(r->pid) - cpu);
      if (!set_ok || !get_ok || redis_block != blocks.back()) {
        std::fprintf(stderr, "%s: SET/GET failed\n", name.c_str());
        failed = true;
      }
    }
    // Concurrent Gets of the same stored prefix: N clients, each its own connection.
    for (int n : clients) {
      for (size_t si = 0; si < servers.size(); ++si) {
        Server& s = servers[si];
        std::vector<std::unique_ptr<v1::KVCache::Stub>> stubs;
        for (int c = 0; c < n; ++c) stubs.push_back(NewStub(s.process->target()));
        std::vector<double> each(n);
        const double cpu = CpuSeconds(s.process->pid());
        self_cpu = SelfCpuSeconds();
        t0 = Clock::now();
        std::vector<std::thread> threads;
        for (int c = 0; c < n; ++c) {
          threads.emplace_back([&, c] {
            const auto start = Clock::now();
            const double got = StubGet(stubs[c].get(), "speed", kv.model_id, raw_tokens[si],
                                       v1::GET_MODE_RECONSTRUCTED);
            each[c] = got == bytes ? Since(start) : -1;
          });
        }
        for (auto& t : threads) t.join();
        const std::string row =
            absl::StrCat(s.name, " Get RECONSTRUCTED of RAW, ", n, " clients (raw stubs)");
        add(row, Since(t0), CpuSeconds(s.process->pid()) - cpu, gb * n);
        for (double e : each) rows[row + " per prefix"].seconds.push_back(e);
      }
      for (Redis* r : {&plain, &aof}) {
        const std::string name = r == &plain ? "Redis (no persistence)" : "Redis (AOF everysec)";
        const std::string prefix = "r" + std::to_string(rep) + ":";
        std::vector<double> each(n);
        const double cpu = CpuSeconds(r->pid);
        self_cpu = SelfCpuSeconds();
        t0 = Clock::now();
        std::vector<std::thread> threads;
        for (int c = 0; c < n; ++c) {
          threads.emplace_back([&, c] {
            const int fd = Connect(r->port);
            std::vector<uint8_t> block(g.num_bytes());
            const auto start = Clock::now();
            each[c] = RedisGet(fd, prefix, nb, &block) ? Since(start) : -1;
            close(fd);
          });
        }
        for (auto& t : threads) t.join();
        const std::string row = absl::StrCat(name, " GET, ", n, " clients");
        add(row, Since(t0), CpuSeconds(r->pid) - cpu, gb * n);
        for (double e : each) rows[row + " per prefix"].seconds.push_back(e);
      }
    }
  }

  // Lookup: one long prefix of a small model stored once per server, then prefixes of it.
  std::map<std::string, std::vector<double>> lookup_us;
  std::vector<std::string> lookup_order;
  if (run_lookup && !lookup_tokens.empty() && !failed) {
    const size_t longest = *std::max_element(lookup_tokens.begin(), lookup_tokens.end());
    KvDump small;
    small.model_id = "lookup-small";
    small.num_layers = 1;
    small.num_kv_heads = 1;
    small.head_dim = 8;
    small.dtype = DType::kFp16;
    small.token_ids.resize(longest);
    for (size_t i = 0; i < longest; ++i)
      small.token_ids[i] = static_cast<uint32_t>(i * 7919 % 32000);
    small.k.assign(longest * 8 * 2, 1);
    small.v.assign(longest * 8 * 2, 2);
    for (Server& s : servers) {
      absl::StatusOr<v1::PutResponse> put = s.client->Put(small, {.encoding = v1::ENCODING_RAW});
      if (!put.ok()) {
        std::fprintf(stderr, "lookup Put: %s\n", std::string(put.status().message()).c_str());
        failed = true;
        break;
      }
    }
    for (int rep = 0; rep < std::max(repeats, 1) * 5 && !failed; ++rep) {
      for (int n : lookup_tokens) {
        const absl::Span<const uint32_t> prefix(small.token_ids.data(), static_cast<size_t>(n));
        for (Server& s : servers) {
          auto key = [&](const char* how) {
            std::string k = absl::StrCat(s.name, " Lookup ", n, " tokens, ", how);
            if (!lookup_us.count(k)) lookup_order.push_back(k);
            return k;
          };
          auto t0 = Clock::now();
          absl::StatusOr<v1::LookupResponse> r = s.client->Lookup(small.model_id, prefix);
          lookup_us[key("kvtrie::Client (packed ids)")].push_back(Since(t0) * 1e6);
          v1::LookupRequest req;
          req.set_namespace_("speed");
          req.set_model_id(small.model_id);
          req.mutable_token_ids()->Add(prefix.begin(), prefix.end());
          v1::LookupResponse resp;
          grpc::ClientContext ctx;
          self_cpu = SelfCpuSeconds();
          t0 = Clock::now();
          grpc::Status st = s.stub->Lookup(&ctx, req, &resp);
          lookup_us[key("raw stub (varint token_ids)")].push_back(Since(t0) * 1e6);
          if (!r.ok() || !st.ok() || r->matched_tokens() != static_cast<uint32_t>(n) / 16 * 16 ||
              resp.matched_tokens() != r->matched_tokens()) {
            std::fprintf(stderr, "lookup of %d tokens failed\n", n);
            failed = true;
          }
        }
      }
    }
  }
  StopRedis(&plain);
  StopRedis(&aof);
  std::vector<int> rcs;
  for (Server& s : servers) rcs.push_back(s.process->Stop());
  if (failed) return 1;

  if (run_get) {
    std::printf(
        "## speed_bench: %zu-token prefix of Llama-3-8B-shaped KV (%zu blocks of 2 MiB, %.0f MiB), "
        "%d interleaved repeats, median [min-max]\n\n",
        tokens, nb, bytes / (1 << 20), repeats);
    std::printf(
        "| path | GB/s | / memcpy | / loopback TCP | server CPU-s per GB | client CPU-s per GB "
        "|\n|---|---|---|---|---|---|\n");
    const double mc = Median(rows["memcpy (1 thread)"].gbs),
                 tcp = Median(rows["loopback TCP, one stream"].gbs);
    for (const std::string& name : order) {
      const Row& r = rows[name];
      const std::string server_cpu =
          r.has_server_cpu ? absl::StrFormat("%.2f", r.server_cpu / r.gb) : "";
      std::printf("| %s | %.3f [%.3f-%.3f] | %.3f | %.3f | %s | %.2f |\n", name.c_str(),
                  Median(r.gbs), *std::min_element(r.gbs.begin(), r.gbs.end()),
                  *std::max_element(r.gbs.begin(), r.gbs.end()), Median(r.gbs) / mc,
                  Median(r.gbs) / tcp, server_cpu.c_str(), r.client_cpu / r.gb);
    }
    std::printf("\n| concurrent Gets, per prefix | p50 s | p99 s | samples |\n|---|---|---|---|\n");
    for (const std::string& name : order) {
      auto it = rows.find(name + " per prefix");
      if (it == rows.end()) continue;
      std::printf("| %s | %.3f | %.3f | %zu |\n", name.c_str(), Median(it->second.seconds),
                  Quantile(it->second.seconds, 0.99), it->second.seconds.size());
    }
  }
  if (!lookup_order.empty()) {
    std::printf("\n## Lookup, end to end over gRPC (loopback), microseconds\n\n");
    std::printf("| call | p50 us | p99 us | samples |\n|---|---|---|---|\n");
    for (const std::string& name : lookup_order) {
      const auto& v = lookup_us[name];
      std::printf("| %s | %.0f | %.0f | %zu |\n", name.c_str(), Median(v), Quantile(v, 0.99),
                  v.size());
    }
  }
  std::printf("\nkvtrie-server exit status");
  for (int rc : rcs) std::printf(" %d", rc);
  std::printf("\n");
  return 0;
}
