#include <ember/distributed/store/detail/store_protocol.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdlib>
#include <cstring>

#include <ember/distributed/errors.h>

namespace ember::dist::detail::store_wire {

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

std::array<uint8_t, 32> hmac_sha256(const std::string& key, const void* msg, size_t n) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  // An empty std::string's data() is a valid pointer, so an empty key is a zero-length key.
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           static_cast<const unsigned char*>(msg), n, out.data(), &len) == nullptr ||
      len != out.size()) {
    throw dist::DistStoreError("TCPStore handshake: OpenSSL's HMAC-SHA256 failed");
  }
  return out;
}

Bytes auth_proof(const std::string& secret, const Bytes& nonce) {
  Bytes msg(kAuthContext, kAuthContext + sizeof(kAuthContext) - 1);
  msg.insert(msg.end(), nonce.begin(), nonce.end());
  const auto mac = hmac_sha256(secret, msg.data(), msg.size());
  return Bytes(mac.begin(), mac.end());
}

bool constant_time_equal(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace ember::dist::detail::store_wire
