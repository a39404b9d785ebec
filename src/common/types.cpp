#include "dsv4/types.h"

#include "dsv4/error.h"

namespace dsv4 {

const char* backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  fail("engine: unknown backend '", name, "', expected cpu or cuda");
}

const char* precision_name(Precision p) { return p == Precision::fp32 ? "fp32" : "reference"; }

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "reference") return Precision::reference;
  fail("engine: unknown precision '", name, "', expected fp32 or reference");
}

}  // namespace dsv4
