// DLTensor checks of the C API: each failure carries the status the caller can act on (bad shape,
// dtype, device, layout) and a message naming the operation, the argument, expected and given.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "dsv4/dsv4.h"
#include "dsv4/tensor.h"

namespace dsv4::capi {

class ApiError : public std::runtime_error {
 public:
  ApiError(dsv4_status s, const std::string& message) : std::runtime_error(message), status(s) {}
  dsv4_status status;
};

// "[2, 3, 512]"
std::string dl_shape_string(const DLTensor* t);
// "float32", "int64", "bfloat16", "uint8", ... as DLPack codes name them.
std::string dl_dtype_name(DLDataType t);

// Throws DSV4_ERROR_INVALID_ARGUMENT for a NULL tensor or a NULL data pointer with elements.
void check_dltensor(const char* op, const char* arg, const DLTensor* t);
[[noreturn]] void throw_shape(const char* op, const char* arg, const DLTensor* t, const std::string& expected);

// Checks rank and shape, device, dtype and compact row-major layout (in that order), and returns the
// view (byte_offset applied).
TensorView checked_view(const char* op, const char* arg, const DLTensor* t, DType dtype,
                        std::initializer_list<int64_t> shape, DLDeviceType device);

}  // namespace dsv4::capi
