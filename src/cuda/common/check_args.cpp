#include "cuda/common/check_args.h"

#include <sstream>
#include <string>

namespace dsv4::cuda {

std::string expected_shape_string(const std::vector<int64_t>& expected, const TensorView& given) {
  std::vector<int64_t> shape = expected;
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] == kAnyDim) shape[d] = static_cast<int>(d) < given.rank ? given.shape[d] : 0;
  return dsv4::shape_string(shape);
}

namespace {

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::ostringstream os;
  for (size_t i = 0; i < dtypes.size(); ++i)
    os << (i == 0 ? "" : i + 1 == dtypes.size() ? " or " : ", ") << dtype_name(dtypes[i]);
  return os.str();
}

std::string stride_string(const TensorView& v) {
  return dsv4::shape_string(std::vector<int64_t>(v.stride.begin(), v.stride.begin() + v.rank));
}

}  // namespace

void check_tensors(const char* op, const std::vector<TensorSpec>& specs) {
  auto checked = [](const TensorSpec& s) { return !s.optional || is_present(*s.view); };
  for (const TensorSpec& s : specs)
    if (checked(s) && s.view->rank != static_cast<int>(s.shape.size()))
      fail(op, ": argument '", s.name, "' has rank ", s.view->rank, ", expected ", s.shape.size());
  for (const TensorSpec& s : specs)
    if (checked(s) && s.view->device != Device::cuda)
      fail(op, ": argument '", s.name, "' is on ", device_name(s.view->device), ", expected cuda");
  for (const TensorSpec& s : specs) {
    if (!checked(s)) continue;
    bool accepted = false;
    for (DType t : s.dtypes) accepted = accepted || t == s.view->dtype;
    if (!accepted)
      fail(op, ": argument '", s.name, "' has dtype ", dtype_name(s.view->dtype), ", expected ", dtype_list(s.dtypes));
  }
  for (const TensorSpec& s : specs)
    if (checked(s) && !s.view->is_contiguous())
      fail(op, ": argument '", s.name, "' is not contiguous (shape ", s.view->shape_string(), ", strides ",
           stride_string(*s.view), ")");
  for (const TensorSpec& s : specs) {
    if (!checked(s)) continue;
    bool same = true;
    for (size_t d = 0; d < s.shape.size(); ++d)
      same = same && s.view->shape[d] >= 0 && (s.shape[d] == kAnyDim || s.shape[d] == s.view->shape[d]);
    if (!same)
      fail(op, ": argument '", s.name, "' has shape ", s.view->shape_string(), ", expected ",
           expected_shape_string(s.shape, *s.view));
    if (s.view->numel() > 0 && s.view->data == nullptr)
      fail(op, ": argument '", s.name, "' of shape ", s.view->shape_string(), " has no data pointer");
  }
}

}  // namespace dsv4::cuda
