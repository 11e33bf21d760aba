// tests/prometheus_text.h
//
// A strict parser of the Prometheus text exposition format (version 0.0.4), for tests that
// scrape /metrics. Beyond the grammar (metric and label names, quoted label values with \\ \" \n
// escapes, float values with +Inf/-Inf/NaN, optional timestamps, a newline after every line) it
// checks: every sample's family has a # TYPE line before its samples, at most one TYPE and one
// HELP per family, no duplicate series or label names, histogram samples are _bucket (with `le`),
// _sum or _count, buckets are cumulative and the +Inf bucket equals _count.
// Errors: INVALID_ARGUMENT naming the line number and what is wrong.
#ifndef KVTRIE_TESTS_PROMETHEUS_TEXT_H_
#define KVTRIE_TESTS_PROMETHEUS_TEXT_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtrie {

struct PromText {
  // Series -> value. A series is written `name{a="x",b="y"}` with the labels sorted by name
  // (`name` alone without labels).
  std::map<std::string, double> samples;
  std::map<std::string, std::string> type;  // family -> counter, gauge, histogram, ...
  bool Has(const std::string& series) const { return samples.count(series) > 0; }
  double Value(const std::string& series) const;  // -1 if absent (and fails the test)
};

absl::StatusOr<PromText> ParsePromText(absl::string_view text);

// GET /metrics from 127.0.0.1:`port` over a raw socket (HTTP/1.0); the body. Fails the test on
// a connection error or a status other than 200.
std::string ScrapeMetrics(int port);

}  // namespace kvtrie

#endif  // KVTRIE_TESTS_PROMETHEUS_TEXT_H_
