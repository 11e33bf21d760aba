// bench/bench_flags.h
//
// Flag: the value of `--name=VALUE` in a bench's argv, or `def` when it is absent. The benches
// take a few string flags each and parse their values themselves (std::stoul, std::stod, ...).
#ifndef KVTRIE_BENCH_BENCH_FLAGS_H_
#define KVTRIE_BENCH_BENCH_FLAGS_H_

#include <cstring>
#include <string>

namespace kvtrie::bench {

inline std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return def;
}

}  // namespace kvtrie::bench

#endif  // KVTRIE_BENCH_BENCH_FLAGS_H_
