// Atomic file writing (atomic_file.h): temporary file in the target's
// directory, write, flush, fsync, rename, fsync of the directory.
#include "io/atomic_file.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace mha::detail {

void sync_path(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, what, ": cannot open '", path,
              "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int saved_errno = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, what, ": cannot sync '", path,
              "' to disk: ", std::strerror(saved_errno));
}

void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write,
                           const char* what) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string temporary =
      path + ".tmp" + std::to_string(static_cast<long>(::getpid()));
  auto parent = target.parent_path();
  if (parent.empty()) {
    parent = ".";
  }
  try {
    {
      std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
      TORCH_CHECK(file.good(), what, ": cannot write the file: cannot open '",
                  path, "' for writing (its temporary file '", temporary,
                  "'): ", std::strerror(errno));
      write(file);
      file.flush();
      TORCH_CHECK(!file.fail(), what, ": cannot write the file: writing '",
                  temporary, "' failed: ", std::strerror(errno));
      file.close();
      TORCH_CHECK(!file.fail(), what, ": cannot write the file: closing '",
                  temporary, "' failed: ", std::strerror(errno));
    }
    sync_path(temporary, what);
    TORCH_CHECK(::rename(temporary.c_str(), path.c_str()) == 0, what,
                ": cannot write the file: renaming '", temporary, "' to '",
                path, "' failed: ", std::strerror(errno));
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
  sync_path(parent.string(), what);
}

void write_text_file(const std::string& path, const std::string& text,
                     const char* what) {
  write_file_atomically(
      path, [&](std::ostream& out) { out << text; }, what);
}

}  // namespace mha::detail
