#include "server/auth.h"

#include <gtest/gtest.h>

namespace kvtrie {
namespace {

TEST(TokenTable, ParsesTenantsAdminAndQuotas) {
  auto t = TokenTable::Parse(R"({"tenants": [
      {"name": "a", "tokens": ["token-aaaa"], "namespaces": ["a", "a2"],
       "quota": {"stored_bytes": "1MiB", "nodes": 10, "put_streams": 2}},
      {"name": "ops", "tokens": ["token-admin"], "admin": true}]})");
  ASSERT_TRUE(t.ok()) << t.status();
  const Tenant* a = (*t)->FindToken("token-aaaa");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "a");
  EXPECT_FALSE(a->admin);
  EXPECT_EQ((*t)->QuotaOf("a2").stored_bytes, 1u << 20);
  EXPECT_EQ((*t)->QuotaOf("a").nodes, 10u);
  EXPECT_EQ((*t)->QuotaOf("a").put_streams, 2u);
  EXPECT_EQ((*t)->QuotaOf("zzz").nodes, 0u);
  EXPECT_TRUE((*t)->FindToken("token-admin")->admin);
  EXPECT_EQ((*t)->FindToken("token-aaa"), nullptr);
  EXPECT_EQ((*t)->namespaces(), (std::vector<std::string>{"a", "a2"}));
}

TEST(TokenTable, ErrorsNameTheEntry) {
  struct Case {
    const char* json;
    const char* says;
  } cases[] = {
      {"[]", "(top)"},
      {R"({"tenants": [{"name": "a", "tokens": ["token-aaaa"]}]})", "tenants[0].namespaces"},
      {R"({"tenants": [{"name": "a", "tokens": ["short"], "namespaces": ["a"]}]})",
       "tenants[0].tokens[0]"},
      {R"({"tenants": [{"name": "a", "tokens": ["token-aaaa"], "namespaces": ["a"]},
                       {"name": "b", "tokens": ["token-aaaa"], "namespaces": ["b"]}]})",
       "tenants[1].tokens[0]: duplicate token"},
      {R"({"tenants": [{"name": "a", "tokens": ["token-aaaa"], "namespaces": ["a"],
                        "quota": {"bytes": 1}}]})",
       "tenants[0].quota: unknown key 'bytes'"},
      {R"({"tenants": [{"name": "a", "tokens": ["token-aaaa"], "namespaces": ["a"],
                        "quota": {"stored_bytes": "lots"}}]})",
       "tenants[0].quota.stored_bytes"},
      {"{not json", "not valid JSON"},
  };
  for (const Case& c : cases) {
    auto t = TokenTable::Parse(c.json);
    ASSERT_FALSE(t.ok()) << c.json;
    EXPECT_NE(std::string(t.status().message()).find(c.says), std::string::npos)
        << t.status() << " should say " << c.says;
  }
}

}  // namespace
}  // namespace kvtrie
