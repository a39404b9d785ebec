#include "capi/dlpack_view.h"

#include <vector>

namespace dsv4::capi {
namespace {

struct DTypeCode {
  DType dtype;
  uint8_t code;
  uint8_t bits;
  const char* name;
};
constexpr DTypeCode kDTypes[] = {
    {DType::f32, kDLFloat, 32, "float32"}, {DType::f64, kDLFloat, 64, "float64"},
    {DType::f16, kDLFloat, 16, "float16"}, {DType::bf16, kDLBfloat, 16, "bfloat16"},
    {DType::i32, kDLInt, 32, "int32"},     {DType::i64, kDLInt, 64, "int64"},
    {DType::i8, kDLInt, 8, "int8"},        {DType::u8, kDLUInt, 8, "uint8"},
};

std::string expected_shape(std::initializer_list<int64_t> shape) {
  return shape_string(std::vector<int64_t>(shape));
}

std::string prefix(const char* op, const char* arg) { return std::string("dsv4: ") + op + ": " + arg; }

}  // namespace

std::string dl_shape_string(const DLTensor* t) {
  return shape_string(std::vector<int64_t>(t->shape, t->shape + t->ndim));
}

std::string dl_dtype_name(DLDataType t) {
  for (const DTypeCode& d : kDTypes)
    if (t.code == d.code && t.bits == d.bits && t.lanes == 1) return d.name;
  return "dtype(code " + std::to_string(t.code) + ", bits " + std::to_string(t.bits) + ", lanes " +
         std::to_string(t.lanes) + ")";
}

void check_dltensor(const char* op, const char* arg, const DLTensor* t) {
  if (!t) throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, prefix(op, arg) + " is NULL");
  if (t->ndim < 0 || t->ndim > kMaxRank || (t->ndim > 0 && !t->shape))
    throw ApiError(DSV4_ERROR_BAD_SHAPE, prefix(op, arg) + " has rank " + std::to_string(t->ndim) +
                                             " or no shape, expected rank 0 ... " + std::to_string(kMaxRank));
}

void throw_shape(const char* op, const char* arg, const DLTensor* t, const std::string& expected) {
  throw ApiError(DSV4_ERROR_BAD_SHAPE,
                 prefix(op, arg) + " has shape " + dl_shape_string(t) + ", expected " + expected);
}

TensorView checked_view(const char* op, const char* arg, const DLTensor* t, DType dtype,
                        std::initializer_list<int64_t> shape, DLDeviceType device) {
  check_dltensor(op, arg, t);
  if (t->ndim != static_cast<int>(shape.size())) throw_shape(op, arg, t, expected_shape(shape));
  const bool cuda_like = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
  const bool device_ok = device == kDLCPU ? (t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost)
                                          : cuda_like;
  if (!device_ok)
    throw ApiError(DSV4_ERROR_BAD_DEVICE, prefix(op, arg) + " is on device type " +
                                              std::to_string(t->device.device_type) + ", expected " +
                                              (device == kDLCPU ? "the CPU (kDLCPU)" : "a CUDA device (kDLCUDA)"));
  const DTypeCode* code = nullptr;
  for (const DTypeCode& d : kDTypes)
    if (d.dtype == dtype) code = &d;
  if (t->dtype.code != code->code || t->dtype.bits != code->bits || t->dtype.lanes != 1)
    throw ApiError(DSV4_ERROR_BAD_DTYPE,
                   prefix(op, arg) + " has dtype " + dl_dtype_name(t->dtype) + ", expected " + code->name);
  int64_t numel = 1;
  for (int d = 0; d < t->ndim; ++d) numel *= t->shape[d];
  // An empty tensor has no layout to check (numpy 2 gives its size-0 dimensions stride 0).
  if (t->strides && numel > 0) {
    int64_t expected = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      if (t->shape[d] != 1 && t->strides[d] != expected)
        throw ApiError(DSV4_ERROR_BAD_LAYOUT,
                       prefix(op, arg) + " is not compact row-major (stride " + std::to_string(t->strides[d]) +
                           " in dimension " + std::to_string(d) + ", expected " + std::to_string(expected) + ")");
      expected *= t->shape[d];
    }
  }
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[d] != shape.begin()[d]) throw_shape(op, arg, t, expected_shape(shape));
  if (numel > 0 && !t->data) throw ApiError(DSV4_ERROR_INVALID_ARGUMENT, prefix(op, arg) + " has no data");
  TensorView v;
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  v.dtype = dtype;
  v.device = device == kDLCPU ? Device::cpu : Device::cuda;
  v.device_index = t->device.device_id;
  v.rank = t->ndim;
  int64_t stride = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    v.shape[d] = t->shape[d];
    v.stride[d] = stride;
    stride *= t->shape[d];
  }
  return v;
}

}  // namespace dsv4::capi
