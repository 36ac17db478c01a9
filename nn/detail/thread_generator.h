// The calling thread's default generator replaced for a scope (internal to nn): checkpointed
// segments and DataLoader batches draw from generators of their own, never from (or rewinding)
// the shared one.
#pragma once

#include <ember/tensor/ops/random.h>

namespace ember::detail {

/// Makes `gen` the calling thread's default generator until destroyed, then puts back the one
/// in use before (a thread that had none gets the process-wide one, which draws alike).
class ThreadGeneratorScope {
 public:
  explicit ThreadGeneratorScope(Generator& gen) : previous_(&default_generator()) {
    set_thread_default_generator(&gen);
  }
  ~ThreadGeneratorScope() { set_thread_default_generator(previous_); }
  ThreadGeneratorScope(const ThreadGeneratorScope&) = delete;
  ThreadGeneratorScope& operator=(const ThreadGeneratorScope&) = delete;

 private:
  Generator* previous_;
};

}  // namespace ember::detail
