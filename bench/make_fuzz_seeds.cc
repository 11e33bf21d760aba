// bench/make_fuzz_seeds.cc — writes the seed corpora of the libFuzzer targets from tests/data:
//   build/bench/make_fuzz_seeds   (run from the repository root; rewrites the *_corpus folders)
// server/fuzz/put_stream_corpus: real Put streams (header, PutTokens, blocks, commit) in the
// fuzzer's record format; codec/fuzz/kv_dump_corpus: small real dumps; client/fuzz/
// residual_chain_corpus: real residual, int8 and lossless blocks of tests/data in order.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/decode_chain.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "kvtrie/v1/kvtrie.pb.h"

namespace kvtrie {
namespace {

void WriteSeed(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

std::string U16(size_t n) { return {static_cast<char>(n & 0xff), static_cast<char>(n >> 8)}; }

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The first `tokens` tokens of `d`.
KvDump Prefix(const KvDump& d, size_t tokens) {
  KvDump p = d;
  p.token_ids.resize(tokens);
  p.surprisal_bits.resize(tokens);
  const size_t row = d.head_dim * DTypeBytes(d.dtype);
  p.k.clear();
  p.v.clear();
  for (size_t r = 0; r < static_cast<size_t>(d.num_layers) * d.num_kv_heads; ++r) {
    p.k.insert(p.k.end(), d.k.begin() + r * d.num_tokens() * row,
               d.k.begin() + (r * d.num_tokens() + tokens) * row);
    p.v.insert(p.v.end(), d.v.begin() + r * d.num_tokens() * row,
               d.v.begin() + (r * d.num_tokens() + tokens) * row);
  }
  return p;
}

int Run() {
  absl::StatusOr<KvDump> d = ReadKvDump("tests/data/sessions/s0");
  if (!d.ok()) {
    std::cerr << d.status() << " (run from the repository root)\n";
    return 1;
  }
  const BlockGeometry g{d->num_layers, d->num_kv_heads, 16, d->head_dim, d->dtype};
  std::vector<std::vector<uint8_t>> blocks;
  for (size_t b = 0; b < 4; ++b) {
    blocks.emplace_back(g.num_bytes());
    GatherBlock(g, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(blocks.back()));
  }

  // Put streams: kind 0 records (serialized PutRequests).
  const auto record = [](const v1::PutRequest& r) {
    const std::string s = r.SerializeAsString();
    return std::string(1, '\0') + U16(s.size()) + s;
  };
  for (const char* encoding : {"lossless", "residual", "int8"}) {
    v1::PutRequest h;
    v1::PutHeader* ph = h.mutable_header();
    ph->set_namespace_("a");
    ph->mutable_model()->set_model_id("m0");
    ph->mutable_model()->set_num_layers(g.num_layers);
    ph->mutable_model()->set_num_kv_heads(g.num_kv_heads);
    ph->mutable_model()->set_head_dim(g.head_dim);
    ph->mutable_model()->set_dtype(v1::DTYPE_FP16);
    ph->mutable_encoding()->set_encoding(std::string(encoding) == "lossless" ? v1::ENCODING_LOSSLESS
                                         : std::string(encoding) == "residual"
                                             ? v1::ENCODING_RESIDUAL
                                             : v1::ENCODING_INT8);
    ph->mutable_token_ids()->Add(d->token_ids.begin(), d->token_ids.begin() + 16);
    ph->mutable_surprisal_bits()->Add(d->surprisal_bits.begin(), d->surprisal_bits.begin() + 16);
    v1::PutRequest t;
    t.mutable_tokens()->mutable_token_ids()->Add(d->token_ids.begin() + 16,
                                                 d->token_ids.begin() + 48);
    t.mutable_tokens()->mutable_surprisal_bits()->Add(d->surprisal_bits.begin() + 16,
                                                      d->surprisal_bits.begin() + 48);
    std::string seed = record(h) + record(t);
    for (uint32_t b = 0; b < 3; ++b) {
      v1::PutRequest pb;
      pb.mutable_block()->set_block_index(b);
      pb.mutable_block()->set_kv(blocks[b].data(), blocks[b].size());
      if (b == 1) {  // as two layer ranges
        pb.mutable_block()->set_layer_end(2);
        pb.mutable_block()->set_kv(blocks[b].data(), g.layer_range_bytes(0, 2));
        seed += record(pb);
        pb.mutable_block()->set_layer_begin(2);
        pb.mutable_block()->set_layer_end(0);
        pb.mutable_block()->set_kv(blocks[b].data() + g.layer_range_bytes(0, 2),
                                   g.layer_range_bytes(2, g.num_layers));
      }
      seed += record(pb);
    }
    v1::PutRequest c;
    c.mutable_commit();
    seed += record(c);
    WriteSeed("server/fuzz/put_stream_corpus", std::string("real_") + encoding, seed);
  }
  // Compact records: a 2-layer, 1-head, head_dim 4, 4-token fp16 model, 8 tokens, 2 blocks.
  {
    const std::string header = std::string("\x00\x01\x02\x01\x04\x01\x04\x02\x40\x08", 10) +
                               std::string("\x01\x02\x03\x04\x05\x06\x07\x00", 8) + "\x01" +
                               std::string(8, '\x10');
    std::string seed = std::string(1, '\x01') + U16(header.size()) + header;
    for (int b = 0; b < 2; ++b) {
      std::string body =
          std::string(1, static_cast<char>(b)) + std::string("\x00\x00", 2) + U16(128);
      for (int i = 0; i < 64; ++i) body += std::string("\x00\x3c", 2);
      seed += std::string(1, '\x02') + U16(body.size()) + body;
    }
    seed += std::string(1, '\x03') + U16(0);
    WriteSeed("server/fuzz/put_stream_corpus", "compact_lossless", seed);
  }

  // Dumps: 16 and 1 token(s) of s0.
  for (size_t tokens : {16, 1}) {
    const std::string dir = std::filesystem::temp_directory_path() / "kvtrie_seed_dump";
    if (auto s = WriteKvDump(dir, Prefix(*d, tokens)); !s.ok()) {
      std::cerr << s << "\n";
      return 1;
    }
    const std::string m = Slurp(dir + "/manifest.json"), k = Slurp(dir + "/k.npy"),
                      v = Slurp(dir + "/v.npy");
    WriteSeed("codec/fuzz/kv_dump_corpus", "s0_" + std::to_string(tokens),
              U16(m.size()) + U16(k.size()) + m + k + v);
  }

  // RESIDUAL chains: blocks 0..3 of s0 encoded as the server stores them (each from its parent).
  for (Encoding e : {Encoding::kResidual, Encoding::kInt8, Encoding::kLossless}) {
    std::string seed(1, '\0');      // fp16
    DecodeChain chain(g, nullptr);  // the parents, as the client's ResidualChain rebuilds them
    std::vector<uint8_t> decoded(g.num_bytes());
    std::string wrapped(1, '\0');
    for (uint32_t b = 0; b < 4; ++b) {
      EncodeOptions o;
      o.encoding = e;
      o.target_rel_rms = 0.1;
      PredictionContext ctx;
      ctx.parent = chain.parent();
      absl::StatusOr<EncodedBlock> enc = EncodeBlock(g, blocks[b], o, ctx);
      if (!enc.ok()) {
        std::cerr << enc.status() << "\n";
        return 1;
      }
      seed += std::string(1, '\0') + std::string(1, static_cast<char>(b)) + std::string(1, '\0') +
              U16(enc->bytes.size()) + enc->bytes;
      absl::StatusOr<BlockHeader> h = ParseBlock(enc->bytes);
      const std::string inner = std::string(1, static_cast<char>(static_cast<int>(e) - 1)) +
                                std::string(1, static_cast<char>(h->params.size())) +
                                std::string(h->params) + std::string(h->payload);
      wrapped += std::string(1, '\x01') + std::string(1, static_cast<char>(b)) +
                 std::string(1, '\0') + U16(inner.size()) + inner;
      if (!chain.Next(enc->bytes, 0, absl::MakeSpan(decoded)).ok()) return 1;
    }
    WriteSeed("client/fuzz/residual_chain_corpus", std::string(EncodingName(e)), seed);
    WriteSeed("client/fuzz/residual_chain_corpus", std::string(EncodingName(e)) + "_wrapped",
              wrapped);
  }
  std::cout << "seeds written\n";
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main() { return kvtrie::Run(); }
