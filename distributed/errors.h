// Errors of the distributed layer (torch.distributed's DistError family).
#pragma once

#include <ember/tensor/error.h>

namespace ember::dist {

/// Base of every distributed error.
class DistError : public Error {
 public:
  using Error::Error;
};
/// A store operation failed (bad key, protocol error, server gone).
class DistStoreError : public DistError {
 public:
  using DistError::DistError;
};
/// A connection could not be made or was lost.
class DistNetworkError : public DistError {
 public:
  using DistError::DistError;
};
/// A backend (gloo, MPI, NCCL) reported an error.
class DistBackendError : public DistError {
 public:
  using DistError::DistError;
};
/// An operation did not complete within its timeout.
class DistTimeoutError : public DistError {
 public:
  using DistError::DistError;
};

}  // namespace ember::dist

// The distributed layer's internals live in ember::dist::detail (each room's detail/ headers).
// The using-directive keeps the tensor layer's helpers (str_cat, ...) reachable as detail::x
// from ember::dist code, which a nested detail namespace would otherwise hide.
namespace ember::dist::detail {
using namespace ::ember::detail;
}  // namespace ember::dist::detail
