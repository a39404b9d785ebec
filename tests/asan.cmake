# paged_cache_stress_asan (included by tests/CMakeLists.txt): the paged-cache stress test built a
# second time under AddressSanitizer + UBSan. The main library is not sanitized, so the sources the
# test exercises (the cache manager, the row formats, config and topology) are compiled into the
# executable itself; every line the stress test runs is instrumented.

file(GLOB DSV4_STRESS_LIBRARY_SOURCES CONFIGURE_DEPENDS
  ${PROJECT_SOURCE_DIR}/src/cache/*.cpp ${PROJECT_SOURCE_DIR}/src/model/*.cpp)
dsv4_add_sanitized_test(TARGET paged_cache_stress_asan_test TEST paged_cache_stress_asan
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/paged_cache_stress_test.cpp ${DSV4_STRESS_LIBRARY_SOURCES}
  DEFINITIONS DSV4_STRESS_SANITIZED)
