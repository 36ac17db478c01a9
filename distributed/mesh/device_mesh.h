// DeviceMesh: the ranks of a job laid out as an n-dimensional array, with one process group per
// dimension (torch.distributed.device_mesh). Tensor parallelism works along one dimension ("tp":
// the ranks of a node), data parallelism along another ("dp": across nodes); DTensor places a
// tensor on a mesh, and FSDP or DDP take the group of one of its dimensions.
//
//   dist::init_process_group({.backend = "gloo"});          // 8 ranks
//   auto mesh = dist::init_device_mesh("cpu", {2, 4}, {"dp", "tp"});
//   auto tp = (*mesh)["tp"];                                  // 1-D: the 4 ranks of my row
//   tp->get_group()->allreduce(t)->wait();                    // among them
//   mesh->get_coordinate();                                   // {my dp index, my tp index}
//
// Rank r of the world sits at the row-major position r of the mesh (init_device_mesh), or where
// a given layout puts it (from_group). Each dimension's groups are created once, when the mesh
// is made, by new_group over the default group's backend (so over gloo they keep its shared-
// memory paths, over NCCL they come from ncclCommSplit, over threads each is a world of its
// own); slicing a mesh reuses them. Making a mesh, and flattening one, is collective: every rank
// of the world calls it with the same arguments, in the same order as its other group creations
// (new_group's rule). Afterwards a mesh is read-only and may be used from any thread.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

class DeviceMesh : public std::enable_shared_from_this<DeviceMesh> {
 public:
  /// Use init_device_mesh or from_group.
  struct Layout {
    std::vector<int64_t> shape;      ///< the size of each dimension
    std::vector<std::string> names;  ///< one per dimension, distinct ("" for unnamed)
    std::vector<int> ranks;          ///< global ranks, row-major over shape
  };
  DeviceMesh(Device device, Layout layout, std::vector<std::shared_ptr<ProcessGroup>> groups,
             std::shared_ptr<const DeviceMesh> root, std::vector<int> root_dims);

  /// "cpu" or "cuda".
  std::string device_type() const { return device_.is_cpu() ? "cpu" : "cuda"; }
  /// This rank's device on the mesh: the CPU, or the CUDA device current when it was made.
  Device device() const { return device_; }
  int ndim() const { return static_cast<int>(layout_.shape.size()); }
  /// The number of ranks along `dim` (a name or an index; -1 or none: the whole mesh).
  int64_t size() const;
  int64_t size(int dim) const;
  int64_t size(const std::string& dim) const { return size(dim_index(dim)); }
  const std::vector<int64_t>& shape() const { return layout_.shape; }
  const std::vector<std::string>& dim_names() const { return layout_.names; }
  /// Every rank of the mesh (global ranks), row-major over shape().
  const std::vector<int>& ranks() const { return layout_.ranks; }

  /// The group of this rank's ranks along `dim` (its other coordinates fixed). A 1-D mesh may
  /// omit `dim`. Throws ValueError for a name that is not a dimension or an index out of range.
  std::shared_ptr<ProcessGroup> get_group(int dim) const;
  std::shared_ptr<ProcessGroup> get_group(const std::string& dim) const;
  std::shared_ptr<ProcessGroup> get_group() const;
  /// The groups of every dimension, in order.
  const std::vector<std::shared_ptr<ProcessGroup>>& get_all_groups() const { return groups_; }
  /// This rank's index along `dim` (its rank in get_group(dim)).
  int get_local_rank(int dim) const;
  int get_local_rank(const std::string& dim) const { return get_local_rank(dim_index(dim)); }
  int get_local_rank() const;
  /// This rank's position on every dimension.
  const std::vector<int>& get_coordinate() const { return coordinate_; }
  /// The index of dimension `name`; ValueError naming the mesh's dimensions otherwise.
  int dim_index(const std::string& name) const;

  /// The 1-D mesh of dimension `name` through this rank (PyTorch's mesh["tp"]); its group is
  /// this mesh's, no new group is made.
  std::shared_ptr<DeviceMesh> operator[](const std::string& name) const;
  /// The sub-mesh of the named dimensions through this rank, in the order given (mesh["dp",
  /// "tp"]); its groups are this mesh's.
  std::shared_ptr<DeviceMesh> slice(const std::vector<std::string>& names) const;
  /// The 1-D mesh of every rank of this mesh (PyTorch's `_flatten`), named `name` (default: the
  /// dimension names joined by `"_"`). Collective over the world: makes one group per copy of this
  /// mesh in the world mesh it was sliced from, the first time; later calls reuse them.
  std::shared_ptr<DeviceMesh> flatten(const std::string& name = "") const;

  /// A mesh over groups that exist already (PyTorch's DeviceMesh.from_group): one group gives a
  /// 1-D mesh of its ranks; several give a mesh whose dimension i is groups[i], laid out as
  /// `layout` (shape, names and global ranks, required then), which must put this rank where
  /// every group's rank says. Makes no group; not collective. Throws ValueError when the groups
  /// do not match the layout or this rank is not in it.
  static std::shared_ptr<DeviceMesh> from_group(std::vector<std::shared_ptr<ProcessGroup>> groups,
                                                const std::string& device_type,
                                                std::optional<Layout> layout = {});

  /// "DeviceMesh(cpu, (dp=2, tp=4), rank 5 at (1, 1))".
  std::string str() const;

  /// The same mesh: the same device, layout (shape, names, ranks) and process groups, so a
  /// sub-mesh taken twice (mesh["tp"], a new object each time) equals itself, as PyTorch compares
  /// meshes by value. Meshes over other groups with the same ranks differ: their collectives do.
  bool operator==(const DeviceMesh& o) const;
  bool operator!=(const DeviceMesh& o) const { return !(*this == o); }

 private:
  std::shared_ptr<DeviceMesh> sub_mesh(const std::vector<int>& dims) const;
  const DeviceMesh& root() const { return root_ ? *root_ : *this; }

  Device device_;
  Layout layout_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
  std::vector<int> coordinate_;
  // The world mesh this one was sliced from (null: this is one), and which of its dimensions
  // this mesh's are: flatten needs the whole layout to create every copy's group in order.
  std::shared_ptr<const DeviceMesh> root_;
  std::vector<int> root_dims_;
  // On the root: the groups flatten made, by the root dimensions they flatten.
  mutable std::mutex flat_mu_;
  mutable std::map<std::vector<int>, std::shared_ptr<ProcessGroup>> flattened_;
};

/// Lays the default group's ranks out as `shape` (row-major: rank r at position r) and makes
/// every dimension's groups (PyTorch's init_device_mesh). `device_type`: "cpu", or "cuda" (the
/// mesh's device is then the current CUDA device, which the caller sets first: the local rank's
/// GPU, or one GPU shared by rank threads). `names`: one per dimension, distinct, or none.
/// Collective over the world. Throws ValueError when the shape does not multiply to the world
/// size, a size is not positive, the names are not one per dimension or repeat, or the device
/// type is neither; and the default group's errors.
std::shared_ptr<DeviceMesh> init_device_mesh(const std::string& device_type,
                                             const std::vector<int64_t>& shape,
                                             const std::vector<std::string>& names = {});

}  // namespace ember::dist
