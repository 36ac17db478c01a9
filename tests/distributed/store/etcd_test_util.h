// A private etcd server for one test: Debian's etcd-server (/usr/bin/etcd) on free loopback
// ports with its data in a fresh temporary directory, killed and removed on destruction.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/store/etcd_store.h>
#include "tests/distributed/store/store_test_util.h"

extern char** environ;

namespace ember::test {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

/// "" when an etcd server can be started here, else why not (for GTEST_SKIP).
inline std::string etcd_unavailable_reason() {
  if (::access(kEtcdBinary, X_OK) == 0) return "";
  return std::string(kEtcdBinary) +
         " is missing: install Debian's etcd-server (scripts/install-deps.sh does)";
}

/// "" when etcd and the program `tool` (Debian's package `package`) can both be used here, else
/// why not.
inline std::string etcd_with_tool_unavailable_reason(const char* tool, const char* package) {
  const std::string why = etcd_unavailable_reason();
  if (!why.empty() || ::access(tool, X_OK) == 0) return why;
  return std::string(tool) + " is missing: install Debian's " + package +
         " (scripts/install-deps.sh does)";
}

inline constexpr const char* kOpensslBinary = "/usr/bin/openssl";

/// "" when etcd can be started with TLS here (etcd and the openssl CLI), else why not.
inline std::string etcd_tls_unavailable_reason() {
  return etcd_with_tool_unavailable_reason(kOpensslBinary, "openssl");
}

/// A throwaway PKI made with the openssl CLI in a fresh temporary directory (EC P-256 keys, valid
/// one day): a CA, a server certificate it signs for IP 127.0.0.1, a client certificate it
/// signs, and a second CA that signs nothing here (the wrong one to trust).
class TestPki {
 public:
  TestPki() {
    make_ca("ca");
    make_ca("other_ca");
    // etcd's JSON gateway dials etcd's own gRPC port presenting the server's certificate, so
    // that one is a client certificate too.
    make_signed("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth");
    make_signed("client", "extendedKeyUsage=clientAuth");
  }
  /// "<dir>/<name>.crt" or ".key" for ca, other_ca, server, client.
  std::string crt(const std::string& name) const { return dir_.file(name + ".crt"); }
  std::string key(const std::string& name) const { return dir_.file(name + ".key"); }

 private:
  void sh(const std::string& cmd) const {
    const std::string log = dir_.file("openssl.log");
    if (std::system((cmd + " >>" + log + " 2>&1").c_str()) != 0) {
      std::ifstream in(log);
      std::stringstream ss;
      ss << in.rdbuf();
      throw std::runtime_error("openssl failed: " + cmd + "\n" + ss.str());
    }
  }
  std::string new_key(const std::string& name) const {
    return " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " + key(name);
  }
  void make_ca(const std::string& name) const {
    sh(std::string(kOpensslBinary) + " req -x509" + new_key(name) + " -out " + crt(name) + " -days 1 -subj /CN=ember-" +
       name);
  }
  void make_signed(const std::string& name, const std::string& ext) const {
    const std::string csr = dir_.file(name + ".csr"), extfile = dir_.file(name + ".ext");
    std::ofstream(extfile) << ext << "\n";
    sh(std::string(kOpensslBinary) + " req -new" + new_key(name) + " -out " + csr + " -subj /CN=ember-" + name);
    sh(std::string(kOpensslBinary) + " x509 -req -in " + csr + " -CA " + crt("ca") + " -CAkey " + key("ca") +
       " -CAcreateserial -days 1 -extfile " + extfile + " -out " + crt(name));
  }

  TempDir dir_;
};

/// How an EtcdServer speaks TLS to its clients: empty = plain HTTP.
struct EtcdServerTls {
  const TestPki* pki = nullptr;  // serves pki->crt("server"), trusts pki->crt("ca")
  bool client_cert_auth = false;  // etcd --client-cert-auth (and --trusted-ca-file ca.crt)
};

/// One etcd server, started by the constructor and ready when it returns (a store answered
/// within 60 s, else std::runtime_error with the end of etcd's log). It spawns no thread in this
/// process, so Children may still fork after it.
class EtcdServer {
 public:
  explicit EtcdServer(EtcdServerTls tls = {}) : tls_(tls) {
    for (int attempt = 0;; ++attempt) {
      if (start()) return;
      stop();
      // A port picked by unused_port() may have been taken before etcd bound it: try new ones.
      if (attempt == 2) throw std::runtime_error("etcd did not start; its log:\n" + log_tail());
    }
  }
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  /// "127.0.0.1:<client port>".
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

  /// Options of a client this server accepts (with TLS: trusting its CA, and with
  /// client_cert_auth presenting the client certificate).
  dist::EtcdStoreOptions client_options() const {
    dist::EtcdStoreOptions o;
    if (tls_.pki) {
      o.https = true;
      o.ca_file = tls_.pki->crt("ca");
      if (tls_.client_cert_auth) {
        o.cert_file = tls_.pki->crt("client");
        o.key_file = tls_.pki->key("client");
      }
    }
    return o;
  }

  /// SIGKILLs etcd now and reaps it (idempotent).
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  /// The last lines of etcd's own log.
  std::string log_tail() const {
    std::ifstream in(dir_.file("etcd.log"));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string all = ss.str();
    return all.size() > 4000 ? all.substr(all.size() - 4000) : all;
  }

 private:
  bool start() {
    client_port_ = unused_port();
    uint16_t peer = unused_port();
    while (peer == client_port_) peer = unused_port();
    const std::string client =
        (tls_.pki ? "https://127.0.0.1:" : "http://127.0.0.1:") + std::to_string(client_port_);
    const std::string peer_url = "http://127.0.0.1:" + std::to_string(peer);
    const std::string data = dir_.file("data-" + std::to_string(client_port_));
    // --max-request-bytes: the store tests' 3 MiB value travels as 4 MiB of base64.
    std::vector<std::string> args = {kEtcdBinary,
                                     "--name=ember-test",
                                     "--data-dir=" + data,
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer_url,
                                     "--initial-advertise-peer-urls=" + peer_url,
                                     "--initial-cluster=ember-test=" + peer_url,
                                     "--max-request-bytes=16777216",
                                     "--logger=zap",
                                     "--log-level=warn"};
    if (tls_.pki) {
      args.push_back("--cert-file=" + tls_.pki->crt("server"));
      args.push_back("--key-file=" + tls_.pki->key("server"));
      // etcd asks clients for a certificate whenever it has a --trusted-ca-file.
      if (tls_.client_cert_auth) {
        args.push_back("--trusted-ca-file=" + tls_.pki->crt("ca"));
        args.push_back("--client-cert-auth");
      }
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    const std::string log = dir_.file("etcd.log");
    ::posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                       0644);
    ::posix_spawn_file_actions_adddup2(&actions, 1, 2);
    ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    const int rc = ::posix_spawn(&pid_, kEtcdBinary, &actions, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("posix_spawn " + std::string(kEtcdBinary) + " failed");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;  // exited (a port in use, say)
      }
      try {
        dist::EtcdStoreOptions o = client_options();
        o.timeout = std::chrono::milliseconds(500);
        dist::EtcdStore probe(endpoint(), o);
        return true;
      } catch (const dist::DistError& e) {
        // Not up yet (the probe's own connect retries paced this loop), unless TLS failed: that
        // will not change.
        if (std::string(e.what()).find("TLS") != std::string::npos) {
          stop();
          throw std::runtime_error(std::string("etcd refused TLS: ") + e.what() + "\n" +
                                   log_tail());
        }
      }
    }
    return false;
  }

  EtcdServerTls tls_;
  TempDir dir_;
  pid_t pid_ = -1;
  uint16_t client_port_ = 0;
};

inline constexpr const char* kCurlBinary = "/usr/bin/curl";

/// "" when etcd with authentication can be set up here (etcd and curl), else why not.
inline std::string etcd_auth_unavailable_reason() {
  return etcd_with_tool_unavailable_reason(kCurlBinary, "curl");
}

/// Runs the sh `script` with $E the server's http:// URL, $PW `password` and $C curl (failing
/// on HTTP errors); std::runtime_error with its output unless it succeeds.
inline void etcd_admin(const EtcdServer& etcd, const std::string& password,
                       const std::string& script) {
  TempDir d;
  std::ofstream(d.file("admin.sh")) << "set -e\nE='http://" << etcd.endpoint() << "'\nPW='"
                                    << password << "'\nC='" << kCurlBinary << " -sSf'\n"
                                    << script << "\n";
  const std::string cmd = "sh " + d.file("admin.sh") + " >" + d.file("out") + " 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream in(d.file("out"));
    std::stringstream ss;
    ss << in.rdbuf();
    throw std::runtime_error("etcd admin script failed:\n" + script + "\n" + ss.str());
  }
}

/// Turns on etcd's authentication (plain HTTP servers), with user root (role root) holding
/// `password`, through the JSON gateway with curl.
inline void enable_etcd_auth(const EtcdServer& etcd, const std::string& password) {
  etcd_admin(etcd, password, R"sh($C $E/v3/auth/user/add -d "{\"name\":\"root\",\"password\":\"$PW\"}"
$C $E/v3/auth/user/grant -d '{"user":"root","role":"root"}'
$C $E/v3/auth/enable -d '{}')sh");
}

/// Turns etcd's authentication off and on again (as root), which invalidates every token.
inline void reenable_etcd_auth(const EtcdServer& etcd, const std::string& password) {
  etcd_admin(etcd, password, R"sh(T=$($C $E/v3/auth/authenticate -d "{\"name\":\"root\",\"password\":\"$PW\"}" | sed 's/.*"token":"\([^"]*\)".*/\1/')
$C -H "Authorization: $T" $E/v3/auth/disable -d '{}'
$C $E/v3/auth/enable -d '{}')sh");
}

}  // namespace ember::test
