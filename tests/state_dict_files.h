// Builders of state-dict files by hand, shared by the state-dict tests and
// the hostile-file tests: PyTorch zip archives with any records, pickles
// written opcode by opcode, safetensors files from a header and data, and a
// patch of a zip's central directory.
#pragma once

#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace handmade {

/// A PyTorch-style zip archive (as torch.save lays it out) with the given
/// records, as bytes.
inline std::string zip_bytes(
    const std::vector<std::pair<std::string, std::string>>& records) {
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer(
      [&bytes](const void* data, size_t n) -> size_t {
        bytes.append(static_cast<const char*>(data), n);
        return n;
      });
  for (const auto& record : records) {
    writer.writeRecord(record.first, record.second.data(),
                       record.second.size());
  }
  writer.writeEndOfFile();
  return bytes;
}

/// Writes the zip archive of `zip_bytes(records)` to `path`.
inline void write_zip(
    const std::string& path,
    const std::vector<std::pair<std::string, std::string>>& records) {
  const std::string bytes = zip_bytes(records);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// Rewrites, in the central directory of the zip `bytes`, the entry of the
/// record whose name ends with `suffix`: compression method `method` (8:
/// deflate) and stated uncompressed size `size`. Returns false when no
/// entry matches.
inline bool patch_central_entry(std::string& bytes, const std::string& suffix,
                                uint16_t method, uint32_t size) {
  auto le = [&](size_t at, int n) {
    uint64_t v = 0;
    for (int i = n; i-- > 0;) {
      v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
    }
    return v;
  };
  for (size_t at = 0; at + 46 <= bytes.size(); ++at) {
    if (le(at, 4) != 0x02014b50) {
      continue;
    }
    const size_t name_size = le(at + 28, 2);
    const std::string name = bytes.substr(at + 46, name_size);
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      bytes[at + 10] = static_cast<char>(method & 0xff);
      bytes[at + 11] = static_cast<char>(method >> 8);
      for (int i = 0; i < 4; ++i) {
        bytes[at + 24 + i] = static_cast<char>((size >> (8 * i)) & 0xff);
      }
      return true;
    }
  }
  return false;
}

/// Builds pickle bytes by hand (opcodes as Python's pickletools names them).
struct Pickle {
  std::string bytes;
  Pickle& op(unsigned char c) {
    bytes.push_back(static_cast<char>(c));
    return *this;
  }
  Pickle& raw(const std::string& s) {
    bytes += s;
    return *this;
  }
  Pickle& proto(int version = 2) { return op(0x80).op(version); }
  Pickle& mark() { return op('('); }
  Pickle& global(const std::string& module, const std::string& name) {
    return op('c').raw(module + "\n" + name + "\n");
  }
  Pickle& str(const std::string& s) {
    op('X');
    for (int i = 0; i < 4; ++i) {
      op(static_cast<unsigned char>((s.size() >> (8 * i)) & 0xff));
    }
    return raw(s);
  }
  Pickle& int1(int v) { return op('K').op(static_cast<unsigned char>(v)); }
  /// BININT: a signed 4-byte int.
  Pickle& int4(int32_t v) {
    op('J');
    for (int i = 0; i < 4; ++i) {
      op(static_cast<unsigned char>((static_cast<uint32_t>(v) >> (8 * i)) &
                                    0xff));
    }
    return *this;
  }
  /// A tuple of ints, each BININT1 when it fits, BININT otherwise.
  Pickle& ints(const std::vector<int>& values) {
    mark();
    for (const int v : values) {
      if (v >= 0 && v < 256) {
        int1(v);
      } else {
        int4(v);
      }
    }
    return op('t');
  }
  Pickle& ordered_dict() {
    return global("collections", "OrderedDict").op(')').op('R');
  }
  /// _rebuild_tensor_v2(('storage', torch.<type>, key, 'cpu', numel),
  ///                    offset, sizes, strides, False, OrderedDict())
  Pickle& tensor(const std::string& type, int numel, int offset,
                 const std::vector<int>& sizes, const std::vector<int>& strides,
                 const std::string& key = "0") {
    global("torch._utils", "_rebuild_tensor_v2").mark();
    mark().str("storage").global("torch", type).str(key).str("cpu");
    int1(numel).op('t').op('Q');
    int1(offset).ints(sizes).ints(strides).op(0x89).ordered_dict();
    return op('t').op('R');
  }
};

/// An OrderedDict {"w": tensor(...)} pickle.
inline std::string one_tensor(const std::string& type, int numel, int offset,
                              const std::vector<int>& sizes,
                              const std::vector<int>& strides) {
  Pickle p;
  p.proto().ordered_dict().mark().str("w");
  p.tensor(type, numel, offset, sizes, strides);
  return p.op('u').op('.').bytes;
}

/// `n` float32 zeros as bytes.
inline std::string floats(int n) {
  return std::string(4 * static_cast<size_t>(n), '\0');
}

/// A safetensors file from a header and a data section.
inline std::string safetensors(const std::string& header,
                               const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[static_cast<size_t>(i)] =
        static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  return bytes + header + data;
}

}  // namespace handmade
