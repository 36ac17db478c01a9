// Everything the tensor library offers, in one include.
#pragma once

#include <ember/tensor/ops/attention.h>
#include <ember/tensor/ops/conv.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops/loss.h>
#include <ember/tensor/ops/norm.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/ops/reduce.h>
#include <ember/tensor/tensor.h>
#include <ember/tensor/threading.h>
