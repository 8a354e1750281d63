// Internal, the safetensors layer of state-dict I/O (declared in
// safetensors.h): the header is JSON, read with nlohmann-json and checked
// entry by entry before any data is read. Depends on tensor_file.h.
//
// Glossary: an "entry" is one tensor of the header; its data_offsets
// [begin, end) are byte offsets into the data section that follows the
// header.
#include "io/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "io/atomic_file.h"
#include "io/tensor_file.h"

namespace mha::detail {
namespace {

/// The format's own limit on the header (the reference implementation
/// refuses larger headers).
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;
/// A safetensors header nests 3 deep ({name: {shape: [...]}}); anything much
/// deeper is refused before parsing, so that no hostile header can exhaust
/// the stack.
constexpr size_t kMaxJsonDepth = 8;

/// How deeply `text`'s JSON arrays and objects nest (brackets inside strings
/// do not count).
size_t json_depth(const std::string& text) {
  size_t depth = 0;
  size_t max_depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return max_depth;
}

/// One tensor of a safetensors header, validated.
struct SafetensorsEntry {
  std::string name;
  const DtypeName* dtype;
  std::vector<int64_t> shape;
  uint64_t begin;  // byte offsets into the data section, [begin, end)
  uint64_t end;
};

/// A JSON number that is a non-negative integer, as uint64.
bool json_unsigned(const nlohmann::json& j, uint64_t* out) {
  if (!j.is_number_unsigned()) {
    return false;
  }
  *out = j.get<uint64_t>();
  return true;
}

/// The header entry `info` of the tensor `name`, checked field by field and
/// against a data section of `data_size` bytes.
SafetensorsEntry parse_safetensors_entry(const std::string& where,
                                         const std::string& name,
                                         const nlohmann::json& info,
                                         uint64_t data_size) {
  const std::string what = where + ": tensor '" + printable(name) + "'";
  TORCH_CHECK(info.is_object(), what,
              ": expected an object {\"dtype\", \"shape\", \"data_offsets\"}",
              ", got ", info.type_name());
  for (auto it = info.begin(); it != info.end(); ++it) {
    TORCH_CHECK(it.key() == "dtype" || it.key() == "shape" ||
                    it.key() == "data_offsets",
                what, ": unknown field '", printable(it.key()),
                "' (expected dtype, shape, data_offsets)");
  }
  TORCH_CHECK(info.contains("dtype") && info.contains("shape") &&
                  info.contains("data_offsets"),
              what, ": needs the fields dtype, shape and data_offsets");

  SafetensorsEntry entry;
  entry.name = name;
  const auto& dtype = info["dtype"];
  TORCH_CHECK(dtype.is_string(), what, ": dtype must be a string, got ",
              dtype.type_name());
  entry.dtype = find_safetensors_dtype(dtype.get<std::string>());
  TORCH_CHECK(entry.dtype != nullptr, what, ": unsupported dtype '",
              printable(dtype.get<std::string>()),
              "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
              "BOOL)");

  const auto& shape = info["shape"];
  TORCH_CHECK(shape.is_array(), what, ": shape must be an array, got ",
              shape.type_name());
  // As the pickle reader: a tensor of a state dict has a few dimensions.
  constexpr size_t kMaxDims = 64;
  TORCH_CHECK(shape.size() <= kMaxDims, what, ": shape has ", shape.size(),
              " dimensions (at most ", kMaxDims, " accepted)");
  for (const auto& dim : shape) {
    uint64_t d = 0;
    TORCH_CHECK(
        json_unsigned(dim, &d) &&
            d <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
        what, ": shape entries must be integers >= 0, got ",
        printable(dim.dump()));
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  const auto& offsets = info["data_offsets"];
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2 &&
                  json_unsigned(offsets[0], &entry.begin) &&
                  json_unsigned(offsets[1], &entry.end),
              what, ": data_offsets must be two integers [begin, end], got ",
              printable(offsets.dump()));
  TORCH_CHECK(entry.begin <= entry.end && entry.end <= data_size, what,
              ": data_offsets [", entry.begin, ", ", entry.end,
              "] out of range: the data section holds ", data_size,
              " bytes (expected begin <= end <= ", data_size,
              "); is the file truncated?");

  uint64_t numel = 0;
  uint64_t nbytes = 0;
  TORCH_CHECK(checked_numel(entry.shape, &numel) &&
                  checked_mul(numel, element_size(*entry.dtype), &nbytes),
              what, ": shape ", c10::IntArrayRef(entry.shape), " is too large");
  TORCH_CHECK(entry.end - entry.begin == nbytes, what, ": data_offsets [",
              entry.begin, ", ", entry.end, "] span ", entry.end - entry.begin,
              " bytes, but shape ", c10::IntArrayRef(entry.shape), " of ",
              entry.dtype->safetensors, " needs ", nbytes, " bytes");
  return entry;
}

}  // namespace

StateDict read_safetensors(const std::string& path, std::ifstream& in,
                           uint64_t file_size,
                           const std::function<bool(const std::string&)>& keep,
                           std::map<std::string, std::string>* metadata) {
  const std::string where = file_label(path) + " (safetensors)";
  unsigned char length_bytes[8];
  read_exact(in, 0, length_bytes, 8, where, "the header length");
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) {
    header_size = (header_size << 8) | length_bytes[i];
  }
  TORCH_CHECK(header_size <= kMaxSafetensorsHeader, where, ": header length ",
              header_size, " exceeds the format's limit of ",
              kMaxSafetensorsHeader, " bytes");
  TORCH_CHECK(header_size <= file_size - 8, where, ": header length ",
              header_size, " runs past the end of the file (", file_size,
              " bytes: at most ", file_size - 8,
              " after the 8-byte length); is the file truncated?");
  std::string header(header_size, '\0');
  read_exact(in, 8, &header[0], header_size, where, "the header");
  TORCH_CHECK(!header.empty() && header[0] == '{', where,
              ": the header must be a JSON object starting with '{'");
  const size_t depth = json_depth(header);
  TORCH_CHECK(depth <= kMaxJsonDepth, where, ": the header nests ", depth,
              " levels deep (a safetensors header needs 3, at most ",
              kMaxJsonDepth, " accepted)");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, ": the header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(json.is_object(), where,
              ": the header must be a JSON object, got ", json.type_name());

  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;
  std::vector<SafetensorsEntry> entries;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      // Free-form string-to-string map (the spec); validated, then ignored.
      TORCH_CHECK(it.value().is_object(), where,
                  ": __metadata__ must be an object, got ",
                  it.value().type_name());
      for (const auto& value : it.value()) {
        TORCH_CHECK(value.is_string(), where,
                    ": __metadata__ values must be strings, got ",
                    value.type_name());
      }
      if (metadata != nullptr) {
        for (auto m = it.value().begin(); m != it.value().end(); ++m) {
          (*metadata)[m.key()] = m.value().get<std::string>();
        }
      }
      continue;
    }
    entries.push_back(
        parse_safetensors_entry(where, it.key(), it.value(), data_size));
  }

  // The tensors must cover the data section exactly: no holes, no overlaps.
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  uint64_t covered = 0;
  for (const auto& entry : entries) {
    TORCH_CHECK(entry.begin == covered, where, ": tensor '",
                printable(entry.name), "' occupies bytes [", entry.begin, ", ",
                entry.end,
                ") of the data section, but the tensors "
                "before it end at byte ",
                covered,
                " (tensors must cover the data section without holes or "
                "overlaps)");
    covered = entry.end;
  }
  TORCH_CHECK(covered == data_size, where, ": the tensors cover ", covered,
              " bytes, but the data section holds ", data_size,
              " (the rest is not indexed by any tensor)");

  StateDict result;
  for (const auto& entry : entries) {
    if (keep && !keep(entry.name)) {
      continue;
    }
    torch::Tensor t =
        tensor_from_bytes(*entry.dtype, entry.shape, [&](void* dst) {
          read_exact(in, data_start + entry.begin, dst, entry.end - entry.begin,
                     where, "tensor data");
        });
    result.insert(entry.name, std::move(t));
  }
  return result;
}

void write_safetensors(const TensorEntries& entries, const std::string& file,
                       const std::string& where) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& [name, t] : entries) {
    TORCH_CHECK(name != "__metadata__", where,
                ": '__metadata__' is reserved in safetensors and cannot name "
                "a tensor");
    const uint64_t nbytes = t.nbytes();
    header[name] = {{"dtype", find_dtype(t.scalar_type())->safetensors},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned (allowed by the spec,
  // as the reference writer does).
  text.append((8 - text.size() % 8) % 8, ' ');

  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) {
    length_bytes[i] = static_cast<unsigned char>(
        (static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  // Atomically: a crash leaves the old file or the complete new one.
  write_file_atomically(
      file,
      [&](std::ostream& out) {
        out.write(reinterpret_cast<const char*>(length_bytes), 8);
        out.write(text.data(), static_cast<std::streamsize>(text.size()));
        for (const auto& entry : entries) {
          out.write(static_cast<const char*>(entry.second.data_ptr()),
                    static_cast<std::streamsize>(entry.second.nbytes()));
        }
      },
      where.c_str());
}

}  // namespace mha::detail
