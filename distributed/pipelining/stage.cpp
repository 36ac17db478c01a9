// Pipeline stages (stage.h).
#include <ember/distributed/pipelining/stage.h>

#include <ember/distributed/init.h>

namespace ember::dist::pipelining {

SequentialPart::SequentialPart(const nn::Sequential& model, int64_t begin, int64_t end)
    : begin_(begin), end_(end) {
  EMBER_CHECK(0 <= begin && begin < end && end <= static_cast<int64_t>(model.size()),
              "[SequentialPart] expected 0 <= begin < end <= ", model.size(), ", got [", begin,
              ", ", end, ")");
  for (int64_t i = begin; i < end; ++i) {
    modules_.push_back(register_module(std::to_string(i), model[i]));
  }
}

Tensor SequentialPart::forward(const Tensor& input) {
  Tensor x = input;
  for (const auto& m : modules_) x = (*m)(x);  // through operator(): hooks and layouts run
  return x;
}

std::vector<std::shared_ptr<SequentialPart>> split_sequential(const nn::Sequential& model,
                                                              const std::vector<int64_t>& boundaries) {
  const int64_t n = static_cast<int64_t>(model.size());
  std::vector<std::shared_ptr<SequentialPart>> parts;
  int64_t begin = 0;
  for (size_t i = 0; i <= boundaries.size(); ++i) {
    const int64_t end = i < boundaries.size() ? boundaries[i] : n;
    EMBER_CHECK(begin < end && end <= n, "[split_sequential] boundaries must increase strictly "
                "inside (0, ", n, ") for a Sequential of ", n, " modules; boundary ", i, " is ",
                end, " after ", begin);
    parts.push_back(std::make_shared<SequentialPart>(model, begin, end));
    begin = end;
  }
  return parts;
}

std::vector<std::shared_ptr<SequentialPart>> split_sequential_evenly(const nn::Sequential& model,
                                                                     int num_stages) {
  const int64_t n = static_cast<int64_t>(model.size());
  EMBER_CHECK(num_stages >= 1 && n % num_stages == 0, "[split_sequential_evenly] ", n,
              " modules do not divide into ", num_stages, " stages of equal length");
  std::vector<int64_t> cuts;
  for (int s = 1; s < num_stages; ++s) cuts.push_back(s * (n / num_stages));
  return split_sequential(model, cuts);
}

PipelineStage::PipelineStage(std::shared_ptr<nn::Module> submodule, int stage_index,
                             int num_stages, Device device, std::shared_ptr<ProcessGroup> group,
                             PipelineStageOptions options)
    : submodule_(std::move(submodule)),
      stage_index_(stage_index),
      num_stages_(num_stages),
      device_(device),
      group_(group ? std::move(group) : default_group()),
      options_(std::move(options)) {
  EMBER_CHECK(submodule_ != nullptr, "[PipelineStage] expected a module, got null");
  EMBER_CHECK(num_stages >= 1 && stage_index >= 0 && stage_index < num_stages,
              "[PipelineStage] expected 0 <= stage_index < num_stages, got stage ", stage_index,
              " of ", num_stages);
}

}  // namespace ember::dist::pipelining
