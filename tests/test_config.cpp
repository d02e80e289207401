#include <gtest/gtest.h>

#include "ciera/config.hpp"
#include "ciera/error.hpp"
#include "common/text.hpp"

#include <bit>

namespace ciera {
namespace {

TEST(Config, DefaultsAreValid) { EXPECT_NO_THROW(CodecConfig{}.validate()); }

TEST(Config, InvalidFieldsAreNamed) {
  CodecConfig c;
  c.block_values = 63;
  try {
    c.validate();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("block_values"), std::string::npos);
  }
  c.block_values = 4097;
  EXPECT_THROW(c.validate(), ConfigError);
  c = CodecConfig{};
  c.coding = ExponentCoding::kFine;
  c.detection = ChangeDetection::kHash;
  EXPECT_THROW(c.validate(), ConfigError);
  c = CodecConfig{};
  c.hash_bits = 0;
  EXPECT_THROW(c.validate(), ConfigError);
}

// Error texts cut to a record field or an excerpt end on a character boundary: a cut inside a
// UTF-8 character made the binding raise UnicodeDecodeError in place of the error.
TEST(Text, CutsNeverSplitAUtf8Character) {
  const std::string text =
      "ab\xC3\xA9"
      "c\xE5\xB1\xA4";  // "abéc層": 2 + 2 + 1 + 3 bytes
  EXPECT_EQ(utf8_prefix(text, 100), text);
  EXPECT_EQ(utf8_prefix(text, 3), "ab");
  EXPECT_EQ(utf8_prefix(text, 4), "ab\xC3\xA9");
  EXPECT_EQ(utf8_prefix(text, 6),
            "ab\xC3\xA9"
            "c");
  EXPECT_EQ(utf8_prefix(text, 7),
            "ab\xC3\xA9"
            "c");
  EXPECT_EQ(utf8_prefix(text, 0), "");
  EXPECT_EQ(shortened(text, 8), text);
  EXPECT_EQ(shortened(text, 7), "ab\xC3\xA9...");
  EXPECT_EQ(shortened(text, 6), "ab...");
}

// The engine names a failed gather "the 16th gather of bucket 'B'" (a user audit read its old
// "at step 15", counted from 0, against the training step 16 beside it).
TEST(Text, OrdinalsInEnglish) {
  const std::pair<uint64_t, const char*> cases[] = {
      {1, "1st"},   {2, "2nd"},   {3, "3rd"},   {4, "4th"},     {11, "11th"},   {12, "12th"},
      {13, "13th"}, {21, "21st"}, {22, "22nd"}, {111, "111th"}, {112, "112th"}, {0, "0th"}};
  for (const auto& [n, text] : cases) EXPECT_EQ(ordinal(n), text);
}

TEST(Config, NamesParse) {
  EXPECT_EQ(parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("half"), DType::kFP16);
  EXPECT_THROW(parse_dtype("int8"), ConfigError);
  EXPECT_EQ(parse_change_detection("hash"), ChangeDetection::kHash);
  EXPECT_THROW(parse_change_detection("crc"), ConfigError);
  EXPECT_EQ(parse_exponent_coding("fine"), ExponentCoding::kFine);
  EXPECT_THROW(parse_exponent_coding("zip"), ConfigError);
}

}  // namespace
}  // namespace ciera

#include "codec/wire.hpp"
#include "format/changes.hpp"
namespace ciera {
namespace {
TEST(Wire, BranchFreeBucketsMatchTheirDefinition) {
  for (uint32_t v = 0; v < 70000; ++v) {
    const unsigned b = wire::bucket_of(v);
    ASSERT_EQ(b, static_cast<unsigned>(std::bit_width(v)));
    ASSERT_EQ(wire::bucket_extra_bits(b), b >= 2 ? b - 1 : 0u);
    ASSERT_EQ(wire::bucket_base(b), b == 0 ? 0u : 1u << (b - 1));
  }
  for (unsigned mask : {31u, 255u}) {
    for (unsigned step = 0; step <= mask; ++step) {
      const unsigned want = step == 1 ? format::kStepUp : step == mask ? format::kStepDown : format::kStepEscape;
      ASSERT_EQ(format::step_class_of(static_cast<uint8_t>(step), static_cast<uint8_t>(mask)), want);
    }
  }
}
}  // namespace
}  // namespace ciera
