// Data loading in one include: datasets, samplers, the DataLoader and (Fashion-)MNIST.
#pragma once

#include "nn/data/dataloader.h"
#include "nn/data/dataset.h"
#include "nn/data/mnist.h"
#include "nn/data/sampler.h"
