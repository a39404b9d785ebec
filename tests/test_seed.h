// The seed of the tests' random inputs: fixed by default, so that every run tests the same inputs;
// DSV4_TEST_SEED=<n> replays another one, DSV4_TEST_SEED=random draws a fresh one (printed on
// failure by SEED_TRACE).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace dsv4::test {

inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* text = std::getenv("DSV4_TEST_SEED");
    if (!text) return uint64_t{20261129};
    if (std::string(text) != "random") return static_cast<uint64_t>(std::strtoull(text, nullptr, 0));
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }();
  return seed;
}

}  // namespace dsv4::test

#define SEED_TRACE() SCOPED_TRACE("DSV4_TEST_SEED=" + std::to_string(::dsv4::test::test_seed()))
