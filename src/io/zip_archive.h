// Internal, the zip layer of state-dict I/O: the zip archive that Python's
// torch.save writes (records data.pkl, byteorder and data/<key>), read and
// written through LibTorch's caffe2::serialize. Depends on tensor_file.h.
// Not installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "io/tensor_file.h"

namespace caffe2::serialize {
class PyTorchStreamReader;
}  // namespace caffe2::serialize

namespace mha::detail {

/// A PyTorch zip archive opened for reading. Every error, LibTorch's zip
/// reader's included, is one c10::Error that starts with `where`. Memory is
/// bounded by the file's size: a record that states more bytes than the
/// archive holds is refused before anything is allocated, and all records
/// read together stay under 4 times the archive's size. What the archive
/// holds open (index_bytes()) and the largest record it may read
/// (largest_record()) are known before any record is read, for the load's
/// MemoryBudget.
class ZipArchiveReader {
 public:
  /// Opens the archive `path` and checks what torch.save writes: the byte
  /// order, if recorded, is little, and the record data.pkl exists. Checks
  /// first every record's stated size against the file's size.
  ZipArchiveReader(const std::string& path, std::string where);
  /// Closes the archive.
  ~ZipArchiveReader();
  ZipArchiveReader(const ZipArchiveReader&) = delete;
  ZipArchiveReader& operator=(const ZipArchiveReader&) = delete;

  /// Whether the archive holds the record `name`.
  bool has_record(const std::string& name);
  /// The bytes of the record `name` and their number. Throws when the bytes
  /// read so far would exceed the budget of 4 times the archive's size.
  std::tuple<at::DataPtr, size_t> record(const std::string& name);

  /// The archive's size in bytes.
  uint64_t size() const { return size_; }
  /// What LibTorch's zip reader holds while the archive is open: its copy
  /// of the central directory and two offsets per record.
  uint64_t index_bytes() const { return index_bytes_; }
  /// The largest size a record states.
  uint64_t largest_record() const { return largest_record_; }

 private:
  std::string where_;
  uint64_t size_ = 0;
  uint64_t index_bytes_ = 0;
  uint64_t largest_record_ = 0;
  uint64_t budget_ = 0;  // bytes all records may fill together
  uint64_t read_ = 0;    // bytes read so far
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
};

/// Writes the zip archive `file` as torch.save does: the record data.pkl
/// holding `pickle`, byteorder "little", and tensor i of `entries` as the
/// storage record "data/<i>".
void write_zip_archive(const std::string& file, const std::string& where,
                       const std::string& pickle, const TensorEntries& entries);

}  // namespace mha::detail
