// Internal, the zip layer of state-dict I/O (declared in zip_archive.h): the
// archive of a PyTorch file, read and written with LibTorch's
// PyTorchStreamReader and PyTorchStreamWriter, whose exceptions become
// c10::Errors that name the file. Before LibTorch's reader allocates
// anything, the central directory is read here and every record's stated
// size checked against the archive's real size. Depends on tensor_file.h.
//
// Glossary: the "EOCD" is the zip's end-of-central-directory record; the
// "central directory" lists every record with its stated (uncompressed)
// size; "archive size" is the file's real size in bytes.
#include "io/zip_archive.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "io/atomic_file.h"
#include "io/tensor_file.h"

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

/// What check_central_directory finds.
struct CentralDirectory {
  uint64_t budget;          // bytes the records may fill in total
  uint64_t bytes;           // of the directory
  uint64_t entries;         // records
  uint64_t largest_record;  // the largest size a record states
};

uint64_t le(const unsigned char* p, int n) {
  uint64_t value = 0;
  for (int i = n; i-- > 0;) {
    value = (value << 8) | p[i];
  }
  return value;
}

/// Reads the central directory of the archive `in` (of `archive_size` bytes)
/// the way miniz, LibTorch's zip library, finds it, and checks each record's
/// stated uncompressed size before anything allocates it: at most the
/// archive's size each (torch.save stores records uncompressed, so a record
/// is never larger than its archive) and at most kMaxRecordBytesPerByte
/// times it together (a compressed archive may expand a little, a zip bomb
/// may not).
CentralDirectory check_central_directory(std::ifstream& in,
                                         uint64_t archive_size,
                                         const std::string& where) {
  constexpr uint64_t kEocdSize = 22;
  constexpr uint64_t kMaxComment = 65535;
  TORCH_CHECK(archive_size >= kEocdSize, where, ": the archive has ",
              archive_size, " bytes, too short for a zip file");
  // The EOCD: the last signature PK\5\6 with room for the record after it
  // (miniz: mz_zip_reader_locate_header_sig).
  const uint64_t tail_size = std::min(archive_size, kEocdSize + kMaxComment);
  std::vector<unsigned char> tail(tail_size);
  read_exact(in, archive_size - tail_size, tail.data(), tail_size, where,
             "the end of the zip archive");
  uint64_t eocd = tail_size;  // offset in tail; tail_size: not found
  for (uint64_t i = tail_size - kEocdSize + 1; i-- > 0;) {
    if (le(&tail[i], 4) == 0x06054b50) {
      eocd = i;
      break;
    }
  }
  TORCH_CHECK(eocd < tail_size, where,
              ": no zip end-of-central-directory record in the last ",
              tail_size, " bytes (not a zip archive, or truncated?)");
  uint64_t entries = le(&tail[eocd + 10], 2);
  uint64_t directory_size = le(&tail[eocd + 12], 4);
  uint64_t directory_offset = le(&tail[eocd + 16], 4);
  const uint64_t eocd_offset = archive_size - tail_size + eocd;
  // Zip64: a locator PK\6\7 just before the EOCD points to the zip64 EOCD.
  if (eocd_offset >= 20) {
    unsigned char locator[20];
    read_exact(in, eocd_offset - 20, locator, 20, where, "the zip64 locator");
    if (le(locator, 4) == 0x07064b50) {
      const uint64_t zip64_offset = le(locator + 8, 8);
      TORCH_CHECK(
          zip64_offset <= archive_size && archive_size - zip64_offset >= 56,
          where,
          ": the zip64 end-of-central-directory record at "
          "offset ",
          zip64_offset, " lies outside the archive of ", archive_size,
          " bytes");
      unsigned char zip64[56];
      read_exact(in, zip64_offset, zip64, 56, where,
                 "the zip64 end-of-central-directory record");
      TORCH_CHECK(le(zip64, 4) == 0x06064b50, where,
                  ": no zip64 end-of-central-directory record at offset ",
                  zip64_offset);
      entries = le(zip64 + 32, 8);
      directory_size = le(zip64 + 40, 8);
      directory_offset = le(zip64 + 48, 8);
    }
  }
  TORCH_CHECK(directory_offset <= archive_size &&
                  directory_size <= archive_size - directory_offset,
              where, ": the central directory (", directory_size,
              " bytes at offset ", directory_offset,
              ") lies outside the archive of ", archive_size, " bytes");
  constexpr uint64_t kEntrySize = 46;  // a central-directory entry's header
  TORCH_CHECK(entries <= directory_size / kEntrySize, where,
              ": the central directory states ", entries,
              " records, more than its ", directory_size, " bytes can hold");
  std::vector<unsigned char> directory(directory_size);
  read_exact(in, directory_offset, directory.data(), directory_size, where,
             "the central directory");

  constexpr uint64_t kMaxRecordBytesPerByte = 4;
  const uint64_t budget = kMaxRecordBytesPerByte * archive_size;
  uint64_t total = 0;
  uint64_t largest = 0;
  uint64_t at = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    TORCH_CHECK(directory_size - at >= kEntrySize &&
                    le(&directory[at], 4) == 0x02014b50,
                where, ": central-directory entry ", e, " (at byte ", at,
                " of ", directory_size, ") is damaged");
    const unsigned char* h = &directory[at];
    uint64_t stated = le(h + 24, 4);  // uncompressed size
    const uint64_t name_size = le(h + 28, 2);
    const uint64_t extra_size = le(h + 30, 2);
    const uint64_t comment_size = le(h + 32, 2);
    const uint64_t entry_size =
        kEntrySize + name_size + extra_size + comment_size;
    TORCH_CHECK(entry_size <= directory_size - at, where,
                ": central-directory entry ", e, " runs past the directory");
    const std::string name(reinterpret_cast<const char*>(h + kEntrySize),
                           name_size);
    if (stated == 0xffffffff) {
      // The real size is in the zip64 extra field (id 1), first.
      bool found = false;
      const unsigned char* x = h + kEntrySize + name_size;
      for (uint64_t i = 0; i + 4 <= extra_size && !found;) {
        const uint64_t id = le(x + i, 2);
        const uint64_t n = le(x + i + 2, 2);
        if (id == 1 && n >= 8 && i + 4 + 8 <= extra_size) {
          stated = le(x + i + 4, 8);
          found = true;
        }
        i += 4 + n;
      }
      TORCH_CHECK(found, where, ": record '", printable(name),
                  "' states a zip64 size but has no zip64 extra field");
    }
    TORCH_CHECK(stated <= archive_size, where, ": record '", printable(name),
                "' states a size of ", stated,
                " bytes, larger than the whole archive (", archive_size,
                " bytes); refused before allocating it");
    total += stated;  // at most 5 times archive_size here: no overflow
    largest = std::max(largest, stated);
    TORCH_CHECK(total <= budget, where, ": the records state ", total,
                " bytes or more in total, over ", kMaxRecordBytesPerByte,
                " times the archive's ", archive_size,
                " bytes (a zip bomb?); refused before allocating them");
    at += entry_size;
  }
  return {budget, directory_size, entries, largest};
}

}  // namespace

ZipArchiveReader::ZipArchiveReader(const std::string& path, std::string where)
    : where_(std::move(where)) {
  using caffe2::serialize::PyTorchStreamReader;
  {
    std::error_code error;
    const uint64_t archive_size = std::filesystem::file_size(path, error);
    TORCH_CHECK(!error, where_,
                ": cannot get the file size: ", error.message());
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.is_open(), where_, ": cannot open the file for reading");
    const CentralDirectory directory =
        check_central_directory(in, archive_size, where_);
    size_ = archive_size;
    budget_ = directory.budget;
    // miniz's copy of the directory, and its two arrays of 4-byte offsets.
    index_bytes_ = directory.bytes + 8 * directory.entries;
    largest_record_ = directory.largest_record;
  }
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
  auto result = with_context(where_, ("reading the record " + name).c_str(),
                             [&] { return reader_->getRecord(name); });
  // miniz matches names without case, so two names can read one record;
  // the bytes read stay within the budget of the stated sizes all the same.
  read_ += std::get<1>(result);
  TORCH_CHECK(read_ <= budget_, where_, ": reading the record '",
              printable(name), "' brings the bytes read to ", read_,
              ", over the archive's budget of ", budget_, " bytes");
  return result;
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
