// Data loading in one include: datasets, samplers, the DataLoader and (Fashion-)MNIST.
#pragma once

#include <ember/nn/data/dataloader.h>
#include <ember/nn/data/dataset.h>
#include <ember/nn/data/mnist.h>
#include <ember/nn/data/sampler.h>
