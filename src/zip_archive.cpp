// Internal, the zip layer of state-dict I/O (declared in zip_archive.h): the
// archive of a PyTorch file, read and written with LibTorch's
// PyTorchStreamReader and PyTorchStreamWriter, whose exceptions become
// c10::Errors that name the file. Depends on tensor_file.h.
#include "zip_archive.h"

#include <caffe2/serialize/inline_container.h>

#include <cstddef>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "atomic_file.h"
#include "tensor_file.h"

namespace mha::detail {
namespace {

/// Runs `f`, turning any exception it throws (LibTorch's zip reader and
/// writer throw c10::Error, std::exception on allocation failures) into one
/// c10::Error that names the file and what was being done.
template <typename F>
auto with_context(const std::string& where, const char* what, F&& f)
    -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", what, ": ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, ": ", what, ": ", e.what());
  }
}

}  // namespace

ZipArchiveReader::ZipArchiveReader(const std::string& path, std::string where)
    : where_(std::move(where)) {
  using caffe2::serialize::PyTorchStreamReader;
  reader_ = with_context(where_, "not a readable PyTorch zip archive", [&] {
    return std::make_unique<PyTorchStreamReader>(path);
  });
  if (has_record("byteorder")) {
    auto [data, size] = record("byteorder");
    const std::string order(static_cast<const char*>(data.get()), size);
    TORCH_CHECK(order == "little", where_, ": byte order '", printable(order),
                "' is not supported (only little)");
  }
  TORCH_CHECK(has_record("data.pkl"), where_,
              ": the archive has no data.pkl record, so it was not written "
              "by torch.save (a TorchScript archive from torch.jit.save or "
              "torch::save?)");
}

ZipArchiveReader::~ZipArchiveReader() = default;

bool ZipArchiveReader::has_record(const std::string& name) {
  return with_context(where_, "reading the archive's index",
                      [&] { return reader_->hasRecord(name); });
}

std::tuple<at::DataPtr, size_t> ZipArchiveReader::record(
    const std::string& name) {
  return with_context(where_, ("reading the record " + name).c_str(),
                      [&] { return reader_->getRecord(name); });
}

void write_zip_archive(const std::string& file, const std::string& where,
                       const std::string& pickle,
                       const TensorEntries& entries) {
  // Atomically: a crash leaves the old file or the complete new one.
  write_file_atomically(
      file,
      [&](std::ostream& out) {
        with_context(where, "writing the zip archive", [&] {
          caffe2::serialize::PyTorchStreamWriter writer(
              [&out](const void* data, size_t n) -> size_t {
                out.write(static_cast<const char*>(data),
                          static_cast<std::streamsize>(n));
                return out.good() ? n : 0;
              });
          writer.writeRecord("data.pkl", pickle.data(), pickle.size());
          writer.writeRecord("byteorder", "little", 6);
          for (size_t i = 0; i < entries.size(); ++i) {
            const torch::Tensor& t = entries[i].second;
            writer.writeRecord("data/" + std::to_string(i), t.data_ptr(),
                               t.nbytes());
          }
          writer.writeEndOfFile();
        });
      },
      where.c_str());
}

}  // namespace mha::detail
