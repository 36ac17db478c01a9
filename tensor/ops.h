// Everything the tensor library offers, in one include.
#pragma once

#include "tensor/conv.h"
#include "tensor/creation.h"
#include "tensor/cuda.h"
#include "tensor/elementwise.h"
#include "tensor/grad_mode.h"
#include "tensor/indexing.h"
#include "tensor/linalg.h"
#include "tensor/random.h"
#include "tensor/reduce.h"
#include "tensor/tensor.h"
#include "tensor/threading.h"
