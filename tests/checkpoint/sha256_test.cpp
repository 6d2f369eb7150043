// SHA-256 against the FIPS 180-4 example vectors, fed whole and in uneven pieces, and a file's hash.
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "strobe/checkpoint/sha256.h"
#include "tests/test_dirs.h"

namespace {

using strobe::checkpoint::Sha256;
using strobe::checkpoint::sha256_file;
using strobe::checkpoint::sha256_hex;

TEST(Sha256, FipsExampleVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PiecesOfAnyLengthGiveTheDigestOfTheWhole) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>((i * 131 + 7) & 0xff);
  const std::string whole = sha256_hex(text);
  for (size_t piece : {1, 3, 55, 56, 63, 64, 65, 127}) {
    Sha256 s;
    for (size_t at = 0; at < text.size(); at += piece) s.update(text.data() + at, std::min(piece, text.size() - at));
    EXPECT_EQ(s.hex_digest(), whole) << "pieces of " << piece;
  }
}

TEST(Sha256, AFileHashesAsItsBytesAndAMissingOneIsNamed) {
  const auto dir = strobe::testing::new_test_dir("strobe-tests", "sha256");
  const std::string path = (dir / "f.bin").string();
  std::string bytes(3 * (1 << 20) + 17, '\0');  // more than one read buffer
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 2654435761u >> 24);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  EXPECT_EQ(sha256_file(path), sha256_hex(bytes));
  try {
    sha256_file(path + ".missing");
    FAIL() << "no error for a missing file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("f.bin.missing"), std::string::npos) << e.what();
  }
}

}  // namespace
