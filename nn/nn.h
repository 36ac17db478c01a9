// Everything the nn library offers, in one include (plus autograd and the tensor library).
#pragma once

#include <ember/autograd/autograd.h>
#include <ember/nn/activation_checkpoint.h>
#include <ember/nn/io/checkpoint.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/data/data.h>
#include <ember/nn/attention.h>
#include <ember/nn/functional.h>
#include <ember/nn/init.h>
#include <ember/nn/layers.h>
#include <ember/nn/loss.h>
#include <ember/nn/module.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/lr_scheduler.h>
#include <ember/nn/optim/optimizer.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/io/serialize.h>
#include <ember/nn/io/summary_writer.h>
