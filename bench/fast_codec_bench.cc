// bench/fast_codec_bench.cc
//
// The fast codec profile (Profile::kFast) against the compact one, in one run:
//   1. bits per component at equal error on every real dump of tests/data (full 16-token blocks),
//      residual at several targets: compact with the parent chained (what the server stores),
//      compact without the parent, and fast (never the parent); lossless compact vs fast.
//   2. throughput on Llama-3-8B-shaped blocks, [32][2][8][16][128] fp16 = 2 MiB each, filled by
//      tiling the real stories260K values of tests/data (each run of 8 channels from another
//      layer, head and block of the dump; tokens stay in order): encode and decode GB/s of the
//      fast residual and fast lossless profiles at 1 and 2 threads (EncodeBlocks / DecodeBlocks on
//      a ThreadPool, one block per task), the compact profiles at 1 thread, and memcpy of the
//      same bytes. Every measurement is repeated (--repeats, default 3) with the systems
//      interleaved; the median is printed, with min-max.
//
//   3. (--learned, on by default) the same Llama-3-8B-shaped throughput with a learned state
//      (PredictorLearner on every other dump, tiled the same way; each tiled block takes all its
//      channels from one source block, so its token ids are that block's): fast residual encode
//      and decode GB/s at 1 and 2 threads (one block per task), the state's fit time excluded.
//      Then the C++ client's decode of the same blocks as one prefix (ResidualChain::DecodeMany,
//      client/residual_chain.h, in windows of 4 x threads blocks as Client::Get hands it them;
//      the state given by its fetcher, no server): GB/s and GB per CPU-second at 1 and 2 threads,
//      and the calling thread's share of the CPU time (1.0: nothing ran on the pool; on a shared
//      machine, where 2 threads may not get 2 cores, the share shows whether the work spread).
//
//   fast_codec_bench [--data_dir=tests/data] [--blocks=16] [--repeats=3] [--target=0.1]
//                    [--skip_bits] [--skip_speed] [--skip_learned]
//                    [--only=SUBSTRING of the throughput rows]
// GB/s is logical (fp16 bytes of the block) per wall-clock second.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "client/residual_chain.h"
#include "codec/block_batch.h"
#include "codec/block_codec.h"
#include "codec/fast_lossless_learned.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"
#include "codec/thread_pool.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;

struct Dump {
  std::string name;
  BlockGeometry g;
  std::vector<std::vector<uint8_t>> blocks;
};

std::vector<Dump> LoadDumps(const std::string& dir) {
  std::vector<Dump> dumps;
  for (const char* name :
       {"GPL-3", "genesis_1-3", "story_prompt", "sessions/s0", "sessions/s1", "sessions/s2",
        "sessions/s3", "neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
    absl::StatusOr<KvDump> d = ReadKvDump(dir + "/" + name);
    if (!d.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(d.status().message()).c_str());
      continue;
    }
    Dump x;
    x.name = name;
    x.g = BlockGeometry{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
    for (size_t b = 0; b < d->num_tokens() / 16; ++b) {
      x.blocks.emplace_back(x.g.num_bytes());
      GatherBlock(x.g, d->num_tokens(), d->k.data(), d->v.data(), b,
                  absl::MakeSpan(x.blocks.back()));
    }
    dumps.push_back(std::move(x));
  }
  return dumps;
}

struct Bits {
  double bits = 0, comps = 0, err[2] = {0, 0}, energy[2] = {0, 0};
  double bpc() const { return bits / comps; }
  double rel() const { return std::sqrt((err[0] + err[1]) / (energy[0] + energy[1])); }
  double worst_plane = 0;  // largest per-block K or V error
};

// Encodes every block of every dump; chain: context.parent = the previous decoded block.
Bits Measure(const std::vector<Dump>& dumps, const EncodeOptions& o, bool chain) {
  Bits r;
  for (const Dump& d : dumps) {
    std::vector<uint8_t> prev, out(d.g.num_bytes());
    for (const auto& block : d.blocks) {
      PredictionContext c;
      if (chain && !prev.empty()) c.parent = prev;
      absl::StatusOr<EncodedBlock> e = EncodeBlock(d.g, block, o, c);
      if (!e.ok() || !DecodeBlock(e->bytes, absl::MakeSpan(out), c).ok()) {
        std::fprintf(stderr, "%s: encode/decode failed\n", d.name.c_str());
        std::exit(1);
      }
      r.bits += 8.0 * e->bytes.size();
      r.comps += d.g.num_elements();
      r.worst_plane = std::max({r.worst_plane, e->rel_rms_error_k, e->rel_rms_error_v});
      std::vector<float> x(d.g.num_elements()), y(d.g.num_elements());
      ToFloat(d.g.dtype, block.data(), x.size(), x.data());
      ToFloat(d.g.dtype, out.data(), y.size(), y.data());
      for (size_t i = 0; i < x.size(); ++i) {
        const int kv = (i / d.g.plane_elements()) % 2;
        r.err[kv] += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
        r.energy[kv] += x[i] * static_cast<double>(x[i]);
      }
      prev = out;
    }
  }
  return r;
}

void PrintBits(const std::vector<Dump>& dumps) {
  size_t blocks = 0;
  for (const Dump& d : dumps) blocks += d.blocks.size();
  std::printf("## Bits per component at equal error: %zu dumps, %zu blocks of %s\n\n", dumps.size(),
              blocks, dumps[0].g.DebugString().c_str());
  std::printf(
      "| target | compact+parent bpc | compact bpc | fast bpc | fast / compact+parent |"
      " fast / compact | rel err compact+parent / fast |\n|---|---|---|---|---|---|---|\n");
  for (double target : {0.02, 0.05, 0.1, 0.17, 0.3}) {
    EncodeOptions o;
    o.encoding = Encoding::kResidual;
    o.target_rel_rms = target;
    const Bits cp = Measure(dumps, o, true);
    const Bits c = Measure(dumps, o, false);
    o.profile = Profile::kFast;
    const Bits f = Measure(dumps, o, false);
    std::printf("| %.2f | %.3f | %.3f | %.3f | %.3f | %.3f | %.4f / %.4f |\n", target, cp.bpc(),
                c.bpc(), f.bpc(), f.bpc() / cp.bpc(), f.bpc() / c.bpc(), cp.rel(), f.rel());
  }
  EncodeOptions l;
  l.encoding = Encoding::kLossless;
  const Bits lc = Measure(dumps, l, false);
  l.profile = Profile::kFast;
  const Bits lf = Measure(dumps, l, false);
  std::printf("| lossless | %.3f (compact) | | %.3f (fast) | %.3f | | 0 / 0 |\n\n", lc.bpc(),
              lf.bpc(), lf.bpc() / lc.bpc());
}

// Llama-3-8B-shaped blocks tiled from the real values.
std::vector<std::vector<uint8_t>> TiledBlocks(const Dump& s, size_t count) {
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  const BlockGeometry& sg = s.g;
  std::vector<std::vector<uint8_t>> out;
  const size_t nb = s.blocks.size();
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
                  reinterpret_cast<const uint16_t*>(s.blocks[(b + 5 * c) % nb].data());
              *o++ =
                  src[(((sl * 2 + kv) * sg.num_kv_heads + sh) * sg.block_tokens + t) * sg.head_dim +
                      d % sg.head_dim];
            }
  }
  return out;
}

// CPU seconds of the whole process (all threads): on a shared machine, wall-clock GB/s depends on
// the neighbours, CPU-s per GB does not.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// CPU seconds of the calling thread alone.
double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// FNV-1a of every encoded byte: equal hashes = the same bytes (before/after a speedup).
uint64_t Fnv1a(uint64_t h, absl::string_view bytes) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}
constexpr uint64_t kFnvBasis = 14695981039346656037ull;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string g_only;  // --only=SUBSTRING: only the throughput rows whose name has it

void PrintSpeed(const Dump& src, size_t nblocks, int repeats, double target) {
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  const std::vector<std::vector<uint8_t>> blocks = TiledBlocks(src, nblocks);
  std::vector<absl::Span<const uint8_t>> in(blocks.begin(), blocks.end());
  const double bytes = static_cast<double>(nblocks) * g.num_bytes();
  ThreadPool pool2(2);
  struct Row {
    std::string name;
    std::vector<double> enc, dec, enc_cpu, dec_cpu;  // GB/s wall; GB per CPU-second
    double bpc = 0, err = 0;
    uint64_t hash = 0;
  };
  std::vector<Row> rows;
  struct Config {
    std::string name;
    Encoding enc;
    Profile profile;
    ThreadPool* pool;
    size_t blocks;  // the compact profiles are slow: fewer blocks
  };
  std::vector<Config> configs = {
      {"residual fast, 1 thread", Encoding::kResidual, Profile::kFast, nullptr, nblocks},
      {"residual fast, 2 threads", Encoding::kResidual, Profile::kFast, &pool2, nblocks},
      {"residual compact, 1 thread", Encoding::kResidual, Profile::kCompact, nullptr, 2},
      {"lossless fast, 1 thread", Encoding::kLossless, Profile::kFast, nullptr, nblocks},
      {"lossless fast, 2 threads", Encoding::kLossless, Profile::kFast, &pool2, nblocks},
      {"lossless compact, 1 thread", Encoding::kLossless, Profile::kCompact, nullptr, 2},
      {"raw envelope, 1 thread", Encoding::kRaw, Profile::kCompact, nullptr, nblocks},
  };
  if (!g_only.empty()) {
    std::vector<Config> kept;
    for (const Config& c : configs)
      if (c.name.find(g_only) != std::string::npos) kept.push_back(c);
    configs = kept;
  }
  rows.resize(configs.size() + 1);
  rows.back().name = "memcpy, 1 thread";
  std::vector<uint8_t> dst(g.num_bytes());
  for (int rep = 0; rep < repeats; ++rep) {
    {  // memcpy of the same bytes
      const double c0 = CpuSeconds();
      const auto t0 = Clock::now();
      for (const auto& b : blocks) std::memcpy(dst.data(), b.data(), b.size());
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      const double cs = CpuSeconds() - c0;
      rows.back().enc.push_back(bytes / s / 1e9);
      rows.back().dec.push_back(bytes / s / 1e9);
      rows.back().enc_cpu.push_back(bytes / cs / 1e9);
      rows.back().dec_cpu.push_back(bytes / cs / 1e9);
    }
    for (size_t k = 0; k < configs.size(); ++k) {
      const Config& c = configs[k];
      EncodeOptions o;
      o.encoding = c.enc;
      o.profile = c.profile;
      o.target_rel_rms = target;
      const auto sub = absl::MakeConstSpan(in).subspan(0, c.blocks);
      const double c0 = CpuSeconds();
      const auto t0 = Clock::now();
      absl::StatusOr<std::vector<EncodedBlock>> e = EncodeBlocks(g, sub, o, c.pool);
      const auto t1 = Clock::now();
      const double c1 = CpuSeconds();
      if (!e.ok()) {
        std::fprintf(stderr, "%s: %s\n", c.name.c_str(), std::string(e.status().message()).c_str());
        std::exit(1);
      }
      std::vector<absl::string_view> enc;
      double stored = 0, err = 0;
      uint64_t hash = kFnvBasis;
      for (const EncodedBlock& b : *e) {
        hash = Fnv1a(hash, b.bytes);
        enc.push_back(b.bytes);
        stored += b.bytes.size();
        err = std::max({err, b.rel_rms_error_k, b.rel_rms_error_v});
      }
      std::vector<std::vector<uint8_t>> out(c.blocks, std::vector<uint8_t>(g.num_bytes()));
      std::vector<absl::Span<uint8_t>> outs(out.begin(), out.end());
      const double c2 = CpuSeconds();
      const auto t2 = Clock::now();
      if (!DecodeBlocks(enc, outs, false, c.pool).ok()) std::exit(1);
      const auto t3 = Clock::now();
      const double c3 = CpuSeconds();
      const double b = static_cast<double>(c.blocks) * g.num_bytes();
      rows[k].name = c.name;
      rows[k].enc.push_back(b / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      rows[k].dec.push_back(b / std::chrono::duration<double>(t3 - t2).count() / 1e9);
      rows[k].enc_cpu.push_back(b / (c1 - c0) / 1e9);
      rows[k].dec_cpu.push_back(b / (c3 - c2) / 1e9);
      rows[k].bpc = 8.0 * stored / (static_cast<double>(c.blocks) * g.num_elements());
      rows[k].err = err;
      rows[k].hash = hash;
    }
  }
  std::printf(
      "## Throughput: %zu Llama-3-8B-shaped blocks (%s, 2 MiB each) tiled from the real "
      "values of %s; residual target %.2f; %d repeats, median [min-max]\n\n",
      nblocks, g.DebugString().c_str(), src.name.c_str(), target, repeats);
  std::printf(
      "| path | encode GB/s | decode GB/s | decode / memcpy | encode GB/CPU-s | "
      "decode GB/CPU-s | bpc | worst plane rel err | bytes FNV-1a |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  const double memcpy_gbs = Median(rows.back().dec);
  for (const Row& r : rows) {
    auto lo = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
    auto hi = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
    std::printf(
        "| %s | %.3f [%.3f-%.3f] | %.3f [%.3f-%.3f] | %.3f | %.3f | %.3f | %.3f | %.4f | %016llx "
        "|\n",
        r.name.c_str(), Median(r.enc), lo(r.enc), hi(r.enc), Median(r.dec), lo(r.dec), hi(r.dec),
        Median(r.dec) / memcpy_gbs, Median(r.enc_cpu), Median(r.dec_cpu), r.bpc, r.err,
        static_cast<unsigned long long>(r.hash));
  }
}

// A Llama-3-8B-shaped block from source block `b` of dump `d` alone (channel run c of 8 from
// layer (l + c) % L, head (h + 3c) % H), with the source block's token ids and position.
struct TiledLearned {
  std::vector<uint8_t> kv;
  std::vector<int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
};

std::vector<TiledLearned> TiledWithTokens(const std::string& path) {
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  std::vector<TiledLearned> out;
  absl::StatusOr<KvDump> d = ReadKvDump(path);
  if (!d.ok() || d->dtype != DType::kFp16) return out;
  const BlockGeometry sg{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
  std::vector<uint8_t> src(sg.num_bytes());
  for (size_t b = 0; b < d->num_tokens() / 16; ++b) {
    GatherBlock(sg, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(src));
    const auto* s = reinterpret_cast<const uint16_t*>(src.data());
    TiledLearned t;
    t.kv.resize(g.num_bytes());
    auto* o = reinterpret_cast<uint16_t*>(t.kv.data());
    for (size_t l = 0; l < g.num_layers; ++l)
      for (size_t kv = 0; kv < 2; ++kv)
        for (size_t h = 0; h < g.num_kv_heads; ++h)
          for (size_t tk = 0; tk < g.block_tokens; ++tk)
            for (size_t dd = 0; dd < g.head_dim; ++dd) {
              const size_t c = dd / sg.head_dim;
              const size_t sl = (l + c) % sg.num_layers, sh = (h + 3 * c) % sg.num_kv_heads;
              *o++ =
                  s[(((sl * 2 + kv) * sg.num_kv_heads + sh) * sg.block_tokens + tk) * sg.head_dim +
                    dd % sg.head_dim];
            }
    for (size_t k = 0; k < 16; ++k)
      t.tokens.push_back(static_cast<int32_t>(d->token_ids[b * 16 + k]));
    t.first_position = static_cast<uint32_t>(b * 16);
    t.previous_token = b ? static_cast<int32_t>(d->token_ids[b * 16 - 1]) : -1;
    out.push_back(std::move(t));
  }
  return out;
}

// The client's decode of `enc` (blocks 0.. of one prefix, `eval`'s tokens) with ResidualChain at
// 1 and 2 threads, in windows of 4 x threads blocks (client/client.cc GetOnce), interleaved.
void PrintClientDecode(const BlockGeometry& g, const std::vector<TiledLearned>& eval,
                       const std::vector<EncodedBlock>& enc,
                       const std::shared_ptr<const PredictorState>& state, int repeats) {
  const size_t n = enc.size();
  if (n == 0 || enc[0].bytes.empty()) return;  // --only left the learned rows out
  std::vector<uint32_t> prefix;
  for (size_t i = 0; i < n; ++i) {
    if (eval[i].first_position != i * g.block_tokens) {
      std::fprintf(stderr, "client decode: block %zu is not at position %zu\n", i, i * 16);
      std::exit(1);
    }
    for (int32_t t : eval[i].tokens) prefix.push_back(static_cast<uint32_t>(t));
  }
  const double bytes = static_cast<double>(n) * g.num_bytes();
  std::vector<std::vector<uint8_t>> out(n, std::vector<uint8_t>(g.num_bytes()));
  std::vector<std::vector<double>> gbs(2), cpu(2), caller(2);
  uint64_t hash[2] = {kFnvBasis, kFnvBasis};
  for (int rep = 0; rep < repeats; ++rep) {
    for (int k = 0; k < 2; ++k) {
      const int threads = k + 1;
      ThreadPool pool(threads);
      int fetches = 0;
      ResidualChain chain(
          g,
          [](uint64_t) -> absl::StatusOr<std::vector<uint8_t>> {
            return absl::NotFoundError("no centroids");
          },
          [&](uint32_t) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
            ++fetches;
            return state;
          });
      const size_t window = 4 * static_cast<size_t>(threads);
      const double c0 = CpuSeconds(), m0 = ThreadCpuSeconds();
      const auto t0 = Clock::now();
      for (size_t first = 0; first < n; first += window) {
        const size_t m = std::min(window, n - first);
        std::vector<uint32_t> index(m), version(m, state->version());
        std::vector<uint64_t> ref(m, 0);
        std::vector<absl::string_view> bytes_of(m);
        std::vector<absl::Span<uint8_t>> outs(m);
        for (size_t i = 0; i < m; ++i) {
          index[i] = static_cast<uint32_t>(first + i);
          bytes_of[i] = enc[first + i].bytes;
          outs[i] = absl::MakeSpan(out[first + i]);
        }
        if (absl::Status s =
                chain.DecodeMany(index, ref, version, prefix, bytes_of, outs, &pool, [](size_t) {});
            !s.ok()) {
          std::fprintf(stderr, "client decode: %s\n", s.ToString().c_str());
          std::exit(1);
        }
      }
      const auto t1 = Clock::now();
      const double c1 = CpuSeconds(), m1 = ThreadCpuSeconds();
      caller[k].push_back((m1 - m0) / (c1 - c0));
      gbs[k].push_back(bytes / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      cpu[k].push_back(bytes / (c1 - c0) / 1e9);
      hash[k] = kFnvBasis;
      for (const std::vector<uint8_t>& o : out) {
        hash[k] =
            Fnv1a(hash[k], absl::string_view(reinterpret_cast<const char*>(o.data()), o.size()));
      }
      if (fetches != 1) std::fprintf(stderr, "client decode: %d state fetches\n", fetches);
    }
  }
  std::printf(
      "\n## Client decode with a learned state (ResidualChain::DecodeMany, %zu blocks of one "
      "prefix, windows of 4 x threads); %d repeats, median [min-max]\n\n"
      "| threads | decode GB/s | GB/s per thread | decode GB/CPU-s | caller's share of the CPU-s "
      "| output FNV-1a |\n|---|---|---|---|---|---|\n",
      n, repeats);
  for (int k = 0; k < 2; ++k) {
    const double lo = *std::min_element(gbs[k].begin(), gbs[k].end());
    const double hi = *std::max_element(gbs[k].begin(), gbs[k].end());
    std::printf("| %d | %.3f [%.3f-%.3f] | %.3f | %.3f | %.2f | %016llx |\n", k + 1, Median(gbs[k]),
                lo, hi, Median(gbs[k]) / (k + 1), Median(cpu[k]), Median(caller[k]),
                static_cast<unsigned long long>(hash[k]));
  }
}

void PrintLearnedSpeed(const std::string& dir, size_t nblocks, int repeats, double target) {
  const BlockGeometry g{32, 8, 16, 128, DType::kFp16};
  std::vector<TiledLearned> eval;
  auto learner = PredictorLearner::Create(g, LearnerOptions{});
  if (!learner.ok()) std::exit(1);
  const auto f0 = Clock::now();
  for (const char* name :
       {"GPL-3", "genesis_1-3", "story_prompt", "sessions/s0", "sessions/s1", "sessions/s2",
        "sessions/s3", "neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
    std::vector<TiledLearned> t = TiledWithTokens(dir + "/" + name);
    if (std::string(name) == "genesis_1-3") {
      eval = std::move(t);
      continue;
    }
    for (const TiledLearned& b : t)
      if (!(*learner)->Observe(b.kv, b.tokens, b.first_position, b.previous_token).ok())
        std::exit(1);
  }
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = (*learner)->Fit(1);
  if (!state.ok() || eval.empty()) {
    std::fprintf(stderr, "learned: %s\n", state.status().ToString().c_str());
    std::exit(1);
  }
  const double fit_s = std::chrono::duration<double>(Clock::now() - f0).count();
  while (eval.size() < nblocks) eval.push_back(eval[eval.size() % eval.size()]);
  eval.resize(nblocks);
  std::vector<PredictionContext> ctx(nblocks);
  for (size_t i = 0; i < nblocks; ++i) {
    ctx[i].learned = state->get();
    ctx[i].tokens = eval[i].tokens;
    ctx[i].first_position = eval[i].first_position;
    ctx[i].previous_token = eval[i].previous_token;
  }
  ThreadPool pool1(1), pool2(2);
  struct Row {
    std::string name;
    std::vector<double> enc, dec, enc_cpu, dec_cpu;
    double bpc = 0, err = 0;
    uint64_t hash = 0;
  } rows[4];
  rows[0].name = "residual fast + learned, 1 thread";
  rows[1].name = "residual fast + learned, 2 threads";
  // Fast LOSSLESS against the state (issue 22) and without it (the byte-plane mode), bit-exact.
  rows[2].name = "lossless fast + learned, 1 thread";
  rows[3].name = "lossless fast, no state, 1 thread";
  const double bytes = static_cast<double>(nblocks) * g.num_bytes();
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = target;
  std::vector<EncodedBlock> enc(nblocks);
  std::vector<std::vector<uint8_t>> out(nblocks, std::vector<uint8_t>(g.num_bytes()));
  for (int rep = 0; rep < repeats; ++rep) {
    for (int k = 0; k < 4; ++k) {
      if (!g_only.empty() && rows[k].name.find(g_only) == std::string::npos) continue;
      ThreadPool* pool = k == 1 ? &pool2 : &pool1;
      o.encoding = k < 2 ? Encoding::kResidual : Encoding::kLossless;
      o.learned_lossless = true;  // the lossless rows measure the learned mode (issue 22)
      const PredictionContext none;
      auto ctx_of = [&](size_t i) -> const PredictionContext& { return k == 3 ? none : ctx[i]; };
      bool ok = true;
      const double c0 = CpuSeconds();
      const auto t0 = Clock::now();
      pool->ParallelFor(nblocks, [&](size_t i) {
        absl::StatusOr<EncodedBlock> e = EncodeBlock(g, eval[i].kv, o, ctx_of(i));
        if (!e.ok())
          ok = false;
        else
          enc[i] = *std::move(e);
      });
      const auto t1 = Clock::now();
      const double c1 = CpuSeconds();
      pool->ParallelFor(nblocks, [&](size_t i) {
        if (!DecodeBlock(enc[i].bytes, absl::MakeSpan(out[i]), ctx_of(i)).ok()) ok = false;
      });
      for (size_t i = 0; k >= 2 && i < nblocks; ++i) ok = ok && out[i] == eval[i].kv;
      const auto t2 = Clock::now();
      const double c2 = CpuSeconds();
      if (!ok) {
        std::fprintf(stderr, "learned: encode/decode failed\n");
        std::exit(1);
      }
      double stored = 0, err = 0;
      uint64_t hash = kFnvBasis;
      for (const EncodedBlock& b : enc) {
        hash = Fnv1a(hash, b.bytes);
        stored += b.bytes.size();
        err = std::max({err, b.rel_rms_error_k, b.rel_rms_error_v});
      }
      rows[k].enc.push_back(bytes / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      rows[k].dec.push_back(bytes / std::chrono::duration<double>(t2 - t1).count() / 1e9);
      rows[k].enc_cpu.push_back(bytes / (c1 - c0) / 1e9);
      rows[k].dec_cpu.push_back(bytes / (c2 - c1) / 1e9);
      rows[k].bpc = 8.0 * stored / (static_cast<double>(nblocks) * g.num_elements());
      rows[k].err = err;
      rows[k].hash = hash;
    }
  }
  PrintClientDecode(g, eval, enc, *state, repeats);
  std::printf(
      "\n## Throughput with a learned state: %zu Llama-3-8B-shaped blocks tiled from "
      "genesis_1-3 (state learned on the other dumps, %llu tokens, fit %.1f s, linear %zu KB, "
      "KLT %zu KB); target %.2f; %d repeats, median [min-max]\n\n",
      nblocks, static_cast<unsigned long long>((*learner)->tokens_observed()), fit_s,
      (*state)->linear_bytes() / 1024, (*state)->klt_bytes() / 1024, target, repeats);
  std::printf(
      "| path | encode GB/s | decode GB/s | encode GB/CPU-s | decode GB/CPU-s | bpc | "
      "worst plane rel err | bytes FNV-1a |\n|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    if (r.enc.empty()) continue;
    auto lo = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
    auto hi = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
    std::printf(
        "| %s | %.3f [%.3f-%.3f] | %.3f [%.3f-%.3f] | %.3f | %.3f | %.3f | %.4f | %016llx |\n",
        r.name.c_str(), Median(r.enc), lo(r.enc), hi(r.enc), Median(r.dec), lo(r.dec), hi(r.dec),
        Median(r.enc_cpu), Median(r.dec_cpu), r.bpc, r.err,
        static_cast<unsigned long long>(r.hash));
  }
  // The learned LOSSLESS payload alone, forced (EncodeBlock keeps the byte-plane mode on these
  // tiled blocks: zstd finds the tiling's repeats), one thread, bit-exact.
  std::vector<double> enc_gbs, dec_gbs;
  double payload_bytes = 0;
  std::vector<std::string> payloads(nblocks);
  for (int rep = 0; rep < repeats; ++rep) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < nblocks; ++i) {
      payloads[i].clear();
      CompressFastLosslessLearned(g, eval[i].kv, **state, ctx[i].tokens, ctx[i].first_position,
                                  ctx[i].previous_token, &payloads[i]);
    }
    const auto t1 = Clock::now();
    for (size_t i = 0; i < nblocks; ++i) {
      if (!DecompressFastLosslessLearned(g, payloads[i], **state, ctx[i].tokens,
                                         ctx[i].first_position, ctx[i].previous_token,
                                         absl::MakeSpan(out[i]))
               .ok() ||
          out[i] != eval[i].kv) {
        std::fprintf(stderr, "learned lossless: not bit-exact\n");
        std::exit(1);
      }
    }
    const auto t2 = Clock::now();
    enc_gbs.push_back(bytes / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    dec_gbs.push_back(bytes / std::chrono::duration<double>(t2 - t1).count() / 1e9);
  }
  for (const std::string& p : payloads) payload_bytes += p.size();
  std::printf("| lossless learned payload (forced), 1 thread | %.3f | %.3f | | | %.3f | 0 | |\n",
              Median(enc_gbs), Median(dec_gbs), 8.0 * payload_bytes / (bytes / 2));
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  std::string data_dir = KVTRIE_TESTDATA_DIR;
  size_t blocks = 16;
  int repeats = 3;
  double target = 0.1;
  bool bits = true, speed = true, learned = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--data_dir=", 0) == 0)
      data_dir = a.substr(11);
    else if (a.rfind("--blocks=", 0) == 0)
      blocks = std::stoul(a.substr(9));
    else if (a.rfind("--repeats=", 0) == 0)
      repeats = std::stoi(a.substr(10));
    else if (a.rfind("--target=", 0) == 0)
      target = std::stod(a.substr(9));
    else if (a.rfind("--only=", 0) == 0)
      kvtrie::g_only = a.substr(7);
    else if (a == "--skip_bits")
      bits = false;
    else if (a == "--skip_speed")
      speed = false;
    else if (a == "--skip_learned")
      learned = false;
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const std::vector<kvtrie::Dump> dumps = kvtrie::LoadDumps(data_dir);
  if (dumps.empty()) return 1;
  if (bits) kvtrie::PrintBits(dumps);
  if (speed) kvtrie::PrintSpeed(dumps[1], blocks, repeats, target);
  if (learned) kvtrie::PrintLearnedSpeed(data_dir, blocks, repeats, target);
  return 0;
}
