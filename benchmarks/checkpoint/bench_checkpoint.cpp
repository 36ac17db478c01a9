// Distributed checkpoints measured (docs/checkpoints.md, docs/benchmarks.md): a GPT-2
// 124M-shaped model (examples/gpt_model.h at --layers 12 --dim 768 --heads 12 --context 1024
// --vocab 50257) and its AdamW state, replicated on --ranks forked processes over gloo (DDP's
// layout: each rank writes its share of every replicated tensor), alternating in each round:
//   save    dist::checkpoint::save, beside `dd conv=fsync` writing as many bytes (each rank its
//           share, at once) into the same directory: the disk's sequential write bandwidth;
//   async   AsyncSaver::save: how long it blocks the caller, beside the synchronous save;
//   overlap AsyncSaver::save staged in the background during a training step's forward and
//           backward (one sequence of --tokens), wait_until_staged() before the optimizer step:
//           the step's time beside the same step without a save, the difference beside the
//           synchronous save;
//   load    dist::checkpoint::load (every piece's checksum checked), beside `dd` reading the
//           dd files back: warm (what was just written is in the page cache), and with --cold
//           after dropping the page cache (as root: /proc/sys/vm/drop_caches), from the disk.
// Medians of --repeats rounds; rank 0 prints a line per round and the medians.
//
//   bench_checkpoint [--ranks 2] [--repeats 3] [--dir DIR] [--layers 12] [--dim 768] [--tokens 128]
//                    [--cold]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "benchmarks/fork_ranks.h"
#include "examples/gpt_model.h"
#include <ember/distributed/checkpoint/checkpoint.h>
#include <ember/distributed/init.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>

using namespace ember;
namespace ckpt = ember::dist::checkpoint;
namespace fs = std::filesystem;

namespace {

struct Args {
  int ranks = 2;
  int repeats = 3;
  std::string dir;
  int64_t layers = 12, dim = 768, heads = 12, context = 1024, vocab = 50257;
  int64_t tokens = 128;  // the overlapped step's sequence
  bool cold = false;     // also load and read after dropping the page cache
};

// Writes dirty pages back and drops the page cache, so the next read comes from the disk.
void drop_page_cache() {
  if (std::system("sync && echo 3 > /proc/sys/vm/drop_caches") != 0) {
    throw std::runtime_error("--cold: cannot drop the page cache (needs root)");
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Runs a shell command; its time in seconds (the command must succeed).
double timed(const std::string& cmd) {
  const double t0 = now_s();
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("failed: " + cmd);
  return now_s() - t0;
}

int run_rank(const Args& a, int rank) {
  dist::init_process_group({.backend = "gloo"});
  auto pg = dist::default_group();
  manual_seed(0);
  auto model = std::make_shared<examples::GPT>(examples::GPTConfig{
      .vocab = a.vocab, .layers = a.layers, .heads = a.heads, .dim = a.dim, .context = a.context});
  nn::optim::AdamW opt(model->parameters(), {.lr = 1e-4});
  {  // one step, so that AdamW holds its moments
    Tensor x = zeros({1, 8}, kInt64);
    model->forward(x).sum().backward();
    opt.step();
    opt.zero_grad();
  }
  int64_t bytes = 0;
  for (const Tensor& p : model->parameters()) bytes += 3 * p.nbytes();  // weights, exp_avg, exp_avg_sq
  ckpt::State state = {{"model", ckpt::model(*model)}, {"optim", ckpt::optimizer(opt, *model)}};
  ckpt::AsyncSaver saver(pg);
  const std::string sync_dir = a.dir + "/sync", async_dir = a.dir + "/async";
  const std::string dd_file = a.dir + "/dd.rank" + std::to_string(rank);
  const int64_t share_mb = bytes / a.ranks / (1 << 20);
  std::vector<double> save_s, dd_write_s, async_block_s, async_total_s, load_s, dd_read_s,
      step_s, step_saving_s, cold_load_s, cold_dd_read_s;
  auto fwd_bwd = [&] {
    Tensor x = zeros({1, a.tokens}, kInt64);
    model->forward(x).sum().backward();
  };
  auto barrier = [&] { pg->barrier()->wait(); };
  for (int r = 0; r < a.repeats; ++r) {
    barrier();
    double t0 = now_s();
    ckpt::save(state, sync_dir, *pg);
    save_s.push_back(now_s() - t0);
    barrier();
    t0 = now_s();
    timed("dd if=/dev/zero of=" + dd_file + " bs=1M count=" + std::to_string(share_mb) +
          " conv=fsync status=none");
    barrier();
    dd_write_s.push_back(now_s() - t0);
    barrier();
    t0 = now_s();
    saver.save(state, async_dir);
    async_block_s.push_back(now_s() - t0);
    saver.wait();
    barrier();
    async_total_s.push_back(now_s() - t0);
    barrier();
    t0 = now_s();
    fwd_bwd();
    step_s.push_back(now_s() - t0);
    barrier();
    t0 = now_s();
    saver.save(state, async_dir, {}, /*stage_in_background=*/true);
    fwd_bwd();
    saver.wait_until_staged();
    step_saving_s.push_back(now_s() - t0);
    saver.wait();
    opt.zero_grad();
    barrier();
    t0 = now_s();
    ckpt::load(state, sync_dir, {.rank = rank});
    barrier();
    load_s.push_back(now_s() - t0);
    t0 = now_s();
    timed("dd if=" + dd_file + " of=/dev/null bs=1M status=none");
    barrier();
    dd_read_s.push_back(now_s() - t0);
    if (a.cold) {
      for (const bool is_load : {true, false}) {
        barrier();
        if (rank == 0) drop_page_cache();
        barrier();
        t0 = now_s();
        if (is_load) {
          ckpt::load(state, sync_dir, {.rank = rank});
        } else {
          timed("dd if=" + dd_file + " of=/dev/null bs=1M status=none");
        }
        barrier();
        (is_load ? cold_load_s : cold_dd_read_s).push_back(now_s() - t0);
      }
    }
    if (rank == 0) {
      std::printf("round %d: save %.2f s, dd write %.2f s, async blocks %.3f s (all %.2f s), step "
                  "%.3f s, saving %.3f s, load %.2f s, dd read %.2f s\n",
                  r + 1, save_s.back(), dd_write_s.back(), async_block_s.back(),
                  async_total_s.back(), step_s.back(), step_saving_s.back(), load_s.back(),
                  dd_read_s.back());
      std::fflush(stdout);
    }
  }
  if (rank == 0) {
    const double gb = static_cast<double>(bytes) / 1e9;
    const double s = median(save_s), w = median(dd_write_s), l = median(load_s),
                 rd = median(dd_read_s), ab = median(async_block_s);
    std::printf("state %.2f GB (%lld parameters with AdamW's two moments) over %d ranks, medians of %d:\n",
                gb, static_cast<long long>(bytes / 12), a.ranks, a.repeats);
    std::printf("  save   %.2f s  %.2f GB/s   dd write %.2f GB/s   ratio %.2fx\n", s, gb / s, gb / w, w / s);
    std::printf("  load   %.2f s  %.2f GB/s   dd read  %.2f GB/s   ratio %.2fx\n", l, gb / l, gb / rd, rd / l);
    if (a.cold) {
      const double cl = median(cold_load_s), cr = median(cold_dd_read_s);
      std::printf("  cold load %.2f s  %.2f GB/s   dd read %.2f GB/s   ratio %.2fx\n", cl, gb / cl,
                  gb / cr, cr / cl);
      std::printf("cold_load_s=%.4f\ncold_dd_read_s=%.4f\n", cl, cr);
    }
    std::printf("  async  blocks %.3f s = %.1f%% of the synchronous save (all of it %.2f s)\n", ab,
                100 * ab / s, median(async_total_s));
    std::vector<double> extra;
    for (size_t i = 0; i < step_s.size(); ++i) extra.push_back(step_saving_s[i] - step_s[i]);
    const double over = std::max(0.0, median(extra));
    std::printf("  overlapped: step %.3f s alone, %.3f s saving: +%.3f s = %.1f%% of the synchronous save\n",
                median(step_s), median(step_saving_s), over, 100 * over / s);
    // For benchmarks/checkpoint/run.py.
    std::printf("gb=%.4f\nsave_s=%.4f\nload_s=%.4f\nasync_block_s=%.4f\ndd_write_s=%.4f\ndd_read_s=%.4f\n"
                "overlap_extra_s=%.4f\n",
                gb, s, l, ab, w, rd, over);
  }
  fs::remove(dd_file);
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Distributed checkpoint save, async save and load against dd"};
  app.add_option("--ranks", a.ranks)->capture_default_str();
  app.add_option("--repeats", a.repeats)->capture_default_str();
  app.add_option("--dir", a.dir, "where to write (default: a fresh folder under /tmp)");
  app.add_option("--layers", a.layers)->capture_default_str();
  app.add_option("--dim", a.dim)->capture_default_str();
  app.add_option("--heads", a.heads)->capture_default_str();
  app.add_option("--context", a.context)->capture_default_str();
  app.add_option("--vocab", a.vocab)->capture_default_str();
  app.add_option("--tokens", a.tokens, "the overlapped step's sequence length")->capture_default_str();
  app.add_flag("--cold", a.cold, "also load and read from the disk, the page cache dropped (root)");
  CLI11_PARSE(app, argc, argv);
  bool made = false;
  if (a.dir.empty()) {
    char tmpl[] = "/tmp/bench_checkpoint_XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 1;
    a.dir = tmpl;
    made = true;
  }
  const int rc = bench::fork_ranks("bench_checkpoint", a.ranks, [&](int rank) { return run_rank(a, rank); });
  if (made) fs::remove_all(a.dir);
  return rc;
}
