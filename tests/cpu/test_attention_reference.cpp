// The attention references (src/reference/attention_reference.h): number formats, KV quantization round trips, and
// decode and prefill on cases small enough to work out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/attention_reference.h"
#include "tessera/error.h"

namespace tessera::reference {
namespace {

using attention::DecodeParams;
using attention::KVFormat;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- number formats ------------------------------------------------------------------------------------------

TEST(AttentionReferenceFormats, Fp16RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(fp16_rne_sat(1.0f), 0x3C00);
  EXPECT_EQ(fp16_rne_sat(-2.0f), 0xC000);
  EXPECT_EQ(fp16_rne_sat(1.0f + 0x1p-11f), 0x3C00);      // tie, to the even neighbour 1.0
  EXPECT_EQ(fp16_rne_sat(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, to the even neighbour 1 + 2^-9
  EXPECT_EQ(fp16_rne_sat(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);
  EXPECT_EQ(fp16_rne_sat(0x1p-25f), 0x0000);      // half the smallest subnormal: tie to zero
  EXPECT_EQ(fp16_rne_sat(3 * 0x1p-25f), 0x0002);  // tie between 1 and 2 subnormal units: 2
  EXPECT_EQ(fp16_rne_sat(65504.0f), 0x7BFF);
  EXPECT_EQ(fp16_rne_sat(65519.0f), 0x7BFF);
  EXPECT_EQ(fp16_rne_sat(65520.0f), 0x7BFF);  // would round to inf: saturated
  EXPECT_EQ(fp16_rne_sat(1e30f), 0x7BFF);
  EXPECT_EQ(fp16_rne_sat(-1e30f), 0xFBFF);
  EXPECT_EQ(fp16_rne_sat(std::numeric_limits<float>::infinity()), 0x7BFF);
  EXPECT_TRUE(std::isnan(host::fp16_to_f32(fp16_rne_sat(NAN))));
}

TEST(AttentionReferenceFormats, E4m3RoundTripsEveryEncodingAndRoundsTiesToEven) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    const float v = host::e4m3_to_f32(static_cast<uint8_t>(b));
    EXPECT_EQ(e4m3_rne_sat(v), b) << "byte " << b;
  }
  // Midpoints between neighbours go to the even code (the mantissa's last bit is the code's), just above or
  // below them to the nearer one.
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = host::e4m3_to_f32(static_cast<uint8_t>(b)), hi = host::e4m3_to_f32(static_cast<uint8_t>(b + 1));
    const float mid = 0.5f * (lo + hi);
    EXPECT_EQ(e4m3_rne_sat(mid), b % 2 == 0 ? b : b + 1) << "between " << b << " and " << b + 1;
    EXPECT_EQ(e4m3_rne_sat(-mid), 0x80 | (b % 2 == 0 ? b : b + 1));
    EXPECT_EQ(e4m3_rne_sat(std::nextafter(mid, 0.0f)), b);
    EXPECT_EQ(e4m3_rne_sat(std::nextafter(mid, 1000.0f)), b + 1);
  }
  EXPECT_EQ(e4m3_rne_sat(448.0f), 0x7E);
  EXPECT_EQ(e4m3_rne_sat(464.0f), 0x7E);  // past the last midpoint: saturated, not NaN
  EXPECT_EQ(e4m3_rne_sat(1e9f), 0x7E);
  EXPECT_EQ(e4m3_rne_sat(-1e9f), 0xFE);
  EXPECT_EQ(e4m3_rne_sat(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(e4m3_rne_sat(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_TRUE(std::isnan(host::e4m3_to_f32(e4m3_rne_sat(NAN))));
  EXPECT_EQ(e4m3_rne_sat(0x1p-10f), 0x00);  // half the smallest subnormal: to zero
  EXPECT_EQ(e4m3_rne_sat(-0.0f), 0x80);
}

// ---- quantization --------------------------------------------------------------------------------------------

std::vector<float> bf16_normals(int64_t n, float sigma, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = host::bf16_to_f32(host::f32_to_bf16(normal(rng)));
  return x;
}

TEST(AttentionReferenceQuant, LayoutSizes) {
  EXPECT_EQ(kv_row_bytes(KVFormat::kNative, 128), 256);
  EXPECT_EQ(kv_row_bytes(KVFormat::kFP8, 128), 128);
  EXPECT_EQ(kv_row_bytes(KVFormat::kInt8, 64), 64);
  EXPECT_EQ(kv_row_bytes(KVFormat::kInt4, 256), 128);
  EXPECT_EQ(kv_row_bytes(KVFormat::kInt4Group32, 64), 32);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kInt8, 128), 1);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kInt4, 128), 1);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kInt4Group32, 256), 8);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kFP8, 128), 0);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kNative, 128), 0);
  EXPECT_EQ(kv_levels(KVFormat::kInt8), 255);
  EXPECT_EQ(kv_levels(KVFormat::kInt4Group32), 15);
  EXPECT_EQ(kv_row_bytes(KVFormat::kInt8KChannel, 128), 128);
  EXPECT_EQ(kv_row_bytes(KVFormat::kInt4KChannel, 128), 64);
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kInt8KChannel, 256), 1);  // the values' per-row pair
  EXPECT_EQ(kv_num_scale_groups(KVFormat::kInt4KChannel, 64), 1);
  EXPECT_EQ(kv_levels(KVFormat::kInt8KChannel), 255);
  EXPECT_EQ(kv_levels(KVFormat::kInt4KChannel), 15);
  EXPECT_TRUE(kv_key_per_channel(KVFormat::kInt8KChannel));
  EXPECT_TRUE(kv_key_per_channel(KVFormat::kInt4KChannel));
  EXPECT_FALSE(kv_key_per_channel(KVFormat::kInt4));
  EXPECT_FALSE(kv_key_per_channel(KVFormat::kInt4Group32));
}

TEST(AttentionReferenceQuant, Int8ByHand) {
  // lo 0, hi 255: scale 1, offset 0; 2.5 and 3.5 are ties, to even codes; 100.25 rounds down.
  const std::vector<float> x = {0.0f, 255.0f, 2.5f, 3.5f, 100.25f, 7.0f, 254.5f, 0.5f};
  const QuantizedKV q = quantize_kv(KVFormat::kInt8, x.data(), 1, 8);
  EXPECT_EQ(q.pairs, (std::vector<uint16_t>{fp16_rne_sat(1.0f), 0x0000}));
  EXPECT_EQ(q.data, (std::vector<uint8_t>{0, 255, 2, 4, 100, 7, 254, 0}));
  EXPECT_EQ(dequantize_kv(q), (std::vector<double>{0, 255, 2, 4, 100, 7, 254, 0}));
}

TEST(AttentionReferenceQuant, Int4PackingByHand) {
  // lo -3, hi 12: scale 1, offset -3; codes 0, 15, 8, 13 -> bytes 0xF0, 0xD8.
  const std::vector<float> x = {-3.0f, 12.0f, 5.0f, 10.0f};
  const QuantizedKV q = quantize_kv(KVFormat::kInt4, x.data(), 1, 4);
  EXPECT_EQ(q.pairs, (std::vector<uint16_t>{0x3C00, fp16_rne_sat(-3.0f)}));
  EXPECT_EQ(q.data, (std::vector<uint8_t>{0xF0, 0xD8}));
  EXPECT_EQ(dequantize_kv(q), (std::vector<double>{-3, 12, 5, 10}));
}

TEST(AttentionReferenceQuant, Int4Group32HasOnePairPerGroup) {
  // Group 0: 0..31 step 0.5 over [0, 15.5]; group 1: constant 2 (scale 0, codes 0, exact).
  std::vector<float> x(64);
  for (int i = 0; i < 32; ++i) x[i] = 0.5f * i;
  for (int i = 32; i < 64; ++i) x[i] = 2.0f;
  const QuantizedKV q = quantize_kv(KVFormat::kInt4Group32, x.data(), 1, 64);
  ASSERT_EQ(q.num_groups, 2);
  EXPECT_EQ(q.pairs[0], fp16_rne_sat(15.5f / 15.0f));
  EXPECT_EQ(q.pairs[1], 0x0000);
  EXPECT_EQ(q.pairs[2], 0x0000);
  EXPECT_EQ(q.pairs[3], fp16_rne_sat(2.0f));
  for (int j = 16; j < 32; ++j) EXPECT_EQ(q.data[j], 0) << j;
  EXPECT_EQ(q.data[15] >> 4, 15);  // element 31 is the maximum
  const std::vector<double> d = dequantize_kv(q);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(d[i], 2.0);
}

// For integer formats: every element within half a step of its value, plus what fp16 rounding of the pair can add
// (offset above lo clamps codes at 0; a scale rounded down clamps the top code).
void expect_int_round_trip(KVFormat format, int D, const std::vector<float>& x, int64_t rows) {
  const QuantizedKV q = quantize_kv(format, x.data(), rows, D);
  const std::vector<double> d = dequantize_kv(q);
  const int levels = kv_levels(format);
  const int group = format == KVFormat::kInt4Group32 ? 32 : D;
  double worst_ratio = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < D / group; ++g) {
      const float* xg = &x[r * D + g * group];
      double lo = xg[0], hi = xg[0];
      for (int i = 0; i < group; ++i) lo = std::min<double>(lo, xg[i]), hi = std::max<double>(hi, xg[i]);
      const double scale = host::fp16_to_f32(q.pairs[(r * q.num_groups + g) * 2]);
      const double offset = host::fp16_to_f32(q.pairs[(r * q.num_groups + g) * 2 + 1]);
      // Half an fp16 ulp, relative, or half the subnormal spacing 2^-24.
      EXPECT_LE(std::fabs(scale - (hi - lo) / levels), std::ldexp((hi - lo) / levels, -11) + 0x1p-25);
      EXPECT_LE(std::fabs(offset - lo), std::ldexp(std::fabs(lo), -11) + 0x1p-25);
      const double bound = scale / 2 + std::fabs(offset - lo) + levels * std::fabs(scale - (hi - lo) / levels) +
                           1e-6 * (std::fabs(lo) + std::fabs(hi));
      for (int i = 0; i < group; ++i) {
        const double err = std::fabs(d[r * D + g * group + i] - xg[i]);
        EXPECT_LE(err, bound) << "row " << r << " element " << g * group + i;
        if (scale > 0) worst_ratio = std::max(worst_ratio, err / scale);
      }
    }
  EXPECT_LT(worst_ratio, 0.51);  // random data: the fp16 slack is tiny next to half a step
}

TEST(AttentionReferenceQuant, IntegerRoundTripErrorBounds) {
  std::mt19937 rng(1234);
  for (KVFormat f : {KVFormat::kInt8, KVFormat::kInt4, KVFormat::kInt4Group32})
    for (int D : {64, 128, 256})
      for (float sigma : {1.0f, 1e-3f, 300.0f}) {
        SCOPED_TRACE("format " + std::to_string(static_cast<int>(f)) + " D=" + std::to_string(D) +
                     " sigma=" + std::to_string(sigma));
        std::vector<float> x = bf16_normals(50 * D, sigma, rng);
        for (int i = 0; i < D; ++i) x[7 * D + i] = x[7 * D] + 10 * sigma;  // a row far from zero
        expect_int_round_trip(f, D, x, 50);
      }
}

TEST(AttentionReferenceQuant, ConstantRowsAreExact) {
  for (KVFormat f : {KVFormat::kInt8, KVFormat::kInt4, KVFormat::kInt4Group32})
    for (float c : {0.0f, 1.00390625f, -7.5f, 1000.0f, 0x1p-20f}) {
      const std::vector<float> x(128, c);
      const QuantizedKV q = quantize_kv(f, x.data(), 1, 128);
      for (int g = 0; g < q.num_groups; ++g) EXPECT_EQ(q.pairs[2 * g], 0x0000);
      for (uint8_t b : q.data) EXPECT_EQ(b, 0);
      const std::vector<double> d = dequantize_kv(q);
      for (double v : d) EXPECT_EQ(v, static_cast<double>(host::fp16_to_f32(fp16_rne_sat(c))));
      EXPECT_EQ(d[0], c);  // these values are exact in fp16 (2^-20 as a subnormal)
    }
}

TEST(AttentionReferenceQuant, Fp8ScalesSaturationAndNaN) {
  // Two heads with scales 2 and 0.5; rows alternate heads.
  const std::vector<float> x = {3.0f, 896.0f, -1e6f, NAN, 0.0f, 1.0f, 300.0f, -0.25f};
  const QuantizedKV q = quantize_kv(KVFormat::kFP8, x.data(), 2, 4, DType::kBF16, {2.0f, 0.5f});
  EXPECT_EQ(q.data[0], e4m3_rne_sat(1.5f));
  EXPECT_EQ(q.data[1], 0x7E);  // 448 exactly
  EXPECT_EQ(q.data[2], 0xFE);  // saturated
  EXPECT_TRUE(std::isnan(host::e4m3_to_f32(q.data[3])));
  EXPECT_EQ(q.data[4], 0x00);
  EXPECT_EQ(q.data[5], e4m3_rne_sat(2.0f));
  EXPECT_EQ(q.data[6], 0x7E);  // 600 saturates
  EXPECT_EQ(q.data[7], e4m3_rne_sat(-0.5f));
  const std::vector<double> d = dequantize_kv(q);
  EXPECT_EQ(d[0], 3.0);
  EXPECT_EQ(d[1], 896.0);
  EXPECT_EQ(d[2], -896.0);
  EXPECT_TRUE(std::isnan(d[3]));
  EXPECT_EQ(d[5], 1.0);
  EXPECT_EQ(d[6], 224.0);
  EXPECT_EQ(d[7], -0.25);
}

TEST(AttentionReferenceQuant, Fp8RoundTripWithinHalfAnUlp) {
  std::mt19937 rng(99);
  const std::vector<float> x = bf16_normals(64 * 128, 3.0f, rng);
  const float scale = 0.0173f;
  const QuantizedKV q = quantize_kv(KVFormat::kFP8, x.data(), 64, 128, DType::kBF16, {scale});
  const std::vector<double> d = dequantize_kv(q);
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = static_cast<double>(x[i] / scale);  // what was rounded (fp32 division)
    if (std::fabs(v) >= 448) {
      EXPECT_EQ(std::fabs(d[i]), 448.0 * scale);
      continue;
    }
    EXPECT_LE(std::fabs(d[i] / scale - v), host::e4m3_half_ulp(v) * (1 + 1e-12)) << i;
  }
}

TEST(AttentionReferenceQuant, NativeRowsCopyBits) {
  std::mt19937 rng(5);
  const std::vector<float> x = bf16_normals(3 * 64, 1.0f, rng);
  const QuantizedKV b = quantize_kv(KVFormat::kNative, x.data(), 3, 64, DType::kBF16);
  ASSERT_EQ(b.row_bytes, 128);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(b.data[2 * i] | (b.data[2 * i + 1] << 8), host::f32_to_bf16(x[i]));
  const QuantizedKV h = quantize_kv(KVFormat::kNative, x.data(), 3, 64, DType::kFP16);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(h.data[2 * i] | (h.data[2 * i + 1] << 8), host::f32_to_fp16(x[i]));
  const std::vector<double> db = dequantize_kv(b), dh = dequantize_kv(h);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(db[i], x[i]);
    EXPECT_EQ(dh[i], x[i]);  // bf16 normals are exact in fp16 too
  }
}

TEST(AttentionReferenceQuant, RejectsInconsistentArguments) {
  const std::vector<float> x(64, 1.0f);
  EXPECT_THROW(quantize_kv(KVFormat::kFP8, x.data(), 1, 64), Error);
  EXPECT_THROW(quantize_kv(KVFormat::kInt4Group32, x.data(), 1, 48), Error);
  EXPECT_THROW(quantize_kv(KVFormat::kInt4, x.data(), 1, 63), Error);
  EXPECT_THROW(quantize_kv(KVFormat::kNative, x.data(), 1, 64, DType::kFP32), Error);
  EXPECT_THROW(quantize_kv(KVFormat::kInt4KChannel, x.data(), 1, 63), Error);
  EXPECT_THROW(quantize_kv(static_cast<KVFormat>(7), x.data(), 1, 64), Error);
}

// ---- per-channel keys (kInt8KChannel, kInt4KChannel) ---------------------------------------------------------

constexpr KVFormat kChannelFormats[] = {KVFormat::kInt8KChannel, KVFormat::kInt4KChannel};

// Value rows of the per-channel formats are kInt8 / kInt4 rows, byte for byte.
TEST(AttentionReferenceKeyBlocks, ValueRowsAreInt8AndInt4Rows) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const std::vector<float> x = bf16_normals(9 * 128, 2.0f, rng);
  for (const auto& [channel, row] : {std::make_pair(KVFormat::kInt8KChannel, KVFormat::kInt8),
                                     std::make_pair(KVFormat::kInt4KChannel, KVFormat::kInt4)}) {
    const QuantizedKV a = quantize_kv(channel, x.data(), 9, 128), b = quantize_kv(row, x.data(), 9, 128);
    EXPECT_EQ(a.row_bytes, b.row_bytes);
    EXPECT_EQ(a.data, b.data);
    EXPECT_EQ(a.pairs, b.pairs);
    EXPECT_EQ(dequantize_kv(a), dequantize_kv(b));
  }
}

TEST(AttentionReferenceKeyBlocks, Int4BlockByHand) {
  // D = 4, three rows. Channel 0: 0, 15, 5 (scale 1, offset 0); channel 1: 12, -3, 0 (scale 1, offset -3);
  // channel 2: constant 1 (scale 0, codes 0); channel 3: 0.5, 0.5, 8 (scale 0.5, offset 0.5).
  const std::vector<float> x = {0.0f, 12.0f, 1.0f, 0.5f, 15.0f, -3.0f, 1.0f, 0.5f, 5.0f, 0.0f, 1.0f, 8.0f};
  std::vector<uint8_t> codes(3 * 2, 0xAA);
  std::vector<uint16_t> params(8, 0xAAAA);
  quantize_key_block(KVFormat::kInt4KChannel, x.data(), 3, 4, codes.data(), params.data());
  EXPECT_EQ(params, (std::vector<uint16_t>{0x3C00, 0x3C00, 0x0000, fp16_rne_sat(0.5f),  // scales
                                           0x0000, fp16_rne_sat(-3.0f), 0x3C00, fp16_rne_sat(0.5f)}));  // offsets
  // Codes (0, 15, 0, 0), (15, 0, 0, 0), (5, 3, 0, 15): channel 2j in the low nibble of byte j.
  EXPECT_EQ(codes, (std::vector<uint8_t>{0xF0, 0x00, 0x0F, 0x00, 0x35, 0xF0}));
  std::vector<double> row(4);
  for (int r = 0; r < 3; ++r) {
    dequantize_key_row(KVFormat::kInt4KChannel, &codes[2 * r], params.data(), 4, row.data());
    for (int d = 0; d < 4; ++d) EXPECT_EQ(row[d], x[4 * r + d]) << "row " << r << " channel " << d;
  }
}

TEST(AttentionReferenceKeyBlocks, Int8BlockByHand) {
  // D = 2, three rows. Channel 0: 0, 255, 3.5 (scale 1, offset 0; 3.5 is a tie, to the even code 4); channel 1:
  // 3, 130.5, 4.25 (scale 0.5, offset 3; (4.25 - 3) / 0.5 = 2.5, a tie, to 2).
  const std::vector<float> x = {0.0f, 3.0f, 255.0f, 130.5f, 3.5f, 4.25f};
  std::vector<uint8_t> codes(6, 0xAA);
  std::vector<uint16_t> params(4, 0xAAAA);
  quantize_key_block(KVFormat::kInt8KChannel, x.data(), 3, 2, codes.data(), params.data());
  EXPECT_EQ(params, (std::vector<uint16_t>{0x3C00, fp16_rne_sat(0.5f), 0x0000, fp16_rne_sat(3.0f)}));
  EXPECT_EQ(codes, (std::vector<uint8_t>{0, 0, 255, 255, 4, 2}));
  std::vector<double> row(2);
  dequantize_key_row(KVFormat::kInt8KChannel, &codes[2], params.data(), 2, row.data());
  EXPECT_EQ(row, (std::vector<double>{255.0, 130.5}));
  dequantize_key_row(KVFormat::kInt8KChannel, &codes[4], params.data(), 2, row.data());
  EXPECT_EQ(row, (std::vector<double>{4.0, 4.0}));
}

// Unpacked codes of one row of a per-channel format.
std::vector<int> key_codes(KVFormat f, const uint8_t* row, int D) {
  std::vector<int> c(D);
  for (int d = 0; d < D; ++d) c[d] = f == KVFormat::kInt4KChannel ? (row[d / 2] >> (4 * (d % 2))) & 0xF : row[d];
  return c;
}

// Blocks of n = 1, 7, 32 rows over D = 64, 128, 256 and three magnitudes. Each channel must be quantized exactly as
// the row rule quantizes that channel's column (checked through quantize_kv of the column, repeated twice so that
// odd n gives an int4 row: the same min and max, so the same pair and codes), and dequantize within half a step
// plus the fp16 rounding of its pair.
TEST(AttentionReferenceKeyBlocks, BlocksFollowTheRowRulePerChannel) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (KVFormat f : kChannelFormats)
    for (int D : {64, 128, 256})
      for (int n : {1, 7, 32})
        for (float sigma : {1.0f, 1e-3f, 300.0f}) {
          SCOPED_TRACE(std::string(attention::kv_format_name(f)) + " D=" + std::to_string(D) + " n=" +
                       std::to_string(n) + " sigma=" + std::to_string(sigma));
          const int levels = kv_levels(f), row_bytes = kv_row_bytes(f, D);
          const KVFormat row_format = f == KVFormat::kInt8KChannel ? KVFormat::kInt8 : KVFormat::kInt4;
          std::vector<float> x = bf16_normals(int64_t{n} * D, sigma, rng);
          for (int r = 0; r < n; ++r) x[r * D + 5] = x[r * D + 5] + 10 * sigma;  // a channel far from zero
          std::vector<uint8_t> codes(n * row_bytes);
          std::vector<uint16_t> params(2 * D);
          quantize_key_block(f, x.data(), n, D, codes.data(), params.data());
          std::vector<std::vector<int>> c(n);
          std::vector<double> deq(int64_t{n} * D);
          for (int r = 0; r < n; ++r) {
            c[r] = key_codes(f, &codes[r * row_bytes], D);
            dequantize_key_row(f, &codes[r * row_bytes], params.data(), D, &deq[r * D]);
          }
          double worst_ratio = 0.0;
          int mismatches = 0;
          for (int d = 0; d < D; ++d) {
            std::vector<float> column(2 * n);
            double lo = x[d], hi = x[d];
            for (int r = 0; r < n; ++r) {
              column[r] = column[n + r] = x[r * D + d];
              lo = std::min<double>(lo, x[r * D + d]);
              hi = std::max<double>(hi, x[r * D + d]);
            }
            const QuantizedKV ref = quantize_kv(row_format, column.data(), 1, 2 * n);
            const std::vector<int> ref_codes = key_codes(f, ref.data.data(), 2 * n);
            if (params[d] != ref.pairs[0] || params[D + d] != ref.pairs[1]) ++mismatches;
            for (int r = 0; r < n; ++r) {
              if (c[r][d] != ref_codes[r]) ++mismatches;
              EXPECT_LE(c[r][d], levels);
            }
            const double scale = host::fp16_to_f32(params[d]), offset = host::fp16_to_f32(params[D + d]);
            // Past half a step only where a code clamps: at 0 (offset rounded above lo) or at the top (scale
            // rounded down). Subnormal fp16 scales (small ranges) make that slack large; elsewhere it is tiny.
            const double slack = std::fabs(offset - lo) + levels * std::fabs(scale - (hi - lo) / levels);
            const double bound = scale / 2 + slack + 1e-6 * (std::fabs(lo) + std::fabs(hi));
            for (int r = 0; r < n; ++r) {
              const double err = std::fabs(deq[r * D + d] - x[r * D + d]);
              EXPECT_LE(err, bound) << "row " << r << " channel " << d;
              if (scale > 0 && slack <= 0.01 * scale) worst_ratio = std::max(worst_ratio, err / scale);
            }
            if (n == 1) {  // one row: scale 0, code 0, the value is its fp16 rounding
              EXPECT_EQ(params[d], 0x0000);
              EXPECT_EQ(deq[d], host::fp16_to_f32(fp16_rne_sat(x[d])));
            }
          }
          EXPECT_EQ(mismatches, 0) << "pairs or codes differ from the row rule applied to the channel's column";
          EXPECT_LT(worst_ratio, 0.51);  // channels with a tiny fp16 slack: half a step, plus fp32 rounding
        }
}

// A channel 20x larger than the rest (a KIVI-style key outlier) changes nothing in the other channels of a
// per-channel block, while per-row scales stretch over it and lose the other channels' precision.
TEST(AttentionReferenceKeyBlocks, OutlierChannelLeavesTheOthersAlone) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int D = 128, n = 32, outlier = 37;
  for (KVFormat f : kChannelFormats) {
    SCOPED_TRACE(attention::kv_format_name(f));
    const std::vector<float> x = bf16_normals(int64_t{n} * D, 1.0f, rng);
    std::vector<float> y = x;
    for (int r = 0; r < n; ++r) y[r * D + outlier] = host::bf16_to_f32(host::f32_to_bf16(20.0f * y[r * D + outlier]));
    const int row_bytes = kv_row_bytes(f, D);
    std::vector<uint8_t> cx(n * row_bytes), cy(n * row_bytes);
    std::vector<uint16_t> px(2 * D), py(2 * D);
    quantize_key_block(f, x.data(), n, D, cx.data(), px.data());
    quantize_key_block(f, y.data(), n, D, cy.data(), py.data());
    // Error over the channels other than the outlier: per channel (the block) and per row (kInt8 / kInt4 rows).
    const KVFormat row_format = f == KVFormat::kInt8KChannel ? KVFormat::kInt8 : KVFormat::kInt4;
    const auto others_error = [&](const std::vector<double>& deq, const std::vector<float>& src) {
      double e = 0, r = 0;
      for (int i = 0; i < n * D; ++i)
        if (i % D != outlier) {
          e += (deq[i] - src[i]) * (deq[i] - src[i]);
          r += static_cast<double>(src[i]) * src[i];
        }
      return std::sqrt(e / r);
    };
    std::vector<double> dx(n * D), dy(n * D);
    for (int r = 0; r < n; ++r) {
      dequantize_key_row(f, &cx[r * row_bytes], px.data(), D, &dx[r * D]);
      dequantize_key_row(f, &cy[r * row_bytes], py.data(), D, &dy[r * D]);
    }
    for (int d = 0; d < D; ++d) {
      if (d == outlier) continue;
      EXPECT_EQ(px[d], py[d]) << d;
      EXPECT_EQ(px[D + d], py[D + d]) << d;
      for (int r = 0; r < n; ++r) EXPECT_EQ(dx[r * D + d], dy[r * D + d]) << "row " << r << " channel " << d;
    }
    const double channel_clean = others_error(dx, x), channel_outlier = others_error(dy, y);
    const double row_clean = others_error(dequantize_kv(quantize_kv(row_format, x.data(), n, D)), x);
    const double row_outlier = others_error(dequantize_kv(quantize_kv(row_format, y.data(), n, D)), y);
    EXPECT_EQ(channel_clean, channel_outlier);
    // Per row, the step grows with the row's range, from the ~5σ of a clean row to about 20 |x_outlier|: the error
    // grows 3-4x (over 500 seeds: at least 2.8x, for int8 and int4 alike; per channel stays 3.6x+ below per row).
    const double factor = 2.0;
    std::printf("[ outlier  ] %s: others' error per channel %.4f (with the outlier %.4f), per row %.4f -> %.4f\n",
                attention::kv_format_name(f), channel_clean, channel_outlier, row_clean, row_outlier);
    EXPECT_GT(row_outlier, factor * row_clean) << "per-row error " << row_clean << " -> " << row_outlier;
    EXPECT_LT(channel_outlier, row_outlier / factor) << "per-channel " << channel_outlier << ", per-row " << row_outlier;
  }
}

TEST(AttentionReferenceKeyBlocks, RejectsInconsistentArguments) {
  const std::vector<float> x(33 * 64, 1.0f);
  std::vector<uint8_t> codes(33 * 64);
  std::vector<uint16_t> params(2 * 64);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt8, x.data(), 4, 64, codes.data(), params.data()), Error);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt4Group32, x.data(), 4, 64, codes.data(), params.data()), Error);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt8KChannel, x.data(), 0, 64, codes.data(), params.data()), Error);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt8KChannel, x.data(), 33, 64, codes.data(), params.data()), Error);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt4KChannel, x.data(), 4, 63, codes.data(), params.data()), Error);
  EXPECT_THROW(quantize_key_block(KVFormat::kInt8KChannel, x.data(), 4, 0, codes.data(), params.data()), Error);
  std::vector<double> out(64);
  EXPECT_THROW(dequantize_key_row(KVFormat::kInt4, codes.data(), params.data(), 64, out.data()), Error);
  EXPECT_THROW(dequantize_key_row(KVFormat::kInt4KChannel, codes.data(), params.data(), 7, out.data()), Error);
  EXPECT_NO_THROW(quantize_key_block(KVFormat::kInt8KChannel, x.data(), 32, 64, codes.data(), params.data()));
}

// ---- decode --------------------------------------------------------------------------------------------------

// k / v [B=1][T_cap][HKV][D] from rows listed per token and head.
TEST(AttentionReferenceDecode, HandComputedSoftmax) {
  // D = 2, HKV = 1, HQ = 2, T_cap = 3, L = 2; the third token is NaN and must not be read.
  // q0 = (1, 0): logits 0 and ln 3 -> p = (1/4, 3/4). q1 = 0: uniform.
  const double ln3 = std::log(3.0);
  const std::vector<double> q = {1, 0, 0, 0};
  const std::vector<double> k = {0, 0, ln3, 0, NAN, NAN};
  const std::vector<double> v = {1, 2, 5, -2, NAN, NAN};
  DecodeParams p;
  p.softmax_scale = 1.0f;
  const DecodeRef r = decode_reference(q, k, v, {2}, {1, 2, 1, 2, 3}, p);
  EXPECT_NEAR(r.o[0], 4.0, 1e-14);
  EXPECT_NEAR(r.o[1], -1.0, 1e-14);
  EXPECT_NEAR(r.o[2], 3.0, 1e-14);
  EXPECT_NEAR(r.o[3], 0.0, 1e-14);
  EXPECT_NEAR(r.lse[0], std::log(4.0), 1e-14);
  EXPECT_NEAR(r.lse[1], std::log(2.0), 1e-14);
  EXPECT_EQ(r.begin[0], 0);
  EXPECT_EQ(r.end[0], 2);
}

TEST(AttentionReferenceDecode, QueryHeadsMapToKVHeadsInGroups) {
  // HQ = 4, HKV = 2, D = 1, one token: o[h] = V[0, h / 2]; q = 0 everywhere.
  const std::vector<double> q(4, 0.0), k = {1.0, -1.0}, v = {10.0, 20.0};
  const DecodeRef r = decode_reference(q, k, v, {1}, {1, 4, 2, 1, 1}, {});
  EXPECT_EQ(r.o, (std::vector<double>{10, 10, 20, 20}));
  for (double l : r.lse) EXPECT_EQ(l, 0.0);
}

TEST(AttentionReferenceDecode, DefaultScaleIsInverseSqrtD) {
  // D = 4, q = (1, 1, 1, 1), K0 = 0, K1 = (1, 1, 1, 1) · ln 2: logits 0 and 0.5 · 4 ln 2 = ln 4 -> p = (1/5, 4/5).
  const double l2 = std::log(2.0);
  const std::vector<double> q = {1, 1, 1, 1}, k = {0, 0, 0, 0, l2, l2, l2, l2};
  const std::vector<double> v = {5, 0, 0, 0, 0, 5, 0, 0};
  const DecodeRef r = decode_reference(q, k, v, {2}, {1, 1, 1, 4, 2}, {});
  EXPECT_NEAR(r.o[0], 1.0, 1e-14);
  EXPECT_NEAR(r.o[1], 4.0, 1e-14);
  EXPECT_NEAR(r.lse[0], std::log(5.0), 1e-14);
}

TEST(AttentionReferenceDecode, NewTokensAttendCausally) {
  // S = 3 new tokens of a sequence of L = 4 (positions 1, 2, 3), D = 1, q = 0: token i averages V[0 .. i + 1].
  // Window 2: token i averages V[i, i + 1]. L = 1: tokens 0 and 1 attend to nothing, token 2 to V[0].
  const std::vector<double> q(3, 0.0), k(5, 0.0), v = {2, 4, 6, 8, NAN};
  DecodeRef r = decode_reference(q, k, v, {4}, {1, 1, 1, 1, 5, 3}, {});
  EXPECT_EQ(r.o, (std::vector<double>{3, 4, 5}));
  EXPECT_EQ(r.end, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_NEAR(r.lse[0], std::log(2.0), 1e-14);
  EXPECT_NEAR(r.lse[2], std::log(4.0), 1e-14);
  DecodeParams p;
  p.window = 2;
  r = decode_reference(q, k, v, {4}, {1, 1, 1, 1, 5, 3}, p);
  EXPECT_EQ(r.o, (std::vector<double>{3, 5, 7}));
  EXPECT_EQ(r.begin, (std::vector<int64_t>{0, 1, 2}));
  r = decode_reference(q, k, v, {1}, {1, 1, 1, 1, 5, 3}, {});
  EXPECT_EQ(r.o, (std::vector<double>{0, 0, 2}));
  EXPECT_TRUE(std::isinf(r.lse[0]) && r.lse[0] < 0);
  EXPECT_TRUE(std::isinf(r.lse[1]) && r.lse[1] < 0);
  EXPECT_EQ(r.lse[2], 0.0);
}

// Token i of S equals a single-token decode over the first L - S + 1 + i keys (random data, GQA, window).
TEST(AttentionReferenceDecode, NewTokensMatchTruncatedSingleTokenDecodes) {
  const int B = 2, S = 4, HQ = 4, HKV = 2, D = 8, T = 12;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd;
  std::vector<double> q(B * S * HQ * D), k(B * T * HKV * D), v(k.size());
  for (auto* vec : {&q, &k, &v})
    for (double& x : *vec) x = nd(rng);
  const std::vector<int32_t> lens = {9, 2};
  for (int window : {0, 3}) {
    DecodeParams p;
    p.window = window;
    const DecodeRef multi = decode_reference(q, k, v, lens, {B, HQ, HKV, D, T, S}, p);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < S; ++i) {
        const std::vector<double> qi(q.begin() + (b * S + i) * HQ * D, q.begin() + (b * S + i + 1) * HQ * D);
        const std::vector<double> kb(k.begin() + b * T * HKV * D, k.begin() + (b + 1) * T * HKV * D);
        const std::vector<double> vb(v.begin() + b * T * HKV * D, v.begin() + (b + 1) * T * HKV * D);
        const int32_t li = std::max(0, lens[b] - S + 1 + i);
        const DecodeRef one = decode_reference(qi, kb, vb, {li}, {1, HQ, HKV, D, T}, p);
        for (int x = 0; x < HQ * D; ++x) EXPECT_EQ(multi.o[(b * S + i) * HQ * D + x], one.o[x]);
        for (int h = 0; h < HQ; ++h) EXPECT_EQ(multi.lse[(b * S + i) * HQ + h], one.lse[h]);
      }
  }
}

TEST(AttentionReferenceDecode, WindowKeepsTheLastKeys) {
  // D = 1, q = 0: o is the mean of the V rows in the window.
  const std::vector<double> q = {0.0}, k(6, 0.0), v = {1, 2, 3, 4, 5, NAN};
  DecodeParams p;
  p.window = 2;
  DecodeRef r = decode_reference(q, k, v, {5}, {1, 1, 1, 1, 6}, p);
  EXPECT_DOUBLE_EQ(r.o[0], 4.5);
  EXPECT_DOUBLE_EQ(r.lse[0], std::log(2.0));
  EXPECT_EQ(r.begin[0], 3);
  p.window = 1;
  r = decode_reference(q, k, v, {5}, {1, 1, 1, 1, 6}, p);
  EXPECT_DOUBLE_EQ(r.o[0], 5.0);
  p.window = 100;  // larger than L: every key
  r = decode_reference(q, k, v, {5}, {1, 1, 1, 1, 6}, p);
  EXPECT_DOUBLE_EQ(r.o[0], 3.0);
  EXPECT_EQ(r.begin[0], 0);
}

TEST(AttentionReferenceDecode, SoftcapBoundsTheLogits) {
  // Logits 0 and 10 capped at 5: 5 tanh(2).
  const std::vector<double> q = {1.0}, k = {0.0, 10.0}, v = {1.0, 0.0};
  DecodeParams p;
  p.softmax_scale = 1.0f;
  p.softcap = 5.0f;
  const DecodeRef r = decode_reference(q, k, v, {2}, {1, 1, 1, 1, 2}, p);
  const double s = 5.0 * std::tanh(2.0);
  EXPECT_NEAR(r.o[0], 1.0 / (1.0 + std::exp(s)), 1e-15);
  EXPECT_NEAR(r.lse[0], std::log(1.0 + std::exp(s)), 1e-13);
  p.softcap = 0.0f;
  const DecodeRef u = decode_reference(q, k, v, {2}, {1, 1, 1, 1, 2}, p);
  EXPECT_NEAR(u.o[0], 1.0 / (1.0 + std::exp(10.0)), 1e-15);
}

TEST(AttentionReferenceDecode, EmptyAndOverlongSequences) {
  // B = 4, T_cap = 2, D = 1: lengths 0, -5 (empty), 100 (clamps to 2), 2.
  const std::vector<double> q(4, 0.0), k(8, 0.0), v = {9, 9, 9, 9, 1, 3, 1, 3};
  const DecodeRef r = decode_reference(q, k, v, {0, -5, 100, 2}, {4, 1, 1, 1, 2}, {});
  EXPECT_EQ(r.o[0], 0.0);
  EXPECT_EQ(r.o[1], 0.0);
  EXPECT_EQ(r.lse[0], -kInf);
  EXPECT_EQ(r.lse[1], -kInf);
  EXPECT_EQ(r.end[2], 2);
  EXPECT_DOUBLE_EQ(r.o[2], 2.0);
  EXPECT_DOUBLE_EQ(r.o[3], 2.0);
  EXPECT_DOUBLE_EQ(r.lse[2], std::log(2.0));
}

TEST(AttentionReferenceDecode, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(3);
  const int B = 5, HQ = 8, HKV = 2, D = 64, T = 300;
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> q(B * HQ * D), k(B * T * HKV * D), v(k.size());
  for (double& x : q) x = n(rng);
  for (double& x : k) x = n(rng);
  for (double& x : v) x = n(rng);
  const std::vector<int32_t> lens = {0, 1, 299, 300, 1000};
  const DecodeRef a = decode_reference(q, k, v, lens, {B, HQ, HKV, D, T}, {}, 1);
  const DecodeRef b = decode_reference(q, k, v, lens, {B, HQ, HKV, D, T}, {}, 7);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
}

// ---- prefill -------------------------------------------------------------------------------------------------

// Random packed q / k / v for a varlen batch.
struct PrefillData {
  std::vector<double> q, k, v;
  std::vector<int32_t> cu_q, cu_k;
};

PrefillData prefill_data(uint64_t seed, const std::vector<int32_t>& sq, const std::vector<int32_t>& sk, int HQ, int HKV,
                         int D) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  PrefillData d;
  d.cu_q = {0};
  d.cu_k = {0};
  for (size_t b = 0; b < sq.size(); ++b) {
    d.cu_q.push_back(d.cu_q.back() + sq[b]);
    d.cu_k.push_back(d.cu_k.back() + sk[b]);
  }
  d.q.resize(static_cast<size_t>(d.cu_q.back()) * HQ * D);
  d.k.resize(static_cast<size_t>(d.cu_k.back()) * HKV * D);
  d.v.resize(d.k.size());
  for (double& x : d.q) x = n(rng);
  for (double& x : d.k) x = 1.5 * n(rng);
  for (double& x : d.v) x = n(rng);
  return d;
}

// The definition, written out with its mask for one (query row, head) at a time: softmax over the keys j of the
// sequence with (causal) j <= p and (window) p - j < window, p = Sk - Sq + i.
TEST(AttentionReferencePrefill, MatchesTheMaskedSoftmaxWrittenOut) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  const int HQ = 6, HKV = 2, D = 24;
  // Sq < Sk, Sq = Sk, an empty sequence, Sq > Sk (causal: the first rows see nothing), a single key and query.
  const std::vector<int32_t> sq = {5, 7, 0, 9, 1, 3}, sk = {12, 7, 4, 4, 1, 0};
  const PrefillData d = prefill_data(seed, sq, sk, HQ, HKV, D);
  const PrefillShape shape{static_cast<int>(sq.size()), HQ, HKV, D};
  for (const bool causal : {false, true})
    for (const int window : {0, 1, 3, 100})
      for (const float softcap : {0.0f, 2.5f}) {
        PrefillRefParams p;
        p.causal = causal;
        p.window = window;
        p.softcap = softcap;
        p.softmax_scale = window == 3 ? 0.3f : 0.0f;
        SCOPED_TRACE("causal " + std::to_string(causal) + " window " + std::to_string(window) + " softcap " +
                     std::to_string(softcap));
        const PrefillRef ref = prefill_reference(d.q, d.k, d.v, d.cu_q, d.cu_k, shape, p);
        const double scale = p.softmax_scale != 0.0f ? p.softmax_scale : 1.0 / std::sqrt(double{D});
        for (size_t b = 0; b < sq.size(); ++b)
          for (int i = 0; i < sq[b]; ++i) {
            const int64_t r = d.cu_q[b] + i, pos = int64_t{sk[b]} - sq[b] + i;
            for (int h = 0; h < HQ; ++h) {
              const int kvh = h / (HQ / HKV);
              std::vector<double> logit;
              std::vector<int64_t> keys;
              for (int64_t j = 0; j < sk[b]; ++j) {
                if (causal && j > pos) continue;
                if (window > 0 && pos - j >= window) continue;
                double x = 0.0;
                for (int e = 0; e < D; ++e)
                  x += d.q[(r * HQ + h) * D + e] * d.k[((d.cu_k[b] + j) * HKV + kvh) * D + e];
                x *= scale;
                if (softcap > 0.0f) x = softcap * std::tanh(x / softcap);
                logit.push_back(x);
                keys.push_back(j);
              }
              const double* o = &ref.o[(r * HQ + h) * D];
              if (keys.empty()) {
                EXPECT_EQ(ref.lse[r * HQ + h], -kInf) << "row " << r << " head " << h;
                for (int e = 0; e < D; ++e) EXPECT_EQ(o[e], 0.0);
                continue;
              }
              double m = -kInf, sum = 0.0;
              for (double x : logit) m = std::max(m, x);
              for (double x : logit) sum += std::exp(x - m);
              EXPECT_NEAR(ref.lse[r * HQ + h], m + std::log(sum), 1e-12) << "row " << r << " head " << h;
              for (int e = 0; e < D; ++e) {
                double want = 0.0;
                for (size_t t = 0; t < keys.size(); ++t)
                  want += std::exp(logit[t] - m) / sum * d.v[((d.cu_k[b] + keys[t]) * HKV + kvh) * D + e];
                EXPECT_NEAR(o[e], want, 1e-12) << "row " << r << " head " << h << " element " << e;
              }
            }
          }
      }
}

// Decode with S new tokens is causal prefill with Sq = S and Sk = the sequence's length (its keys in a [B, T_cap]
// cache instead of packed).
TEST(AttentionReferencePrefill, CausalPrefillOfTheLastTokensIsDecode) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  const int B = 4, HQ = 8, HKV = 2, D = 32, T = 50, S = 3;
  const std::vector<int32_t> lens = {50, 2, 17, 0};
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> q(B * S * HQ * D), k(B * T * HKV * D), v(k.size());
  for (double& x : q) x = n(rng);
  for (double& x : k) x = n(rng);
  for (double& x : v) x = n(rng);
  // The same keys packed: sequence b's first lens[b] rows; its S queries are rows [b·S, b·S + S) of q either way.
  std::vector<double> kp, vp;
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (int b = 0; b < B; ++b) {
    kp.insert(kp.end(), k.begin() + int64_t{b} * T * HKV * D, k.begin() + (int64_t{b} * T + lens[b]) * HKV * D);
    vp.insert(vp.end(), v.begin() + int64_t{b} * T * HKV * D, v.begin() + (int64_t{b} * T + lens[b]) * HKV * D);
    cu_q.push_back(cu_q.back() + S);
    cu_k.push_back(cu_k.back() + lens[b]);
  }
  for (const int window : {0, 5}) {
    DecodeParams dp;
    dp.window = window;
    dp.softcap = 3.0f;
    PrefillRefParams pp;
    pp.causal = true;
    pp.window = window;
    pp.softcap = 3.0f;
    const DecodeRef dec = decode_reference(q, k, v, lens, {B, HQ, HKV, D, T, S}, dp);
    const PrefillRef pre = prefill_reference(q, kp, vp, cu_q, cu_k, {B, HQ, HKV, D}, pp);
    EXPECT_EQ(dec.begin, pre.begin) << "window " << window;
    EXPECT_EQ(dec.end, pre.end) << "window " << window;
    ASSERT_EQ(dec.o.size(), pre.o.size());
    for (size_t i = 0; i < dec.o.size(); ++i) ASSERT_NEAR(dec.o[i], pre.o[i], 1e-13) << "element " << i;
    for (size_t i = 0; i < dec.lse.size(); ++i) EXPECT_EQ(dec.lse[i], pre.lse[i]) << "row " << i;
  }
}

TEST(AttentionReferencePrefill, RejectsInconsistentArguments) {
  const PrefillData d = prefill_data(1, {2, 3}, {4, 3}, 4, 2, 8);
  const PrefillShape shape{2, 4, 2, 8};
  EXPECT_NO_THROW(prefill_reference(d.q, d.k, d.v, d.cu_q, d.cu_k, shape, {}));
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, {1, 2, 5}, d.cu_k, shape, {}), Error);     // not from 0
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, {0, 3, 2}, d.cu_k, shape, {}), Error);     // decreasing
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, {0, 2}, d.cu_k, shape, {}), Error);        // B + 1 values
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, {0, 2, 4}, d.cu_k, shape, {}), Error);     // q's rows
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, d.cu_q, {0, 4, 8}, shape, {}), Error);     // k's rows
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, d.cu_q, d.cu_k, {2, 3, 2, 8}, {}), Error);  // HQ % HKV
  PrefillRefParams bad;
  bad.window = -1;
  EXPECT_THROW(prefill_reference(d.q, d.k, d.v, d.cu_q, d.cu_k, shape, bad), Error);
}

// ---- the check -----------------------------------------------------------------------------------------------

struct CheckFixture {
  DecodeRef ref;
  std::vector<uint16_t> o;
  std::vector<float> lse;
  CheckFixture() {
    std::mt19937 rng(8);
    std::normal_distribution<double> n(0.0, 1.0);
    const int B = 3, HQ = 4, HKV = 2, D = 32, T = 40;
    std::vector<double> q(B * HQ * D), k(B * T * HKV * D), v(k.size());
    for (double& x : q) x = n(rng);
    for (double& x : k) x = n(rng);
    for (double& x : v) x = n(rng);
    ref = decode_reference(q, k, v, {17, 0, 40}, {B, HQ, HKV, D, T}, {});
    for (double x : ref.o) o.push_back(host::f32_to_bf16(static_cast<float>(x)));
    for (double x : ref.lse) lse.push_back(static_cast<float>(x));
  }
};

TEST(AttentionReferenceCheck, AcceptsTheRoundedReference) {
  CheckFixture f;
  const DecodeCheck r = check_decode_output(f.ref, f.o, DType::kBF16, f.lse);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_LT(r.error, 3e-3);
  EXPECT_GT(r.error, 0.0);
  EXPECT_EQ(r.compared, 3 * 4 * 32);
}

TEST(AttentionReferenceCheck, FlagsNaNWrongRowsEmptyRowsAndLse) {
  {
    CheckFixture f;
    f.o[5] = 0x7FC0;  // NaN
    const DecodeCheck r = check_decode_output(f.ref, f.o, DType::kBF16, f.lse);
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(r.nonfinite, 1);
  }
  {
    CheckFixture f;
    f.o[1 * 4 * 32 + 3] = host::f32_to_bf16(1e-30f);  // sequence 1 has no keys
    const DecodeCheck r = check_decode_output(f.ref, f.o, DType::kBF16, f.lse);
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(r.empty_rows_bad, 1);
  }
  {
    CheckFixture f;
    f.lse[1 * 4 + 2] = 0.0f;  // must be -inf
    EXPECT_FALSE(check_decode_output(f.ref, f.o, DType::kBF16, f.lse).ok);
  }
  {
    CheckFixture f;
    f.lse[0] += 0.1f;
    const DecodeCheck r = check_decode_output(f.ref, f.o, DType::kBF16, f.lse);
    EXPECT_FALSE(r.ok);
    EXPECT_NEAR(r.lse_max_error, 0.1, 1e-6);
  }
  {
    // lse_rtol: the bound is max(lse_atol, lse_rtol · |expected|), per row.
    CheckFixture f;
    const double want = f.ref.lse[0];
    DecodeTolerance tol;
    tol.lse_atol = 1e-6;
    tol.lse_rtol = 1e-2;
    f.lse[0] = static_cast<float>(want + 0.9e-2 * std::fabs(want));
    EXPECT_TRUE(check_decode_output(f.ref, f.o, DType::kBF16, f.lse, tol).ok);
    f.lse[0] = static_cast<float>(want + 1.1e-2 * std::fabs(want));
    EXPECT_FALSE(check_decode_output(f.ref, f.o, DType::kBF16, f.lse, tol).ok);
    tol.lse_atol = 2e-2 * std::fabs(want);  // the larger of the two
    EXPECT_TRUE(check_decode_output(f.ref, f.o, DType::kBF16, f.lse, tol).ok);
  }
  {
    CheckFixture f;
    for (int d = 0; d < 32; ++d) f.o[2 * 4 * 32 + 32 + d] = 0;  // one row of 8 lost
    DecodeTolerance tol;
    tol.o_rtol = 1.0;
    tol.row_rtol = 2e-2;
    const DecodeCheck r = check_decode_output(f.ref, f.o, DType::kBF16, f.lse, tol);
    EXPECT_FALSE(r.ok);
    EXPECT_NEAR(r.worst_row_error, 1.0, 1e-12);
    EXPECT_FALSE(check_decode_output(f.ref, f.o, DType::kBF16, f.lse).ok);  // and the Frobenius error shows it
  }
}

TEST(AttentionReferenceCheck, StridedOutputs) {
  CheckFixture f;
  // o with rows of 40 elements and heads padded, lse transposed [HQ][B].
  const int B = 3, HQ = 4, D = 32;
  std::vector<uint16_t> o(B * HQ * 40, 0x7FC0);
  std::vector<float> lse(HQ * B);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < HQ; ++h) {
      for (int d = 0; d < D; ++d) o[(b * HQ + h) * 40 + d] = f.o[(b * HQ + h) * D + d];
      lse[h * B + b] = f.lse[b * HQ + h];
    }
  const DecodeCheck r = check_decode_output(f.ref, o.data(), DType::kBF16, HQ * 40, 40, lse.data(), 1, B);
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace tessera::reference
