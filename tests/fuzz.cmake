# Extra builds of tests/safetensors_fuzz_test.cpp (included by tests/CMakeLists.txt):
#  * safetensors_fuzz_asan_test: the seeded mutation loop (a fixed number of mutants) under
#    AddressSanitizer + UBSan;
#  * safetensors_header_fuzzer: a libFuzzer target of parse_safetensors_header, built with clang++
#    when it has libFuzzer, run by ctest for 15 s from a seed corpus the plain test writes.
# Both compile only the reader's own sources, so that every line they exercise is instrumented.

set(DSV4_FUZZ_TEST_SOURCE ${CMAKE_CURRENT_SOURCE_DIR}/safetensors_fuzz_test.cpp)
set(DSV4_FUZZ_READER_SOURCES ${PROJECT_SOURCE_DIR}/src/weights/safetensors.cpp ${PROJECT_SOURCE_DIR}/src/common/tensor.cpp)

dsv4_add_sanitized_test(TARGET safetensors_fuzz_asan_test TEST safetensors_fuzz_asan
  SOURCES ${DSV4_FUZZ_TEST_SOURCE} ${DSV4_FUZZ_READER_SOURCES})

# libFuzzer needs clang; the project itself may be built with another compiler, so the target is
# compiled by a custom command.
find_program(DSV4_CLANGXX NAMES clang++ clang++-14)
set(DSV4_LIBFUZZER_WORKS OFF)
if(DSV4_CLANGXX)
  set(probe_dir ${CMAKE_CURRENT_BINARY_DIR}/libfuzzer_probe)
  file(WRITE ${probe_dir}/probe.cpp
    "#include <cstddef>\n#include <cstdint>\nextern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
  execute_process(COMMAND ${DSV4_CLANGXX} -std=c++20 -fsanitize=fuzzer,address ${probe_dir}/probe.cpp -o ${probe_dir}/probe
                  RESULT_VARIABLE probe_result OUTPUT_QUIET ERROR_QUIET)
  if(probe_result EQUAL 0)
    set(DSV4_LIBFUZZER_WORKS ON)
  endif()
endif()

if(DSV4_LIBFUZZER_WORKS)
  get_target_property(json_includes nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
  set(json_flags)
  foreach(dir ${json_includes})
    # The compiler's own directories stay implicit: -isystem /usr/include breaks #include_next.
    if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
      list(APPEND json_flags -isystem ${dir})
    endif()
  endforeach()
  # Not the target's own name in this folder: Ninja would see two rules for one path.
  set(fuzzer ${CMAKE_CURRENT_BINARY_DIR}/libfuzzer/safetensors_header_fuzzer)
  file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/libfuzzer)
  file(GLOB dsv4_public_headers ${PROJECT_SOURCE_DIR}/include/dsv4/*.h)
  add_custom_command(OUTPUT ${fuzzer}
    COMMAND ${DSV4_CLANGXX} -std=c++20 -O1 -g -DDSV4_LIBFUZZER -fsanitize=fuzzer ${DSV4_SANITIZER_FLAGS}
            -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_SOURCE_DIR}/src ${json_flags}
            ${DSV4_FUZZ_TEST_SOURCE} ${DSV4_FUZZ_READER_SOURCES} -o ${fuzzer}
    DEPENDS ${DSV4_FUZZ_TEST_SOURCE} ${DSV4_FUZZ_READER_SOURCES} ${dsv4_public_headers}
    COMMENT "Building the libFuzzer target safetensors_header_fuzzer with ${DSV4_CLANGXX}"
    VERBATIM)
  add_custom_target(safetensors_header_fuzzer ALL DEPENDS ${fuzzer})

  set(corpus ${CMAKE_CURRENT_BINARY_DIR}/safetensors_fuzz_corpus)
  set(artifacts ${CMAKE_CURRENT_BINARY_DIR}/safetensors_fuzz_artifacts/)
  file(MAKE_DIRECTORY ${artifacts})
  add_test(NAME safetensors_fuzz_seed_corpus
           COMMAND ${CMAKE_COMMAND} -E env DSV4_FUZZ_CORPUS_DIR=${corpus}
                   $<TARGET_FILE:safetensors_fuzz_test> --gtest_filter=SafetensorsFuzz.SeedCorpusIsValid)
  set_tests_properties(safetensors_fuzz_seed_corpus PROPERTIES FIXTURES_SETUP safetensors_fuzz_corpus)
  add_test(NAME safetensors_libfuzzer
           COMMAND ${fuzzer} -runs=50000 -seed=1 -timeout=10 -rss_limit_mb=2048 -artifact_prefix=${artifacts}
                   ${corpus})
  set_tests_properties(safetensors_libfuzzer PROPERTIES FIXTURES_REQUIRED safetensors_fuzz_corpus TIMEOUT 120)
else()
  message(STATUS "dsv4: no clang++ with libFuzzer; the safetensors_header_fuzzer target is skipped")
endif()
