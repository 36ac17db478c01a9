// Everything the autograd library offers, in one include (plus the tensor library).
#pragma once

#include <ember/autograd/engine.h>
#include <ember/autograd/function.h>
#include <ember/autograd/gradcheck.h>
#include <ember/autograd/node.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>
