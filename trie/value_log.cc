#include "trie/value_log.h"

#include <rocksdb/env.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec/crc32c.h"
#include "trie/record_store.h"

namespace kvtrie {
namespace {

constexpr char kPointerMagic[4] = {'K', 'V', 'L', '1'};
constexpr char kRecordMagic[4] = {'K', 'V', 'S', '1'};
constexpr size_t kKeyBytes = 16;

void PutLE(char* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t GetLE(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(p[i]);
  return v;
}

// Fills header[32] for `key` and `length`.
void MakeHeader(absl::string_view key, uint64_t length, char* header) {
  std::memcpy(header, kRecordMagic, 4);
  std::memset(header + 8, 0, kKeyBytes);
  std::memcpy(header + 8, key.data(), std::min(key.size(), kKeyBytes));
  PutLE(header + 24, length, 8);
  PutLE(header + 4, Crc32cExtend(0, header + 8, 24), 4);
}

bool HeaderOk(const char* header) {
  return std::memcmp(header, kRecordMagic, 4) == 0 &&
         GetLE(header + 4, 4) == Crc32cExtend(0, header + 8, 24);
}

// Reads exactly n bytes at offset into dst.
rocksdb::Status ReadExact(const rocksdb::RandomAccessFile& f, uint64_t offset, size_t n, char* dst,
                          bool* short_read) {
  rocksdb::Slice got;
  rocksdb::Status s = f.Read(offset, n, &got, dst);
  if (!s.ok()) return s;
  *short_read = got.size() != n;
  if (!*short_read && got.data() != dst) std::memcpy(dst, got.data(), n);
  return s;
}

bool ParseSegmentName(const std::string& name, uint32_t* number) {
  if (name.size() != 10 || name.compare(6, 4, ".seg") != 0) return false;
  uint32_t n = 0;
  if (!absl::SimpleAtoi(name.substr(0, 6), &n) || n == 0) return false;
  *number = n;
  return true;
}

}  // namespace

std::string EncodeValuePointer(const ValuePointer& p) {
  std::string s(kValuePointerBytes, '\0');
  std::memcpy(&s[0], kPointerMagic, 4);
  PutLE(&s[4], p.segment, 4);
  PutLE(&s[8], p.offset, 8);
  PutLE(&s[16], p.length, 8);
  PutLE(&s[24], p.crc, 4);
  return s;
}

bool DecodeValuePointer(absl::string_view value, ValuePointer* p) {
  if (value.size() != kValuePointerBytes || std::memcmp(value.data(), kPointerMagic, 4) != 0) {
    return false;
  }
  p->segment = static_cast<uint32_t>(GetLE(value.data() + 4, 4));
  p->offset = GetLE(value.data() + 8, 8);
  p->length = GetLE(value.data() + 16, 8);
  p->crc = static_cast<uint32_t>(GetLE(value.data() + 24, 4));
  return true;
}

ValueLog::ValueLog(const Options& options) : options_(options) {}

std::string ValueLog::SegmentPath(uint32_t number) const {
  return absl::StrFormat("%s/%06u.seg", options_.dir, number);
}

absl::StatusOr<std::unique_ptr<ValueLog>> ValueLog::Open(const Options& options) {
  rocksdb::Env* env = options.env;
  if (auto s = env->CreateDirIfMissing(options.dir); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("value log: cannot create '", options.dir, "': ", s.ToString()));
  }
  std::vector<std::string> children;
  if (auto s = env->GetChildren(options.dir, &children); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("value log: cannot list '", options.dir, "': ", s.ToString()));
  }
  std::unique_ptr<ValueLog> log(new ValueLog(options));
  absl::MutexLock lock(&log->mu_);
  for (const std::string& c : children) {
    // GetChildren of some Envs (the in-memory one) returns paths below the folder too.
    const size_t slash = c.find_last_of('/');
    const std::string name = slash == std::string::npos ? c : c.substr(slash + 1);
    uint32_t n = 0;
    if (!ParseSegmentName(name, &n)) continue;
    uint64_t size = 0;
    if (auto s = env->GetFileSize(log->SegmentPath(n), &size); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("value log: ", s.ToString()));
    }
    log->segments_[n].bytes = size;
    log->next_number_ = std::max(log->next_number_, n + 1);
  }
  return log;
}

ValueLog::~ValueLog() {
  absl::MutexLock lock(&mu_);
  if (auto s = SealActiveLocked(); !s.ok()) spdlog::warn("value log at close: {}", s.ToString());
}

absl::Status ValueLog::SealActiveLocked() {
  if (!active_) return absl::OkStatus();
  rocksdb::Status s = active_->Sync();
  rocksdb::Status c = active_->Close();
  active_.reset();
  segments_[active_number_].sealed = true;
  if (!s.ok()) return FromRocks(s, absl::StrCat("value log: sealing segment ", active_number_));
  return FromRocks(c, absl::StrCat("value log: closing segment ", active_number_));
}

absl::Status ValueLog::Append(absl::Span<const Entry> entries, std::vector<ValuePointer>* out) {
  out->clear();
  out->reserve(entries.size());
  // Headers and CRCs outside the mutex (the CRC reads every payload byte).
  std::vector<char> headers(entries.size() * (kHeaderBytes + kTrailerBytes));
  std::vector<uint32_t> crcs(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    char* h = &headers[i * (kHeaderBytes + kTrailerBytes)];
    MakeHeader(entries[i].key, entries[i].payload.size(), h);
    crcs[i] = Crc32c(entries[i].payload);
    PutLE(h + kHeaderBytes, crcs[i], 4);
  }
  absl::MutexLock lock(&mu_);
  if (active_ && segments_[active_number_].bytes >= options_.segment_bytes) {
    if (auto s = SealActiveLocked(); !s.ok()) return s;
  }
  if (!active_) {
    const uint32_t n = next_number_++;
    rocksdb::EnvOptions eo;
    rocksdb::Status s = options_.env->NewWritableFile(SegmentPath(n), &active_, eo);
    if (!s.ok()) {
      active_.reset();
      return FromRocks(s, absl::StrCat("value log: creating segment ", n));
    }
    active_number_ = n;
    Segment& seg = segments_[n];
    seg.sealed = false;
  }
  Segment& seg = segments_[active_number_];
  uint64_t offset = seg.bytes;
  rocksdb::Status s;
  for (size_t i = 0; i < entries.size() && s.ok(); ++i) {
    const char* h = &headers[i * (kHeaderBytes + kTrailerBytes)];
    const absl::string_view payload = entries[i].payload;
    s = active_->Append(rocksdb::Slice(h, kHeaderBytes));
    if (s.ok() && !payload.empty())
      s = active_->Append(rocksdb::Slice(payload.data(), payload.size()));
    if (s.ok()) s = active_->Append(rocksdb::Slice(h + kHeaderBytes, kTrailerBytes));
    if (!s.ok()) break;
    out->push_back(ValuePointer{active_number_, offset, payload.size(), crcs[i]});
    offset += RecordBytes(payload.size());
  }
  if (s.ok()) s = active_->Flush();
  if (s.ok() && options_.sync) s = active_->Sync();
  if (!s.ok()) {
    // What reached the file is unknown: count the file as it is, append elsewhere from now on.
    uint64_t size = offset;
    if (options_.env->GetFileSize(SegmentPath(active_number_), &size).ok()) seg.bytes = size;
    active_->Close().PermitUncheckedError();
    active_.reset();
    seg.sealed = true;
    out->clear();
    return FromRocks(s, absl::StrCat("value log: appending to segment ", active_number_));
  }
  for (const Entry& e : entries) bytes_appended_ += e.payload.size();
  seg.bytes = offset;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<rocksdb::RandomAccessFile>> ValueLog::ReaderOf(uint32_t number) {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(number);
  if (it == segments_.end()) {
    return absl::NotFoundError(absl::StrCat("value log segment ", number, " is gone"));
  }
  if (!it->second.reader) {
    std::unique_ptr<rocksdb::RandomAccessFile> f;
    rocksdb::Status s =
        options_.env->NewRandomAccessFile(SegmentPath(number), &f, rocksdb::EnvOptions());
    if (s.IsPathNotFound()) {
      return absl::NotFoundError(absl::StrCat("value log segment ", number, " is missing"));
    }
    if (!s.ok()) return FromRocks(s, absl::StrCat("value log segment ", number));
    it->second.reader = std::move(f);
  }
  return it->second.reader;
}

absl::StatusOr<std::string> ValueLog::Read(absl::string_view key, const ValuePointer& p) {
  absl::StatusOr<std::shared_ptr<rocksdb::RandomAccessFile>> f = ReaderOf(p.segment);
  if (!f.ok()) return f.status();
  const std::string where = absl::StrCat("value log segment ", p.segment, " at ", p.offset);
  char header[kHeaderBytes];
  bool short_read = false;
  rocksdb::Status s = ReadExact(**f, p.offset, kHeaderBytes, header, &short_read);
  if (!s.ok()) return FromRocks(s, where);
  if (short_read || !HeaderOk(header)) {
    return absl::DataLossError(absl::StrCat(where, ": torn or bad record header"));
  }
  char expected[kHeaderBytes];
  MakeHeader(key, p.length, expected);
  if (std::memcmp(header, expected, kHeaderBytes) != 0) {
    return absl::DataLossError(absl::StrCat(where, ": the record is not this payload's"));
  }
  std::string payload(p.length, '\0');
  if (p.length > 0) {
    s = ReadExact(**f, p.offset + kHeaderBytes, p.length, payload.data(), &short_read);
    if (!s.ok()) return FromRocks(s, where);
    if (short_read) return absl::DataLossError(absl::StrCat(where, ": torn record"));
  }
  if (Crc32c(payload) != p.crc) {
    return absl::DataLossError(absl::StrCat(where, ": payload checksum mismatch"));
  }
  return payload;
}

absl::Status ValueLog::Sync() {
  absl::MutexLock lock(&mu_);
  if (!active_) return absl::OkStatus();
  return FromRocks(active_->Sync(), absl::StrCat("value log: syncing segment ", active_number_));
}

absl::Status ValueLog::Roll() {
  absl::MutexLock lock(&mu_);
  return SealActiveLocked();
}

absl::Status ValueLog::Scan(uint32_t segment,
                            const std::function<void(absl::string_view, const ValuePointer&)>& fn) {
  uint64_t size = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = segments_.find(segment);
    if (it == segments_.end()) return absl::NotFoundError("value log segment is gone");
    size = it->second.bytes;
  }
  absl::StatusOr<std::shared_ptr<rocksdb::RandomAccessFile>> f = ReaderOf(segment);
  if (!f.ok()) return f.status();
  uint64_t offset = 0;
  char header[kHeaderBytes];
  while (offset + kHeaderBytes <= size) {
    bool short_read = false;
    rocksdb::Status s = ReadExact(**f, offset, kHeaderBytes, header, &short_read);
    if (!s.ok()) return FromRocks(s, absl::StrCat("value log segment ", segment));
    if (short_read || !HeaderOk(header)) break;  // a torn tail
    const uint64_t length = GetLE(header + 24, 8);
    if (length > size || offset + RecordBytes(length) > size) break;
    char trailer[kTrailerBytes];
    s = ReadExact(**f, offset + kHeaderBytes + length, kTrailerBytes, trailer, &short_read);
    if (!s.ok()) return FromRocks(s, absl::StrCat("value log segment ", segment));
    if (short_read) break;
    fn(absl::string_view(header + 8, kKeyBytes),
       ValuePointer{segment, offset, length, static_cast<uint32_t>(GetLE(trailer, 4))});
    offset += RecordBytes(length);
  }
  return absl::OkStatus();
}

void ValueLog::AddLive(const ValuePointer& p) {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(p.segment);
  if (it != segments_.end()) it->second.live += RecordBytes(p.length);
}

void ValueLog::RemoveLive(const ValuePointer& p) {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(p.segment);
  if (it == segments_.end()) return;
  const uint64_t n = RecordBytes(p.length);
  it->second.live = it->second.live > n ? it->second.live - n : 0;
}

std::vector<ValueLog::SegmentInfo> ValueLog::Segments() const {
  absl::MutexLock lock(&mu_);
  std::vector<SegmentInfo> out;
  for (const auto& [n, s] : segments_) {
    out.push_back(SegmentInfo{n, s.bytes, s.live, s.sealed, s.obsolete});
  }
  return out;
}

void ValueLog::MarkObsolete(uint32_t number, uint64_t seq) {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(number);
  if (it == segments_.end() || !it->second.sealed || it->second.obsolete) return;
  it->second.obsolete = true;
  it->second.obsolete_seq = seq;
}

absl::Status ValueLog::DeleteObsolete(uint64_t oldest_reader_seq) {
  std::vector<uint32_t> victims;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, s] : segments_) {
      if (s.obsolete && s.obsolete_seq <= oldest_reader_seq) victims.push_back(n);
    }
  }
  absl::Status first;
  for (uint32_t n : victims) {
    rocksdb::Status s = options_.env->DeleteFile(SegmentPath(n));
    if (!s.ok() && !s.IsPathNotFound()) {
      spdlog::warn("value log: deleting segment {}: {} (kept; retried later)", n, s.ToString());
      if (first.ok()) first = FromRocks(s, absl::StrCat("value log: deleting segment ", n));
      continue;
    }
    absl::MutexLock lock(&mu_);
    segments_.erase(n);  // readers holding its file keep it open
    ++segments_deleted_;
  }
  return first;
}

uint64_t ValueLog::Bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [n, s] : segments_) total += s.bytes;
  return total;
}

uint64_t ValueLog::segments_deleted() const {
  absl::MutexLock lock(&mu_);
  return segments_deleted_;
}

uint64_t ValueLog::bytes_appended() const {
  absl::MutexLock lock(&mu_);
  return bytes_appended_;
}

}  // namespace kvtrie
