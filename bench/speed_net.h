// bench/speed_net.h
//
// Loopback helpers of bench/speed_bench and bench/put_bench: a minimal RESP client (pipelined SET / GET of binary
// values), redis-server started on a free port in a folder and stopped by PID, one loopback TCP
// stream. Benchmark code: errors are returned as false / -1, not explained.
#ifndef KVTRIE_BENCH_SPEED_NET_H_
#define KVTRIE_BENCH_SPEED_NET_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvtrie::bench {

// A TCP connection to 127.0.0.1:`port` with TCP_NODELAY, or -1.
int Connect(int port);
// SET prefix+i blocks[i] for every block, pipelined; true if every reply is +OK.
bool RedisSet(int fd, const std::string& prefix, const std::vector<std::vector<uint8_t>>& blocks);
// GET prefix+i for i < blocks, pipelined, each into `block` (overwritten); true if every value
// has block->size() bytes.
bool RedisGet(int fd, const std::string& prefix, size_t blocks, std::vector<uint8_t>* block);

struct Redis {
  pid_t pid = -1;
  int port = 0;
  int fd = -1;  // one connection, open
};
// redis-server `bin` on a free loopback port with its files in `dir`: without persistence, or
// with AOF everysec (`aof`). fd < 0 if it did not answer within 5 s.
Redis StartRedis(const std::string& bin, const std::string& dir, bool aof);
void StopRedis(Redis* r);  // SIGTERM by PID, waits

// Seconds to send `bytes` bytes over one loopback TCP stream (1 MiB sends), or -1.
double TcpStream(size_t bytes);

}  // namespace kvtrie::bench

#endif  // KVTRIE_BENCH_SPEED_NET_H_
