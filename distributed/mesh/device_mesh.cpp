#include <ember/distributed/mesh/device_mesh.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include <ember/distributed/init.h>
#include <ember/tensor/gpu/cuda.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[DeviceMesh]";

int64_t product(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<>());
}

std::string shape_str(const std::vector<int64_t>& shape, const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "(";
  for (size_t d = 0; d < shape.size(); ++d) {
    os << (d ? ", " : "");
    if (d < names.size() && !names[d].empty()) os << names[d] << "=";
    os << shape[d];
  }
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

Device device_of(const std::string& device_type) {
  if (device_type == "cpu") return kCPU;
  EMBER_CHECK(device_type == "cuda", kOp, " device_type must be \"cpu\" or \"cuda\", got \"",
              device_type, "\"");
  return cuda_device(cuda::current_device());
}

void check_layout(const DeviceMesh::Layout& l) {
  EMBER_CHECK(!l.shape.empty(), kOp, " a mesh needs at least one dimension");
  for (int64_t s : l.shape) {
    EMBER_CHECK(s > 0, kOp, " every dimension's size must be positive, got ",
                shape_str(l.shape, l.names));
  }
  EMBER_CHECK(l.names.size() == l.shape.size(), kOp, " expected one name per dimension (",
              l.shape.size(), "), got ", l.names.size());
  std::set<std::string> seen;
  for (const std::string& n : l.names) {
    EMBER_CHECK(n.empty() || seen.insert(n).second, kOp, " dimension name '", n,
                "' is given twice");
  }
  EMBER_CHECK(static_cast<int64_t>(l.ranks.size()) == product(l.shape), kOp, " shape ",
              shape_str(l.shape, l.names), " holds ", product(l.shape), " ranks, but ",
              l.ranks.size(), " were given");
}

// Row-major strides of `shape`.
std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

// The flat positions, in row-major order over `dims` (in that order), of the points whose other
// coordinates are those of `at`.
std::vector<int64_t> plane(const std::vector<int64_t>& shape, const std::vector<int>& dims,
                           const std::vector<int>& at) {
  const std::vector<int64_t> stride = strides_of(shape);
  int64_t base = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (std::find(dims.begin(), dims.end(), static_cast<int>(d)) == dims.end()) {
      base += at[d] * stride[d];
    }
  }
  std::vector<int64_t> out{base};
  for (int d : dims) {
    std::vector<int64_t> next;
    for (int64_t p : out) {
      for (int64_t i = 0; i < shape[d]; ++i) next.push_back(p + i * stride[d]);
    }
    out.swap(next);
  }
  return out;
}

// Every coordinate of the dimensions not in `dims`, row-major (each a full coordinate with the
// `dims` entries 0): one per copy of the sub-mesh over `dims`.
std::vector<std::vector<int>> copies(const std::vector<int64_t>& shape,
                                     const std::vector<int>& dims) {
  std::vector<std::vector<int>> out{std::vector<int>(shape.size(), 0)};
  for (size_t d = 0; d < shape.size(); ++d) {
    if (std::find(dims.begin(), dims.end(), static_cast<int>(d)) != dims.end()) continue;
    std::vector<std::vector<int>> next;
    for (const auto& c : out) {
      for (int64_t i = 0; i < shape[d]; ++i) {
        next.push_back(c);
        next.back()[d] = static_cast<int>(i);
      }
    }
    out.swap(next);
  }
  return out;
}

std::vector<int> ranks_at(const DeviceMesh::Layout& l, const std::vector<int64_t>& positions) {
  std::vector<int> out;
  out.reserve(positions.size());
  for (int64_t p : positions) out.push_back(l.ranks[p]);
  return out;
}

// Makes the groups of `dims` (flattened together) for every copy of that sub-mesh, in order,
// through new_group (collective over the world); returns this rank's.
std::shared_ptr<ProcessGroup> make_groups(const DeviceMesh::Layout& l, const std::vector<int>& dims,
                                          int my_rank) {
  std::shared_ptr<ProcessGroup> mine;
  for (const std::vector<int>& at : copies(l.shape, dims)) {
    std::vector<int> members = ranks_at(l, plane(l.shape, dims, at));
    auto g = new_group(members);
    if (g != nullptr) {
      EMBER_INTERNAL_ASSERT(std::find(members.begin(), members.end(), my_rank) != members.end(),
                            "new_group gave a group to a rank not in it");
      mine = std::move(g);
    }
  }
  return mine;
}

int my_global_rank(const ProcessGroup& g) {
  const auto& gr = g.global_ranks();
  return gr.empty() ? g.rank() : gr[g.rank()];
}

}  // namespace

DeviceMesh::DeviceMesh(Device device, Layout layout,
                       std::vector<std::shared_ptr<ProcessGroup>> groups,
                       std::shared_ptr<const DeviceMesh> root, std::vector<int> root_dims)
    : device_(device),
      layout_(std::move(layout)),
      groups_(std::move(groups)),
      root_(std::move(root)),
      root_dims_(std::move(root_dims)) {
  check_layout(layout_);
  EMBER_CHECK(groups_.size() == layout_.shape.size(), kOp, " expected one group per dimension (",
              layout_.shape.size(), "), got ", groups_.size());
  for (size_t d = 0; d < groups_.size(); ++d) {
    EMBER_CHECK(groups_[d] != nullptr, kOp, " dimension ", d, " of ",
                shape_str(layout_.shape, layout_.names), " has no group on this rank");
    EMBER_CHECK(groups_[d]->size() == layout_.shape[d], kOp, " dimension ", d, " of ",
                shape_str(layout_.shape, layout_.names), " has size ", layout_.shape[d],
                " but its group has ", groups_[d]->size(), " ranks");
  }
  const int me = my_global_rank(*groups_[0]);
  const auto it = std::find(layout_.ranks.begin(), layout_.ranks.end(), me);
  EMBER_CHECK(it != layout_.ranks.end(), kOp, " rank ", me, " is not in the mesh ",
              shape_str(layout_.shape, layout_.names));
  int64_t pos = it - layout_.ranks.begin();
  const std::vector<int64_t> stride = strides_of(layout_.shape);
  for (size_t d = 0; d < layout_.shape.size(); ++d) {
    coordinate_.push_back(static_cast<int>(pos / stride[d]));
    pos %= stride[d];
    EMBER_CHECK(groups_[d]->rank() == coordinate_[d], kOp, " rank ", me, " sits at index ",
                coordinate_[d], " of dimension ", d, " in the layout, but is rank ",
                groups_[d]->rank(), " of that dimension's group");
  }
  if (root_dims_.empty()) {
    root_dims_.resize(layout_.shape.size());
    std::iota(root_dims_.begin(), root_dims_.end(), 0);
  }
}

int64_t DeviceMesh::size() const { return product(layout_.shape); }

int64_t DeviceMesh::size(int dim) const {
  if (dim == -1) return size();
  EMBER_CHECK(dim >= 0 && dim < ndim(), kOp, " dimension ", dim, " is out of range for ", str(),
              " (-1: the whole mesh)");
  return layout_.shape[dim];
}

int DeviceMesh::dim_index(const std::string& name) const {
  for (int d = 0; d < ndim() && !name.empty(); ++d) {  // an unnamed dimension's name is ""
    if (layout_.names[d] == name) return d;
  }
  std::string known;
  for (const std::string& n : layout_.names) {
    if (!n.empty()) known += (known.empty() ? "'" : ", '") + n + "'";
  }
  throw ValueError(detail::str_cat(kOp, " '", name, "' is not a dimension of ", str(),
                                   " (its dimensions: ", known.empty() ? "unnamed" : known, ")"));
}

std::shared_ptr<ProcessGroup> DeviceMesh::get_group(int dim) const {
  EMBER_CHECK(dim >= 0 && dim < ndim(), kOp, " dimension ", dim, " is out of range for ", str());
  return groups_[dim];
}
std::shared_ptr<ProcessGroup> DeviceMesh::get_group(const std::string& dim) const {
  return groups_[dim_index(dim)];
}
std::shared_ptr<ProcessGroup> DeviceMesh::get_group() const {
  EMBER_CHECK(ndim() == 1, kOp, " get_group() without a dimension needs a 1-D mesh, this is ",
              str());
  return groups_[0];
}

int DeviceMesh::get_local_rank(int dim) const {
  EMBER_CHECK(dim >= 0 && dim < ndim(), kOp, " dimension ", dim, " is out of range for ", str());
  return coordinate_[dim];
}
int DeviceMesh::get_local_rank() const {
  EMBER_CHECK(ndim() == 1, kOp, " get_local_rank() without a dimension needs a 1-D mesh, this is ",
              str());
  return coordinate_[0];
}

std::shared_ptr<DeviceMesh> DeviceMesh::sub_mesh(const std::vector<int>& dims) const {
  Layout l;
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::vector<int> root_dims;
  for (int d : dims) {
    l.shape.push_back(layout_.shape[d]);
    l.names.push_back(layout_.names[d]);
    groups.push_back(groups_[d]);
    root_dims.push_back(root_dims_[d]);
  }
  l.ranks = ranks_at(layout_, plane(layout_.shape, dims, coordinate_));
  std::shared_ptr<const DeviceMesh> root = root_ ? root_ : shared_from_this();
  return std::make_shared<DeviceMesh>(device_, std::move(l), std::move(groups), std::move(root),
                                      std::move(root_dims));
}

std::shared_ptr<DeviceMesh> DeviceMesh::operator[](const std::string& name) const {
  return sub_mesh({dim_index(name)});
}

std::shared_ptr<DeviceMesh> DeviceMesh::slice(const std::vector<std::string>& names) const {
  EMBER_CHECK(!names.empty(), kOp, " slice needs at least one dimension name");
  std::vector<int> dims;
  for (const std::string& n : names) {
    const int d = dim_index(n);
    EMBER_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(), kOp, " slice names '", n,
                "' twice");
    dims.push_back(d);
  }
  return sub_mesh(dims);
}

std::shared_ptr<DeviceMesh> DeviceMesh::flatten(const std::string& name) const {
  std::string flat_name = name;
  if (flat_name.empty()) {
    for (const std::string& n : layout_.names) flat_name += (flat_name.empty() ? "" : "_") + n;
  }
  std::shared_ptr<ProcessGroup> group;
  if (ndim() == 1) {
    group = groups_[0];
  } else {
    const DeviceMesh& r = root();
    std::vector<int> key = root_dims_;
    std::sort(key.begin(), key.end());
    std::lock_guard<std::mutex> lock(r.flat_mu_);
    auto it = r.flattened_.find(key);
    if (it == r.flattened_.end()) {
      it = r.flattened_.emplace(key, make_groups(r.layout_, key, my_global_rank(*groups_[0])))
               .first;
    }
    group = it->second;
  }
  Layout l;
  l.shape = {size()};
  l.names = {flat_name};
  l.ranks = layout_.ranks;
  std::sort(l.ranks.begin(), l.ranks.end());  // a group's ranks are in global order
  return std::make_shared<DeviceMesh>(device_, std::move(l),
                                      std::vector<std::shared_ptr<ProcessGroup>>{group}, nullptr,
                                      std::vector<int>{});
}

std::shared_ptr<DeviceMesh> DeviceMesh::from_group(
    std::vector<std::shared_ptr<ProcessGroup>> groups, const std::string& device_type,
    std::optional<Layout> layout) {
  EMBER_CHECK(!groups.empty(), kOp, " from_group needs at least one group");
  for (const auto& g : groups) EMBER_CHECK(g != nullptr, kOp, " from_group got a null group");
  Layout l;
  if (layout) {
    l = std::move(*layout);
    if (l.names.empty()) l.names.assign(l.shape.size(), "");
  } else {
    EMBER_CHECK(groups.size() == 1, kOp, " from_group with ", groups.size(),
                " groups needs their layout (shape, names and global ranks)");
    const auto& gr = groups[0]->global_ranks();
    l.shape = {groups[0]->size()};
    l.names = {""};
    if (gr.empty()) {
      l.ranks.resize(groups[0]->size());
      std::iota(l.ranks.begin(), l.ranks.end(), 0);
    } else {
      l.ranks = gr;
    }
  }
  return std::make_shared<DeviceMesh>(device_of(device_type), std::move(l), std::move(groups),
                                      nullptr, std::vector<int>{});
}

bool DeviceMesh::operator==(const DeviceMesh& o) const {
  return this == &o || (device_ == o.device_ && layout_.shape == o.layout_.shape &&
                        layout_.names == o.layout_.names && layout_.ranks == o.layout_.ranks &&
                        groups_ == o.groups_);
}

std::string DeviceMesh::str() const {
  std::ostringstream os;
  os << "DeviceMesh(" << device_type() << ", " << shape_str(layout_.shape, layout_.names);
  if (!coordinate_.empty()) {
    os << ", rank " << my_global_rank(*groups_[0]) << " at (";
    for (size_t d = 0; d < coordinate_.size(); ++d) os << (d ? ", " : "") << coordinate_[d];
    os << ")";
  }
  os << ")";
  return os.str();
}

std::shared_ptr<DeviceMesh> init_device_mesh(const std::string& device_type,
                                             const std::vector<int64_t>& shape,
                                             const std::vector<std::string>& names) {
  const Device device = device_of(device_type);
  DeviceMesh::Layout l;
  l.shape = shape;
  l.names = names.empty() ? std::vector<std::string>(shape.size(), "") : names;
  std::shared_ptr<ProcessGroup> world = default_group();
  EMBER_CHECK(!shape.empty() && std::all_of(shape.begin(), shape.end(),
                                           [](int64_t s) { return s > 0; }),
              "[init_device_mesh] every dimension's size must be positive, got ",
              shape_str(shape, l.names));
  EMBER_CHECK(product(shape) == world->size(), "[init_device_mesh] mesh shape ",
              shape_str(shape, l.names), " holds ", product(shape),
              " ranks, but the world has ", world->size());
  l.ranks.resize(world->size());
  std::iota(l.ranks.begin(), l.ranks.end(), 0);
  check_layout(l);
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    // A dimension that spans the world is the world: no group to make.
    groups.push_back(shape[d] == world->size() ? world : make_groups(l, {d}, world->rank()));
  }
  return std::make_shared<DeviceMesh>(device, std::move(l), std::move(groups), nullptr,
                                      std::vector<int>{});
}

}  // namespace ember::dist
