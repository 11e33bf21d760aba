#include "client/get_wire.h"

#include <string>

namespace kvtrie {
namespace {

// Sequential reads over a list of slices.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Settle(); }

  size_t position() const { return consumed_; }
  bool done() const { return index_ == slices_.size(); }

  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // The next `n` bytes as views (appended to `pieces`), or skipped when `pieces` is null.
  bool Bytes(size_t n, std::vector<absl::Span<const uint8_t>>* pieces) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      const size_t k = std::min(n, s.size() - offset_);
      if (pieces != nullptr) pieces->emplace_back(s.begin() + offset_, k);
      Advance(k);
      n -= k;
    }
    return true;
  }
  bool String(size_t n, std::string* out) {
    std::vector<absl::Span<const uint8_t>> pieces;
    if (!Bytes(n, &pieces)) return false;
    out->clear();
    out->reserve(n);
    for (auto p : pieces) out->append(reinterpret_cast<const char*>(p.data()), p.size());
    return true;
  }
  // Skips a field of wire type `type`.
  bool Skip(uint32_t type) {
    uint64_t v;
    switch (type) {
      case 0:
        return Varint(&v);
      case 1:
        return Bytes(8, nullptr);
      case 2:
        return Varint(&v) && Bytes(v, nullptr);
      case 5:
        return Bytes(4, nullptr);
      default:
        return false;
    }
  }

 private:
  bool Byte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }
  void Advance(size_t k) {
    offset_ += k;
    consumed_ += k;
    Settle();
  }
  void Settle() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0, offset_ = 0, consumed_ = 0;
};

bool ParseBlock(SliceReader* r, size_t end, v1::GetBlock* b,
                std::vector<absl::Span<const uint8_t>>* kv) {
  while (r->position() < end) {
    uint64_t tag, v;
    if (!r->Varint(&tag) || r->position() > end) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3), type = tag & 7;
    if (type == 0 && field != 5 && field != 6) {
      if (!r->Varint(&v)) return false;
      switch (field) {
        case 1:
          b->set_block_index(static_cast<uint32_t>(v));
          break;
        case 2:
          b->set_node_id(v);
          break;
        case 3:
          b->set_layer_begin(static_cast<uint32_t>(v));
          break;
        case 4:
          b->set_layer_end(static_cast<uint32_t>(v));
          break;
        case 7:
          b->set_encoding(static_cast<v1::Encoding>(static_cast<int>(v)));
          break;
        case 8:
          b->set_reference_node_id(v);
          break;
        default:
          break;  // an unknown varint field
      }
      continue;
    }
    if (type == 2 && (field == 5 || field == 6)) {
      if (!r->Varint(&v) || v > end - r->position()) return false;
      if (field == 5) {
        kv->clear();
        if (!r->Bytes(v, kv)) return false;
      } else if (!r->String(v, b->mutable_encoded())) {
        return false;
      }
      continue;
    }
    if (field >= 1 && field <= 8) return false;  // a known field with the wrong wire type
    if (!r->Skip(type)) return false;
  }
  return r->position() == end;
}

}  // namespace

bool ParseGetResponse(const std::vector<grpc::Slice>& slices, v1::GetResponse* msg,
                      std::vector<absl::Span<const uint8_t>>* kv) {
  msg->Clear();
  kv->clear();
  SliceReader r(slices);
  while (!r.done()) {
    uint64_t tag, len;
    if (!r.Varint(&tag)) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3), type = tag & 7;
    if ((field == 1 || field == 2) && type == 2) {
      if (!r.Varint(&len)) return false;
      if (field == 1) {
        std::string bytes;
        if (!r.String(len, &bytes)) return false;
        if (!msg->mutable_header()->MergeFromString(bytes)) return false;
      } else {
        v1::GetBlock* b = msg->mutable_block();
        if (!ParseBlock(&r, r.position() + len, b, kv)) return false;
      }
      continue;
    }
    if (field == 1 || field == 2) return false;
    if (!r.Skip(type)) return false;
  }
  return true;
}

}  // namespace kvtrie
