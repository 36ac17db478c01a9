#include <ember/tensor/error.h>

namespace ember::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(str_cat("internal assert failed at ", file, ":", line, ": ", cond,
                      msg.empty() ? "" : ": ", msg,
                      "\nThis is a bug in Ember; please report it with the code that triggered it."));
}

}  // namespace ember::detail
