// Tensor views and owning host tensors.
//
// TensorView is a plain (trivially copyable) description of strided memory on some device; the
// params structs of every operation are made of views and scalars. HostTensor owns host memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/error.h"

namespace dsv4 {

enum class DType : uint8_t {
  f32,
  f64,
  bf16,
  f16,
  e4m3,     // fp8 e4m3fn
  ue8m0,    // power-of-two scale byte: value 2^(byte-127)
  e2m1x2,   // two fp4 e2m1 codes per byte, even element in the low nibble
  u8,
  i8,
  i32,
  i64,
  bool_,
};

// Bytes per element; for e2m1x2 the size of one byte holding two elements.
size_t dtype_size(DType t);
// Short name as in safetensors ("F32", "BF16", "F8_E4M3", ...).
const char* dtype_name(DType t);

enum class Device : uint8_t { cpu, cuda };
const char* device_name(Device d);

inline constexpr int kMaxRank = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};   // elements per dimension
  std::array<int64_t, kMaxRank> stride{};  // elements between neighbours of each dimension

  int64_t size(int d) const { return shape[d < 0 ? d + rank : d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 37, 256]"

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }

  // A contiguous view of `data` with the given shape.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu, int device_index = 0);
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu, int device_index = 0);
};

std::string shape_string(const std::vector<int64_t>& shape);

// Owning, contiguous host tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const { return shape_[d < 0 ? d + rank() : d]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return bytes_.size(); }
  bool empty() const { return numel_ == 0; }

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <class T> T* as() { return reinterpret_cast<T*>(bytes_.data()); }
  template <class T> const T* as() const { return reinterpret_cast<const T*>(bytes_.data()); }

  TensorView view();
  TensorView view() const;  // the view's data pointer is non-const; do not write through it

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<std::byte> bytes_;
};

}  // namespace dsv4
