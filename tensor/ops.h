// Everything the tensor library offers, in one include.
#pragma once

#include <ember/tensor/attention.h>
#include <ember/tensor/conv.h>
#include <ember/tensor/creation.h>
#include <ember/tensor/cuda.h>
#include <ember/tensor/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/indexing.h>
#include <ember/tensor/linalg.h>
#include <ember/tensor/loss.h>
#include <ember/tensor/norm.h>
#include <ember/tensor/random.h>
#include <ember/tensor/reduce.h>
#include <ember/tensor/tensor.h>
#include <ember/tensor/threading.h>
