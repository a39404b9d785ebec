// Argument validation shared by every CUDA operation: one call checks all tensors of an op in a
// fixed order (rank, device, dtype, contiguity, shape), so an op's validate_<op> function reads as
// the list of its tensors followed by its cross-tensor invariants.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

inline constexpr int64_t kAnyDim = -1;  // an expected dimension that matches any size

struct TensorSpec {
  std::string name;                 // the params field, e.g. "q" or "window.pages"
  const TensorView* view;
  std::vector<int64_t> shape;       // expected shape (its length is the expected rank)
  std::vector<DType> dtypes;        // accepted dtypes
  bool optional = false;            // absent (default TensorView) is accepted and skips the checks
};

// Throws "dsv4: <op>: argument '<name>' has rank 2, expected 3" (then device, dtype, contiguity,
// shape: "... has shape [3, 60, 512], expected [3, 64, 512]"). Every spec passes a phase before
// the next phase starts.
void check_tensors(const char* op, const std::vector<TensorSpec>& specs);

// Expected shape as text with the given sizes in place of kAnyDim.
std::string expected_shape_string(const std::vector<int64_t>& expected, const TensorView& given);

}  // namespace dsv4::cuda
