// Everything the nn library offers, in one include (plus autograd and the tensor library).
#pragma once

#include "autograd/autograd.h"
#include "nn/checkpoint.h"
#include "nn/clip_grad.h"
#include "nn/data/data.h"
#include "nn/attention.h"
#include "nn/functional.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "nn/optim/adam.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/optimizer.h"
#include "nn/optim/sgd.h"
#include "nn/serialize.h"
#include "nn/summary_writer.h"
