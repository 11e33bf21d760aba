// The strict Prometheus text parser rejects what a scraper would (tests/prometheus_text.h).
#include "tests/prometheus_text.h"

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(PromText, AcceptsWellFormedTextAndSortsLabels) {
  auto p = ParsePromText(
      "# HELP a_total A.\n# TYPE a_total counter\na_total{z=\"1\",b=\"x\\\"y\"} 3\n"
      "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1.5\nh_count 2\n"
      "# TYPE g gauge\ng 1e3 1700000000000\n");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->Value("a_total{b=\"x\"y\",z=\"1\"}"), 3);
  EXPECT_EQ(p->Value("g"), 1000);
  EXPECT_EQ(p->type.at("h"), "histogram");
}

TEST(PromText, RejectsMalformedText) {
  for (const char* bad : {
           "# TYPE a counter\na 1",                     // no final newline
           "a 1\n",                                     // no TYPE
           "# TYPE a counter\na{b=c} 1\n",              // unquoted label value
           "# TYPE a counter\na{b=\"c\",b=\"d\"} 1\n",  // duplicate label
           "# TYPE a counter\na one\n",                 // bad value
           "# TYPE a counter\na 1\na 2\n",              // duplicate series
           "# TYPE a counter\n# TYPE a gauge\na 1\n",   // second TYPE
           "# TYPE 1a counter\n",                       // bad name
           "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
           "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 3\n",  // +Inf != count
           "# TYPE a counter\na -1\n",                                  // negative counter
       }) {
    EXPECT_FALSE(ParsePromText(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace kvtrie
