// The TCPStore wire protocol (internal; tests include it to send hand-made frames).
//
// Note [TCPStore protocol]
// Every message, either way, is one frame: a 12-byte header, then `length` bytes of payload.
//   header: u32 magic "EMBS" | u8 version | u8 type | u16 flags (0) | u32 length  (little-endian)
// A payload is a sequence of fields: a blob is u32 length + bytes, a number is 8 bytes
// (little-endian). Each type has a fixed field layout (see Type) and nothing may follow it.
//
// Handshake: on accept the server sends kChallenge {nonce: blob of 32 random bytes,
// secret_required: u64}. The client answers kAuth {proof: blob}, proof being
// HMAC-SHA256(secret, kAuthContext + nonce), or empty without a secret. The server answers
// kOk, or kAuthFailed and closes. So the secret never crosses the wire and a recorded proof
// cannot be replayed against another nonce. The server does not prove itself to the client.
//
// After that the client sends one request at a time and reads its reply (kOk, kTimeout,
// kError) before sending the next. The server reads on while a request waits, so it notices
// a client that goes away; a second request while one is pending is a protocol violation.
//
// Anything malformed (bad magic, version, type, flags, length over the limit, fields that do
// not parse, a request before authentication) makes the server drop that connection, and only
// that one. Before authentication a frame may carry at most kMaxHandshakePayload bytes, so a
// stranger cannot make the server allocate large buffers. Without a secret anyone
// authenticates, so the server never allocates what a header claims: its buffer grows with the
// bytes that arrive, within a total for all connections, and a frame that stops arriving is
// dropped (TCPStoreServerOptions::max_buffered_bytes, partial_frame_timeout).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ember::dist::detail::store_wire {

using Bytes = std::vector<uint8_t>;

constexpr uint32_t kMagic = 0x53424d45;  // "EMBS" in memory order
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderSize = 12;
constexpr size_t kMaxKeySize = 4096;                // bytes
constexpr size_t kMaxValueSize = size_t{64} << 20;  // 64 MiB
constexpr size_t kMaxKeysPerRequest = 4096;         // check / wait
/// Largest payload either side accepts after the handshake (compare_set carries two values).
constexpr size_t kMaxPayload = 2 * kMaxValueSize + 2 * kMaxKeySize + 64;
/// Largest payload accepted before the client has authenticated.
constexpr size_t kMaxHandshakePayload = 256;
constexpr size_t kNonceSize = 32;
constexpr size_t kProofSize = 32;
inline constexpr char kAuthContext[] = "ember-store-auth-v1";

enum class Type : uint8_t {
  // server -> client, handshake
  kChallenge = 1,   // nonce: blob, secret_required: u64
  kAuthFailed = 2,  // (empty)
  // client -> server
  kAuth = 10,        // proof: blob
  kSet = 11,         // key, value
  kGet = 12,         // key, timeout_ms: u64            -> kOk value | kTimeout
  kAdd = 13,         // key, delta: u64 (two's complement) -> kOk result: u64
  kCompareSet = 14,  // key, expected, desired          -> kOk value
  kCheck = 15,       // count: u64, count keys          -> kOk u64 (0/1)
  kWait = 16,        // timeout_ms: u64, count: u64, keys -> kOk | kTimeout
  kDeleteKey = 17,   // key                              -> kOk u64 (0/1)
  kNumKeys = 18,     //                                  -> kOk u64
  kJoin = 19,        // (empty): counts a worker         -> kOk u64 workers joined
  // server -> client, replies
  kOk = 100,       // per request, see above (kSet, kAuth: empty)
  kTimeout = 101,  // count: u64, the keys still missing
  kError = 102,    // message: blob (e.g. add on a non-integer value)
};

/// True for the request types a client may send after authenticating.
bool is_request(uint8_t type);

/// A decoded frame header.
struct Header {
  uint8_t type = 0;
  uint32_t length = 0;
};

/// Decodes a header; on failure returns nullopt and sets *why (bad magic, version, flags).
std::optional<Header> parse_header(const uint8_t* bytes, std::string* why);

/// Builds one frame: reserves the header, appends fields, patches the length in finish().
class FrameWriter {
 public:
  explicit FrameWriter(Type type);
  FrameWriter& blob(const void* data, size_t n);
  FrameWriter& blob(const std::string& s) { return blob(s.data(), s.size()); }
  FrameWriter& blob(const Bytes& b) { return blob(b.data(), b.size()); }
  FrameWriter& u64(uint64_t v);
  /// The complete frame (header + payload); the writer is left empty.
  Bytes finish();

 private:
  Bytes buf_;
};

/// Reads the fields of a payload. Every read checks bounds; after a failure ok() is false and
/// later reads fail too.
class PayloadReader {
 public:
  PayloadReader(const uint8_t* data, size_t n) : p_(data), left_(n) {}
  /// A blob of at most max_len bytes.
  bool blob(size_t max_len, std::string* out);
  bool blob(size_t max_len, Bytes* out);
  bool u64(uint64_t* out);
  /// True if every read succeeded and the payload is used up.
  bool done() const { return ok_ && left_ == 0; }
  bool ok() const { return ok_; }

 private:
  bool take(size_t n, const uint8_t** out);
  /// A blob's length field, then its bytes (at most max_len): *out points into the payload.
  bool take_blob(size_t max_len, const uint8_t** out, size_t* n);
  const uint8_t* p_;
  size_t left_;
  bool ok_ = true;
};

/// HMAC-SHA256(key, msg) (RFC 2104), computed by OpenSSL's libcrypto. Throws DistStoreError
/// if OpenSSL fails.
std::array<uint8_t, 32> hmac_sha256(const std::string& key, const void* msg, size_t n);
/// The handshake proof for `nonce`: HMAC-SHA256(secret, kAuthContext + nonce).
Bytes auth_proof(const std::string& secret, const Bytes& nonce);
/// Compares in time that depends only on the sizes, not on where the bytes differ
/// (OpenSSL's CRYPTO_memcmp).
bool constant_time_equal(const Bytes& a, const Bytes& b);

}  // namespace ember::dist::detail::store_wire
