// safetensors reader (validated header, read-only mmap), sharded checkpoints and writer.
#include "dsv4/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dsv4/numeric.h"

namespace dsv4 {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The upstream format caps the header at 100 MB; anything larger is a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// A safetensors header nests at most three levels: {name: {"shape": [dims]}}.
constexpr int kMaxHeaderDepth = 3;

struct DTypeName {
  const char* name;
  DType dtype;
};
// The dtypes this reader accepts (safetensors names).
constexpr DTypeName kDTypeNames[] = {
    {"F64", DType::f64},       {"F32", DType::f32},        {"F16", DType::f16},
    {"BF16", DType::bf16},     {"F8_E4M3", DType::e4m3},   {"F8_E8M0", DType::ue8m0},
    {"U8", DType::u8},         {"I8", DType::i8},          {"I32", DType::i32},
    {"I64", DType::i64},       {"BOOL", DType::bool_},
};

std::optional<DType> parse_dtype(const std::string& name) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : kDTypeNames) s += std::string(s.empty() ? "" : ", ") + d.name;
  return s;
}

bool is_safetensors_dtype(DType t) {
  return std::any_of(std::begin(kDTypeNames), std::end(kDTypeNames),
                     [t](const DTypeName& d) { return d.dtype == t; });
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// A JSON integer as a non-negative uint64 (no floats, no negatives).
std::optional<uint64_t> as_unsigned(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

SafetensorsEntry parse_entry(const std::string& name, const json& info, const std::string& source) {
  const auto bad = [&](auto&&... parts) {
    fail("safetensors: ", source, ": tensor '", name, "' ", parts...);
  };
  if (!info.is_object()) bad("has a header entry of JSON type ", info.type_name(), ", expected an object");
  for (const auto& [key, value] : info.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad("has an unexpected key '", key, "' (expected dtype, shape, data_offsets)");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!info.contains(key)) bad("has no '", key, "'");

  SafetensorsEntry e;
  e.name = name;
  const json& dtype = info["dtype"];
  if (!dtype.is_string()) bad("has a dtype of JSON type ", dtype.type_name(), ", expected a string");
  const auto parsed = parse_dtype(dtype.get<std::string>());
  if (!parsed) bad("has unknown dtype '", dtype.get<std::string>(), "' (supported: ", supported_dtypes(), ")");
  e.dtype = *parsed;

  const json& shape = info["shape"];
  if (!shape.is_array()) bad("has a shape of JSON type ", shape.type_name(), ", expected an array");
  int64_t numel = 1;
  for (const json& dim : shape) {
    const auto d = as_unsigned(dim);
    if (!d) bad("has shape ", shape.dump(), " with an entry that is not a non-negative integer");
    if (*d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, static_cast<int64_t>(*d), &numel))
      bad("has shape ", shape.dump(), " whose element count overflows 64 bits");
    e.shape.push_back(static_cast<int64_t>(*d));
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(e.dtype), &nbytes))
    bad("has shape ", shape.dump(), " whose byte size overflows 64 bits");

  const json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    bad("has data_offsets ", offsets.dump(), ", expected [begin, end]");
  const auto begin = as_unsigned(offsets[0]);
  const auto end = as_unsigned(offsets[1]);
  if (!begin || !end) bad("has data_offsets ", offsets.dump(), " that are not non-negative integers");
  if (*begin > *end) bad("has data_offsets ", offsets.dump(), " with begin after end");
  e.begin = *begin;
  e.end = *end;
  if (e.end - e.begin != nbytes)
    bad("has data_offsets ", offsets.dump(), " spanning ", e.end - e.begin, " bytes, but ", dtype_name(e.dtype),
        " ", shape_string(e.shape), " needs ", nbytes);
  return e;
}

// IEEE half precision (only checkpoints use it; numeric.h covers the formats of the math).
float f16_bits_to_float(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent == 0)  // zero or subnormal: mantissa * 2^-24, exact in fp32
    return float_from_bits(sign | float_bits(static_cast<float>(mantissa) * 0x1p-24f));
  return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Element i of a tensor of dtype `t` at `p` (any alignment), as a float.
float element_as_float(DType t, const std::byte* p, int64_t i) {
  const auto load = [&](auto tag) {
    decltype(tag) v;
    std::memcpy(&v, p + i * static_cast<int64_t>(sizeof v), sizeof v);
    return v;
  };
  switch (t) {
    case DType::f32: return load(float{});
    case DType::f64: return static_cast<float>(load(double{}));
    case DType::bf16: return bf16_bits_to_float(load(uint16_t{}));
    case DType::f16: return f16_bits_to_float(load(uint16_t{}));
    case DType::e4m3: return e4m3_to_float(load(uint8_t{}));
    case DType::ue8m0: return ue8m0_to_float(load(uint8_t{}));
    case DType::u8: case DType::bool_: return static_cast<float>(load(uint8_t{}));
    case DType::i8: return static_cast<float>(load(int8_t{}));
    case DType::i32: return static_cast<float>(load(int32_t{}));
    case DType::i64: return static_cast<float>(load(int64_t{}));
    case DType::e2m1x2: break;
  }
  fail("safetensors: cannot convert ", dtype_name(t), " to F32");
}

// Closes a file descriptor on every path out of SafetensorsFile::open.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsHeader parse_safetensors_header(const std::byte* file, size_t file_size, const std::string& source) {
  DSV4_CHECK(file_size >= 8, "safetensors: ", source, ": file is ", file_size,
             " bytes, too short for the 8-byte header length");
  const uint64_t header_len = read_le64(file);
  DSV4_CHECK(header_len <= file_size - 8, "safetensors: ", source, ": header length ", header_len,
             " runs past the end of the file (", file_size - 8, " bytes follow the length field)");
  DSV4_CHECK(header_len <= kMaxHeaderBytes, "safetensors: ", source, ": header length ", header_len,
             " exceeds the format's limit of ", kMaxHeaderBytes, " bytes");

  const char* text = reinterpret_cast<const char*>(file + 8);
  std::set<std::string> seen_names;
  std::string duplicate;
  // Rejects nesting deeper than a valid header and remembers repeated tensor names (the JSON
  // library would silently keep the last one).
  const json::parser_callback_t check_structure = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxHeaderDepth)
      fail("safetensors: ", source, ": header nests deeper than ", kMaxHeaderDepth,
           " levels, which no valid header does");
    if (event == json::parse_event_t::key && depth == 1 && !seen_names.insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  json root;
  try {
    root = json::parse(text, text + header_len, check_structure);
  } catch (const json::exception& e) {
    fail("safetensors: ", source, ": header is not valid JSON: ", e.what());
  }
  DSV4_CHECK(root.is_object(), "safetensors: ", source, ": header is a JSON ", root.type_name(),
             ", expected an object");
  DSV4_CHECK(duplicate.empty(), "safetensors: ", source, ": header names '", duplicate, "' twice");

  SafetensorsHeader header;
  header.data_offset = 8 + header_len;
  const uint64_t data_size = file_size - header.data_offset;
  for (const auto& [name, info] : root.items()) {
    if (name == "__metadata__") {
      DSV4_CHECK(info.is_object(), "safetensors: ", source, ": __metadata__ is a JSON ", info.type_name(),
                 ", expected an object of strings");
      for (const auto& [key, value] : info.items()) {
        DSV4_CHECK(value.is_string(), "safetensors: ", source, ": __metadata__ value of '", key, "' is a JSON ",
                   value.type_name(), ", expected a string");
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e = parse_entry(name, info, source);
    DSV4_CHECK(e.end <= data_size, "safetensors: ", source, ": tensor '", name, "' has data_offsets [", e.begin, ", ",
               e.end, "] past the end of the data section (", data_size, " bytes)");
    header.entries.push_back(std::move(e));
  }
  std::sort(header.entries.begin(), header.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < header.entries.size(); ++i) {
    const SafetensorsEntry& prev = header.entries[i - 1];
    const SafetensorsEntry& cur = header.entries[i];
    DSV4_CHECK(cur.begin >= prev.end, "safetensors: ", source, ": tensors '", prev.name, "' [", prev.begin, ", ",
               prev.end, ") and '", cur.name, "' [", cur.begin, ", ", cur.end, ") overlap");
  }
  return header;
}

// ---------------------------------------------------------------------------------------------

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  FdGuard fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  DSV4_CHECK(fd.fd >= 0, "safetensors: cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  DSV4_CHECK(::fstat(fd.fd, &st) == 0, "safetensors: cannot stat '", path, "': ", std::strerror(errno));
  DSV4_CHECK(S_ISREG(st.st_mode), "safetensors: '", path, "' is not a regular file");
  const auto size = static_cast<size_t>(st.st_size);
  DSV4_CHECK(size >= 8, "safetensors: ", path, ": file is ", size, " bytes, too short for the 8-byte header length");

  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  DSV4_CHECK(mapping != MAP_FAILED, "safetensors: cannot map '", path, "' (", size, " bytes): ", std::strerror(errno));
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->base_ = static_cast<const std::byte*>(mapping);
  file->size_ = size;
  file->header_ = parse_safetensors_header(file->base_, size, path);
  for (size_t i = 0; i < file->header_.entries.size(); ++i) file->index_[file->header_.entries[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), size_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.entries[it->second];
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  DSV4_CHECK(e != nullptr, "safetensors: ", path_, ": no tensor named '", name, "'");
  return *e;
}

TensorView SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = at(name);
  return TensorView::contiguous(const_cast<std::byte*>(data(e)), e.dtype, e.shape);
}

HostTensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry& e = at(name);
  HostTensor t(e.dtype, e.shape);
  if (t.nbytes() > 0) std::memcpy(t.data(), data(e), t.nbytes());  // an empty tensor has no buffer
  return t;
}

HostTensor SafetensorsFile::read_as(const std::string& name, DType as) const {
  const SafetensorsEntry& e = at(name);
  if (as == e.dtype) return read(name);
  DSV4_CHECK(as == DType::f32, "safetensors: ", path_, ": tensor '", name, "' is ", dtype_name(e.dtype),
             "; it can be read as itself or as F32, not as ", dtype_name(as));
  HostTensor t(DType::f32, e.shape);
  float* out = t.as<float>();
  const std::byte* src = data(e);
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = element_as_float(e.dtype, src, i);
  return t;
}

// ---------------------------------------------------------------------------------------------

namespace {

std::shared_ptr<SafetensorsFile> open_shard(const fs::path& shard, const std::string& index_path,
                                            const std::string& first_tensor) {
  std::error_code ec;
  DSV4_CHECK(fs::is_regular_file(shard, ec), "safetensors: index ", index_path, ": shard '", shard.string(),
             "' (holding '", first_tensor, "') does not exist");
  return SafetensorsFile::open(shard.string());
}

json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(in.good(), "safetensors: cannot open index '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::exception& e) {
    fail("safetensors: index ", path, " is not valid JSON: ", e.what());
  }
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const char* candidate : {"model.safetensors.index.json", "model.safetensors"}) {
      const fs::path p = fs::path(path) / candidate;
      if (fs::exists(p, ec)) return open(p.string());
    }
    fail("safetensors: directory '", path, "' holds neither model.safetensors.index.json nor model.safetensors");
  }

  Checkpoint ckpt;
  ckpt.path_ = path;
  if (fs::path(path).extension() != ".json") {
    ckpt.files_.push_back(SafetensorsFile::open(path));
    for (const SafetensorsEntry& e : ckpt.files_[0]->header().entries) ckpt.where_[e.name] = 0;
    return ckpt;
  }

  const json index = read_json_file(path);
  DSV4_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             "safetensors: index ", path, " has no 'weight_map' object");
  const fs::path dir = fs::path(path).parent_path();
  std::map<std::string, size_t> shard_slot;
  for (const auto& [name, shard_json] : index["weight_map"].items()) {
    DSV4_CHECK(shard_json.is_string(), "safetensors: index ", path, ": weight_map entry '", name, "' is a JSON ",
               shard_json.type_name(), ", expected a shard file name");
    const std::string shard = shard_json.get<std::string>();
    auto slot = shard_slot.find(shard);
    if (slot == shard_slot.end()) {
      ckpt.files_.push_back(open_shard(dir / shard, path, name));
      slot = shard_slot.emplace(shard, ckpt.files_.size() - 1).first;
    }
    DSV4_CHECK(ckpt.files_[slot->second]->find(name) != nullptr, "safetensors: index ", path, " maps tensor '", name,
               "' to shard '", shard, "', which does not contain it");
    ckpt.where_[name] = slot->second;
  }
  return ckpt;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, slot] : where_) out.push_back(name);
  return out;
}

std::pair<const SafetensorsFile*, const SafetensorsEntry*> Checkpoint::find(const std::string& name) const {
  const auto it = where_.find(name);
  DSV4_CHECK(it != where_.end(), "safetensors: checkpoint ", path_, " has no tensor named '", name, "'");
  const SafetensorsFile* file = files_[it->second].get();
  return {file, &file->at(name)};
}

// ---------------------------------------------------------------------------------------------

void SafetensorsWriter::add(const std::string& name, const HostTensor& tensor) {
  add(name, tensor.dtype(), tensor.shape(), tensor.data(), tensor.nbytes());
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                            size_t nbytes) {
  DSV4_CHECK(!name.empty() && name != "__metadata__", "safetensors writer: invalid tensor name '", name, "'");
  DSV4_CHECK(is_safetensors_dtype(dtype), "safetensors writer: tensor '", name, "' has dtype ", dtype_name(dtype),
             ", which safetensors cannot store (supported: ", supported_dtypes(), ")");
  DSV4_CHECK(std::none_of(items_.begin(), items_.end(), [&](const Item& i) { return i.name == name; }),
             "safetensors writer: tensor '", name, "' added twice");
  int64_t numel = 1;
  for (int64_t d : shape) {
    DSV4_CHECK(d >= 0, "safetensors writer: tensor '", name, "' has negative dimension in shape ", shape_string(shape));
    numel *= d;
  }
  const size_t expected = static_cast<size_t>(numel) * dtype_size(dtype);
  DSV4_CHECK(nbytes == expected, "safetensors writer: tensor '", name, "' ", dtype_name(dtype), " ",
             shape_string(shape), " needs ", expected, " bytes, given ", nbytes);
  const auto* bytes = static_cast<const std::byte*>(data);
  items_.push_back({name, dtype, std::move(shape), std::vector<std::byte>(bytes, bytes + nbytes)});
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Item*> sorted;
  for (const Item& item : items_) sorted.push_back(&item);
  std::sort(sorted.begin(), sorted.end(), [](const Item* a, const Item* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Item* item : sorted) {
    header[item->name] = {{"dtype", dtype_name(item->dtype)},
                          {"shape", item->shape},
                          {"data_offsets", {offset, offset + item->bytes.size()}}};
    offset += item->bytes.size();
  }
  std::string text = header.dump();
  // Pad with spaces so that the data section starts 8-byte aligned, as the format recommends.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);

  // Written next to the target and renamed, so a failed write never leaves a truncated file behind.
  const std::string tmp = path + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    DSV4_CHECK(out.good(), "safetensors writer: cannot create '", tmp, "': ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Item* item : sorted)
      out.write(reinterpret_cast<const char*>(item->bytes.data()), static_cast<std::streamsize>(item->bytes.size()));
    out.close();
    if (!out.good()) {
      std::remove(tmp.c_str());
      fail("safetensors writer: writing '", tmp, "' failed: ", std::strerror(errno));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail("safetensors writer: cannot rename '", tmp, "' to '", path, "': ", ec.message());
  }
}

}  // namespace dsv4
