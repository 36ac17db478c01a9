// End to end: a small model trained on a slice of Fashion-MNIST with the nn stack (MNIST
// reader, DataLoader, Sequential of layers, cross_entropy, SGD with momentum) must bring its
// loss well below where it started and classify held-out images far better than chance.
#include <gtest/gtest.h>

#include <filesystem>

#include <ember/nn/data/data.h>
#include <ember/nn/layers.h>
#include <ember/nn/loss.h>
#include <ember/nn/optim/sgd.h>

namespace ember::nn {
namespace {

using functional::cross_entropy;

constexpr const char* kRoot = "/usr/share/datasets/fashion-mnist";

TEST(Train, FashionMnistSliceLossFallsAndAccuracyRises) {
  if (!std::filesystem::exists(std::string(kRoot) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed at " << kRoot
                 << " (Debian package dataset-fashion-mnist)";
  }
  manual_seed(0);
  data::MNIST train(kRoot, /*train=*/true, data::Normalization{0.2860, 0.3530});
  data::MNIST test(kRoot, /*train=*/false, data::Normalization{0.2860, 0.3530});
  // 4096 training images, 1024 test images.
  auto all = [](int64_t n) {
    std::vector<int64_t> idx(n);
    for (int64_t i = 0; i < n; ++i) idx[i] = i;
    return idx;
  };
  auto slice = [&](const data::Dataset& ds, int64_t n) {
    const data::Batch b = ds.get_batch(all(n));
    return std::make_shared<data::TensorDataset>(b.data, b.target);
  };
  auto train_set = slice(train, 4096);
  auto test_set = slice(test, 1024);
  data::DataLoader loader(train_set, {.batch_size = 64, .shuffle = true, .seed = 1});

  auto model = std::make_shared<Sequential>(
      std::make_shared<Flatten>(), std::make_shared<Linear>(784, 128),
      std::make_shared<ReLU>(), std::make_shared<Linear>(128, 10));
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});

  auto eval = [&](const data::TensorDataset& ds) {
    NoGradGuard no_grad;
    model->eval();
    const data::Batch b = ds.get_batch(all(ds.size()));
    const Tensor logits = model->forward(b.data);
    const double loss = cross_entropy(logits, b.target).item<float>();
    const double acc = eq(argmax(logits, 1), b.target).to(kFloat32).mean().item<float>();
    model->train();
    return std::pair{loss, acc};
  };

  const auto [loss0, acc0] = eval(*train_set);
  for (int epoch = 0; epoch < 3; ++epoch) {
    loader.set_epoch(epoch);
    for (const data::Batch& b : loader) {
      opt.zero_grad();
      cross_entropy(model->forward(b.data), b.target).backward();
      opt.step();
    }
  }
  const auto [loss1, acc1] = eval(*train_set);
  const auto [test_loss, test_acc] = eval(*test_set);
  std::printf("[ TRAIN    ] train loss %.3f -> %.3f, train acc %.3f -> %.3f, test acc %.3f\n", loss0,
              loss1, acc0, acc1, test_acc);
  EXPECT_GT(loss0, 2.0) << "an untrained 10-way classifier starts near ln(10) = 2.3";
  EXPECT_LT(loss1, 0.5 * loss0);
  EXPECT_GT(test_acc, 0.7) << "chance is 0.1";
}

}  // namespace
}  // namespace ember::nn
