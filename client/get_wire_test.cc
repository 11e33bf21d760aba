#include "client/get_wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

// `bytes` cut into slices at `cuts` (ascending offsets).
std::vector<grpc::Slice> Cut(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> out;
  size_t begin = 0;
  for (size_t c : cuts) {
    out.emplace_back(bytes.data() + begin, c - begin);
    begin = c;
  }
  out.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return out;
}

std::string Join(const std::vector<absl::Span<const uint8_t>>& pieces) {
  std::string s;
  for (auto p : pieces) s.append(reinterpret_cast<const char*>(p.data()), p.size());
  return s;
}

v1::GetResponse Block(std::string kv, std::string encoded) {
  v1::GetResponse m;
  v1::GetBlock* b = m.mutable_block();
  b->set_block_index(3);
  b->set_node_id(1ull << 50);
  b->set_layer_begin(2);
  b->set_layer_end(4);
  b->set_kv(std::move(kv));
  b->set_encoded(std::move(encoded));
  b->set_encoding(v1::ENCODING_LOSSLESS);
  b->set_reference_node_id(77);
  b->set_predictor_version(5);
  return m;
}

// The hand parser must know every field of GetBlock: one it skipped would be silently lost (a
// RESIDUAL block's predictor_version was, once). Every scalar field set to a distinct value must
// come back.
TEST(ParseGetResponseTest, KnowsEveryFieldOfGetBlock) {
  v1::GetResponse m = Block("kv", "enc");
  const google::protobuf::Descriptor* d = v1::GetBlock::descriptor();
  const google::protobuf::Reflection* r = m.block().GetReflection();
  v1::GetBlock* b = m.mutable_block();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    switch (f->cpp_type()) {
      case google::protobuf::FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(b, f, 100 + i);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(b, f, (1ull << 40) + i);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnumValue(b, f, 2);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_STRING:
        break;  // kv and encoded, set above
      default:
        ADD_FAILURE() << "GetBlock." << f->name() << ": a field type this test does not set";
    }
  }
  const std::string wire = m.SerializeAsString();
  v1::GetResponse got;
  std::vector<absl::Span<const uint8_t>> pieces;
  const std::vector<grpc::Slice> slices = Cut(wire, {});  // the pieces point into these
  ASSERT_TRUE(ParseGetResponse(slices, &got, &pieces));
  got.mutable_block()->set_kv(Join(pieces));
  EXPECT_EQ(got.SerializeAsString(), wire);
}

TEST(ParseGetResponseTest, MatchesProtobufAtEverySliceBoundary) {
  std::string kv(300, '\0');
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<char>(i * 13);
  const v1::GetResponse want = Block(kv, "enc");
  const std::string wire = want.SerializeAsString();
  for (size_t cut = 1; cut < wire.size(); ++cut) {
    v1::GetResponse got;
    std::vector<absl::Span<const uint8_t>> pieces;
    const std::vector<grpc::Slice> slices = Cut(wire, {cut});  // the pieces point into these
    ASSERT_TRUE(ParseGetResponse(slices, &got, &pieces)) << cut;
    EXPECT_EQ(Join(pieces), kv) << cut;
    EXPECT_TRUE(got.block().kv().empty());
    got.mutable_block()->set_kv(kv);
    EXPECT_EQ(got.SerializeAsString(), wire) << cut;
  }
  v1::GetResponse header;
  header.mutable_header()->set_matched_blocks(9);
  header.mutable_header()->mutable_model()->set_model_id("m");
  v1::GetResponse got;
  std::vector<absl::Span<const uint8_t>> pieces;
  ASSERT_TRUE(ParseGetResponse(Cut(header.SerializeAsString(), {2}), &got, &pieces));
  EXPECT_EQ(got.SerializeAsString(), header.SerializeAsString());
}

TEST(ParseGetResponseTest, SkipsUnknownFieldsAndRefusesTruncatedOrMistypedBytes) {
  v1::GetResponse m = Block("abcd", "");
  std::string wire = m.SerializeAsString();
  // An unknown field 15 (varint) at the top level parses and is skipped.
  std::string with_unknown = wire + std::string("\x78\x05", 2);
  v1::GetResponse got;
  std::vector<absl::Span<const uint8_t>> pieces;
  const std::vector<grpc::Slice> slices = Cut(with_unknown, {});
  ASSERT_TRUE(ParseGetResponse(slices, &got, &pieces));
  EXPECT_EQ(Join(pieces), "abcd");
  for (size_t len = 0; len < wire.size(); ++len) {  // every truncation fails
    const std::vector<grpc::Slice> cut = Cut(wire.substr(0, len), {});
    EXPECT_FALSE(ParseGetResponse(cut, &got, &pieces) && Join(pieces) == "abcd" &&
                 got.block().reference_node_id() == 77)
        << len;
  }
  // kv (field 5) sent as a varint: refused, not misread.
  std::string bad = std::string("\x12\x02\x28\x01", 4);
  EXPECT_FALSE(ParseGetResponse(Cut(bad, {}), &got, &pieces));
}

TEST(ScatterLayerPiecesTest, MatchesScatterLayers) {
  const BlockGeometry g{3, 2, 4, 8, DType::kFp16};
  const size_t tokens = 12, seq = g.num_layers * g.num_kv_heads * tokens * g.head_dim * 2;
  std::vector<uint8_t> layers(g.layer_range_bytes(1, 3));
  for (size_t i = 0; i < layers.size(); ++i) layers[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> k1(seq), v1(seq), k2(seq), v2(seq);
  ScatterLayers(g, tokens, 1, 3, layers, 2, k1.data(), v1.data());
  const absl::Span<const uint8_t> all(layers);
  std::vector<absl::Span<const uint8_t>> pieces = {all.subspan(0, 5), all.subspan(5, 250),
                                                   all.subspan(255)};
  ScatterLayerPieces(g, tokens, 1, 3, pieces, 2, k2.data(), v2.data());
  EXPECT_EQ(k1, k2);
  EXPECT_EQ(v1, v2);
  EXPECT_NE(k1, std::vector<uint8_t>(seq));
}

}  // namespace
}  // namespace kvtrie
