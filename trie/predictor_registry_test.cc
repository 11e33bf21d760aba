// SpreadSample and LearnQueue::PushSample (trie/predictor_registry.h): which blocks of a Put the
// learner gets when the queue has room for only some of them.
#include "trie/predictor_registry.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(SpreadSampleTest, OneIndexInEachStrideFromStartToEnd) {
  for (uint64_t seed : {0ull, 1ull, 511ull, 1023ull, 0xdeadbeefull}) {
    const std::vector<uint32_t> s = SpreadSample(128, 32, seed);
    ASSERT_EQ(s.size(), 32u);
    for (size_t i = 0; i < s.size(); ++i) {
      EXPECT_GE(s[i], 4 * i) << "seed " << seed;  // in stride i: [4i, 4i + 4)
      EXPECT_LT(s[i], 4 * i + 4) << "seed " << seed;
    }
    EXPECT_LT(s.front(), 4u);   // the Put's start ...
    EXPECT_GE(s.back(), 124u);  // ... and its end, not its first 32 blocks
  }
}

TEST(SpreadSampleTest, UnevenStridesStayDistinctAscendingAndInRange) {
  for (uint32_t n : {1u, 2u, 7u, 33u, 100u, 129u}) {
    for (uint32_t k : {1u, 3u, 5u, 32u, 99u, 200u}) {
      for (uint64_t seed : {0ull, 700ull, 1023ull}) {
        const std::vector<uint32_t> s = SpreadSample(n, k, seed);
        ASSERT_EQ(s.size(), std::min(n, k)) << n << " " << k;
        for (size_t i = 0; i < s.size(); ++i) {
          EXPECT_LT(s[i], n);
          if (i > 0) EXPECT_GT(s[i], s[i - 1]) << n << " " << k << " " << seed;
        }
      }
    }
  }
  EXPECT_TRUE(SpreadSample(10, 0, 0).empty());
  EXPECT_TRUE(SpreadSample(0, 10, 0).empty());
  const std::vector<uint32_t> all = SpreadSample(5, 9, 3);
  EXPECT_EQ(all, (std::vector<uint32_t>{0, 1, 2, 3, 4}));  // k >= n: every block
  // Seed 512 of 1024 is the middle of each stride.
  EXPECT_EQ(SpreadSample(12, 3, 512), (std::vector<uint32_t>{2, 6, 10}));
}

TEST(SpreadSampleTest, DifferentSeedsPickDifferentOffsets) {
  EXPECT_NE(SpreadSample(128, 16, 0), SpreadSample(128, 16, 600));
  EXPECT_EQ(SpreadSample(128, 16, 77), SpreadSample(128, 16, 77));  // deterministic
}

class PushSampleTest : public testing::Test {
 protected:
  // n jobs of `bytes` each; each records its index when it runs, and holds `alive_` while it
  // exists (so a dropped job can be seen to be destroyed).
  std::vector<LearnQueue::Job> Jobs(size_t n, uint64_t bytes) {
    std::vector<LearnQueue::Job> jobs;
    for (size_t i = 0; i < n; ++i) {
      jobs.emplace_back(bytes, [this, i, keep = alive_] {
        absl::MutexLock lock(&mu_);
        ran_.push_back(static_cast<uint32_t>(i));
      });
    }
    return jobs;
  }
  std::vector<uint32_t> Ran() {
    absl::MutexLock lock(&mu_);
    return ran_;
  }
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
  absl::Mutex mu_;
  std::vector<uint32_t> ran_ ABSL_GUARDED_BY(mu_);
};

TEST_F(PushSampleTest, RoomForAQuarterTakesAQuarterSpreadOverThePut) {
  LearnQueue q(/*max_bytes=*/32 * 100);
  const std::vector<bool> queued = q.PushSample(Jobs(128, 100), /*seed=*/512);
  q.Drain();
  const std::vector<uint32_t> ran = Ran();
  ASSERT_EQ(ran.size(), 32u);
  EXPECT_EQ(ran, SpreadSample(128, 32, 512));  // in order, one in every 4
  EXPECT_EQ(ran.front(), 2u);
  EXPECT_EQ(ran.back(), 126u);
  size_t n = 0;
  for (size_t i = 0; i < queued.size(); ++i) {
    n += queued[i];
    EXPECT_EQ(queued[i], std::find(ran.begin(), ran.end(), i) != ran.end()) << i;
  }
  EXPECT_EQ(n, 32u);
  EXPECT_EQ(alive_.use_count(), 1) << "a job was kept after it ran or was dropped";
}

TEST_F(PushSampleTest, EverythingFitsEverythingIsQueued) {
  LearnQueue q(1 << 20);
  const std::vector<bool> queued = q.PushSample(Jobs(10, 100), 0);
  q.Drain();
  EXPECT_EQ(queued, std::vector<bool>(10, true));
  EXPECT_EQ(Ran(), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST_F(PushSampleTest, NoRoomOrStoppedQueuesNothingAndDestroysTheJobs) {
  LearnQueue q(/*max_bytes=*/99);  // not even one job of 100 bytes
  EXPECT_EQ(q.PushSample(Jobs(8, 100), 0), std::vector<bool>(8, false));
  EXPECT_EQ(alive_.use_count(), 1);
  q.Stop();
  LearnQueue stopped(1 << 20);
  stopped.Stop();
  EXPECT_EQ(stopped.PushSample(Jobs(4, 1), 0), std::vector<bool>(4, false));
  EXPECT_EQ(alive_.use_count(), 1);
  EXPECT_TRUE(Ran().empty());
}

}  // namespace
}  // namespace kvtrie
