// DeviceMesh: layouts, each dimension's groups (which ranks, that they reduce among exactly
// those), slicing and flattening, from_group, and the errors; 4- and 8-rank meshes as rank
// threads of the "threads" backend, and a 2 x 2 mesh as processes over gloo's shared memory.
#include <ember/distributed/mesh/device_mesh.h>

#include <gtest/gtest.h>

#include <numeric>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/ops/creation.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::require;

// Rank threads' groups time out well before ctest's limit if a rank fails to join.
constexpr Duration kTimeout = 60s;

// The sum over a group of each member's global rank.
int64_t rank_sum(ProcessGroup& g, int global_rank) {
  Tensor t = full({1}, static_cast<double>(global_rank), TensorOptions(kInt64));
  g.allreduce(t)->wait();
  return t.item<int64_t>();
}

void require_eq(const std::string& what, int64_t got, int64_t want) {
  require(got == want, what + ": got " + std::to_string(got) + ", expected " + std::to_string(want));
}

TEST(DeviceMesh, TwoByFourOverRankThreads) {
  run_rank_threads(8, [](int r) {
    auto mesh = init_device_mesh("cpu", {2, 4}, {"dp", "tp"});
    require(mesh->ndim() == 2 && mesh->size() == 8 && mesh->size("tp") == 4 &&
                mesh->size(0) == 2,
            "sizes");
    require(mesh->get_coordinate() == std::vector<int>({r / 4, r % 4}), "coordinate");
    require_eq("local rank along tp", mesh->get_local_rank("tp"), r % 4);
    require_eq("local rank along dp", mesh->get_local_rank("dp"), r / 4);
    // tp: my row (r / 4) of the 2 x 4 layout; dp: my column.
    const int row = r / 4, col = r % 4;
    require_eq("tp group sum", rank_sum(*mesh->get_group("tp"), r), 4 * row * 4 + 6);
    require_eq("dp group sum", rank_sum(*mesh->get_group("dp"), r), col + (col + 4));
    require(mesh->get_group("tp")->global_ranks() ==
                std::vector<int>({4 * row, 4 * row + 1, 4 * row + 2, 4 * row + 3}),
            "tp group's global ranks");
    // mesh["tp"]: the same group, not a new one.
    auto tp = (*mesh)["tp"];
    require(tp->ndim() == 1 && tp->get_group() == mesh->get_group("tp") &&
                tp->get_local_rank() == col && tp->ranks() == mesh->get_group("tp")->global_ranks(),
            "mesh[\"tp\"]");
    // Reordered slice, then flatten: one group of all 8.
    auto td = mesh->slice({"tp", "dp"});
    require(td->shape() == std::vector<int64_t>({4, 2}) &&
                td->get_coordinate() == std::vector<int>({col, row}),
            "slice(tp, dp)");
    auto flat = mesh->flatten();
    require(flat->dim_names() == std::vector<std::string>({"dp_tp"}) && flat->size() == 8,
            "flatten");
    require_eq("flattened group sum", rank_sum(*flat->get_group(), r), 28);
    require(mesh->flatten()->get_group() == flat->get_group(), "flatten reuses its group");
    require(mesh->str() == "DeviceMesh(cpu, (dp=2, tp=4), rank " + std::to_string(r) + " at (" +
                               std::to_string(row) + ", " + std::to_string(col) + "))",
            "str(): " + mesh->str());
  }, kTimeout);
}

// pp x dp x tp = 2 x 2 x 2: the (dp, tp) sub-mesh flattened is the 4 ranks of my pp stage.
TEST(DeviceMesh, ThreeDimensionsAndTheFlattenedSliceOfTwo) {
  run_rank_threads(8, [](int r) {
    auto mesh = init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
    const int pp = r / 4;
    auto dp_tp = mesh->slice({"dp", "tp"})->flatten();
    require(dp_tp->ranks() == std::vector<int>({4 * pp, 4 * pp + 1, 4 * pp + 2, 4 * pp + 3}),
            "flattened (dp, tp) ranks");
    require_eq("flattened (dp, tp) sum", rank_sum(*dp_tp->get_group(), r), 16 * pp + 6);
    require_eq("pp group sum", rank_sum(*mesh->get_group("pp"), r), (r % 4) * 2 + 4);
    require_eq("tp group sum", rank_sum(*(*mesh)["tp"]->get_group(), r), (r / 2) * 4 + 1);
  }, kTimeout);
}

TEST(DeviceMesh, OneDimensionOverTheWorldIsTheDefaultGroup) {
  run_rank_threads(4, [](int r) {
    auto mesh = init_device_mesh("cpu", {4});
    require(mesh->get_group() == default_group(), "a 1-D mesh over the world uses the world");
    require_eq("sum", rank_sum(*mesh->get_group(), r), 6);
  }, kTimeout);
}

TEST(DeviceMesh, ErrorsNameWhatIsWrong) {
  run_rank_threads(4, [](int r) {
    expect_error([] { init_device_mesh("cpu", {3, 2}); },
                 {"[init_device_mesh] mesh shape (3, 2) holds 6 ranks, but the world has 4"});
    expect_error([] { init_device_mesh("cpu", {4, 0}); },
                 {"every dimension's size must be positive"});
    expect_error([] { init_device_mesh("tpu", {4}); },
                 {"device_type must be \"cpu\" or \"cuda\", got \"tpu\""});
    expect_error([] { init_device_mesh("cpu", {2, 2}, {"dp"}); },
                 {"expected one name per dimension (2), got 1"});
    expect_error([] { init_device_mesh("cpu", {2, 2}, {"dp", "dp"}); },
                 {"dimension name 'dp' is given twice"});
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    expect_error([&] { mesh->get_group("pp"); },
                 {"'pp' is not a dimension of DeviceMesh(cpu, (dp=2, tp=2)", "'dp', 'tp'"});
    expect_error([&] { (*mesh)["sp"]; }, {"'sp' is not a dimension"});
    expect_error([&] { mesh->get_group(); }, {"needs a 1-D mesh"});
    expect_error([&] { mesh->size(-2); }, {"dimension -2 is out of range", "(-1: the whole mesh)"});
    EXPECT_EQ(mesh->size(-1), 4);
    // An unnamed mesh has no dimension "" (it took the first).
    auto unnamed = init_device_mesh("cpu", {2, 2});
    expect_error([&] { (*unnamed)[""]; }, {"'' is not a dimension", "unnamed"});
    expect_error([&] { unnamed->get_group(""); }, {"'' is not a dimension"});
    // from_group with a layout that leaves this rank out.
    DeviceMesh::Layout l{{2}, {"x"}, {r == 0 ? 1 : 0, r == 0 ? 2 : 1}};
    if (r != 1) {
      expect_error([&] { DeviceMesh::from_group({mesh->get_group("tp")}, "cpu", l); },
                   {"is not in the mesh"});
    }
  }, kTimeout);
}

TEST(DeviceMesh, FromGroupWrapsExistingGroups) {
  run_rank_threads(4, [](int r) {
    auto made = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto mesh = DeviceMesh::from_group(made->get_all_groups(), "cpu",
                                       DeviceMesh::Layout{{2, 2}, {"a", "b"}, {0, 1, 2, 3}});
    require(mesh->get_coordinate() == made->get_coordinate(), "same coordinates");
    require(mesh->get_group("b") == made->get_group("tp"), "same groups, none made");
    // Equality is by value: device, layout and groups; other names make another mesh.
    require(*(*made)["tp"] == *(*made)["tp"] && *(*made)["tp"] != *(*made)["dp"] &&
                *made == *made->slice({"dp", "tp"}) && *mesh != *made,
            "meshes compare by value");
    require(*DeviceMesh::from_group(made->get_all_groups(), "cpu",
                                    DeviceMesh::Layout{{2, 2}, {"a", "b"}, {0, 1, 2, 3}}) == *mesh,
            "the same groups and layout twice");
    auto one = DeviceMesh::from_group({default_group()}, "cpu");
    require(one->size() == 4 && one->get_local_rank() == r, "1-D from the world");
    // Groups that contradict the layout (tp's group as dimension 0): ranks 1 and 2 sit where
    // their groups' ranks say otherwise (ranks 0 and 3 cannot tell: their indices agree).
    if (r == 1 || r == 2) {
      expect_error([&] {
        DeviceMesh::from_group({made->get_group("tp"), made->get_group("dp")}, "cpu",
                               DeviceMesh::Layout{{2, 2}, {"a", "b"}, {0, 1, 2, 3}});
      }, {"[DeviceMesh] rank", "of that dimension's group"});
    }
  }, kTimeout);
}

// Processes over gloo: a 2 x 2 mesh's groups are gloo groups over shared memory.
TEST(DeviceMeshProcesses, TwoByTwoOverGlooSharedMemory) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  test::Children kids(4, [](int rank, const std::string& port) {
    TCPStoreOptions so;
    so.timeout = 60s;
    auto store = std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    InitOptions o;
    o.backend = "gloo";
    o.store = store;
    o.rank = rank;
    o.world_size = 4;
    o.timeout = 60s;
    init_process_group(o);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    for (const char* dim : {"dp", "tp"}) {
      auto g = std::dynamic_pointer_cast<ProcessGroupGloo>(mesh->get_group(dim));
      require(g && g->uses_shared_memory(), std::string(dim) + ": a gloo group over shared memory");
    }
    require_eq("tp sum", rank_sum(*mesh->get_group("tp"), rank), (rank / 2) * 4 + 1);
    require_eq("dp sum", rank_sum(*mesh->get_group("dp"), rank), (rank % 2) * 2 + 2);
    require_eq("flat sum", rank_sum(*mesh->flatten()->get_group(), rank), 6);
    destroy_process_group();
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

}  // namespace
}  // namespace ember::dist
