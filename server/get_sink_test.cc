#include "server/get_sink.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace kvtrie {
namespace {

// The bytes of `buffer`, joined.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::GetBlock Meta() {
  v1::GetBlock b;
  b.set_block_index(7);
  b.set_node_id(1ull << 40);
  b.set_layer_begin(3);
  b.set_layer_end(9);
  b.set_encoding(v1::ENCODING_RESIDUAL);
  b.set_reference_node_id(12345);
  return b;
}

TEST(FrameGetBlockTest, ParsesAsTheSameGetResponseForKvAndEncoded) {
  for (const size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{3u << 20}}) {
    for (const bool encoded : {false, true}) {
      auto payload = std::make_shared<std::string>(size, '\0');
      for (size_t i = 0; i < size; ++i) (*payload)[i] = static_cast<char>(i * 31 + 7);
      grpc::ByteBuffer framed = FrameGetBlock(Meta(), encoded, *payload, payload);
      v1::GetResponse parsed;
      ASSERT_TRUE(parsed.ParseFromString(Flatten(framed))) << size;
      v1::GetResponse want;
      *want.mutable_block() = Meta();
      if (encoded) {
        want.mutable_block()->set_encoded(*payload);
      } else {
        want.mutable_block()->set_kv(*payload);
      }
      EXPECT_EQ(parsed.SerializeAsString(), want.SerializeAsString()) << size << " " << encoded;
      EXPECT_TRUE(parsed.has_block());
    }
  }
}

TEST(FrameGetBlockTest, ReferencesThePayloadAndReleasesItsOwner) {
  auto payload = std::make_shared<std::string>(1 << 20, 'x');
  std::weak_ptr<std::string> watch = payload;
  {
    grpc::ByteBuffer framed = FrameGetBlock(Meta(), false, *payload, payload);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(framed.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    // The second slice is the payload itself, not a copy.
    EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), payload->data());
    payload.reset();
    EXPECT_FALSE(watch.expired());  // the slices keep it
  }
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace kvtrie
