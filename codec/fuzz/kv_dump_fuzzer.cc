// codec/fuzz/kv_dump_fuzzer.cc
//
// libFuzzer target for the KV dump reader (codec/kv_dump.h): the input is split into
// manifest.json, k.npy and v.npy ([u16 manifest length][u16 k length][manifest][k][v]), written to
// a folder of this process, and read with ReadKvDump and ReadKvManifest. Whatever the bytes: a
// status or a dump whose k and v hold exactly layers x kv_heads x tokens x head_dim elements and
// one surprisal value per token — never a crash or an out-of-bounds read (ASan + UBSan).
// Seeds in codec/fuzz/kv_dump_corpus (cut from tests/data).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "codec/kv_dump.h"

namespace {

const std::string& Dir() {
  static const std::string* dir = [] {
    auto* d = new std::string((std::filesystem::temp_directory_path() /
                               ("kvtrie_dump_fuzz_" + std::to_string(::getpid())))
                                  .string());
    std::filesystem::create_directories(*d);
    return d;
  }();
  return *dir;
}

void Write(const std::string& name, const uint8_t* p, size_t n) {
  std::ofstream out(Dir() + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(p), static_cast<std::streamsize>(n));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  size_t m = data[0] | (data[1] << 8), k = data[2] | (data[3] << 8);
  data += 4;
  size -= 4;
  m = std::min(m, size);
  k = std::min(k, size - m);
  Write("manifest.json", data, m);
  Write("k.npy", data + m, k);
  Write("v.npy", data + m + k, size - m - k);
  absl::StatusOr<kvtrie::KvDump> d = kvtrie::ReadKvDump(Dir());
  if (d.ok()) {
    const size_t elements =
        static_cast<size_t>(d->num_layers) * d->num_kv_heads * d->num_tokens() * d->head_dim;
    const size_t bytes = elements * kvtrie::DTypeBytes(d->dtype);
    if (d->k.size() != bytes || d->v.size() != bytes ||
        d->surprisal_bits.size() != d->num_tokens()) {
      fprintf(stderr, "inconsistent dump: k %zu v %zu bytes, want %zu\n", d->k.size(), d->v.size(),
              bytes);
      abort();
    }
  }
  (void)kvtrie::ReadKvManifest(Dir());
  return 0;
}
