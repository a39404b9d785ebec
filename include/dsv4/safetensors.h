// safetensors files: a validated, memory-mapped reader, sharded checkpoints, and a writer.
//
// The header is validated completely before any tensor is touched: JSON syntax, known dtypes,
// shapes, offsets inside the data section, no overlaps, sizes equal to numel * dtype size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/tensor.h"

namespace dsv4 {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets relative to the start of the data section
  uint64_t end = 0;
  int64_t numel() const;
};

// Parsed, validated header of a safetensors byte stream. `file_size` is the total size of the
// file; throws dsv4::Error("dsv4: safetensors: <source>: ...") on any inconsistency.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;            // in file order of their data
  std::map<std::string, std::string> metadata;      // "__metadata__"
  uint64_t data_offset = 0;                         // 8 + header length
};
SafetensorsHeader parse_safetensors_header(const std::byte* file, size_t file_size,
                                           const std::string& source);

class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const SafetensorsEntry* find(const std::string& name) const;  // nullptr when absent
  const SafetensorsEntry& at(const std::string& name) const;    // throws naming the file
  const std::byte* data(const SafetensorsEntry& e) const { return base_ + header_.data_offset + e.begin; }
  // A read-only view of the tensor in the mapping (valid while the file lives). The format does not
  // align tensors: the data may be misaligned for its dtype (read() copies).
  TensorView view(const std::string& name) const;
  // A copy, converted to `as` when given (f32 from bf16/f16/e4m3/f64/ints supported).
  HostTensor read(const std::string& name) const;
  HostTensor read_as(const std::string& name, DType as) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// A single .safetensors file, a sharded checkpoint's index JSON (`weight_map`), or a directory
// holding model.safetensors or model.safetensors.index.json.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // The file holding `name` and its entry; throws naming the checkpoint when absent.
  std::pair<const SafetensorsFile*, const SafetensorsEntry*> find(const std::string& name) const;
  const std::string& path() const { return path_; }
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
};

class SafetensorsWriter {
 public:
  void add(const std::string& name, const HostTensor& tensor);
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes);
  void set_metadata(const std::string& key, const std::string& value);
  void write(const std::string& path) const;  // data 8-byte aligned, tensors sorted by name

 private:
  struct Item { std::string name; DType dtype; std::vector<int64_t> shape; std::vector<std::byte> bytes; };
  std::vector<Item> items_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dsv4
