// bench/bench_redis.h
//
// A minimal RESP client and redis-server launcher for the benches that compare with Redis 7
// (bench/put_bench.cc; bench/speed_bench.cc has its own copy of the same code): pipelined SET /
// GET of binary values on one TCP connection, and StartRedis / StopRedis of a redis-server
// child on a free loopback port (without persistence, or with --appendonly yes --appendfsync
// everysec), stopped by its PID.
#ifndef KVTRIE_BENCH_BENCH_REDIS_H_
#define KVTRIE_BENCH_BENCH_REDIS_H_

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
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace kvtrie::bench {

inline int Connect(int port) {
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

inline bool SendAll(int fd, const char* p, size_t n) {
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

inline std::string Bulk(const std::string& s) {
  return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n";
}

// SET key_i block_i for every block, pipelined; true if every reply is +OK.
inline bool RedisSet(int fd, const std::string& prefix,
                     const std::vector<std::vector<uint8_t>>& blocks) {
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
inline bool RedisGet(int fd, const std::string& prefix, std::vector<std::vector<uint8_t>>* out) {
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

inline int FreePort() {
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

inline Redis StartRedis(const std::string& bin, const std::string& dir, bool aof) {
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

inline void StopRedis(Redis* r) {
  if (r->fd >= 0) close(r->fd);
  if (r->pid > 0) {
    kill(r->pid, SIGTERM);
    waitpid(r->pid, nullptr, 0);
  }
}

}  // namespace kvtrie::bench

#endif  // KVTRIE_BENCH_BENCH_REDIS_H_
