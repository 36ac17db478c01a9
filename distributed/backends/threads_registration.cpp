// The threads backend's registration (init_process_group's "threads") and run_rank_threads
// over it: a group's ranks are threads of one process, which find the world their rank 0 made
// through the group's store.
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/tensor/ops/random.h>

namespace ember::dist {

using detail::str_cat;

namespace {

// The worlds of groups being created, by name: a group's ranks are threads of one process, so
// its store carries rank 0's key into this table, not the world itself. An entry holds its world
// until every rank has taken it, which rank 0 waits for: as with a real backend, making a group
// is a rendezvous of its members, so no rank can drop the world before the others found it.
struct Joining {
  std::shared_ptr<ThreadWorld> world;
  int joined = 0;
};
struct WorldTable {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Joining> worlds;
  uint64_t next = 0;
};
WorldTable& world_table() {
  static WorldTable* t = new WorldTable();  // never destroyed: groups may outlive statics
  return *t;
}

// Rank 0 makes the group's world, publishes its key and waits for the others to take it.
std::shared_ptr<ThreadWorld> meet_world(const BackendArgs& a) {
  constexpr const char* kKey = "threads_world";
  WorldTable& t = world_table();
  if (a.rank == 0) {
    auto world = ThreadWorld::create(a.size);
    std::string key;
    {
      std::lock_guard<std::mutex> lock(t.mu);
      key = str_cat(::getpid(), ":", t.next++);
      t.worlds[key] = Joining{world, 1};
    }
    a.store->set(kKey, Bytes(key.begin(), key.end()));
    std::unique_lock<std::mutex> lock(t.mu);
    const bool all = t.cv.wait_for(lock, a.timeout, [&] { return t.worlds[key].joined == a.size; });
    const int joined = t.worlds[key].joined;
    t.worlds.erase(key);
    if (!all) {
      throw DistTimeoutError(str_cat("[threads] rank 0 of ", a.size, ": only ", joined,
                                     " of the group's ranks joined it within ",
                                     a.timeout.count(), " ms"));
    }
    return world;
  }
  const Bytes v = a.store->get(kKey, a.timeout);
  const std::string key(v.begin(), v.end());
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.worlds.find(key);
  EMBER_CHECK(it != t.worlds.end(), "[threads] rank ", a.rank, " of ", a.size, ": rank 0's world '",
              key, "' is not in this process (", ::getpid(), "): every rank of the threads "
              "backend must be a thread of one process");
  std::shared_ptr<ThreadWorld> world = it->second.world;
  EMBER_CHECK(world->size() == a.size, "[threads] rank ", a.rank, ": rank 0 made a world of ",
              world->size(), " ranks, this rank expected ", a.size);
  ++it->second.joined;
  t.cv.notify_all();
  return world;
}

std::shared_ptr<ProcessGroup> make_threads(const BackendArgs& a) {
  if (a.rank < 0) return nullptr;  // not a member of this group
  std::shared_ptr<ThreadWorld> world = meet_world(a);
  // A sub-group's world fails with its parent's: an aborted rank thread ends them all.
  if (auto* parent = dynamic_cast<ProcessGroupThreads*>(a.parent.get()); parent && a.rank == 0) {
    parent->world()->adopt(world);
  }
  return std::make_shared<ProcessGroupThreads>(world, a.rank, ProcessGroup::Options{a.timeout});
}

const bool kThreadsRegistered = [] {
  register_backend("threads", make_threads, BackendTraits{.default_group_per_thread = true});
  return true;
}();

}  // namespace

void run_rank_threads(int size, const std::function<void(int rank)>& body, Duration timeout) {
  EMBER_CHECK(size >= 1, "[threads] run_rank_threads needs at least one rank, got ", size);
  auto store = std::make_shared<HashStore>();
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      // Each rank draws from a generator of its own, as a process would.
      Generator gen;
      set_thread_default_generator(&gen);
      try {
        InitOptions o;
        o.backend = "threads";
        o.store = store;
        o.rank = r;
        o.world_size = size;
        o.timeout = timeout;
        init_process_group(o);
        body(r);
      } catch (...) {
        const std::exception_ptr e = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) {
            first = e;
            first_rank = r;
          }
        }
        if (is_initialized()) {
          if (auto* pg = dynamic_cast<ProcessGroupThreads*>(default_group().get())) {
            pg->world()->abort(RankThreadError(r, size, e).what());
          }
        }
      }
      destroy_process_group();
      set_thread_default_generator(nullptr);
    });
  }
  for (auto& t : threads) t.join();
  if (first) throw RankThreadError(first_rank, size, first);
}

}  // namespace ember::dist
