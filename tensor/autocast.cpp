// Autocast state, the guard, and the cast (with its per-scope cache) that op front ends call.
#include <ember/tensor/autocast.h>

#include <memory>
#include <unordered_map>

#include <ember/tensor/error.h>
#include <ember/tensor/grad_mode.h>

namespace ember {

namespace detail {
__thread uint8_t t_autocast_active = 0;
}  // namespace detail

namespace {

constexpr int kDeviceTypes = 2;

int slot(Device d) { return static_cast<int>(d.type); }
uint8_t bit(Device d) { return static_cast<uint8_t>(1u << slot(d)); }

// A cached cast: valid while the source is alive (the weak pointer locks to it, so a new tensor
// at a reused address never hits) and unmodified (its version is unchanged).
struct CacheEntry {
  std::weak_ptr<TensorImpl> src;
  uint32_t version = 0;
  Tensor cast;
};

// The key holds the grad mode as well: a copy cast under no_grad has no history and must not
// be handed to an op that records (torch's cache has that hole).
struct CacheKey {
  const TensorImpl* impl;
  Dtype dtype;
  bool grad;
  bool operator==(const CacheKey&) const = default;
};
struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    return std::hash<const void*>()(k.impl) ^ (static_cast<size_t>(k.dtype) << 1) ^ k.grad;
  }
};

struct AutocastState {
  std::array<bool, kDeviceTypes> enabled{};
  std::array<Dtype, kDeviceTypes> dtype{kBFloat16, kFloat16};
  bool cache_enabled = true;
  int nesting = 0;
  std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> cache;
};

thread_local AutocastState t_state;

void check_dtype(Device device, Dtype dtype) {
  if (device.is_cpu()) {
    EMBER_CHECK(dtype == kBFloat16, "[autocast] CPU autocast supports bfloat16 only, got ", dtype,
                " (torch 1.13 warns and disables autocast for this; Ember refuses)");
  } else {
    EMBER_CHECK(dtype == kFloat16 || dtype == kBFloat16,
                "[autocast] CUDA autocast supports float16 and bfloat16, got ", dtype);
  }
}

// torch caches only casts of float32 tensors that require grad (parameters) to the autocast
// dtype. The tensor layer cannot tell a leaf from an op output, so op outputs that require
// grad are cached too; that is safe (same value, same history), and the cache is dropped when
// the outermost scope exits, normally before backward.
bool cacheable(const Tensor& t, Dtype to, Device device) {
  return t_state.cache_enabled && to == t_state.dtype[slot(device)] && t.dtype() == kFloat32 &&
         t.requires_grad() && !t.impl()->is_view;
}

Tensor cast_one(const Tensor& t, Dtype to, Device device) {
  if (!t.defined() || !t.is_floating_point() || t.dtype() == kFloat64 || t.dtype() == to) {
    return t;
  }
  if (!cacheable(t, to, device)) return t.to(to);
  const CacheKey key{t.impl(), to, GradMode::is_enabled()};
  auto it = t_state.cache.find(key);
  if (it != t_state.cache.end() && it->second.src.lock() == t.impl_ptr() &&
      it->second.version == t.version()) {
    return it->second.cast;
  }
  Tensor cast = t.to(to);
  t_state.cache[key] = CacheEntry{t.impl_ptr(), t.version(), cast};
  return cast;
}

}  // namespace

bool is_autocast_enabled(Device device) { return t_state.enabled[slot(device)]; }
Dtype get_autocast_dtype(Device device) { return t_state.dtype[slot(device)]; }

void set_autocast_enabled(Device device, bool enabled) {
  t_state.enabled[slot(device)] = enabled;
  if (enabled) {
    detail::t_autocast_active |= bit(device);
  } else {
    detail::t_autocast_active &= static_cast<uint8_t>(~bit(device));
  }
}

void set_autocast_dtype(Device device, Dtype dtype) {
  check_dtype(device, dtype);
  t_state.dtype[slot(device)] = dtype;
}

bool is_autocast_cache_enabled() { return t_state.cache_enabled; }
void set_autocast_cache_enabled(bool enabled) { t_state.cache_enabled = enabled; }
void clear_autocast_cache() { t_state.cache.clear(); }

AutocastGuard::AutocastGuard(Device device, std::optional<Dtype> dtype, bool enabled,
                             std::optional<bool> cache_enabled)
    : device_(device),
      prev_enabled_(is_autocast_enabled(device)),
      prev_dtype_(get_autocast_dtype(device)),
      prev_cache_(is_autocast_cache_enabled()) {
  // Validate before changing anything, so a refused guard leaves the state as it was.
  // A disabled guard accepts any dtype (it casts nothing), so `AutocastGuard(dev, dt, use_amp)`
  // works with use_amp false whatever dt is; a guard nested inside it that enables autocast
  // without a dtype of its own checks the one it inherits.
  if (enabled) check_dtype(device, dtype.value_or(prev_dtype_));
  if (dtype) t_state.dtype[slot(device)] = *dtype;
  set_autocast_enabled(device, enabled);
  if (cache_enabled) set_autocast_cache_enabled(*cache_enabled);
  ++t_state.nesting;
}

AutocastGuard::~AutocastGuard() {
  if (--t_state.nesting == 0) clear_autocast_cache();
  set_autocast_enabled(device_, prev_enabled_);
  t_state.dtype[slot(device_)] = prev_dtype_;
  t_state.cache_enabled = prev_cache_;
}

namespace detail {

AutocastInputs::AutocastInputs(AutocastPolicy policy, std::initializer_list<const Tensor*> inputs) {
  EMBER_INTERNAL_ASSERT(inputs.size() <= kMaxInputs, "too many autocast inputs");
  const Tensor* first = nullptr;
  for (const Tensor* t : inputs) {
    if (t->defined()) {
      first = t;
      break;
    }
  }
  if (first == nullptr) return;
  const Device device = first->device();
  if ((t_autocast_active & bit(device)) == 0) return;

  Dtype to = t_state.dtype[slot(device)];
  if (policy == AutocastPolicy::kFloat32) {
    to = kFloat32;
  } else if (policy == AutocastPolicy::kPromote) {
    std::optional<Dtype> widest;
    for (const Tensor* t : inputs) {
      if (t->defined() && t->is_floating_point()) {
        widest = widest ? promote_types(*widest, t->dtype()) : t->dtype();
      }
    }
    if (!widest) return;
    to = *widest;
  }
  size_t i = 0;
  for (const Tensor* t : inputs) cast_[i++] = cast_one(*t, to, device);
  active_ = true;
  suspended_ = static_cast<uint8_t>(slot(device));
  t_autocast_active &= static_cast<uint8_t>(~bit(device));
}

size_t autocast_cache_size() { return t_state.cache.size(); }

AutocastInputs::~AutocastInputs() {
  // Resumes only the suspended device type, and only if no setter switched it off meanwhile.
  if (active_ && t_state.enabled[suspended_])
    t_autocast_active |= static_cast<uint8_t>(1u << suspended_);
}

}  // namespace detail
}  // namespace ember
