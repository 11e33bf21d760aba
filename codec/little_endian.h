// codec/little_endian.h
//
// Little-endian integers in byte strings, as every codec format here stores them (block_codec.h,
// FORMAT.md). Internal to the codec.
#ifndef KVTRIE_CODEC_LITTLE_ENDIAN_H_
#define KVTRIE_CODEC_LITTLE_ENDIAN_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvtrie {
namespace internal {

// Appends the sizeof(T) bytes of `v`, least significant first. T: an unsigned integer.
template <typename T>
void PutLE(std::string* out, T v) {
  char buf[sizeof(T)];
  for (size_t i = 0; i < sizeof(T); ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(buf, sizeof(T));
}

// Reads sizeof(T) bytes at `p`, least significant first. The caller checks the length.
template <typename T>
T GetLE(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_LITTLE_ENDIAN_H_
