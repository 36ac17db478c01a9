// What the DDP, comm-hook, join and SyncBatchNorm tests share: forked gloo ranks on 127.0.0.1
// and checks that throw (in a child) naming what differs.
#pragma once

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/conv.h>
#include <ember/nn/layers/flatten.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/module.h>
#include <ember/nn/layers/pooling.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/store/store_test_util.h"

namespace ember::test {

/// Runs body(rank, store) in n forked ranks, each a client of one TCPStoreServer on an
/// OS-picked port of 127.0.0.1; every rank's failure is reported here.
inline void run_store_children(
    int n, const std::function<void(int, std::shared_ptr<dist::TCPStore>)>& body) {
  using namespace std::chrono_literals;
  Children kids(n, [&](int rank, const std::string& port) {
    dist::TCPStoreOptions so;
    so.timeout = 60s;
    body(rank,
         std::make_shared<dist::TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so));
  });
  dist::TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  dist::TCPStoreServer server(o);
  kids.go(std::to_string(server.port()));
  expect_children_ok(kids.join());
}

/// Runs body(pg, rank) in n forked ranks joined into a gloo group (run_store_children).
/// `shm`: GlooOptions::shared_memory (then DDP's buckets all-reduce gradients in place).
inline void run_gloo_ranks(
    int n, const std::function<void(std::shared_ptr<dist::ProcessGroupGloo>, int)>& body,
    bool shm = true) {
  using namespace std::chrono_literals;
  run_store_children(n, [&](int rank, std::shared_ptr<dist::TCPStore> store) {
    dist::ProcessGroupGloo::GlooOptions go{60s, "127.0.0.1"};
    go.shared_memory = shm;
    auto pg = std::make_shared<dist::ProcessGroupGloo>(
        std::make_shared<dist::PrefixStore>("pg", store), rank, n, go);
    require(pg->uses_shared_memory() == (shm && n > 1), "uses_shared_memory()");
    body(pg, rank);
  });
}

/// Runs body(rank) in n forked ranks, each with the default process group over gloo
/// (init_process_group through run_store_children's store), destroyed after body. What body
/// needs that starts threads must be made in it (the parent must not start threads before it
/// forks).
inline void run_gloo_world(int n, const std::function<void(int rank)>& body) {
  using namespace std::chrono_literals;
  run_store_children(n, [&](int rank, std::shared_ptr<dist::TCPStore> store) {
    dist::init_process_group(
        {.backend = "gloo", .store = store, .rank = rank, .world_size = n, .timeout = 60s});
    body(rank);
    dist::destroy_process_group();
  });
}

/// Throws naming the tensor, the index and both values unless |got - want| <= tol*(1+|want|)
/// (a NaN on either side fails).
inline void require_close(const std::string& what, const Tensor& got, const Tensor& want,
                          double tol = 1e-5) {
  require(got.defined(), what + ": undefined");
  require(got.shape() == want.shape(), what + ": shape differs");
  const auto g = got.to(kFloat64).reshape({-1}).to_vector<double>();
  const auto w = want.to(kFloat64).reshape({-1}).to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(std::fabs(g[i] - w[i]) <= tol * (1 + std::fabs(w[i])))) {
      throw std::runtime_error(what + ": index " + std::to_string(i) + " got " +
                               std::to_string(g[i]) + " want " + std::to_string(w[i]));
    }
  }
}

/// Throws unless every rank holds bitwise the same parameters (and buffers, if asked) as rank 0.
inline void require_same_on_all_ranks(dist::ProcessGroup& pg, const nn::Module& m,
                                      bool buffers = false) {
  std::vector<Tensor> flat;
  for (const Tensor& p : m.parameters()) flat.push_back(p.detach().cpu().reshape({-1}).to(kFloat32));
  if (buffers) {
    for (const Tensor& b : m.buffers()) flat.push_back(b.detach().cpu().reshape({-1}).to(kFloat32));
  }
  Tensor mine = cat(flat, 0).contiguous();
  Tensor all = zeros({pg.size() * mine.numel()}, kFloat32);
  pg.allgather_into_tensor(all, mine)->wait();
  const auto v = all.to_vector<float>();
  const int64_t k = mine.numel();
  for (int r = 1; r < pg.size(); ++r) {
    for (int64_t i = 0; i < k; ++i) {
      require(v[r * k + i] == v[i], "element " + std::to_string(i) + " differs: rank 0 " +
                                        std::to_string(v[i]) + ", rank " + std::to_string(r) +
                                        " " + std::to_string(v[r * k + i]));
    }
  }
}

/// Inputs and targets of a regression batch, and rank `rank`'s equal slice of it.
struct Batch {
  Tensor x, y;
};
inline Batch slice(const Batch& b, int rank, int n) {
  const int64_t per = b.x.size(0) / n;
  return {b.x.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}
inline Batch to_device(const Batch& b, Device d) { return {b.x.to(d), b.y.to(d)}; }

/// A small CNN (conv, ReLU, max-pool, flatten, linear) with seeded initial weights, on the CPU:
/// inputs [N, 1, 8, 8], outputs [N, 3]. With a bucket cap under 12 bytes each parameter gets its own bucket.
inline std::shared_ptr<nn::Sequential> make_cnn(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(1, 4, 3, nn::Conv2dOptions{.padding = 1}),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 4 * 4, 3));
}
/// A regression batch for make_cnn, on the CPU.
inline Batch cnn_batch(uint64_t seed, int64_t rows) {
  manual_seed(seed);
  return {randn({rows, 1, 8, 8}), randn({rows, 3})};
}

inline Tensor loss_of(nn::Module& m, const Batch& b) {
  return nn::functional::mse_loss(m.forward(b.x), b.y);
}

}  // namespace ember::test
