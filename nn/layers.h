// Every layer in one include: linear, convolution, normalisation, activations, dropout,
// embedding, pooling, flatten, multi-head attention, the transformer encoder layer, mixture of
// experts and the containers. Losses are in nn/loss.h, functional forms in nn/functional.h,
// initialisers in nn/init.h.
#pragma once

#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/conv.h>
#include <ember/nn/layers/dropout.h>
#include <ember/nn/layers/embedding.h>
#include <ember/nn/layers/flatten.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/moe.h>
#include <ember/nn/layers/multihead_attention.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/layers/pooling.h>
#include <ember/nn/layers/transformer.h>
