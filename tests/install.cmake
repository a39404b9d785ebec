# find_package(dsv4) after `cmake --install`: the README's API example, built as a consumer.
add_test(NAME install_find_package
  COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DCONSUMER_DIR=${CMAKE_CURRENT_SOURCE_DIR}/install
          -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/install_check -P ${CMAKE_CURRENT_SOURCE_DIR}/install/check_install.cmake)
set_tests_properties(install_find_package PROPERTIES TIMEOUT 600)
