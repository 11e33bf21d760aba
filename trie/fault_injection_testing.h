// trie/fault_injection_testing.h — test-only: a RocksDB file system that fails on demand.
//
// FaultFs wraps the real (POSIX) file system and, while a fault is set, makes the chosen
// operations fail: appends to or syncs of the WAL (`*.log`), appends to any file with ENOSPC,
// reads of payload files (BlobDB's `*.blob`, the value log's `*.seg`), deletes of value log
// segments, and a torn append to a segment (half of the bytes written, then an error). Crash()
// simulates a power loss as LevelDB's fault_injection_test does: from then on every write and
// sync fails (so nothing more reaches the disk), and DropUnsyncedWal() — call it once the store
// is closed — truncates every WAL file and value log segment to what had been synced. Use it
// through Env(), passed as StoreOptions::env.
#ifndef KVTRIE_TRIE_FAULT_INJECTION_TESTING_H_
#define KVTRIE_TRIE_FAULT_INJECTION_TESTING_H_

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace kvtrie {

class FaultFs : public rocksdb::FileSystemWrapper {
 public:
  std::atomic<bool> fail_wal_append{false};
  std::atomic<bool> fail_wal_sync{false};
  std::atomic<bool> no_space{false};
  std::atomic<bool> fail_blob_read{false};  // blob files and value log segments
  std::atomic<bool> fail_segment_delete{false};
  std::atomic<bool> tear_segment_append{false};  // writes half of an append, then fails
  std::atomic<int> faults{0};                    // operations failed so far

  FaultFs() : FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  const char* Name() const override { return "FaultFs"; }

  // An Env over this file system (owned by the caller, outliving the store).
  static std::unique_ptr<rocksdb::Env> NewEnv(const std::shared_ptr<FaultFs>& fs) {
    return rocksdb::NewCompositeEnv(fs);
  }

  void Crash() { crashed_ = true; }
  // Truncates each WAL file and segment to its synced length. REQUIRES: the store is closed.
  void DropUnsyncedWal() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, synced] : synced_) {
      std::error_code ec;
      if (std::filesystem::exists(name, ec)) std::filesystem::resize_file(name, synced, ec);
    }
    crashed_ = false;
  }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    if (crashed_) return Injected();
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, r, dbg);
    if (s.ok()) r->reset(new File(this, f, std::move(*r)));
    return s;
  }
  rocksdb::IOStatus NewRandomAccessFile(const std::string& f, const rocksdb::FileOptions& o,
                                        std::unique_ptr<rocksdb::FSRandomAccessFile>* r,
                                        rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->NewRandomAccessFile(f, o, r, dbg);
    if (s.ok() && (IsBlob(f) || IsSegment(f))) r->reset(new Reader(this, std::move(*r)));
    return s;
  }
  rocksdb::IOStatus DeleteFile(const std::string& f, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* dbg) override {
    if (IsSegment(f) && fail_segment_delete) return Injected();
    return target()->DeleteFile(f, o, dbg);
  }

 private:
  static bool EndsWith(const std::string& s, const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
  }
  static bool IsWal(const std::string& f) { return EndsWith(f, ".log"); }
  static bool IsBlob(const std::string& f) { return EndsWith(f, ".blob"); }
  static bool IsSegment(const std::string& f) { return EndsWith(f, ".seg"); }
  static bool TracksSync(const std::string& f) { return IsWal(f) || IsSegment(f); }
  rocksdb::IOStatus Injected() {
    ++faults;
    return rocksdb::IOStatus::IOError("injected fault");
  }

  class File : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(FaultFs* fs, std::string name, std::unique_ptr<rocksdb::FSWritableFile> f)
        : FSWritableFileOwnerWrapper(std::move(f)), fs_(fs), name_(std::move(name)) {
      if (TracksSync(name_)) fs_->SetSynced(name_, 0);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (auto s = Check(); !s.ok()) return s;
      if (IsSegment(name_) && fs_->tear_segment_append && d.size() > 1) {
        rocksdb::Slice half(d.data(), d.size() / 2);
        size_ += half.size();
        target()->Append(half, o, dbg).PermitUncheckedError();
        return fs_->Injected();
      }
      size_ += d.size();
      return target()->Append(d, o, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& d, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& v,
                             rocksdb::IODebugContext* dbg) override {
      if (auto s = Check(); !s.ok()) return s;
      size_ += d.size();
      return target()->Append(d, o, v, dbg);
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      if (auto s = CheckSync(); !s.ok()) return s;
      rocksdb::IOStatus s = target()->Sync(o, dbg);
      if (s.ok()) Synced();
      return s;
    }
    rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      if (auto s = CheckSync(); !s.ok()) return s;
      rocksdb::IOStatus s = target()->Fsync(o, dbg);
      if (s.ok()) Synced();
      return s;
    }
    rocksdb::IOStatus RangeSync(uint64_t off, uint64_t n, const rocksdb::IOOptions& o,
                                rocksdb::IODebugContext* dbg) override {
      if (auto s = CheckSync(); !s.ok()) return s;
      return target()->RangeSync(off, n, o, dbg);
    }

   private:
    rocksdb::IOStatus Check() {
      if (fs_->crashed_ || (IsWal(name_) && fs_->fail_wal_append)) return fs_->Injected();
      if (fs_->no_space) {
        ++fs_->faults;
        return rocksdb::IOStatus::NoSpace("injected: no space left on device");
      }
      return rocksdb::IOStatus::OK();
    }
    rocksdb::IOStatus CheckSync() {
      if (fs_->crashed_ || (IsWal(name_) && fs_->fail_wal_sync)) return fs_->Injected();
      return rocksdb::IOStatus::OK();
    }
    void Synced() {
      if (TracksSync(name_)) fs_->SetSynced(name_, size_);
    }
    FaultFs* const fs_;
    const std::string name_;
    uint64_t size_ = 0;
  };

  class Reader : public rocksdb::FSRandomAccessFileOwnerWrapper {
   public:
    Reader(FaultFs* fs, std::unique_ptr<rocksdb::FSRandomAccessFile> f)
        : FSRandomAccessFileOwnerWrapper(std::move(f)), fs_(fs) {}
    rocksdb::IOStatus Read(uint64_t offset, size_t n, const rocksdb::IOOptions& o,
                           rocksdb::Slice* result, char* scratch,
                           rocksdb::IODebugContext* dbg) const override {
      if (fs_->fail_blob_read) return fs_->Injected();
      return target()->Read(offset, n, o, result, scratch, dbg);
    }
    rocksdb::IOStatus MultiRead(rocksdb::FSReadRequest* reqs, size_t num,
                                const rocksdb::IOOptions& o,
                                rocksdb::IODebugContext* dbg) override {
      if (fs_->fail_blob_read) return fs_->Injected();
      return target()->MultiRead(reqs, num, o, dbg);
    }

   private:
    FaultFs* const fs_;
  };

  void SetSynced(const std::string& name, uint64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    synced_[name] = size;
  }

  std::atomic<bool> crashed_{false};
  std::mutex mu_;
  std::map<std::string, uint64_t> synced_;  // WAL file -> bytes known to be on disk
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_FAULT_INJECTION_TESTING_H_
