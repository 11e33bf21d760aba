// trie/value_log.h
//
// ValueLog: the append-only files that hold block payloads, owned by RecordStore
// (trie/record_store.h), which keeps in RocksDB only a small ValuePointer per payload. Each
// payload byte is written once (WiscKey's key-value separation; Titan and BadgerDB do the same).
//
// Files: `<dir>/NNNNNN.seg` (six decimal digits, numbered from 1), all I/O through the
// rocksdb::Env given (the posix one, the fault-injecting one of trie/fault_injection_testing.h or
// the in-memory one of trie/memory_env.h). One segment is active (appended to); it is sealed when
// it reaches Options::segment_bytes, at Roll(), or when an append to it fails; a reopened log
// seals every segment it finds and appends to a new one (so it never appends after a torn tail).
//
// Record: header (32 bytes) | payload | CRC-32C of the payload (4 bytes, little-endian).
//   header: magic "KVS1" | CRC-32C of header bytes 8..31 | key (16 bytes) | payload length (8,
//   little-endian). The key is RecordStore's node key, so a segment can be scanned (GC) without
//   the index. A ValuePointer names (segment, offset of the record, payload length, payload CRC);
//   Read checks the header (magic, its CRC, key and length) and the payload's CRC against the
//   pointer: a torn or rotten record reads as DATA_LOSS "value log segment N ...", never as other
//   bytes. A torn tail (a crash while appending) is such a record: no pointer committed to it
//   (RecordStore writes the pointer after the append), so it is garbage, dropped with its segment.
//
// Appends: a group of records in one call, under the log's mutex, with one write(2) per piece
// (header, payload, trailer; no copy of the payload), then one fdatasync when Options::sync.
// Sync() syncs the active segment (RecordStore calls it before every RocksDB flush, so a pointer
// in an SST never outlives its bytes on a power loss).
//
// Space accounting: bytes (file size) and live bytes per segment. Live bytes are RecordStore's to
// keep (AddLive / RemoveLive, rebuilt at open from the pointers in RocksDB). A segment whose live
// bytes moved elsewhere is MarkObsolete(segment, seq) and deleted by DeleteObsolete once no reader
// that could still hold an older pointer remains (RecordStore passes its oldest snapshot's
// sequence number). A failed delete keeps it listed (and counted in Bytes()); the next
// DeleteObsolete tries again.
//
// Thread-safe. Read does its I/O outside the mutex, on a shared reader of the segment (a segment
// deleted meanwhile stays readable by it on POSIX; a Read that finds it gone is NOT_FOUND).
#ifndef KVTRIE_TRIE_VALUE_LOG_H_
#define KVTRIE_TRIE_VALUE_LOG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace rocksdb {
class Env;
class RandomAccessFile;
class WritableFile;
}  // namespace rocksdb

namespace kvtrie {

struct ValuePointer {
  uint32_t segment = 0;
  uint64_t offset = 0;  // of the record (its header)
  uint64_t length = 0;  // of the payload
  uint32_t crc = 0;     // CRC-32C of the payload
  bool operator==(const ValuePointer& o) const {
    return segment == o.segment && offset == o.offset && length == o.length && crc == o.crc;
  }
};

// A pointer as RocksDB stores it: "KVL1" | segment (4) | offset (8) | length (8) | crc (4), all
// little-endian, 28 bytes. Inline payloads (envelopes of codec/block_codec.h, "KVB1...") of
// folders written before the value log never decode as one.
constexpr size_t kValuePointerBytes = 28;
std::string EncodeValuePointer(const ValuePointer& p);
// True (and *p set) when `value` is an encoded pointer.
bool DecodeValuePointer(absl::string_view value, ValuePointer* p);

class ValueLog {
 public:
  static constexpr uint64_t kHeaderBytes = 32;
  static constexpr uint64_t kTrailerBytes = 4;
  static constexpr uint64_t RecordBytes(uint64_t payload) {
    return kHeaderBytes + payload + kTrailerBytes;
  }

  struct Options {
    rocksdb::Env* env = nullptr;  // required
    std::string dir;              // created if missing
    bool sync = false;            // fdatasync each appended group
    uint64_t segment_bytes = 64ull << 20;
  };
  struct Entry {
    absl::string_view key;  // 16 bytes (NodeKey)
    absl::string_view payload;
  };
  struct SegmentInfo {
    uint32_t number = 0;
    uint64_t bytes = 0;
    uint64_t live = 0;
    bool sealed = false;
    bool obsolete = false;
  };

  // Lists the segments under dir (all sealed; their live bytes 0 until AddLive). Errors:
  // UNAVAILABLE if the folder cannot be created or listed.
  static absl::StatusOr<std::unique_ptr<ValueLog>> Open(const Options& options);
  ~ValueLog();  // syncs and closes the active segment
  ValueLog(const ValueLog&) = delete;
  ValueLog& operator=(const ValueLog&) = delete;

  // Appends `entries` to the active segment (a new one when it is full), in order, and syncs
  // when Options::sync; out[i] points at entries[i]. Errors: the Env's (RESOURCE_EXHAUSTED for
  // ENOSPC, UNAVAILABLE for I/O); the segment is then sealed and what was written of the group
  // is garbage.
  absl::Status Append(absl::Span<const Entry> entries, std::vector<ValuePointer>* out);
  // The payload `p` points at, for `key`. Errors: NOT_FOUND if the segment is gone; DATA_LOSS
  // "value log segment N ..." if the record is torn, rotten or not the one expected;
  // UNAVAILABLE on an I/O error.
  absl::StatusOr<std::string> Read(absl::string_view key, const ValuePointer& p);
  // Syncs the active segment.
  absl::Status Sync();
  // Seals the active segment (the next Append starts a new one).
  absl::Status Roll();
  // Calls fn for every whole record header of a sealed segment, in order; stops at the first
  // torn or bad header (a torn tail). The payload is not read (nor checked).
  absl::Status Scan(uint32_t segment,
                    const std::function<void(absl::string_view key, const ValuePointer&)>& fn);

  void AddLive(const ValuePointer& p);
  void RemoveLive(const ValuePointer& p);
  std::vector<SegmentInfo> Segments() const;
  // Segment `number` holds nothing a pointer written after sequence `seq` refers to.
  void MarkObsolete(uint32_t number, uint64_t seq);
  // Deletes the obsolete segments marked at a sequence <= `oldest_reader_seq`. Returns the first
  // delete error (those segments stay listed); OK otherwise.
  absl::Status DeleteObsolete(uint64_t oldest_reader_seq);
  // Bytes of every listed segment file (obsolete ones not yet deleted included).
  uint64_t Bytes() const;
  // How many segments were deleted, and payload bytes appended, since Open.
  uint64_t segments_deleted() const;
  uint64_t bytes_appended() const;

 private:
  struct Segment {
    uint64_t bytes = 0;
    uint64_t live = 0;
    bool sealed = true;
    bool obsolete = false;
    uint64_t obsolete_seq = 0;
    std::shared_ptr<rocksdb::RandomAccessFile> reader;
  };
  explicit ValueLog(const Options& options);
  std::string SegmentPath(uint32_t number) const;
  absl::Status SealActiveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<rocksdb::RandomAccessFile>> ReaderOf(uint32_t number);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<uint32_t, Segment> segments_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<rocksdb::WritableFile> active_ ABSL_GUARDED_BY(mu_);
  uint32_t active_number_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t next_number_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t segments_deleted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_appended_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_VALUE_LOG_H_
