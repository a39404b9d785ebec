# The Python package dsv4 (python/): the pybind11 module dsv4._dsv4 over the C API, and the pure
# Python files next to it in ${PROJECT_BINARY_DIR}/python/dsv4, so that PYTHONPATH=<build>/python
# imports it from the build tree. `cmake --install` puts the package into DSV4_PYTHON_INSTALL_DIR.
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3)
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module)

# pybind11: its CMake package, else the headers `pybind11` or a pip-installed torch carries.
set(DSV4_PYBIND11_INCLUDE_DIR "" CACHE PATH "pybind11 headers (found automatically when empty)")
if(Python3_FOUND AND NOT DSV4_PYBIND11_INCLUDE_DIR)
  find_package(pybind11 CONFIG QUIET)
  if(pybind11_FOUND)
    set(DSV4_PYBIND11_INCLUDE_DIR ${pybind11_INCLUDE_DIRS} CACHE PATH "" FORCE)
  else()
    execute_process(COMMAND ${Python3_EXECUTABLE} -c
      "import os\ntry:\n import pybind11; print(pybind11.get_include())\nexcept ImportError:\n import torch.utils.cpp_extension as c; print(next(p for p in c.include_paths() if os.path.isdir(os.path.join(p, 'pybind11'))))"
      OUTPUT_VARIABLE _dsv4_pybind11 OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_dsv4_pybind11)
      set(DSV4_PYBIND11_INCLUDE_DIR ${_dsv4_pybind11} CACHE PATH "" FORCE)
    endif()
  endif()
endif()

set(_dsv4_numpy_found OFF)
if(Python3_FOUND)
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy" RESULT_VARIABLE _dsv4_numpy_rc
    OUTPUT_QUIET ERROR_QUIET)
  if(_dsv4_numpy_rc EQUAL 0)
    set(_dsv4_numpy_found ON)
  endif()
endif()
if(NOT Python3_FOUND OR NOT DSV4_PYBIND11_INCLUDE_DIR OR NOT _dsv4_numpy_found)
  if(DSV4_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "dsv4: DSV4_PYTHON=ON needs Python 3 with its headers, numpy and pybind11 "
                        "(Debian: python3-dev python3-numpy pybind11-dev)")
  endif()
  message(STATUS "dsv4: no Python 3 headers, numpy or pybind11 for ${Python3_EXECUTABLE}: "
                 "the Python package is not built")
  return()
endif()
set(DSV4_HAS_PYTHON ON)

set(DSV4_PYTHON_BUILD_DIR ${PROJECT_BINARY_DIR}/python/dsv4)
Python3_add_library(dsv4_python MODULE WITH_SOABI ${PROJECT_SOURCE_DIR}/python/src/module.cpp)
target_include_directories(dsv4_python PRIVATE ${DSV4_PYBIND11_INCLUDE_DIR})
target_link_libraries(dsv4_python PRIVATE dsv4_capi_objects dsv4 OpenMP::OpenMP_CXX)
set_target_properties(dsv4_python PROPERTIES OUTPUT_NAME _dsv4 LIBRARY_OUTPUT_DIRECTORY ${DSV4_PYTHON_BUILD_DIR}
  CXX_VISIBILITY_PRESET hidden)
# A toolchain that links libstdc++ statically (the H200 machines' /opt/gcc does) would otherwise
# export the module's copy of libstdc++, and the process's own libstdc++ (loaded by torch) would
# interpose half of it: the first number formatted into an error message crashed in a locale
# facet. Symbols of the static archives stay inside the module.
target_link_options(dsv4_python PRIVATE -Wl,--exclude-libs,ALL)

# The pure Python files, copied into the build tree whenever they change.
file(GLOB_RECURSE DSV4_PYTHON_FILES CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/python/dsv4
  ${PROJECT_SOURCE_DIR}/python/dsv4/*.py)
set(_dsv4_copied)
foreach(f ${DSV4_PYTHON_FILES})
  add_custom_command(OUTPUT ${DSV4_PYTHON_BUILD_DIR}/${f}
    COMMAND ${CMAKE_COMMAND} -E copy ${PROJECT_SOURCE_DIR}/python/dsv4/${f} ${DSV4_PYTHON_BUILD_DIR}/${f}
    DEPENDS ${PROJECT_SOURCE_DIR}/python/dsv4/${f})
  list(APPEND _dsv4_copied ${DSV4_PYTHON_BUILD_DIR}/${f})
endforeach()
add_custom_target(dsv4_python_files ALL DEPENDS ${_dsv4_copied})
add_dependencies(dsv4_python dsv4_python_files)

# The interpreter's own package directory when it lies under the install prefix (Debian's
# /usr/local/lib/python3.X/dist-packages, a virtual environment's site-packages), else
# lib/python3.X/site-packages under the prefix (then put that on PYTHONPATH).
execute_process(COMMAND ${Python3_EXECUTABLE} -c "import sysconfig; print(sysconfig.get_path('platlib'))"
  OUTPUT_VARIABLE _dsv4_platlib OUTPUT_STRIP_TRAILING_WHITESPACE)
cmake_path(IS_PREFIX CMAKE_INSTALL_PREFIX "${_dsv4_platlib}" NORMALIZE _dsv4_under_prefix)
if(_dsv4_under_prefix)
  file(RELATIVE_PATH _dsv4_python_dir ${CMAKE_INSTALL_PREFIX} ${_dsv4_platlib})
else()
  set(_dsv4_python_dir lib/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/site-packages)
endif()
set(DSV4_PYTHON_INSTALL_DIR ${_dsv4_python_dir} CACHE PATH
  "Where `cmake --install` puts the package dsv4, relative to CMAKE_INSTALL_PREFIX")
install(TARGETS dsv4_python LIBRARY DESTINATION ${DSV4_PYTHON_INSTALL_DIR}/dsv4)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/dsv4/ DESTINATION ${DSV4_PYTHON_INSTALL_DIR}/dsv4
  FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
message(STATUS "dsv4: Python ${Python3_EXECUTABLE} (${Python3_VERSION}), pybind11 ${DSV4_PYBIND11_INCLUDE_DIR}, "
               "installs into <prefix>/${DSV4_PYTHON_INSTALL_DIR}")
