#include "dsv4/tensor.h"

#include <sstream>

namespace dsv4 {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    case DType::e4m3: case DType::ue8m0: case DType::e2m1x2: case DType::u8: case DType::i8:
    case DType::bool_: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::e4m3: return "F8_E4M3";
    case DType::ue8m0: return "F8_E8M0";
    case DType::e2m1x2: return "F4_E2M1x2";
    case DType::u8: return "U8";
    case DType::i8: return "I8";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::bool_: return "BOOL";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

std::string TensorView::shape_string() const {
  return dsv4::shape_string(std::vector<int64_t>(shape.begin(), shape.begin() + rank));
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device, int device_index) {
  DSV4_CHECK(shape.size() <= static_cast<size_t>(kMaxRank), "tensor: rank ", shape.size(),
             " exceeds the maximum of ", kMaxRank);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.rank = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = s;
    s *= shape[d];
  }
  return v;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device, int device_index) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device, device_index);
}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  numel_ = 1;
  for (int64_t s : shape_) {
    DSV4_CHECK(s >= 0, "tensor: negative dimension in shape ", dsv4::shape_string(shape_));
    numel_ *= s;
  }
  const size_t elem = dtype_size(dtype);
  const size_t bytes = dtype == DType::e2m1x2 ? static_cast<size_t>(numel_) : static_cast<size_t>(numel_) * elem;
  bytes_.assign(bytes, std::byte{0});
}

TensorView HostTensor::view() { return TensorView::contiguous(bytes_.data(), dtype_, shape_); }
TensorView HostTensor::view() const {
  return TensorView::contiguous(const_cast<std::byte*>(bytes_.data()), dtype_, shape_);
}

}  // namespace dsv4
