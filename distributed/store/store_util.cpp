#include <ember/distributed/store/detail/store_util.h>

#include <algorithm>
#include <limits>
#include <thread>
#include <unordered_set>

namespace ember::dist::detail {

using dist::Bytes;
using dist::Duration;

void check_store_timeout(const std::string& op, Duration timeout) {
  // torch treats 0 as "no timeout"; Ember wants every blocking call to end, so it refuses it.
  EMBER_CHECK(timeout.count() > 0, "[", op, "] timeout must be positive, got ", timeout.count(),
              " ms (infinite timeouts are not supported; pass a large one instead)");
}

StoreClock::time_point store_deadline(Duration timeout) {
  return StoreClock::now() + std::min(timeout, kMaxStoreTimeout);
}

int64_t ms_until(StoreClock::time_point deadline) {
  const auto left = deadline - StoreClock::now();
  if (left <= StoreClock::duration::zero()) return 0;
  return std::chrono::ceil<std::chrono::milliseconds>(left).count();
}

void backoff_sleep(dist::Duration* backoff, StoreClock::time_point deadline, dist::Duration cap) {
  std::this_thread::sleep_for(std::min(*backoff, dist::Duration(ms_until(deadline))));
  *backoff = std::min(*backoff * 2, cap);
}

std::string quote_key(const std::string& key) {
  constexpr size_t kShown = 120;
  static const char* kHex = "0123456789abcdef";
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  out += "'";
  if (key.size() > kShown) out += str_cat("... (", key.size(), " bytes)");
  return out;
}

std::string quote_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 8;
  std::string out = "[";
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) {
    if (i) out += ", ";
    out += quote_key(keys[i]);
  }
  if (keys.size() > kShown) out += str_cat(", ... and ", keys.size() - kShown, " more");
  return out + "]";
}

void throw_store_timeout(const std::string& op, Duration timeout,
                         const std::vector<std::string>& keys,
                         const std::vector<std::string>& missing, const std::string& where) {
  throw dist::DistTimeoutError(str_cat("[", op, "] timed out after ", timeout.count(),
                                       " ms waiting for keys ", quote_keys(keys),
                                       " (missing: ", quote_keys(missing), ")", where));
}

int64_t parse_store_counter(const std::string& op, const std::string& key, const Bytes& value) {
  const std::string text(value.begin(), value.end());
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  bool ok = i < text.size() && text.size() - i <= 19;
  uint64_t magnitude = 0;
  for (; ok && i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9')
      ok = false;
    else
      magnitude = magnitude * 10 + static_cast<uint64_t>(text[i] - '0');
  }
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) + negative;
  ok = ok && magnitude <= limit;
  if (!ok) {
    Bytes shown(value.begin(), value.begin() + std::min<size_t>(value.size(), 64));
    throw dist::DistStoreError(str_cat("[", op, "] key ", quote_key(key),
                                       " holds a value that is not an int64 counter: ",
                                       quote_key(std::string(shown.begin(), shown.end())),
                                       " (add only works on keys created by add, or set to "
                                       "decimal text)"));
  }
  return negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
}

int64_t add_store_counter(const std::string& op, const std::string& key, int64_t current,
                          int64_t delta) {
  int64_t out = 0;
  if (__builtin_add_overflow(current, delta, &out)) {
    throw dist::DistStoreError(str_cat("[", op, "] key ", quote_key(key), " holds ", current,
                                       "; adding ", delta, " overflows int64"));
  }
  return out;
}

Bytes format_store_counter(int64_t v) {
  const std::string s = std::to_string(v);
  return Bytes(s.begin(), s.end());
}

std::vector<std::string> unique_keys(const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  std::unordered_set<std::string> seen;
  for (const auto& k : keys) {
    if (seen.insert(k).second) out.push_back(k);
  }
  return out;
}

}  // namespace ember::dist::detail
