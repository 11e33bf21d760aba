#include "tests/prometheus_text.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

bool IsMetricName(absl::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
                    (i > 0 && std::isdigit(static_cast<unsigned char>(c)));
    if (!ok) return false;
  }
  return true;
}

bool IsLabelName(absl::string_view s) {
  return IsMetricName(s) && s.find(':') == absl::string_view::npos;
}

// As Prometheus reads values (Go's strconv.ParseFloat): NaN and Inf in any case.
bool ParseValue(absl::string_view s, double* v) {
  const std::string lower = absl::AsciiStrToLower(s);
  if (lower == "+inf" || lower == "inf") return *v = INFINITY, true;
  if (lower == "-inf") return *v = -INFINITY, true;
  if (lower == "nan") return *v = NAN, true;
  return absl::SimpleAtod(s, v) &&
         s.find_first_not_of("0123456789.eE+-") == absl::string_view::npos;
}

}  // namespace

// GET /metrics over a raw socket (HTTP/1.0: the server closes when done). Returns the body.
std::string ScrapeMetrics(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
  std::string resp;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos) << resp;
  EXPECT_EQ(resp.rfind("HTTP/1.", 0), 0u) << resp.substr(0, 100);
  EXPECT_NE(resp.substr(0, body).find(" 200 "), std::string::npos) << resp.substr(0, body);
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

double PromText::Value(const std::string& series) const {
  auto it = samples.find(series);
  EXPECT_NE(it, samples.end()) << "no series " << series;
  return it == samples.end() ? -1 : it->second;
}

absl::StatusOr<PromText> ParsePromText(absl::string_view text) {
  PromText out;
  std::set<std::string> helped, sampled_families;
  // Histogram checks: (family, labels without le) -> buckets (le, count), count.
  std::map<std::string, std::vector<std::pair<double, double>>> buckets;
  std::map<std::string, double> counts;
  if (!text.empty() && text.back() != '\n') {
    return absl::InvalidArgumentError("the text does not end with a newline");
  }
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("line ", n, ": ", what, ": '", line, "'"));
    };
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() >= 3 && (parts[1] == "HELP" || parts[1] == "TYPE")) {
        const std::string family(parts[2]);
        if (!IsMetricName(family)) return bad("bad metric name");
        if (parts[1] == "HELP") {
          if (!helped.insert(family).second) return bad("second HELP");
        } else {
          if (parts.size() != 4) return bad("TYPE without a type");
          static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                                       "untyped"};
          if (!kTypes.count(std::string(parts[3]))) return bad("unknown type");
          if (out.type.count(family)) return bad("second TYPE");
          if (sampled_families.count(family)) return bad("TYPE after samples");
          out.type[family] = std::string(parts[3]);
        }
      }
      continue;
    }
    // name{labels} value [timestamp]
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    const std::string name(line.substr(0, i));
    if (!IsMetricName(name)) return bad("bad metric name");
    std::map<std::string, std::string> labels;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (true) {
        if (i >= line.size()) return bad("unterminated labels");
        if (line[i] == '}') {
          ++i;
          break;
        }
        size_t eq = line.find('=', i);
        if (eq == absl::string_view::npos) return bad("label without '='");
        const std::string lname(line.substr(i, eq - i));
        if (!IsLabelName(lname)) return bad("bad label name");
        if (eq + 1 >= line.size() || line[eq + 1] != '"') return bad("label value not quoted");
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            if (++j >= line.size()) return bad("dangling escape");
            if (line[j] == 'n')
              value.push_back('\n');
            else if (line[j] == '\\' || line[j] == '"')
              value.push_back(line[j]);
            else
              return bad("bad escape in a label value");
          } else {
            value.push_back(line[j]);
          }
        }
        if (j >= line.size()) return bad("unterminated label value");
        if (!labels.emplace(lname, value).second) return bad("duplicate label");
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
    }
    if (i >= line.size() || line[i] != ' ') return bad("no value");
    std::vector<absl::string_view> rest = absl::StrSplit(line.substr(i + 1), ' ');
    if (rest.empty() || rest.size() > 2) return bad("expected 'value [timestamp]'");
    double value = 0;
    if (!ParseValue(rest[0], &value)) return bad("bad value");
    int64_t ts = 0;
    if (rest.size() == 2 && !absl::SimpleAtoi(rest[1], &ts)) return bad("bad timestamp");
    // Its family: the name, or the name less a histogram/summary suffix.
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (absl::EndsWith(name, suffix)) {
        const std::string base = name.substr(0, name.size() - strlen(suffix));
        if (out.type.count(base) &&
            (out.type[base] == "histogram" || out.type[base] == "summary")) {
          family = base;
        }
      }
    }
    if (!out.type.count(family)) return bad("sample before its family's TYPE");
    const std::string& type = out.type[family];
    if (type == "histogram" && family == name) return bad("histogram sample without a suffix");
    if (type == "counter" && value < 0) return bad("negative counter");
    sampled_families.insert(family);
    std::vector<std::string> lv;
    for (const auto& [k, v] : labels) lv.push_back(absl::StrCat(k, "=\"", v, "\""));
    const std::string series =
        lv.empty() ? name : absl::StrCat(name, "{", absl::StrJoin(lv, ","), "}");
    if (!out.samples.emplace(series, value).second) return bad("duplicate series");
    if (type == "histogram") {
      std::map<std::string, std::string> rest_labels = labels;
      rest_labels.erase("le");
      std::vector<std::string> rl;
      for (const auto& [k, v] : rest_labels) rl.push_back(absl::StrCat(k, "=", v));
      const std::string key = absl::StrCat(family, "{", absl::StrJoin(rl, ","), "}");
      if (absl::EndsWith(name, "_bucket")) {
        double le = 0;
        if (!labels.count("le") || !ParseValue(labels["le"], &le)) return bad("bucket without le");
        buckets[key].push_back({le, value});
      } else if (absl::EndsWith(name, "_count")) {
        counts[key] = value;
      }
    }
  }
  for (const auto& [key, b] : buckets) {
    for (size_t k = 1; k < b.size(); ++k) {
      if (!(b[k].first > b[k - 1].first) || b[k].second < b[k - 1].second) {
        return absl::InvalidArgumentError(absl::StrCat(key, ": buckets not cumulative in le"));
      }
    }
    if (b.empty() || !std::isinf(b.back().first) || !counts.count(key) ||
        b.back().second != counts[key]) {
      return absl::InvalidArgumentError(absl::StrCat(key, ": +Inf bucket != _count"));
    }
  }
  return out;
}

}  // namespace kvtrie
