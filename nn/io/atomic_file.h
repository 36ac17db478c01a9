// Atomic file replacement: a reader sees the old file or the complete new one, never a torn one.
//
// The new contents go to a uniquely named temp file in the target's directory (same file
// system, so the rename is atomic); the file is fsync'ed, renamed over the target, and the
// directory is fsync'ed so the rename itself survives a power cut. On any error the temp file
// is removed and the target is left untouched. A crash (or kill) mid-write can leave a stray
// temp file named `.<target name>.tmp-*` next to the target, but never a broken target.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace ember::nn {

/// Receives consecutive pieces of a file's contents (data, n bytes); copies them before
/// returning. Throws ember::Error if the write fails.
using ByteSink = std::function<void(const void* data, size_t n)>;

/// Replaces the file at `path` with `bytes` atomically (see the file comment). The new file has
/// mode 0666 minus the umask; a symlink at `path` is replaced, not followed.
/// Throws ember::Error naming `path`, the step that failed and the system's error text
/// (e.g. "No such file or directory" when the directory does not exist).
void write_file_atomic(const std::string& path, std::string_view bytes);

/// Like write_file_atomic(path, bytes), but streams the contents: `produce(sink)` calls `sink`
/// any number of times, so a large file need not be built in memory first. If `produce` throws,
/// the temp file is removed, the target is left as it was and the exception propagates.
void write_file_atomic(const std::string& path,
                       const std::function<void(const ByteSink& sink)>& produce);

}  // namespace ember::nn

// In ember::detail, not ember::nn::detail: a nested detail namespace would hide
// ember::detail::str_cat from unqualified `detail::` uses in ember::nn code.
namespace ember::detail {
/// The steps of write_file_atomic, for fault injection in tests.
enum class AtomicWriteStep { kNone, kCreate, kWrite, kFsync, kRename, kFsyncDir };

/// Test hook: makes the next write_file_atomic on the calling thread fail at `step` as if the
/// system call had set errno to `err`. For kWrite, the first `after_bytes` bytes are written
/// normally and the write that would go past them fails (a disk filling up halfway).
/// The fault fires once and is then cleared; kNone clears it without firing. `skip`: the first
/// `skip` writes pass `step` unharmed (to fail the second of two writes, skip 1; not for kWrite).
void inject_atomic_write_fault(AtomicWriteStep step, int err, size_t after_bytes = 0, int skip = 0);
}  // namespace ember::detail
