// Every layer in one include: linear, convolution, normalisation, activations, dropout,
// embedding, pooling, flatten, multi-head attention, the transformer encoder layer and the
// containers. Losses are in nn/loss.h, functional forms in nn/functional.h, initialisers in
// nn/init.h.
#pragma once

#include <ember/nn/activation.h>
#include <ember/nn/container.h>
#include <ember/nn/conv.h>
#include <ember/nn/dropout.h>
#include <ember/nn/embedding.h>
#include <ember/nn/flatten.h>
#include <ember/nn/linear.h>
#include <ember/nn/multihead_attention.h>
#include <ember/nn/norm.h>
#include <ember/nn/pooling.h>
#include <ember/nn/transformer.h>
