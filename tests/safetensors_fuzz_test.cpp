// Fuzzing of the safetensors reader: every input, however malformed, must either parse into a
// consistent header or throw dsv4::Error — never crash, hang, read out of bounds or throw anything
// else.
//
// Built three ways (tests/fuzz.cmake): the plain GoogleTest executable (a seeded mutation loop over
// valid files, a fixed number of mutants unless DSV4_FUZZ_SECONDS asks for a time budget), the same under AddressSanitizer + UBSan, and with
// DSV4_LIBFUZZER as a libFuzzer target of parse_safetensors_header.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dsv4/safetensors.h"

namespace dsv4::fuzz {

using Bytes = std::vector<uint8_t>;

// Parses `file` as a whole safetensors file. On success, checks what the validation promises
// (entries in data order, inside the data section, not overlapping, sized numel * dtype size).
// Returns whether it parsed; a broken promise aborts, any exception but dsv4::Error escapes.
bool parse_checked(const uint8_t* file, size_t size) {
  SafetensorsHeader h;
  try {
    h = parse_safetensors_header(reinterpret_cast<const std::byte*>(file), size, "fuzz");
  } catch (const Error&) {
    return false;
  }
  const uint64_t data_size = size - h.data_offset;
  uint64_t previous_end = 0;
  for (const SafetensorsEntry& e : h.entries) {
    const bool ok = h.data_offset <= size && e.begin >= previous_end && e.begin <= e.end && e.end <= data_size &&
                    e.end - e.begin == static_cast<uint64_t>(e.numel()) * dtype_size(e.dtype);
    if (!ok) std::abort();
    previous_end = e.end;
  }
  return true;
}

}  // namespace dsv4::fuzz

#ifdef DSV4_LIBFUZZER

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsv4::fuzz::parse_checked(data, size);
  return 0;
}

#else

#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>

namespace dsv4::fuzz {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// xorshift64*: small, seeded, the same sequence everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545f4914f6cdd1dull;
  }
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }
  bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }

 private:
  uint64_t state_;
};

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), {});
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("dsv4_fuzz_" + std::to_string(::getpid()) + "_" + name)).string();
}

// Valid files to mutate: written by SafetensorsWriter, with checkpoint-like names, every dtype,
// empty and scalar tensors, metadata.
std::vector<Bytes> seed_files() {
  std::vector<Bytes> seeds;
  const std::string path = temp_path("seed.safetensors");
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::e4m3, DType::ue8m0,
                          DType::u8,  DType::i8,   DType::i32, DType::i64, DType::bool_};
  for (int variant = 0; variant < 6; ++variant) {
    Rng rng(100 + variant);
    SafetensorsWriter w;
    const int tensors = 1 + variant * 3;
    for (int t = 0; t < tensors; ++t) {
      const DType dtype = dtypes[rng.below(std::size(dtypes))];
      std::vector<int64_t> shape;
      for (size_t d = rng.below(4); d > 0; --d) shape.push_back(static_cast<int64_t>(rng.below(6)));
      HostTensor tensor(dtype, shape);
      for (size_t i = 0; i < tensor.nbytes(); ++i) static_cast<uint8_t*>(tensor.data())[i] = static_cast<uint8_t>(rng.next());
      w.add("layers." + std::to_string(t) + (t % 2 ? ".self_attn.q_a_proj.weight" : ".attn.wkv.scale"), tensor);
    }
    if (variant % 2) w.set_metadata("format", "pt");
    w.write(path);
    seeds.push_back(read_bytes(path));
  }
  fs::remove(path);
  return seeds;
}

void set_length(Bytes& file, uint64_t length) {
  if (file.size() < 8) file.resize(8);
  for (int i = 0; i < 8; ++i) file[i] = static_cast<uint8_t>(length >> (8 * i));
}

uint64_t header_length(const Bytes& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[i];
  return n;
}

// A JSON value a fuzzer would like to put where a number, a string or an array belongs.
json odd_value(Rng& rng) {
  switch (rng.below(10)) {
    case 0: return -static_cast<int64_t>(rng.below(100)) - 1;
    case 1: return rng.next();                          // up to 2^64 - 1
    case 2: return static_cast<int64_t>(rng.below(64));
    case 3: return 2.5;
    case 4: return "F8_E5M2";
    case 5: return json::array({rng.below(16), rng.below(16)});
    case 6: return json::object();
    case 7: return nullptr;
    case 8: return json::array({json::array({1})});
    default: return "BF16";
  }
}

// Structural edits of a valid header: odd values in dtype/shape/offsets/metadata, removed keys,
// duplicated or swapped offsets. The data section is kept.
void edit_json(Bytes& file, Rng& rng) {
  const uint64_t n = header_length(file);
  json h = json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  std::vector<std::string> names;
  for (const auto& [name, value] : h.items())
    if (name != "__metadata__") names.push_back(name);
  if (names.empty() || rng.chance(10)) {
    h["__metadata__"] = json::object({{"k", odd_value(rng)}});
  } else {
    json& entry = h[names[rng.below(names.size())]];
    const char* keys[] = {"dtype", "shape", "data_offsets"};
    const char* key = keys[rng.below(3)];
    switch (rng.below(5)) {
      case 0: entry[key] = odd_value(rng); break;
      case 1: entry.erase(key); break;
      case 2:
        if (entry[key].is_array() && !entry[key].empty()) entry[key][rng.below(entry[key].size())] = odd_value(rng);
        break;
      case 3: entry["data_offsets"] = h[names[rng.below(names.size())]]["data_offsets"]; break;
      default: h[names[0] + "_copy"] = entry; break;
    }
  }
  const std::string text = h.dump();
  Bytes out(8);
  set_length(out, text.size());
  out.insert(out.end(), text.begin(), text.end());
  out.insert(out.end(), file.begin() + 8 + static_cast<std::ptrdiff_t>(n), file.end());
  file = std::move(out);
}

// One random byte-level or JSON-level mutation.
void mutate(Bytes& file, const std::vector<Bytes>& seeds, Rng& rng) {
  static const uint8_t kInteresting[] = {0, 0xff, '"', '{', '}', '[', ']', ',', ':', '-', '9', ' ', '\\', 0x80};
  const size_t header_end = std::min<size_t>(file.size(), 8 + std::min<uint64_t>(header_length(file), file.size()));
  // Mostly inside the length field and the header, where the parser looks.
  const auto position = [&] { return rng.chance(85) && header_end > 0 ? rng.below(header_end) : rng.below(file.size()); };
  if (file.empty()) {
    file.push_back(static_cast<uint8_t>(rng.next()));
    return;
  }
  switch (rng.below(8)) {
    case 0: file[position()] ^= static_cast<uint8_t>(1u << rng.below(8)); break;
    case 1: file[position()] = kInteresting[rng.below(std::size(kInteresting))]; break;
    case 2: file.resize(rng.below(file.size())); break;
    case 3: {  // splice header bytes of another seed over this file's header
      const Bytes& other = seeds[rng.below(seeds.size())];
      const size_t from = rng.below(other.size()), to = position();
      const size_t len = std::min({rng.below(64) + 1, other.size() - from, file.size() - to});
      std::copy_n(other.begin() + static_cast<std::ptrdiff_t>(from), len, file.begin() + static_cast<std::ptrdiff_t>(to));
      break;
    }
    case 4: {  // insert or delete header bytes, keeping the length field consistent half the time
      const size_t at = std::max<size_t>(8, std::min(position(), header_end));
      if (at > file.size()) break;
      if (rng.chance(50)) {
        file.insert(file.begin() + static_cast<std::ptrdiff_t>(at), kInteresting[rng.below(std::size(kInteresting))]);
        if (rng.chance(50)) set_length(file, header_length(file) + 1);
      } else if (at < file.size()) {
        file.erase(file.begin() + static_cast<std::ptrdiff_t>(at));
        if (rng.chance(50) && header_length(file) > 0) set_length(file, header_length(file) - 1);
      }
      break;
    }
    case 5: {  // length field: random, off by a little, or absurd
      const uint64_t n = header_length(file);
      const uint64_t choices[] = {rng.next(), n + 1, n - 1, n + rng.below(16), file.size(), 0, ~0ull};
      set_length(file, choices[rng.below(std::size(choices))]);
      break;
    }
    default:
      if (parse_checked(file.data(), file.size())) edit_json(file, rng);
      else file[position()] ^= static_cast<uint8_t>(rng.next());
      break;
  }
}

// By default a fixed number of mutants from a fixed seed, so every run tests the same inputs;
// DSV4_FUZZ_SEED picks another seed (a failure prints seed and iteration), DSV4_FUZZ_SECONDS=<s>
// is the long local mode: as many mutants as fit.
double fuzz_seconds() {
  const char* s = std::getenv("DSV4_FUZZ_SECONDS");
  return s ? std::atof(s) : 0.0;
}
uint64_t fuzz_seed() {
  const char* s = std::getenv("DSV4_FUZZ_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 20261129;
}
constexpr int64_t kDefaultFuzzIterations = 20000;

TEST(SafetensorsFuzz, SeedCorpusIsValid) {
  // Also the seed corpus of the libFuzzer target: written where DSV4_FUZZ_CORPUS_DIR points.
  const char* dir = std::getenv("DSV4_FUZZ_CORPUS_DIR");
  if (dir) fs::create_directories(dir);
  const std::vector<Bytes> seeds = seed_files();
  for (size_t i = 0; i < seeds.size(); ++i) {
    EXPECT_TRUE(parse_checked(seeds[i].data(), seeds[i].size())) << "seed " << i;
    if (dir) write_bytes((fs::path(dir) / ("seed_" + std::to_string(i) + ".safetensors")).string(), seeds[i]);
  }
}

TEST(SafetensorsFuzz, MutatedFilesParseOrFailWithDsv4Error) {
  const std::vector<Bytes> seeds = seed_files();
  const std::string path = temp_path("mutant.safetensors");
  const uint64_t seed = fuzz_seed();
  const double seconds = fuzz_seconds();
  Rng rng(seed);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int64_t iterations = 0, parsed = 0, opened = 0;
  while (seconds > 0 ? std::chrono::steady_clock::now() < deadline : iterations < kDefaultFuzzIterations) {
    Bytes file = seeds[rng.below(seeds.size())];
    for (size_t m = 1 + rng.below(4); m > 0; --m) mutate(file, seeds, rng);
    ++iterations;
    try {
      parsed += parse_checked(file.data(), file.size()) ? 1 : 0;
      // Now and then the whole reader: mmap, every tensor copied and converted.
      if (iterations % 16 == 0) {
        write_bytes(path, file);
        try {
          const auto f = SafetensorsFile::open(path);
          for (const SafetensorsEntry& e : f->header().entries) {
            const HostTensor copy = f->read(e.name);
            const HostTensor as_f32 = f->read_as(e.name, DType::f32);
            ASSERT_EQ(as_f32.numel(), copy.numel());
          }
          ++opened;
        } catch (const Error&) {
        }
      }
    } catch (const std::exception& e) {
      write_bytes(temp_path("failure.safetensors"), file);
      FAIL() << "seed " << seed << " iteration " << iterations << " threw a non-dsv4 exception: " << e.what() << " (input saved to "
             << temp_path("failure.safetensors") << ")";
    }
  }
  fs::remove(path);
  std::printf("fuzz: %lld inputs, %lld parsed, %lld opened through the file reader\n",
              static_cast<long long>(iterations), static_cast<long long>(parsed), static_cast<long long>(opened));
  // The mutations must reach both outcomes, or the loop tests less than it claims.
  EXPECT_GT(iterations, 1000);
  EXPECT_GT(parsed, iterations / 100);
  EXPECT_LT(parsed, iterations);
}

}  // namespace
}  // namespace dsv4::fuzz

#endif
