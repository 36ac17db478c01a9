#include <ember/distributed/sampler.h>

#include <ember/distributed/init.h>
#include <ember/distributed/process_group.h>
#include <ember/tensor/error.h>

namespace ember::dist {

std::shared_ptr<nn::data::DistributedSampler> distributed_sampler(
    int64_t dataset_size, const DistributedSamplerOptions& options) {
  std::shared_ptr<ProcessGroup> group = options.group;
  if (!group) {
    EMBER_CHECK(is_initialized(),
                "[distributed_sampler] no group given and the default process group is not "
                "initialized: call dist::init_process_group() first, pass options.group, or "
                "give the replicas and the rank to nn::data::DistributedSampler yourself");
    group = default_group();
  }
  EMBER_CHECK(group->rank() >= 0 && group->rank() < group->size(),
              "[distributed_sampler] this process is not a member of the group (rank ",
              group->rank(), " of ", group->size(), ")");
  return std::make_shared<nn::data::DistributedSampler>(dataset_size, group->size(),
                                                        group->rank(), options.shuffle,
                                                        options.seed, options.drop_last);
}

std::shared_ptr<nn::data::DistributedSampler> distributed_sampler(
    const nn::data::Dataset& dataset, const DistributedSamplerOptions& options) {
  return distributed_sampler(dataset.size(), options);
}

}  // namespace ember::dist
