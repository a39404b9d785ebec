// Errors: every failure is a dsv4::Error whose message starts with "dsv4: <operation>: " and names
// the argument, what was expected and what was given.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dsv4 {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates the parts with operator<< and throws "dsv4: <parts...>".
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream os;
  os << "dsv4: ";
  (os << ... << std::forward<Parts>(parts));
  throw Error(os.str());
}

}  // namespace dsv4

// DSV4_CHECK(cond, "op: ", "argument 'x' has rank ", r, ", expected 3");
#define DSV4_CHECK(cond, ...)        \
  do {                               \
    if (!(cond)) ::dsv4::fail(__VA_ARGS__); \
  } while (0)
