#include <ember/launcher/console.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ember::launcher {

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // console gone (EPIPE, SIGPIPE ignored): drop the output
    off += static_cast<size_t>(n);
  }
}

void log_line(const std::string& s) { write_all(STDERR_FILENO, "emberrun: " + s + "\n"); }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace ember::launcher
