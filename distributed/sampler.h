// torch.utils.data.DistributedSampler(dataset) as PyTorch users write it: the number of
// replicas and this replica's rank come from the default process group (or a given one), so a
// training loop does not spell them out. nn::data::DistributedSampler (nn/data/sampler.h) has
// the sampling itself and takes them explicitly: nn cannot see process groups.
#pragma once

#include <cstdint>
#include <memory>

#include <ember/nn/data/dataset.h>
#include <ember/nn/data/sampler.h>

namespace ember::dist {

class ProcessGroup;

struct DistributedSamplerOptions {
  /// The group whose ranks share the data; null: the default group (init_process_group's).
  std::shared_ptr<ProcessGroup> group;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

/// This rank's share of `dataset_size` examples, split over the group's ranks with
/// torch.utils.data.DistributedSampler's semantics (nn::data::DistributedSampler; call
/// set_epoch each epoch). Throws ValueError, saying what to do, when no group is given and the
/// default group is not initialized, or when this process is not a member of the group.
std::shared_ptr<nn::data::DistributedSampler> distributed_sampler(
    int64_t dataset_size, const DistributedSamplerOptions& options = {});
/// The same over `dataset`'s size.
std::shared_ptr<nn::data::DistributedSampler> distributed_sampler(
    const nn::data::Dataset& dataset, const DistributedSamplerOptions& options = {});

}  // namespace ember::dist
