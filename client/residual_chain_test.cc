// ResidualChain::DecodeMany (client/residual_chain.h) on real stories260K KV (Genesis 1-3; the
// learned state from GPL-3 and story_prompt, no shared text): fast blocks coded against a learned
// state decode on the pool, bit-identical with 1 and 4 threads, in any window, to the sequential
// chain; a prefix that mixes them with compact blocks predicted from their parent and from a
// centroid decodes right; the state is fetched once, on the calling thread; errors keep their
// position and code.
#include "client/residual_chain.h"

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/decode_chain.h"
#include "codec/predictor_state.h"
#include "codec/testing_blocks.h"
#include "codec/thread_pool.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr uint32_t kT = 16;
constexpr uint64_t kCentroid = 77;

// Learned from GPL-3 and story_prompt.
std::shared_ptr<const PredictorState> TrainState(uint32_t version) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  return LearnState({&gpl, &story}, version);
}

// How block b of the prefix is coded.
enum class Kind { kLearnedFast, kFast, kCompactParent, kCompactCentroid };

class ResidualChainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    state_ = new std::shared_ptr<const PredictorState>(TrainState(5));
    gen_ = new TokenBlocks(LoadTokenBlocks("genesis_1-3"));
    centroid_ = new std::vector<uint8_t>(LoadRealBlocks("GPL-3").blocks[3]);
  }
  static void TearDownTestSuite() {
    delete state_;
    delete gen_;
    delete centroid_;
  }
  const BlockGeometry& g() const { return gen_->real.geometry; }

  // Encodes blocks 0..kinds.size() of Genesis as `kinds` says (each against the reconstruction
  // of the one before), and decodes them with DecodeChain in order into want_.
  void Encode(const std::vector<Kind>& kinds) {
    ASSERT_LE(kinds.size(), gen_->real.blocks.size());
    DecodeChain chain(g(), [](uint64_t node, absl::Span<uint8_t> out) {
      if (node != kCentroid) return absl::NotFoundError("no such centroid");
      std::copy(centroid_->begin(), centroid_->end(), out.begin());
      return absl::OkStatus();
    });
    chain.AddPredictor(state());
    enc_.clear();
    refs_.clear();
    versions_.clear();
    want_.assign(kinds.size(), std::vector<uint8_t>(g().num_bytes()));
    for (size_t b = 0; b < kinds.size(); ++b) {
      EncodeOptions o;
      o.encoding = Encoding::kResidual;
      o.target_rel_rms = 0.05;
      PredictionContext ctx;
      ctx.parent = chain.parent();
      if (kinds[b] == Kind::kLearnedFast || kinds[b] == Kind::kFast) {
        o.profile = Profile::kFast;
      } else if (kinds[b] == Kind::kCompactParent) {
        o.predictors = 1u << static_cast<int>(Predictor::kParent);
      } else {
        o.predictors = 1u << static_cast<int>(Predictor::kCentroid);
        o.reference_node_id = kCentroid;
        ctx.reference = *centroid_;
      }
      if (kinds[b] == Kind::kLearnedFast) {
        ctx.learned = state_->get();
        ctx.tokens = gen_->tokens[b];
        ctx.first_position = static_cast<uint32_t>(b * kT);
        ctx.previous_token = b ? gen_->tokens[b - 1].back() : -1;
      }
      absl::StatusOr<EncodedBlock> e = EncodeBlock(g(), gen_->real.blocks[b], o, ctx);
      ASSERT_TRUE(e.ok()) << e.status();
      ASSERT_EQ(e->predictor_version, kinds[b] == Kind::kLearnedFast ? 5u : 0u) << b;
      const uint64_t ref = ParseBlock(e->bytes)->reference_node_id;
      ASSERT_EQ(ref, kinds[b] == Kind::kCompactCentroid ? kCentroid : 0u) << b;
      if (kinds[b] == Kind::kCompactParent) {
        ASSERT_GT(e->predictor_count[0][static_cast<int>(Predictor::kParent)], 0u) << b;
      }
      ASSERT_TRUE(chain.Next(e->bytes, ref, absl::MakeSpan(want_[b]), gen_->tokens[b]).ok());
      refs_.push_back(ref);
      versions_.push_back(e->predictor_version);
      enc_.push_back(std::move(e->bytes));
    }
    prefix_.clear();
    for (size_t b = 0; b < kinds.size(); ++b) {
      for (int32_t t : gen_->tokens[b]) prefix_.push_back(static_cast<uint32_t>(t));
    }
  }

  // Decodes the whole prefix with DecodeMany in windows of `window` blocks on `pool`.
  // `fetches`: the state fetches; `threads`: the threads `done` ran on.
  absl::Status DecodeAll(size_t window, ThreadPool* pool, std::vector<std::vector<uint8_t>>* got,
                         int* fetches, std::set<std::thread::id>* threads = nullptr,
                         ResidualChain::FetchPredictor fetch = nullptr) {
    const std::thread::id caller = std::this_thread::get_id();
    *fetches = 0;
    if (fetch == nullptr) {
      fetch = [&](uint32_t v) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
        ++*fetches;
        EXPECT_EQ(std::this_thread::get_id(), caller);  // never on the pool
        if (v != 5) return absl::NotFoundError("no such version");
        return state();
      };
    }
    ResidualChain chain(
        g(),
        [](uint64_t node) -> absl::StatusOr<std::vector<uint8_t>> {
          if (node != kCentroid) return absl::NotFoundError("no such centroid");
          return *centroid_;
        },
        fetch);
    got->assign(enc_.size(), std::vector<uint8_t>(g().num_bytes(), 0xEE));
    absl::Mutex mu;
    std::vector<int> done_count(enc_.size(), 0);
    for (size_t first = 0; first < enc_.size(); first += window) {
      const size_t m = std::min(window, enc_.size() - first);
      std::vector<uint32_t> index;
      std::vector<absl::string_view> bytes;
      std::vector<absl::Span<uint8_t>> outs;
      for (size_t i = first; i < first + m; ++i) {
        index.push_back(static_cast<uint32_t>(i));
        bytes.push_back(enc_[i]);
        outs.push_back(absl::MakeSpan((*got)[i]));
      }
      absl::Status s =
          chain.DecodeMany(index, absl::MakeConstSpan(refs_).subspan(first, m),
                           absl::MakeConstSpan(versions_).subspan(first, m), prefix_, bytes, outs,
                           pool, [&](size_t i) {
                             bool alone = false;
                             {
                               absl::MutexLock lock(&mu);
                               ++done_count[first + i];
                               if (threads != nullptr) {
                                 threads->insert(std::this_thread::get_id());
                                 alone = threads->size() == 1;
                               }
                             }
                             // Until a second thread has decoded a block, each block takes a
                             // while, so the pool's other threads (if it hands them any) get
                             // there even on a loaded machine.
                             if (alone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
                           });
      if (!s.ok()) return s;
    }
    for (size_t i = 0; i < enc_.size(); ++i) EXPECT_EQ(done_count[i], 1) << "block " << i;
    return absl::OkStatus();
  }

  static std::shared_ptr<const PredictorState> state() { return *state_; }

  static std::shared_ptr<const PredictorState>* state_;
  static TokenBlocks* gen_;
  static std::vector<uint8_t>* centroid_;
  std::vector<std::string> enc_;
  std::vector<uint64_t> refs_;
  std::vector<uint32_t> versions_;
  std::vector<uint32_t> prefix_;
  std::vector<std::vector<uint8_t>> want_;
};

std::shared_ptr<const PredictorState>* ResidualChainTest::state_ = nullptr;
TokenBlocks* ResidualChainTest::gen_ = nullptr;
std::vector<uint8_t>* ResidualChainTest::centroid_ = nullptr;

TEST_F(ResidualChainTest, LearnedFastBlocksDecodeOnThePoolBitIdenticalToTheChain) {
  ASSERT_NO_FATAL_FAILURE(Encode(std::vector<Kind>(gen_->real.blocks.size(), Kind::kLearnedFast)));
  ThreadPool one(1), four(4);
  for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &one, &four}) {
    for (size_t window : {size_t{1}, size_t{5}, enc_.size()}) {
      std::vector<std::vector<uint8_t>> got;
      int fetches = 0;
      std::set<std::thread::id> threads;
      const bool spread = pool == &four && window > 1;  // blocks for more than one thread
      ASSERT_TRUE(DecodeAll(window, pool, &got, &fetches, spread ? &threads : nullptr).ok());
      EXPECT_EQ(fetches, 1);  // once per version, not per block or per window (the chain keeps it)
      for (size_t b = 0; b < got.size(); ++b) {
        EXPECT_EQ(got[b], want_[b]) << "block " << b << " window " << window;
      }
      // Four threads: the learned blocks were spread over the pool, not decoded in order here.
      if (spread) {
        EXPECT_GT(threads.size(), 1u) << "window " << window;
      }
    }
  }
  // Sequential Decode, block by block: the same.
  ResidualChain chain(
      g(), nullptr,
      [](uint32_t) -> absl::StatusOr<std::shared_ptr<const PredictorState>> { return state(); });
  for (size_t b = 0; b < enc_.size(); ++b) {
    std::vector<uint8_t> out(g().num_bytes());
    ASSERT_TRUE(chain
                    .Decode(static_cast<uint32_t>(b), 0, 5,
                            absl::MakeConstSpan(prefix_).subspan(b * kT, kT), enc_[b],
                            absl::MakeSpan(out))
                    .ok());
    EXPECT_EQ(out, want_[b]) << "block " << b;
  }
}

TEST_F(ResidualChainTest, MixedPrefixDecodesRightAroundTheParallelBlocks) {
  using K = Kind;
  // Compact blocks right after learned ones read their reconstruction as the parent; a centroid
  // block after a stateless fast one; learned blocks after compact ones take their previous token.
  ASSERT_NO_FATAL_FAILURE(
      Encode({K::kLearnedFast, K::kLearnedFast, K::kCompactParent, K::kLearnedFast,
              K::kCompactCentroid, K::kCompactParent, K::kLearnedFast, K::kFast,
              K::kCompactCentroid, K::kFast, K::kLearnedFast, K::kCompactParent, K::kLearnedFast}));
  ThreadPool one(1), four(4);
  for (ThreadPool* pool : {&one, &four}) {
    for (size_t window : {size_t{1}, size_t{2}, size_t{3}, enc_.size()}) {
      std::vector<std::vector<uint8_t>> got;
      int fetches = 0;
      ASSERT_TRUE(DecodeAll(window, pool, &got, &fetches).ok());
      EXPECT_GE(fetches, 1);
      for (size_t b = 0; b < got.size(); ++b) {
        EXPECT_EQ(got[b], want_[b]) << "block " << b << " window " << window;
      }
    }
  }
}

TEST_F(ResidualChainTest, AFailedStateFetchIsReportedAtItsBlockWithItsCode) {
  ASSERT_NO_FATAL_FAILURE(Encode({Kind::kFast, Kind::kFast, Kind::kLearnedFast, Kind::kFast}));
  ThreadPool four(4);
  std::vector<std::vector<uint8_t>> got;
  int fetches = 0;
  int calls = 0;
  absl::Status s =
      DecodeAll(enc_.size(), &four, &got, &fetches, nullptr,
                [&](uint32_t) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
                  ++calls;
                  return absl::AbortedError("state 5 deleted");
                });
  EXPECT_TRUE(absl::IsAborted(s)) << s;  // the fetcher's error, unchanged
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(got[0], want_[0]);  // the blocks before it were decoded
  EXPECT_EQ(got[1], want_[1]);
  // A fetched state of the wrong version: DATA_LOSS naming the block.
  auto wrong = TrainState(6);
  s = DecodeAll(enc_.size(), &four, &got, &fetches, nullptr, [&](uint32_t) {
    return absl::StatusOr<std::shared_ptr<const PredictorState>>(wrong);
  });
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("block 2"), std::string::npos) << s;
  // A malformed learned block (its params version; the CRC resealed so the envelope passes):
  // DATA_LOSS naming it, from the pool.
  const size_t params_at = ParseBlock(enc_[2])->params.data() - enc_[2].data();
  enc_[2][params_at] ^= 0x40;
  const uint32_t crc = Crc32c(absl::string_view(enc_[2]).substr(0, enc_[2].size() - 4));
  for (int k = 0; k < 4; ++k) enc_[2][enc_[2].size() - 4 + k] = static_cast<char>(crc >> (8 * k));
  ASSERT_TRUE(ParseBlock(enc_[2]).ok());
  s = DecodeAll(enc_.size(), &four, &got, &fetches);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("block 2"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvtrie
