// init_process_group, the default group and new_group; the registries of backends and init
// methods they pick from (init.h).
#include <ember/distributed/init.h>

#include <algorithm>
#include <mutex>

#include <ember/distributed/detail/environment.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/trace_clock.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/observe/log.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist {

namespace {

struct Backend {
  BackendFactory factory;
  BackendTraits traits;
};

// Backends and init methods, process-wide. A function-local static, so registering from a static
// initializer is safe whatever the order in which the libraries' initializers run.
struct Registry {
  std::mutex mu;
  std::map<std::string, Backend> backends;
  std::vector<InitMethod> init_methods;  // highest priority first, then in registration order
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: used from static destructors' time
  return *r;
}

// The default group and the groups new_group made: one per process, or one per thread for a
// backend with default_group_per_thread (threads).
struct World {
  std::mutex mu;
  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> world;
  std::string backend;
  std::string master_addr;
  int next_group = 1;
  std::vector<std::shared_ptr<ProcessGroup>> groups;
};

World& process_world() {
  static World* w = new World();  // never destroyed: groups may outlive static destruction
  return *w;
}

// Set while this thread holds a per-thread default group.
thread_local std::unique_ptr<World> t_world;

World& state() { return t_world ? *t_world : process_world(); }

// The backend `name`, or ValueError naming `op` and the registered ones.
Backend find_backend(const char* op, const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.backends.find(name);
  if (it != r.backends.end()) return it->second;
  std::string known;
  for (const auto& [n, b] : r.backends) known += (known.empty() ? "" : ", ") + n;
  throw ValueError(detail::str_cat("[", op, "] unknown backend '", name, "' (available: ", known,
                                   ")"));
}


// The rendezvous for `o`: its store when given, else the first init method taking the URL.
Rendezvous meet(const InitOptions& o, Duration timeout) {
  if (o.store) {
    EMBER_CHECK(o.init_method.empty(), "[init_process_group] pass either a store or an "
                "init_method, not both (init_method '", o.init_method, "')");
    detail::check_rank_size(o.rank, o.world_size, "with a given store, pass rank and world_size");
    return {o.store, o.rank, o.world_size, "", nullptr};
  }
  const std::string url = o.init_method.empty() ? "env://" : o.init_method;
  std::vector<InitMethod> methods;
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    methods = registry().init_methods;
  }
  for (const InitMethod& m : methods) {
    if (m.accepts(url, o.backend)) return m.rendezvous(url, o, timeout);
  }
  std::string known;
  for (const InitMethod& m : methods) known += (known.empty() ? "" : ", ") + m.name;
  throw ValueError(detail::str_cat("[init_process_group] unsupported init_method '", url,
                                   "' (expected ", known, ")"));
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory, BackendTraits traits) {
  EMBER_CHECK(!name.empty() && factory, "[register_backend] needs a name and a factory");
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().backends[name] = Backend{std::move(factory), traits};
}

std::vector<std::string> registered_backends() {
  std::lock_guard<std::mutex> lock(registry().mu);
  std::vector<std::string> names;
  for (const auto& [name, b] : registry().backends) names.push_back(name);
  return names;
}

bool is_backend_available(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry().mu);
  const auto it = registry().backends.find(name);
  return it != registry().backends.end() && it->second.traits.built;
}

void register_init_method(InitMethod method) {
  EMBER_CHECK(!method.name.empty() && method.accepts && method.rendezvous,
              "[register_init_method] needs a name, accepts and rendezvous");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& m = r.init_methods;
  m.erase(std::remove_if(m.begin(), m.end(),
                         [&](const InitMethod& x) { return x.name == method.name; }),
          m.end());
  const auto at = std::find_if(m.begin(), m.end(), [&](const InitMethod& x) {
    return x.priority < method.priority;
  });
  m.insert(at, std::move(method));
}

// EMBER_PG_TIMEOUT lets a job give up on a hung rank sooner than the backend's default.
Duration default_collective_timeout(const std::string& backend) {
  return timeout_from_env("EMBER_PG_TIMEOUT")
      .value_or(backend == "nccl" ? kDefaultNcclTimeout : kDefaultCollectiveTimeout);
}

std::string default_backend(bool cuda_available, bool nccl_built) {
  return cuda_available && nccl_built ? "nccl" : "gloo";
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  InitOptions o = options;
  if (o.backend.empty()) {
    const bool nccl_built = is_backend_available("nccl");
    o.backend = default_backend(cuda::is_available(), nccl_built);
    // Said at info: the same program picks differently on a machine with and without a GPU.
    logging::info("[init_process_group] no backend given: using ", o.backend,
                  o.backend == "nccl" ? " (this build has NCCL and the process sees a GPU)"
                  : nccl_built        ? " (no CUDA device is visible to this process)"
                                      : " (this build has no NCCL)");
  }
  const Backend backend = find_backend("init_process_group", o.backend);
  const bool per_thread = backend.traits.default_group_per_thread;
  World* w = per_thread ? t_world.get() : &process_world();
  if (w != nullptr) {
    std::lock_guard<std::mutex> lock(w->mu);
    EMBER_CHECK(!w->world, "[init_process_group] the default process group is already "
                "initialized (rank ", w->world ? w->world->rank() : -1, " of ",
                w->world ? w->world->size() : 0, per_thread ? ", on this thread" : "",
                "); call destroy_process_group first");
  }
  const Duration timeout = o.timeout ? *o.timeout : default_collective_timeout(o.backend);
  EMBER_CHECK(timeout.count() > 0, "[init_process_group] timeout must be positive, got ",
              timeout.count(), " ms");

  // The rendezvous may take a while; the state is only set at the end.
  Rendezvous r = meet(o, timeout);
  std::shared_ptr<ProcessGroup> pg = r.world;
  if (!pg) {
    pg = backend.factory(BackendArgs{std::make_shared<PrefixStore>("default_pg", r.store), r.rank,
                                     r.world_size, timeout, r.master_addr,
                                     /*global_ranks=*/{}});
  }
  if (trace::enabled() && pg) align_trace_clock(*pg);  // before any span worth aligning

  if (per_thread && !t_world) t_world = std::make_unique<World>();
  World& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  EMBER_CHECK(!s.world, "[init_process_group] another thread initialized the default group "
              "meanwhile");
  s.store = r.store;
  s.world = pg;
  logging::set_rank(pg->rank());
  s.backend = o.backend;
  s.master_addr = r.master_addr;
  s.next_group = 1;
  return pg;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().world != nullptr;
}

std::shared_ptr<ProcessGroup> default_group() {
  std::lock_guard<std::mutex> lock(state().mu);
  EMBER_CHECK(state().world,
              "[default_group] the default process group is not initialized; "
              "call init_process_group first");
  return state().world;
}

std::shared_ptr<Store> default_store() {
  std::lock_guard<std::mutex> lock(state().mu);
  EMBER_CHECK(state().store,
              "[default_store] the default process group is not initialized; "
              "call init_process_group first");
  return state().store;
}

int get_rank(const std::shared_ptr<ProcessGroup>& group) {
  if (group) return group->rank();
  return default_group()->rank();
}

int get_world_size(const std::shared_ptr<ProcessGroup>& group) {
  if (group) return group->size();
  return default_group()->size();
}

std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, std::optional<Duration> timeout,
                                        const std::string& backend_name) {
  World& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  EMBER_CHECK(s.world,
              "[new_group] the default process group is not initialized; call "
              "init_process_group first");
  const int world_size = s.world->size(), me = s.world->rank();
  if (ranks.empty()) {
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  }
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  EMBER_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "[new_group] ranks must be distinct, got [", listed, "]");
  EMBER_CHECK(sorted.front() >= 0 && sorted.back() < world_size,
              "[new_group] ranks must be in "
              "[0, ",
              world_size, "), got ", sorted.front(), "..", sorted.back());
  ranks = sorted;
  const std::string name = backend_name.empty() ? s.backend : backend_name;
  BackendFactory factory = find_backend("new_group", name).factory;
  const int id = s.next_group++;  // every rank counts every new_group, member or not
  auto store = std::make_shared<PrefixStore>(detail::str_cat("group_", id), s.store);
  const Duration t = timeout.value_or(s.world->timeout());
  const std::string master_addr = s.master_addr;
  const std::shared_ptr<ProcessGroup> parent = s.world;
  lock.unlock();

  const auto pos = std::find(ranks.begin(), ranks.end(), me);
  const int group_rank = pos == ranks.end() ? -1 : static_cast<int>(pos - ranks.begin());
  auto pg = factory(BackendArgs{store, group_rank, static_cast<int>(ranks.size()), t,
                                master_addr, ranks, parent});
  if (pg == nullptr) return nullptr;
  pg->set_global_ranks(ranks);
  lock.lock();
  s.groups.push_back(pg);
  return pg;
}

int get_global_rank(const ProcessGroup& group, int group_rank) {
  EMBER_CHECK(group_rank >= 0 && group_rank < group.size(), "[get_global_rank] group rank ",
              group_rank, " is not in a group of size ", group.size());
  return group.global_ranks()[group_rank];
}

int get_group_rank(const ProcessGroup& group, int global_rank) {
  const auto& g = group.global_ranks();
  const auto it = std::find(g.begin(), g.end(), global_rank);
  EMBER_CHECK(it != g.end(), "[get_group_rank] global rank ", global_rank,
              " is not a member of this group of size ", group.size());
  return static_cast<int>(it - g.begin());
}

void destroy_process_group() {
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::shared_ptr<ProcessGroup> world;
  std::shared_ptr<Store> store;
  {
    World& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    groups.swap(s.groups);
    world.swap(s.world);
    store.swap(s.store);
    s.backend.clear();
    s.master_addr.clear();
    s.next_group = 1;
  }
  t_world.reset();
  // Released here, outside the lock, groups before the store they use.
  groups.clear();
  world.reset();
  store.reset();
}

}  // namespace ember::dist
