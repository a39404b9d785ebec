# paged_cache_stress_asan (included by tests/CMakeLists.txt): the paged-cache stress test built a
# second time under AddressSanitizer + UBSan. The main library is not sanitized, so the sources the
# test exercises (the cache manager, the row formats, config and topology) are compiled into the
# executable itself; every line the stress test runs is instrumented.

include(CheckCXXSourceCompiles)
set(CMAKE_REQUIRED_FLAGS "-fsanitize=address,undefined")
set(CMAKE_REQUIRED_LINK_OPTIONS -fsanitize=address,undefined)
check_cxx_source_compiles("int main() { return 0; }" DSV4_HAVE_ASAN_UBSAN)
unset(CMAKE_REQUIRED_FLAGS)
unset(CMAKE_REQUIRED_LINK_OPTIONS)

if(DSV4_HAVE_ASAN_UBSAN)
  file(GLOB DSV4_STRESS_LIBRARY_SOURCES CONFIGURE_DEPENDS
    ${PROJECT_SOURCE_DIR}/src/cache/*.cpp ${PROJECT_SOURCE_DIR}/src/model/*.cpp)
  set(DSV4_STRESS_SANITIZERS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_executable(paged_cache_stress_asan_test
    ${CMAKE_CURRENT_SOURCE_DIR}/paged_cache_stress_test.cpp ${DSV4_STRESS_LIBRARY_SOURCES})
  target_include_directories(paged_cache_stress_asan_test PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_compile_definitions(paged_cache_stress_asan_test PRIVATE DSV4_STRESS_SANITIZED)
  target_compile_options(paged_cache_stress_asan_test PRIVATE -O1 -g ${DSV4_STRESS_SANITIZERS})
  target_link_options(paged_cache_stress_asan_test PRIVATE ${DSV4_STRESS_SANITIZERS})
  target_link_libraries(paged_cache_stress_asan_test PRIVATE nlohmann_json::nlohmann_json GTest::gtest GTest::gtest_main)
  add_test(NAME paged_cache_stress_asan COMMAND paged_cache_stress_asan_test)
  set_tests_properties(paged_cache_stress_asan PROPERTIES TIMEOUT 300
    ENVIRONMENT "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1;UBSAN_OPTIONS=print_stacktrace=1")
else()
  message(STATUS "dsv4: the compiler cannot build with -fsanitize=address,undefined; paged_cache_stress_asan skipped")
endif()
