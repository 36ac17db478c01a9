// Errors thrown by every Ember layer.
//
// Two macros for two audiences:
//   EMBER_CHECK(cond, ...)        bad user input: throws ValueError (or the type given with
//                                 EMBER_CHECK_TYPE); the message names the op, what was
//                                 expected and what was got.
//   EMBER_INTERNAL_ASSERT(cond, ...) an invariant of Ember itself: "this is a bug".
// Message pieces are streamed with operator<<, so shapes, dtypes and devices print directly.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace ember {

/// Base of every Ember exception.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};
/// A value was out of range or inconsistent (bad shape, bad dim, bad option).
class ValueError : public Error {
 public:
  using Error::Error;
};
/// The dtype or device of an argument is not supported by the op.
class TypeError : public Error {
 public:
  using Error::Error;
};
/// An index was out of bounds.
class IndexError : public Error {
 public:
  using Error::Error;
};
/// The operation exists but is not implemented for these arguments (or this build).
class NotImplementedError : public Error {
 public:
  using Error::Error;
};
/// A CUDA runtime, cuBLAS or cuDNN call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};
/// Out of memory on a device.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_internal(const char* file, int line, const char* cond,
                                 const std::string& msg);
}  // namespace detail

}  // namespace ember

#define EMBER_CHECK_TYPE(ErrorType, cond, ...)                         \
  do {                                                                 \
    if (__builtin_expect(!(cond), 0)) {                                \
      throw ErrorType(::ember::detail::str_cat(__VA_ARGS__));          \
    }                                                                  \
  } while (0)

#define EMBER_CHECK(cond, ...) EMBER_CHECK_TYPE(::ember::ValueError, cond, __VA_ARGS__)

#define EMBER_INTERNAL_ASSERT(cond, ...)                                                   \
  do {                                                                                     \
    if (__builtin_expect(!(cond), 0)) {                                                    \
      ::ember::detail::throw_internal(__FILE__, __LINE__, #cond,                            \
                                      ::ember::detail::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                                      \
  } while (0)
