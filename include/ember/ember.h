// Ember in one include: tensors, autograd, nn (layers, losses, optimizers, data, checkpoints,
// mixed precision) and distributed training (process groups, DDP, ZeRO, FSDP, sharded
// checkpoints, comm hooks, compression, local SGD).
// Link Ember::ember (CMake) or `pkg-config --libs ember`.
#pragma once

#include <ember/distributed/ddp/amp.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/compression_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/hook_registry.h>
#include <ember/distributed/ddp/local_sgd.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/distributed/ddp/sync_batch_norm.h>
#include <ember/distributed/flight_recorder.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sampler.h>
#include <ember/distributed/process_group.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/checkpoint/model_checkpoint.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/distributed/sharding/zero_hook.h>
#include <ember/nn/amp/autocast.h>
#include <ember/nn/amp/grad_scaler.h>
#include <ember/nn/layers/multihead_attention.h>
#include <ember/nn/nn.h>
#include <ember/nn/layers/transformer.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/gpu/cudnn.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/version.h>
