# The two commands of the README. Both install missing Debian packages when run as root,
# configure into build/ and build; `run` then runs the main job, `test` the whole suite.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
DEBIAN_PACKAGES := cmake g++ make libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev \
  libdlpack-dev python3-dev pybind11-dev python3-numpy python3-pytest python3-torch
CMAKE_FLAGS ?=

.PHONY: all deps configure build run test clean

all: build

deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "dsv4: installing Debian packages:$$missing"; \
	    (apt-get install -y --no-install-recommends $$missing || (apt-get update && apt-get install -y --no-install-recommends $$missing)) >/dev/null; \
	  else \
	    echo "dsv4: missing Debian packages:$$missing (run as root to install them)"; \
	  fi; \
	fi

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

run: build
	./$(BUILD_DIR)/dsv4 run

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

clean:
	rm -rf $(BUILD_DIR)
