#include "distributed/detail/store_protocol.h"

#include <cstdlib>
#include <cstring>

#include "distributed/tcp_store.h"

namespace ember::detail::store_wire {

namespace {
void put_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace

bool is_request(uint8_t type) {
  return type >= static_cast<uint8_t>(Type::kSet) && type <= static_cast<uint8_t>(Type::kJoin);
}

std::optional<Header> parse_header(const uint8_t* b, std::string* why) {
  const uint64_t magic = get_le(b, 4);
  if (magic != kMagic) {
    *why = str_cat("bad magic 0x", std::hex, magic, " (not an Ember store frame)");
    return std::nullopt;
  }
  if (b[4] != kVersion) {
    *why = str_cat("protocol version ", int(b[4]), ", expected ", int(kVersion));
    return std::nullopt;
  }
  if (get_le(b + 6, 2) != 0) {
    *why = "nonzero flags";
    return std::nullopt;
  }
  Header h;
  h.type = b[5];
  h.length = static_cast<uint32_t>(get_le(b + 8, 4));
  return h;
}

FrameWriter::FrameWriter(Type type) : buf_(kHeaderSize) {
  put_le(buf_.data(), kMagic, 4);
  buf_[4] = kVersion;
  buf_[5] = static_cast<uint8_t>(type);
}

// Callers keep fields far below 4 GiB (kMaxValueSize), so the size checks here only catch a bug;
// they throw DistStoreError rather than use EMBER_INTERNAL_ASSERT, whose reporter is part of
// ember_tensor, which the store library does not link (distributed/CMakeLists.txt).
FrameWriter& FrameWriter::blob(const void* data, size_t n) {
  EMBER_CHECK_TYPE(dist::DistStoreError, n <= UINT32_MAX, "[TCPStore] a blob of ", n,
                   " bytes does not fit the protocol's 32-bit length field");
  const size_t at = buf_.size();
  buf_.resize(at + 4 + n);
  put_le(buf_.data() + at, n, 4);
  if (n) std::memcpy(buf_.data() + at + 4, data, n);
  return *this;
}

FrameWriter& FrameWriter::u64(uint64_t v) {
  const size_t at = buf_.size();
  buf_.resize(at + 8);
  put_le(buf_.data() + at, v, 8);
  return *this;
}

Bytes FrameWriter::finish() {
  const size_t len = buf_.size() - kHeaderSize;
  EMBER_CHECK_TYPE(dist::DistStoreError, len <= UINT32_MAX, "[TCPStore] a frame of ", len,
                   " bytes does not fit the protocol's 32-bit length field");
  put_le(buf_.data() + 8, len, 4);
  return std::move(buf_);
}

bool PayloadReader::take(size_t n, const uint8_t** out) {
  if (!ok_ || n > left_) {
    ok_ = false;
    return false;
  }
  *out = p_;
  p_ += n;
  left_ -= n;
  return true;
}

bool PayloadReader::take_blob(size_t max_len, const uint8_t** out, size_t* n) {
  const uint8_t* p = nullptr;
  if (!take(4, &p)) return false;
  const uint64_t len = get_le(p, 4);
  if (len > max_len || !take(len, out)) {
    ok_ = false;
    return false;
  }
  *n = len;
  return true;
}

bool PayloadReader::blob(size_t max_len, std::string* out) {
  const uint8_t* p = nullptr;
  size_t n = 0;
  if (!take_blob(max_len, &p, &n)) return false;
  out->assign(reinterpret_cast<const char*>(p), n);
  return true;
}

bool PayloadReader::blob(size_t max_len, Bytes* out) {
  const uint8_t* p = nullptr;
  size_t n = 0;
  if (!take_blob(max_len, &p, &n)) return false;
  out->assign(p, p + n);
  return true;
}

bool PayloadReader::u64(uint64_t* out) {
  const uint8_t* p = nullptr;
  if (!take(8, &p)) return false;
  *out = get_le(p, 8);
  return true;
}

std::string store_secret(const std::optional<std::string>& given) {
  if (given) return *given;
  const char* env = std::getenv(dist::kStoreSecretEnv);
  return env ? env : "";
}

// ---- SHA-256 (FIPS 180-4), compact: the handshake hashes a few dozen bytes per connection. ----

namespace {
constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void sha256_block(uint32_t h[8], const uint8_t* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) |
           (uint32_t{block[4 * i + 2]} << 8) | uint32_t{block[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 =
        k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}
}  // namespace

std::array<uint8_t, 32> sha256(const void* data, size_t n) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const auto* p = static_cast<const uint8_t*>(data);
  size_t left = n;
  for (; left >= 64; left -= 64, p += 64) sha256_block(h, p);
  // Padding: 0x80, zeros, then the bit length as a big-endian u64, in one or two blocks.
  uint8_t tail[128] = {};
  if (left) std::memcpy(tail, p, left);
  tail[left] = 0x80;
  const size_t tail_len = left + 9 <= 64 ? 64 : 128;
  const uint64_t bits = static_cast<uint64_t>(n) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t off = 0; off < tail_len; off += 64) sha256_block(h, tail + off);
  std::array<uint8_t, 32> out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h[i] >> (24 - 8 * j));
  }
  return out;
}

std::array<uint8_t, 32> hmac_sha256(const std::string& key, const void* msg, size_t n) {
  uint8_t k[64] = {};
  if (key.size() > 64) {
    const auto kh = sha256(key.data(), key.size());
    std::memcpy(k, kh.data(), kh.size());
  } else if (!key.empty()) {
    std::memcpy(k, key.data(), key.size());
  }
  Bytes inner(64 + n);
  for (int i = 0; i < 64; ++i) inner[i] = k[i] ^ 0x36;
  if (n) std::memcpy(inner.data() + 64, msg, n);
  const auto ih = sha256(inner.data(), inner.size());
  uint8_t outer[64 + 32];
  for (int i = 0; i < 64; ++i) outer[i] = k[i] ^ 0x5c;
  std::memcpy(outer + 64, ih.data(), 32);
  return sha256(outer, sizeof(outer));
}

Bytes auth_proof(const std::string& secret, const Bytes& nonce) {
  Bytes msg(kAuthContext, kAuthContext + sizeof(kAuthContext) - 1);
  msg.insert(msg.end(), nonce.begin(), nonce.end());
  const auto mac = hmac_sha256(secret, msg.data(), msg.size());
  return Bytes(mac.begin(), mac.end());
}

bool constant_time_equal(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return false;
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = diff | (a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace ember::detail::store_wire
