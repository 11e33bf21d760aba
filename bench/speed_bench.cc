// bench/speed_bench.cc
//
// The service's Put / Get path against Redis and the machine's limits, in one run (issue 10's
// baseline for the later server work). Starts kvtrie-server (tests/server_process.h) and two
// redis-servers on free loopback ports in temp dirs -- one without persistence (--save ""
// --appendonly no), one with --appendonly yes --appendfsync everysec -- and stops them by PID.
// One prefix = --tokens tokens of Llama-3-8B-shaped KV ([32][8][tokens][128] fp16 for K and for
// V, 128 KiB per token) tiled from the real stories260K values of tests/data (each run of 8
// channels from another layer, head and token offset of genesis_1-3). Each repeat uses fresh
// token ids (nothing is deduplicated) and runs, interleaved: memcpy of the prefix, one loopback
// TCP stream of the same bytes, kvtrie Put / Get (RAW; RESIDUAL and LOSSLESS in the fast
// profile, Get RECONSTRUCTED), and Redis SET / GET of the same 2 MiB raw blocks (one key per
// block, pipelined) on both Redis servers. Prints the median and min-max of --repeats runs in
// GB/s of logical (fp16) bytes, one client, wall clock.
//
//   speed_bench [--tokens=512] [--repeats=3] [--redis=redis-server]
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- a minimal RESP client: pipelined SET / GET of binary values ----------------------------

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

class Reader {
 public:
  explicit Reader(int fd) : fd_(fd) {}
  bool Fill() {
    if (pos_ == end_) pos_ = end_ = 0;
    if (end_ == buf_.size()) {
      if (pos_ > 0) {
        std::memmove(buf_.data(), buf_.data() + pos_, end_ - pos_);
        end_ -= pos_;
        pos_ = 0;
      } else {
        buf_.resize(buf_.size() * 2);
      }
    }
    const ssize_t r = recv(fd_, buf_.data() + end_, buf_.size() - end_, 0);
    if (r <= 0) return false;
    end_ += static_cast<size_t>(r);
    return true;
  }
  bool Line(std::string* line) {
    for (;;) {
      const char* s = buf_.data() + pos_;
      const void* nl = std::memchr(s, '\n', end_ - pos_);
      if (nl) {
        const size_t len = static_cast<const char*>(nl) - s;
        line->assign(s, len > 0 && s[len - 1] == '\r' ? len - 1 : len);
        pos_ += len + 1;
        return true;
      }
      if (!Fill()) return false;
    }
  }
  bool Bytes(char* dst, size_t n) {
    while (n > 0) {
      if (pos_ == end_ && !Fill()) return false;
      const size_t k = std::min(n, end_ - pos_);
      std::memcpy(dst, buf_.data() + pos_, k);
      pos_ += k;
      dst += k;
      n -= k;
    }
    return true;
  }

 private:
  int fd_;
  std::vector<char> buf_ = std::vector<char>(1 << 20);
  size_t pos_ = 0, end_ = 0;
};

std::string Bulk(const std::string& s) {
  return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n";
}

// SET key_i block_i for every block, pipelined; true if every reply is +OK.
bool RedisSet(int fd, const std::string& prefix, const std::vector<std::vector<uint8_t>>& blocks) {
  std::thread sender([&] {
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string head = "*3\r\n" + Bulk("SET") + Bulk(prefix + std::to_string(i)) + "$" +
                               std::to_string(blocks[i].size()) + "\r\n";
      SendAll(fd, head.data(), head.size());
      SendAll(fd, reinterpret_cast<const char*>(blocks[i].data()), blocks[i].size());
      SendAll(fd, "\r\n", 2);
    }
  });
  Reader r(fd);
  bool ok = true;
  std::string line;
  for (size_t i = 0; i < blocks.size(); ++i) ok &= r.Line(&line) && line == "+OK";
  sender.join();
  return ok;
}

// GET key_i into out[i] for every block, pipelined; true if every value has the block's size.
bool RedisGet(int fd, const std::string& prefix, std::vector<std::vector<uint8_t>>* out) {
  std::string cmds;
  for (size_t i = 0; i < out->size(); ++i) {
    cmds += "*2\r\n" + Bulk("GET") + Bulk(prefix + std::to_string(i));
  }
  if (!SendAll(fd, cmds.data(), cmds.size())) return false;
  Reader r(fd);
  std::string line;
  for (auto& b : *out) {
    if (!r.Line(&line) || line.empty() || line[0] != '$') return false;
    if (std::stoul(line.substr(1)) != b.size()) return false;
    if (!r.Bytes(reinterpret_cast<char*>(b.data()), b.size()) || !r.Line(&line)) return false;
  }
  return true;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

struct Redis {
  pid_t pid = -1;
  int port = 0;
  int fd = -1;
};

Redis StartRedis(const std::string& bin, const std::string& dir, bool aof) {
  Redis r;
  r.port = FreePort();
  std::vector<std::string> args = {
      bin,      "--port", std::to_string(r.port), "--bind",          "127.0.0.1", "--dir", dir,
      "--save", "",       "--appendonly",         aof ? "yes" : "no"};
  if (aof) args.insert(args.end(), {"--appendfsync", "everysec"});
  r.pid = fork();
  if (r.pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  for (int i = 0; i < 100 && r.fd < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    r.fd = Connect(r.port);
  }
  return r;
}

void StopRedis(Redis* r) {
  if (r->fd >= 0) close(r->fd);
  if (r->pid > 0) {
    kill(r->pid, SIGTERM);
    waitpid(r->pid, nullptr, 0);
  }
}

// One loopback TCP stream of `bytes` bytes (1 MiB sends), seconds.
double TcpStream(size_t bytes) {
  const int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  listen(ls, 1);
  std::vector<char> src(1 << 20, 'x'), dst(1 << 20);
  const auto t0 = Clock::now();
  std::thread sender([&] {
    const int fd = Connect(ntohs(a.sin_port));
    for (size_t sent = 0; sent < bytes; sent += src.size()) SendAll(fd, src.data(), src.size());
    close(fd);
  });
  const int fd = accept(ls, nullptr, nullptr);
  size_t got = 0;
  for (ssize_t r; (r = recv(fd, dst.data(), dst.size(), 0)) > 0;) got += r;
  sender.join();
  const double s = Since(t0);
  close(fd);
  close(ls);
  return got >= bytes ? s : -1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  using namespace kvtrie;
  size_t tokens = 512;
  int repeats = 3;
  std::string redis_bin = "/usr/bin/redis-server";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--tokens=", 0) == 0)
      tokens = std::stoul(a.substr(9));
    else if (a.rfind("--repeats=", 0) == 0)
      repeats = std::stoi(a.substr(10));
    else if (a.rfind("--redis=", 0) == 0)
      redis_bin = a.substr(8);
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
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

  const std::string dir = kvtrie::testing::FreshDir("speed_bench");
  absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> server =
      kvtrie::testing::ServerProcess::Start(dir + "/kvtrie", {"--memory_bytes=4294967296"});
  if (!server.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(server.status().message()).c_str());
    return 1;
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
  ClientOptions co;
  co.target = (*server)->target();
  co.ns = "speed";
  std::unique_ptr<Client> client_ptr = Client::Create(co);
  Client& client = *client_ptr;

  std::map<std::string, std::vector<double>> gbs;
  std::vector<std::string> order;
  auto add = [&](const std::string& row, double seconds) {
    if (!gbs.count(row)) order.push_back(row);
    gbs[row].push_back(seconds > 0 ? bytes / seconds / 1e9 : 0);
  };
  std::vector<uint8_t> copy(kv.k.size());
  std::vector<std::vector<uint8_t>> got(nb, std::vector<uint8_t>(g.num_bytes()));
  struct Mode {
    const char* name;
    v1::Encoding encoding;
    v1::EncodingSpec::Profile profile;
  };
  const Mode modes[] = {
      {"RAW", v1::ENCODING_RAW, v1::EncodingSpec::PROFILE_COMPACT},
      {"RESIDUAL fast (0.1)", v1::ENCODING_RESIDUAL, v1::EncodingSpec::PROFILE_FAST},
      {"LOSSLESS fast", v1::ENCODING_LOSSLESS, v1::EncodingSpec::PROFILE_FAST},
  };
  uint32_t next_token = 1;
  for (int rep = 0; rep < repeats; ++rep) {
    auto t0 = Clock::now();
    std::memcpy(copy.data(), kv.k.data(), kv.k.size());
    std::memcpy(copy.data(), kv.v.data(), kv.v.size());
    add("memcpy (1 thread)", Since(t0));
    add("loopback TCP, one stream", kvtrie::TcpStream(static_cast<size_t>(bytes)));
    for (const Mode& m : modes) {
      for (auto& t : kv.token_ids) t = next_token++;  // a new prefix: nothing deduplicated
      t0 = Clock::now();
      absl::StatusOr<v1::PutResponse> put =
          client.Put(kv, {.encoding = m.encoding, .target_rel_rms = 0.1, .profile = m.profile});
      const double put_s = Since(t0);
      t0 = Clock::now();
      absl::StatusOr<KvDump> back = client.Get(kv.model_id, kv.token_ids);
      const double get_s = Since(t0);
      if (!put.ok() || !back.ok() || back->num_tokens() != tokens) {
        std::fprintf(stderr, "kvtrie %s: %s %s\n", m.name,
                     put.ok() ? "" : std::string(put.status().message()).c_str(),
                     back.ok() ? "" : std::string(back.status().message()).c_str());
        return 1;
      }
      add(std::string("kvtrie Put ") + m.name, put_s);
      add(std::string("kvtrie Get RECONSTRUCTED of ") + m.name, get_s);
    }
    for (Redis* r : {&plain, &aof}) {
      const std::string name = r == &plain ? "Redis (no persistence)" : "Redis (AOF everysec)";
      const std::string prefix = "r" + std::to_string(rep) + ":";
      t0 = Clock::now();
      const bool set_ok = RedisSet(r->fd, prefix, blocks);
      add(name + " SET", Since(t0));
      t0 = Clock::now();
      const bool get_ok = RedisGet(r->fd, prefix, &got);
      add(name + " GET", Since(t0));
      if (!set_ok || !get_ok || got.back() != blocks.back()) {
        std::fprintf(stderr, "%s: SET/GET failed\n", name.c_str());
        return 1;
      }
    }
  }
  StopRedis(&plain);
  StopRedis(&aof);
  const int rc = (*server)->Stop();
  std::printf(
      "## speed_bench: one client, %zu-token prefix of Llama-3-8B-shaped KV (%zu blocks of "
      "2 MiB, %.0f MiB), %d interleaved repeats, median [min-max] GB/s\n\n",
      tokens, nb, bytes / (1 << 20), repeats);
  std::printf("| path | GB/s | / memcpy | / loopback TCP |\n|---|---|---|---|\n");
  const double mc = Median(gbs["memcpy (1 thread)"]), tcp = Median(gbs["loopback TCP, one stream"]);
  for (const std::string& row : order) {
    const auto& v = gbs[row];
    std::printf("| %s | %.3f [%.3f-%.3f] | %.3f | %.3f |\n", row.c_str(), Median(v),
                *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()),
                Median(v) / mc, Median(v) / tcp);
  }
  std::printf("\nkvtrie-server exit status %d\n", rc);
  return 0;
}
