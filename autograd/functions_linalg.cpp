// Backward rules of the linalg ops.
#include "autograd/functions.h"
#include "tensor/ops.h"

namespace ember::autograd {

void register_linalg(FactoryTable& t) { (void)t; }

}  // namespace ember::autograd
