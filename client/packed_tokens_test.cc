#include "client/packed_tokens.h"

#include <numeric>
#include <string>
#include <vector>

#include "absl/base/config.h"
#include "gtest/gtest.h"
#include "kvtrie/v1/kvtrie.pb.h"

namespace kvtrie {
namespace {

// The buffer's bytes, and its slices' data pointers.
std::string Flatten(const grpc::ByteBuffer& buffer, std::vector<const uint8_t*>* starts) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string all;
  for (const grpc::Slice& s : slices) {
    starts->push_back(s.begin());
    all.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return all;
}

TEST(PackedTokens, TheWireMessageParsesAsTheRequestAndPointsAtTheCallersIds) {
  if (!ABSL_IS_LITTLE_ENDIAN) GTEST_SKIP() << "WithPackedTokens requires little-endian";
  // 0, 1, 31 (one-byte length), 32 and 5000 ids (two- and three-byte length varints).
  for (size_t n : {0u, 1u, 31u, 32u, 5000u}) {
    std::vector<uint32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0xfffff000u);
    v1::LookupRequest head_only;
    head_only.set_namespace_("tenant-a");
    head_only.set_model_id("m");
    std::string head;
    const grpc::ByteBuffer wire =
        WithPackedTokens(head_only, v1::LookupRequest::kTokenIdsPackedFieldNumber, ids, &head);
    std::vector<const uint8_t*> starts;
    v1::LookupRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(wire, &starts))) << n;
    EXPECT_EQ(parsed.namespace_(), "tenant-a");
    EXPECT_EQ(parsed.model_id(), "m");
    EXPECT_EQ(parsed.token_ids_size(), 0);
    std::string packed;
    PackTokens(ids, &packed);
    EXPECT_EQ(parsed.token_ids_packed(), packed) << n;
    if (n > 0) {
      ASSERT_EQ(starts.size(), 2u);
      EXPECT_EQ(starts[1], reinterpret_cast<const uint8_t*>(ids.data()));  // not copied
    }
  }
  // Another message and field number: GetRequest.token_ids_packed beside its other fields.
  std::vector<uint32_t> ids = {1, 2, 3, 70000};
  v1::GetRequest get;
  get.set_model_id("m2");
  get.set_max_blocks(9);
  std::string head;
  std::vector<const uint8_t*> starts;
  v1::GetRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(
      WithPackedTokens(get, v1::GetRequest::kTokenIdsPackedFieldNumber, ids, &head), &starts)));
  EXPECT_EQ(parsed.model_id(), "m2");
  EXPECT_EQ(parsed.max_blocks(), 9u);
  std::string packed;
  PackTokens(ids, &packed);
  EXPECT_EQ(parsed.token_ids_packed(), packed);
}

}  // namespace
}  // namespace kvtrie
