// Internals shared by the Store implementations: timeouts, counters, key formatting for
// messages. Not part of the public API.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ember/distributed/store/store.h>

namespace ember::dist::detail {

using StoreClock = std::chrono::steady_clock;

/// Longest timeout a store honours (ten years); longer ones are clamped so that deadlines and
/// the wire encoding never overflow.
constexpr dist::Duration kMaxStoreTimeout = std::chrono::hours(24 * 365 * 10);

/// Throws ValueError "[<op>] timeout must be positive, got <t> ms" unless timeout > 0.
void check_store_timeout(const std::string& op, dist::Duration timeout);

/// now + timeout, with timeout clamped to kMaxStoreTimeout.
StoreClock::time_point store_deadline(dist::Duration timeout);

/// Milliseconds left until deadline (0 if past), rounded up so a wait never ends early.
int64_t ms_until(StoreClock::time_point deadline);

/// The stores' retry loops: sleeps *backoff (never past deadline), then doubles it up to cap.
void backoff_sleep(dist::Duration* backoff, StoreClock::time_point deadline, dist::Duration cap);

/// A key quoted for messages: 'abc'; non-printable bytes as \xNN, long keys shortened.
std::string quote_key(const std::string& key);

/// Keys quoted and listed for messages: ['a', 'b', ... and 7 more].
std::string quote_keys(const std::vector<std::string>& keys);

/// Throws DistTimeoutError: "[<op>] timed out after <t> ms waiting for keys [...] (missing:
/// [...])<where>". `where` names the store, e.g. " on the store at host:port".
[[noreturn]] void throw_store_timeout(const std::string& op, dist::Duration timeout,
                                      const std::vector<std::string>& keys,
                                      const std::vector<std::string>& missing,
                                      const std::string& where);

/// The counter held by `value` (decimal text as torch stores it, optional sign, no spaces).
/// Throws DistStoreError naming op, key and value if it is not an int64.
int64_t parse_store_counter(const std::string& op, const std::string& key,
                            const dist::Bytes& value);

/// current + delta, or DistStoreError naming op and key on int64 overflow.
int64_t add_store_counter(const std::string& op, const std::string& key, int64_t current,
                          int64_t delta);

/// The decimal text of v as bytes.
dist::Bytes format_store_counter(int64_t v);

/// Keys in order of first appearance, duplicates dropped.
std::vector<std::string> unique_keys(const std::vector<std::string>& keys);

}  // namespace ember::dist::detail
