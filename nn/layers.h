// Every layer in one include: linear, convolution, normalisation, activations, dropout,
// embedding, pooling, flatten, multi-head attention, the transformer encoder layer and the
// containers. Losses are in nn/loss.h, functional forms in nn/functional.h, initialisers in
// nn/init.h.
#pragma once

#include "nn/activation.h"
#include "nn/container.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/embedding.h"
#include "nn/flatten.h"
#include "nn/linear.h"
#include "nn/multihead_attention.h"
#include "nn/norm.h"
#include "nn/pooling.h"
#include "nn/transformer.h"
