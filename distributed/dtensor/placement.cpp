#include <ember/distributed/dtensor/placement.h>

#include <algorithm>

namespace ember::dist {

std::string Placement::str() const {
  switch (kind_) {
    case Kind::Replicate: return "Replicate()";
    case Kind::Shard: return detail::str_cat("Shard(", dim_, ")");
    case Kind::Partial: return detail::str_cat("Partial(", to_string(op_), ")");
  }
  return "?";
}

std::string to_string(const Placements& p) {
  std::string s = "(";
  for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + p[i].str();
  return s + (p.size() == 1 ? ",)" : ")");
}

int64_t shard_offset(int64_t size, int64_t n, int64_t i) {
  const int64_t chunk = (size + n - 1) / n;
  return std::min(size, i * chunk);
}

int64_t shard_length(int64_t size, int64_t n, int64_t i) {
  const int64_t chunk = (size + n - 1) / n;
  return std::max<int64_t>(0, std::min(size, (i + 1) * chunk) - i * chunk);
}

}  // namespace ember::dist
