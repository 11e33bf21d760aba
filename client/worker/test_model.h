// client/worker/test_model.h
//
// Test helper: the model file the worker tests run on, loaded once per process — $KVTRIE_MODEL if
// set, else the repository's copy KVTRIE_TESTDATA_DIR/stories260K/stories260K.gguf (so a fresh
// clone runs every test), else the shared one, $KVTRIE_SHARED_DATA_DIR (default
// KVTRIE_SHARED_DATA_DIR, ../shared/data) /stories260K/stories260K.gguf.
// KVTRIE_LOAD_MODEL_OR_SKIP(model) GTEST_SKIP()s with a message naming the path when it is absent.
#ifndef KVTRIE_CLIENT_WORKER_TEST_MODEL_H_
#define KVTRIE_CLIENT_WORKER_TEST_MODEL_H_

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "client/worker/llama_model.h"

namespace kvtrie::worker::testing {

inline std::string TestModelPath() {
  const char* env = std::getenv("KVTRIE_MODEL");
  if (env != nullptr && env[0] != '\0') return env;
  const std::string in_repo = std::string(KVTRIE_TESTDATA_DIR) + "/stories260K/stories260K.gguf";
  if (std::filesystem::exists(in_repo)) return in_repo;
  const char* shared = std::getenv("KVTRIE_SHARED_DATA_DIR");
  return std::string(shared != nullptr && shared[0] != '\0' ? shared : KVTRIE_SHARED_DATA_DIR) +
         "/stories260K/stories260K.gguf";
}

// nullptr when the file is absent; aborts the test binary on a load error of a present file.
inline const LlamaModel* TestModel() {
  static const LlamaModel* model = []() -> const LlamaModel* {
    if (!std::filesystem::exists(TestModelPath())) return nullptr;
    absl::StatusOr<std::unique_ptr<LlamaModel>> m = LlamaModel::Load(TestModelPath());
    if (!m.ok()) {
      std::fprintf(stderr, "loading %s: %s\n", TestModelPath().c_str(),
                   m.status().ToString().c_str());
      std::abort();
    }
    return m->release();
  }();
  return model;
}

}  // namespace kvtrie::worker::testing

#define KVTRIE_LOAD_MODEL_OR_SKIP(var)                                                      \
  const ::kvtrie::worker::LlamaModel* var = ::kvtrie::worker::testing::TestModel();         \
  if (var == nullptr) {                                                                     \
    GTEST_SKIP() << "model file " << ::kvtrie::worker::testing::TestModelPath()             \
                 << " is absent; set $KVTRIE_MODEL to a stories260K GGUF to run this test"; \
  }

#endif  // KVTRIE_CLIENT_WORKER_TEST_MODEL_H_
