// bench/checksum_bench.cc
//
// What the envelope's content checksum costs (issue 30 row 4, codec/envelope.h flags bit 2),
// in one run on one core: Llama-3-8B-shaped blocks, [32][2][8][16][128] fp16 = 2 MiB each, tiled
// from the real genesis_1-3 values of tests/data (each run of 8 channels from another layer, head
// and block of the dump, as bench/fast_codec_bench.cc). Rows:
//   memcpy, CRC-32C and XXH3-64 of the same bytes (what a checksum pass costs against a copy);
//   fast LOSSLESS and fast RESIDUAL (--target, 0.1) encode and decode with and without the
//   checksum (EncodeOptions::content_checksum; a decoder checks a block's checksum when present).
// Every row runs --repeats times (default 9), all rows interleaved per repeat; the table shows the
// median and the min-max of the calling thread's CPU-seconds per logical GB (fp16 bytes of the
// blocks), so a loaded machine's neighbours do not count, and the checksum's share of each codec
// call.
//
//   checksum_bench [--data_dir=tests/data] [--blocks=32] [--repeats=9] [--target=0.1]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "xxhash.h"

namespace kvtrie {
namespace {

const BlockGeometry kLlama{32, 8, 16, 128, DType::kFp16};

// Llama-3-8B-shaped blocks tiled from the real values of `d` (16-token blocks of `sg`).
std::vector<std::vector<uint8_t>> TiledBlocks(const BlockGeometry& sg,
                                              const std::vector<std::vector<uint8_t>>& src_blocks,
                                              size_t count) {
  const BlockGeometry& g = kLlama;
  std::vector<std::vector<uint8_t>> out;
  const size_t nb = src_blocks.size();
  for (size_t b = 0; b < count; ++b) {
    out.emplace_back(g.num_bytes());
    auto* o = reinterpret_cast<uint16_t*>(out.back().data());
    for (size_t l = 0; l < g.num_layers; ++l)
      for (size_t kv = 0; kv < 2; ++kv)
        for (size_t h = 0; h < g.num_kv_heads; ++h)
          for (size_t t = 0; t < g.block_tokens; ++t)
            for (size_t d = 0; d < g.head_dim; ++d) {
              const size_t c = d / sg.head_dim;
              const size_t sl = (l + c) % sg.num_layers, sh = (h + 3 * c) % sg.num_kv_heads;
              const auto* src =
                  reinterpret_cast<const uint16_t*>(src_blocks[(b + 5 * c) % nb].data());
              *o++ =
                  src[(((sl * 2 + kv) * sg.num_kv_heads + sh) * sg.block_tokens + t) * sg.head_dim +
                      d % sg.head_dim];
            }
  }
  return out;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

struct Row {
  std::string name;
  std::function<void()> run;  // one pass over every block
  std::vector<double> s_per_gb = {};
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::string data_dir = KVTRIE_TESTDATA_DIR;
  size_t blocks = 32, repeats = 9;
  double target = 0.1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--data_dir=", 0) == 0)
      data_dir = a.substr(11);
    else if (a.rfind("--blocks=", 0) == 0)
      blocks = std::stoul(a.substr(9));
    else if (a.rfind("--repeats=", 0) == 0)
      repeats = std::stoul(a.substr(10));
    else if (a.rfind("--target=", 0) == 0)
      target = std::stod(a.substr(9));
    else {
      std::fprintf(stderr,
                   "usage: checksum_bench [--data_dir=] [--blocks=] [--repeats=] "
                   "[--target=]\n");
      return 2;
    }
  }
  absl::StatusOr<KvDump> d = ReadKvDump(data_dir + "/genesis_1-3");
  if (!d.ok()) {
    std::fprintf(stderr, "%s\n", std::string(d.status().message()).c_str());
    return 1;
  }
  const BlockGeometry sg{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
  std::vector<std::vector<uint8_t>> src;
  for (size_t b = 0; b < d->num_tokens() / 16; ++b) {
    src.emplace_back(sg.num_bytes());
    GatherBlock(sg, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(src.back()));
  }
  const std::vector<std::vector<uint8_t>> kv = TiledBlocks(sg, src, blocks);
  const BlockGeometry& g = kLlama;
  const double gb = 1e-9 * g.num_bytes() * blocks;

  EncodeOptions lossless;
  lossless.encoding = Encoding::kLossless;
  lossless.profile = Profile::kFast;
  EncodeOptions residual;
  residual.encoding = Encoding::kResidual;
  residual.profile = Profile::kFast;
  residual.target_rel_rms = target;
  const auto encode_all = [&](EncodeOptions o, bool checksum) {
    o.content_checksum = checksum;
    std::vector<std::string> out;
    for (const auto& b : kv) out.push_back(EncodeBlock(g, b, o)->bytes);
    return out;
  };
  const std::vector<std::string> ll_with = encode_all(lossless, true),
                                 ll_without = encode_all(lossless, false),
                                 res_with = encode_all(residual, true),
                                 res_without = encode_all(residual, false);
  std::vector<uint8_t> out(g.num_bytes());
  volatile uint64_t sink = 0;
  const auto encode_row = [&](const EncodeOptions& base, bool checksum) {
    return [&, base, checksum] {
      EncodeOptions o = base;
      o.content_checksum = checksum;
      for (const auto& b : kv) sink = sink + EncodeBlock(g, b, o)->bytes.size();
    };
  };
  const auto decode_row = [&](const std::vector<std::string>* enc) {
    return [&, enc] {
      for (const std::string& e : *enc) {
        if (!DecodeBlock(e, absl::MakeSpan(out)).ok()) std::abort();
      }
    };
  };
  std::vector<Row> rows = {
      {"memcpy",
       [&] {
         for (const auto& b : kv) {
           std::memcpy(out.data(), b.data(), b.size());
           sink = sink + out[out.size() / 2];
         }
       }},
      {"CRC-32C",
       [&] {
         for (const auto& b : kv)
           sink =
               sink + Crc32c(absl::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
       }},
      {"XXH3-64",
       [&] {
         for (const auto& b : kv) sink = sink + XXH3_64bits(b.data(), b.size());
       }},
      {"lossless fast encode, no checksum", encode_row(lossless, false)},
      {"lossless fast encode, checksum", encode_row(lossless, true)},
      {"lossless fast decode, no checksum", decode_row(&ll_without)},
      {"lossless fast decode, checksum", decode_row(&ll_with)},
      {"residual fast encode, no checksum", encode_row(residual, false)},
      {"residual fast encode, checksum", encode_row(residual, true)},
      {"residual fast decode, no checksum", decode_row(&res_without)},
      {"residual fast decode, checksum", decode_row(&res_with)},
  };
  for (Row& r : rows) r.run();  // warm-up (page faults, thread-local buffers)
  for (size_t k = 0; k < repeats; ++k) {
    for (Row& r : rows) {
      const double t0 = ThreadCpuSeconds();
      r.run();
      r.s_per_gb.push_back((ThreadCpuSeconds() - t0) / gb);
    }
  }
  std::printf(
      "## Content checksum cost: %zu Llama-3-8B-shaped blocks (2 MiB fp16) tiled from "
      "genesis_1-3, residual target %.2f, %zu interleaved repeats, 1 thread\n\n",
      blocks, target, repeats);
  std::printf(
      "| row | CPU-ms per GB (median) | min-max | GB per CPU-s | vs memcpy |\n"
      "|---|---|---|---|---|\n");
  const double memcpy_med = Median(rows[0].s_per_gb);
  for (const Row& r : rows) {
    const double m = Median(r.s_per_gb);
    const auto [lo, hi] = std::minmax_element(r.s_per_gb.begin(), r.s_per_gb.end());
    std::printf("| %s | %.1f | %.1f-%.1f | %.2f | %.2fx |\n", r.name.c_str(), 1e3 * m, 1e3 * *lo,
                1e3 * *hi, 1 / m, m / memcpy_med);
  }
  std::printf(
      "\n| codec call | checksum's share of its CPU (median with - without) |\n|---|---|\n");
  for (size_t i = 3; i + 1 < rows.size(); i += 2) {
    const double without = Median(rows[i].s_per_gb), with = Median(rows[i + 1].s_per_gb);
    std::printf("| %s | %+.1f %% |\n", rows[i].name.substr(0, rows[i].name.find(',')).c_str(),
                100 * (with - without) / without);
  }
  std::printf(
      "\nBlock bytes: lossless %zu -> %zu, residual %zu -> %zu (all blocks; + 8 per "
      "block)\n",
      [&] {
        size_t n = 0;
        for (auto& e : ll_without) n += e.size();
        return n;
      }(),
      [&] {
        size_t n = 0;
        for (auto& e : ll_with) n += e.size();
        return n;
      }(),
      [&] {
        size_t n = 0;
        for (auto& e : res_without) n += e.size();
        return n;
      }(),
      [&] {
        size_t n = 0;
        for (auto& e : res_with) n += e.size();
        return n;
      }());
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
