// Everything the autograd library offers, in one include (plus the tensor library).
#pragma once

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
