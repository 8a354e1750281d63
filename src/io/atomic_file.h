// Internal: the one place where mha writes files. Every file is written
// atomically: to a temporary file in the same directory, flushed and
// fsync'ed, then renamed over the target, and the directory fsync'ed, so
// that a process killed at any moment (or a machine that loses power)
// leaves either the old file or the complete new one, never a torn one.
// Not installed.
#pragma once

#include <functional>
#include <ostream>
#include <string>

namespace mha::detail {

/// Writes the file at `path` atomically (see above): `write` streams the
/// contents into a temporary file `path` + ".tmp<pid>" in the same
/// directory, which then replaces `path` (created or replaced). Throws
/// c10::Error, starting with `what` and naming the path and the system's
/// reason, if the file cannot be opened, written, synced or renamed; the
/// temporary file is removed then and `path` is left as it was.
void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write,
                           const char* what);

/// Writes `text` to the file at `path` (bytes as given), atomically as
/// write_file_atomically.
void write_text_file(const std::string& path, const std::string& text,
                     const char* what);

/// fsync(2)s the file or directory at `path`, so that what was written
/// there (a directory: its entries, such as a rename) survives a crash.
/// Throws c10::Error starting with `what` on failure.
void sync_path(const std::string& path, const char* what);

}  // namespace mha::detail
