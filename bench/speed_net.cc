#include "bench/speed_net.h"

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
#include <thread>

namespace kvtrie::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
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

}  // namespace

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

bool RedisGet(int fd, const std::string& prefix, size_t blocks, std::vector<uint8_t>* block) {
  std::string cmds;
  for (size_t i = 0; i < blocks; ++i) {
    cmds += "*2\r\n" + Bulk("GET") + Bulk(prefix + std::to_string(i));
  }
  if (!SendAll(fd, cmds.data(), cmds.size())) return false;
  Reader r(fd);
  std::string line;
  for (size_t i = 0; i < blocks; ++i) {
    if (!r.Line(&line) || line.empty() || line[0] != '$') return false;
    if (std::stoul(line.substr(1)) != block->size()) return false;
    if (!r.Bytes(reinterpret_cast<char*>(block->data()), block->size()) || !r.Line(&line)) {
      return false;
    }
  }
  return true;
}

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

}  // namespace kvtrie::bench
