#include "server/config.h"

#include <gtest/gtest.h>

namespace kvtrie {
namespace {

TEST(Config, ParsesNameValueLinesCommentsAndQuotes) {
  auto kv = ParseConfigText(
      "# comment\n\nlisten = 0.0.0.0:50051\n  memory_bytes=8GiB  \n--sync = true\n"
      "log_format = \"json\"\n",
      "x.conf");
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ(kv->size(), 4u);
  EXPECT_EQ((*kv)[0], (std::pair<std::string, std::string>{"listen", "0.0.0.0:50051"}));
  EXPECT_EQ((*kv)[1], (std::pair<std::string, std::string>{"memory_bytes", "8GiB"}));
  EXPECT_EQ((*kv)[2], (std::pair<std::string, std::string>{"sync", "true"}));
  EXPECT_EQ((*kv)[3], (std::pair<std::string, std::string>{"log_format", "json"}));
}

TEST(Config, SyntaxErrorsNameFileAndLine) {
  auto kv = ParseConfigText("listen = x\nmemory_bytes 8GiB\n", "k.conf");
  ASSERT_FALSE(kv.ok());
  EXPECT_NE(std::string(kv.status().message()).find("k.conf:2:"), std::string::npos) << kv.status();
  kv = ParseConfigText("Bad-Name = 1\n", "k.conf");
  ASSERT_FALSE(kv.ok());
  EXPECT_NE(std::string(kv.status().message()).find("k.conf:1:"), std::string::npos);
}

TEST(Config, SecretsAreRecognisedByName) {
  EXPECT_TRUE(IsSecretFlag("token"));
  EXPECT_TRUE(IsSecretFlag("admin_token"));
  EXPECT_TRUE(IsSecretFlag("db_password"));
  EXPECT_FALSE(IsSecretFlag("tokens_file"));
  EXPECT_FALSE(IsSecretFlag("tls_key"));  // a path, not the key
}

}  // namespace
}  // namespace kvtrie
