# numeric_test cross-checks numeric.h against CUDA's host-side fp8/bf16/fp4 conversions; those
# headers compile with the host compiler alone, so the check runs whenever a toolkit is installed.
set(DSV4_CUDA_FP_INCLUDE_DIR /usr/local/cuda/include)
if(TARGET numeric_test AND EXISTS ${DSV4_CUDA_FP_INCLUDE_DIR}/cuda_fp8.h)
  target_include_directories(numeric_test SYSTEM PRIVATE ${DSV4_CUDA_FP_INCLUDE_DIR})
  target_compile_definitions(numeric_test PRIVATE DSV4_HAVE_CUDA_FP_HEADERS)
endif()
