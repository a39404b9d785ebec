// safetensors reader / writer / sharded checkpoints: valid round trips and every malformed case.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dsv4/safetensors.h"
#include "test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;


std::vector<std::byte> file_bytes(const std::string& header, size_t data_bytes) {
  std::vector<std::byte> bytes(8 + header.size() + data_bytes, std::byte{0x5a});
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<std::byte>((header.size() >> (8 * i)) & 0xff);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

void write_file(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Expects parse_safetensors_header to throw a dsv4::Error whose message contains `needle`.
void expect_header_error(const std::string& header, size_t data_bytes, const std::string& needle) {
  const auto bytes = file_bytes(header, data_bytes);
  try {
    parse_safetensors_header(bytes.data(), bytes.size(), "case.safetensors");
    ADD_FAILURE() << "header accepted: " << header;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dsv4: safetensors: case.safetensors: "), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "message '" << msg << "' lacks '" << needle << "'";
  }
}

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

// Independent decoders for the read_as checks.
float decode_bf16(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float decode_f16(uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent == 31) return mantissa ? std::nanf("") : (sign ? -INFINITY : INFINITY);
  const float magnitude =
      exponent == 0 ? std::ldexp(mantissa / 1024.0f, -14) : std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15);
  return sign ? -magnitude : magnitude;
}
float decode_e4m3(uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 3) & 0xf, mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::nanf("");
  const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return sign ? -magnitude : magnitude;
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t(dtype, std::move(shape));
  auto* bytes = static_cast<uint8_t*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(rng());
  return t;
}

TEST(Safetensors, WriterRoundTripKeepsBytesShapesAndMetadata) {
  TempDir dir;
  std::mt19937_64 rng(7);
  HostTensor f32(DType::f32, {3, 5});
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < f32.numel(); ++i) f32.as<float>()[i] = normal(rng);
  HostTensor bf16 = random_tensor(DType::bf16, {4, 3}, rng);
  for (int64_t i = 0; i < bf16.numel(); ++i) bf16.as<uint16_t>()[i] &= 0xbfff;  // finite values only
  HostTensor i64 = random_tensor(DType::i64, {2}, rng);
  HostTensor u8 = random_tensor(DType::u8, {7}, rng);  // odd size: later tensors unaligned
  HostTensor e4m3 = random_tensor(DType::e4m3, {2, 8}, rng);
  HostTensor f16 = random_tensor(DType::f16, {64}, rng);
  f16.as<uint16_t>()[0] = 0x0001;  // the smallest subnormal
  f16.as<uint16_t>()[1] = 0xfc00;  // -inf
  HostTensor ue8m0 = random_tensor(DType::ue8m0, {9}, rng);
  ue8m0.as<uint8_t>()[0] = 1;
  ue8m0.as<uint8_t>()[1] = 254;
  HostTensor empty(DType::f32, {0, 4});
  HostTensor scalar(DType::f64, {});
  scalar.as<double>()[0] = 2.5;

  SafetensorsWriter writer;
  writer.add("b.f32", f32);
  writer.add("a.bf16", bf16);
  writer.add("z.i64", i64);
  writer.add("c.u8", u8);
  writer.add("d.e4m3", e4m3);
  writer.add("e.empty", empty);
  writer.add("f.scalar", scalar);
  writer.add("g.f16", f16);
  writer.add("h.ue8m0", ue8m0);
  writer.set_metadata("format", "pt");
  writer.write(dir.file("t.safetensors"));
  EXPECT_FALSE(fs::exists(dir.file("t.safetensors.partial")));

  auto file = SafetensorsFile::open(dir.file("t.safetensors"));
  EXPECT_EQ(file->header().data_offset % 8, 0u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->header().entries.size(), 9u);
  // The writer lays tensors out sorted by name; entries come back in data order.
  std::vector<std::string> order;
  for (const auto& e : file->header().entries) order.push_back(e.name);
  EXPECT_EQ(order, (std::vector<std::string>{"a.bf16", "b.f32", "c.u8", "d.e4m3", "e.empty", "f.scalar", "g.f16",
                                             "h.ue8m0", "z.i64"}));

  for (const auto& [name, original] : std::vector<std::pair<std::string, const HostTensor*>>{
           {"b.f32", &f32}, {"a.bf16", &bf16}, {"z.i64", &i64}, {"c.u8", &u8}, {"d.e4m3", &e4m3},
           {"e.empty", &empty}, {"f.scalar", &scalar}, {"g.f16", &f16}, {"h.ue8m0", &ue8m0}}) {
    const HostTensor back = file->read(name);
    EXPECT_EQ(back.dtype(), original->dtype()) << name;
    EXPECT_EQ(back.shape(), original->shape()) << name;
    ASSERT_EQ(back.nbytes(), original->nbytes()) << name;
    EXPECT_EQ(std::memcmp(back.data(), original->data(), back.nbytes()), 0) << name;
    const TensorView v = file->view(name);
    EXPECT_EQ(v.numel(), original->numel()) << name;
    EXPECT_EQ(std::memcmp(v.data, original->data(), original->nbytes()), 0) << name;
  }

  const HostTensor bf16_f = file->read_as("a.bf16", DType::f32);
  for (int64_t i = 0; i < bf16.numel(); ++i)
    EXPECT_EQ(bf16_f.as<float>()[i], decode_bf16(bf16.as<uint16_t>()[i])) << i;
  const HostTensor e4m3_f = file->read_as("d.e4m3", DType::f32);
  for (int64_t i = 0; i < e4m3.numel(); ++i) {
    const float want = decode_e4m3(e4m3.as<uint8_t>()[i]);
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(e4m3_f.as<float>()[i])) << i;
    else
      EXPECT_EQ(e4m3_f.as<float>()[i], want) << i;
  }
  const HostTensor f16_f = file->read_as("g.f16", DType::f32);
  for (int64_t i = 0; i < f16.numel(); ++i) {
    const float want = decode_f16(f16.as<uint16_t>()[i]);
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(f16_f.as<float>()[i])) << i;
    else
      EXPECT_EQ(f16_f.as<float>()[i], want) << i;
  }
  const HostTensor ue8m0_f = file->read_as("h.ue8m0", DType::f32);
  for (int64_t i = 0; i < ue8m0.numel(); ++i) {
    const uint8_t b = ue8m0.as<uint8_t>()[i];
    if (b == 255)
      EXPECT_TRUE(std::isnan(ue8m0_f.as<float>()[i])) << i;
    else
      EXPECT_EQ(ue8m0_f.as<float>()[i], std::ldexp(1.0f, b - 127)) << i;
  }
  const HostTensor i64_f = file->read_as("z.i64", DType::f32);
  for (int64_t i = 0; i < i64.numel(); ++i)
    EXPECT_EQ(i64_f.as<float>()[i], static_cast<float>(i64.as<int64_t>()[i]));
  EXPECT_EQ(file->read_as("f.scalar", DType::f32).as<float>()[0], 2.5f);
  EXPECT_EQ(file->read_as("b.f32", DType::f32).nbytes(), f32.nbytes());

  expect_error([&] { file->read_as("b.f32", DType::bf16); }, "can be read as itself or as F32, not as BF16");
  expect_error([&] { file->at("nope"); }, "no tensor named 'nope'");
  EXPECT_EQ(file->find("nope"), nullptr);
}

TEST(Safetensors, HeaderPaddingIsSpaces) {
  TempDir dir;
  SafetensorsWriter writer;
  HostTensor t(DType::u8, {3});
  writer.add("x", t);
  writer.write(dir.file("p.safetensors"));
  std::ifstream in(dir.file("p.safetensors"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  EXPECT_EQ((8 + len) % 8, 0u);
  const std::string header(bytes.data() + 8, len);
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  EXPECT_EQ(bytes.size(), 8 + len + 3);
}

TEST(Safetensors, WriterRejectsInvalidInput) {
  SafetensorsWriter writer;
  HostTensor t(DType::f32, {2});
  writer.add("x", t);
  expect_error([&] { writer.add("x", t); }, "tensor 'x' added twice");
  expect_error([&] { writer.add("__metadata__", t); }, "invalid tensor name '__metadata__'");
  expect_error([&] { writer.add("y", DType::f32, {3}, t.data(), t.nbytes()); }, "needs 12 bytes, given 8");
  expect_error([&] { writer.add("y", DType::e2m1x2, {8}, t.data(), 8); }, "which safetensors cannot store");
  TempDir dir;
  expect_error([&] { writer.write(dir.file("missing_dir/x.safetensors")); }, "cannot create");
}

TEST(Safetensors, MalformedHeadersNameTheProblem) {
  const std::string ok_entry = R"("t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]})";
  // The reference valid case, so that the cases below fail for their own reason only.
  const auto good = file_bytes("{" + ok_entry + "}", 16);
  EXPECT_EQ(parse_safetensors_header(good.data(), good.size(), "ok").entries.size(), 1u);

  expect_header_error("{" + ok_entry + "}", 15, "past the end of the data section (15 bytes)");
  expect_header_error("{\"t\": ", 0, "header is not valid JSON");
  expect_header_error("[1, 2]", 0, "header is a JSON array, expected an object");
  expect_header_error(R"({"t": [1]})", 0, "tensor 't' has a header entry of JSON type array");
  expect_header_error(R"({"t": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}})", 2,
                      "unknown dtype 'F8_E5M2'");
  expect_header_error(R"({"t": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}})", 8, "dtype of JSON type number");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8,
                      "not a non-negative integer");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", 8,
                      "not a non-negative integer");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})", 8, "shape of JSON type string");
  expect_header_error(R"({"t": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8,
                      "element count overflows 64 bits");
  expect_header_error(R"({"t": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 8]}})", 8,
                      "byte size overflows 64 bits");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}})", 8,
                      "expected [begin, end]");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", 8,
                      "that are not non-negative integers");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", 8, "begin after end");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [100, 108]}})", 8,
                      "past the end of the data section (8 bytes)");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
                      "spanning 8 bytes, but F32 [3] needs 12");
  expect_header_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                      12, "tensors 'a' [0, 8) and 'b' [4, 12) overlap");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                      16, "header names 't' twice");
  expect_header_error(R"({"__metadata__": {"format": 1}})", 0, "__metadata__ value of 'format' is a JSON number");
  expect_header_error(R"({"__metadata__": ["pt"]})", 0, "__metadata__ is a JSON array");
  expect_header_error(R"({"t": {"shape": [2], "data_offsets": [0, 8]}})", 8, "tensor 't' has no 'dtype'");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", 8,
                      "unexpected key 'x'");
  expect_header_error(R"({"t": {"dtype": "F32", "shape": [[2]], "data_offsets": [0, 8]}})", 8, "nests deeper");
  expect_header_error(std::string(10000, '[') + std::string(10000, ']'), 0, "nests deeper");
}

TEST(Safetensors, MalformedLengthFieldAndTruncatedFiles) {
  std::vector<std::byte> tiny(5, std::byte{1});
  expect_error([&] { parse_safetensors_header(tiny.data(), tiny.size(), "tiny"); }, "file is 5 bytes, too short");

  auto bytes = file_bytes("{}", 0);
  bytes[0] = std::byte{0x40};  // length 64, only 2 header bytes follow
  expect_error([&] { parse_safetensors_header(bytes.data(), bytes.size(), "len"); },
               "header length 64 runs past the end of the file (2 bytes follow");
  for (int i = 0; i < 8; ++i) bytes[i] = std::byte{0xff};
  expect_error([&] { parse_safetensors_header(bytes.data(), bytes.size(), "len"); },
               "header length 18446744073709551615 runs past the end");

  // The same problems through the file reader.
  TempDir dir;
  write_file(dir.file("short.safetensors"), tiny);
  expect_error([&] { SafetensorsFile::open(dir.file("short.safetensors")); }, "too short for the 8-byte header length");
  auto truncated = file_bytes(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 16);
  truncated.resize(truncated.size() - 1);
  write_file(dir.file("cut.safetensors"), truncated);
  expect_error([&] { SafetensorsFile::open(dir.file("cut.safetensors")); },
               "tensor 't' has data_offsets [0, 16] past the end of the data section (15 bytes)");
  expect_error([&] { SafetensorsFile::open(dir.file("absent.safetensors")); }, "cannot open");
  expect_error([&] { SafetensorsFile::open(dir.file("")); }, "is not a regular file");
}

// Writes two shards and their index; returns the index path.
std::string write_sharded(const TempDir& dir, const std::string& weight_map_json) {
  HostTensor a(DType::f32, {2}), b(DType::bf16, {3}), c(DType::i32, {1});
  a.as<float>()[0] = 1.5f;
  a.as<float>()[1] = -2.0f;
  SafetensorsWriter s1, s2;
  s1.add("a", a);
  s1.add("b", b);
  s2.add("c", c);
  s1.write(dir.file("m-1.safetensors"));
  s2.write(dir.file("m-2.safetensors"));
  std::ofstream(dir.file("model.safetensors.index.json")) << R"({"metadata": {}, "weight_map": )" << weight_map_json
                                                          << "}";
  return dir.file("model.safetensors.index.json");
}

TEST(Safetensors, ShardedCheckpointsResolveNamesThroughTheIndex) {
  TempDir dir;
  const std::string index = write_sharded(dir, R"({"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"})");
  for (const std::string& path : {index, dir.file("")}) {  // the index itself, or its directory
    const Checkpoint ckpt = Checkpoint::open(path);
    EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_EQ(ckpt.files().size(), 2u);
    const auto [file, entry] = ckpt.find("a");
    EXPECT_EQ(fs::path(file->path()).filename(), "m-1.safetensors");
    EXPECT_EQ(file->read_as("a", DType::f32).as<float>()[1], -2.0f);
    EXPECT_EQ(entry->shape, (std::vector<int64_t>{2}));
    EXPECT_EQ(fs::path(ckpt.find("c").first->path()).filename(), "m-2.safetensors");
    EXPECT_TRUE(ckpt.contains("b"));
    EXPECT_FALSE(ckpt.contains("d"));
    expect_error([&] { ckpt.find("d"); }, "has no tensor named 'd'");
  }
  const Checkpoint single = Checkpoint::open(dir.file("m-2.safetensors"));
  EXPECT_EQ(single.names(), (std::vector<std::string>{"c"}));
}

TEST(Safetensors, ShardedCheckpointErrors) {
  {
    TempDir dir;
    write_sharded(dir, R"({"a": "m-1.safetensors", "c": "m-3.safetensors"})");
    expect_error([&] { Checkpoint::open(dir.file("model.safetensors.index.json")); },
                 "shard '" + dir.file("m-3.safetensors") + "' (holding 'c') does not exist");
  }
  {
    TempDir dir;
    write_sharded(dir, R"({"a": "m-1.safetensors", "c": "m-1.safetensors"})");
    expect_error([&] { Checkpoint::open(dir.file("model.safetensors.index.json")); },
                 "maps tensor 'c' to shard 'm-1.safetensors', which does not contain it");
  }
  {
    TempDir dir;
    write_sharded(dir, R"({"a": 3})");
    expect_error([&] { Checkpoint::open(dir.file("model.safetensors.index.json")); },
                 "weight_map entry 'a' is a JSON number");
  }
  {
    TempDir dir;
    std::ofstream(dir.file("x.json")) << R"({"weight_map": )";
    expect_error([&] { Checkpoint::open(dir.file("x.json")); }, "is not valid JSON");
    std::ofstream(dir.file("y.json")) << R"({"metadata": {}})";
    expect_error([&] { Checkpoint::open(dir.file("y.json")); }, "has no 'weight_map' object");
    expect_error([&] { Checkpoint::open(dir.file("")); }, "holds neither model.safetensors.index.json nor");
  }
}

TEST(Safetensors, GoldenCheckpointsOpen) {
  const std::string golden = std::string(DSV4_TEST_DATA_DIR) + "/golden/";
  const Checkpoint v40 = Checkpoint::open(golden + "v40a.weights.safetensors");
  EXPECT_EQ(v40.names().size(), 38u);
  const auto [file, entry] = v40.find("layers.2.self_attn.compressor.position_bias");
  EXPECT_EQ(entry->dtype, DType::bf16);
  EXPECT_EQ(entry->shape, (std::vector<int64_t>{16, 512}));
  const HostTensor bias = file->read_as(entry->name, DType::f32);
  const TensorView raw = file->view(entry->name);
  for (int64_t i = 0; i < bias.numel(); i += 97) {
    uint16_t bits;
    std::memcpy(&bits, static_cast<const char*>(raw.data) + 2 * i, 2);
    EXPECT_EQ(bias.as<float>()[i], decode_bf16(bits));
  }

  const Checkpoint v41 = Checkpoint::open(golden + "v41a.weights.index.json");
  EXPECT_EQ(v41.files().size(), 2u);
  EXPECT_TRUE(v41.contains("layers.4.attn.indexer.wq_b.weight"));
  EXPECT_EQ(v41.find("layers.1.attn.compressor.wgate.weight").second->dtype, DType::f32);
}

}  // namespace
}  // namespace dsv4
