// Internal, the safetensors layer of state-dict I/O (declared in
// safetensors.h): the header is JSON, read member by member with
// nlohmann-json's SAX parser (json_members.h) and checked entry by entry,
// within the load's memory budget, before any data is read. Depends on
// tensor_file.h and json_members.h.
//
// Glossary: an "entry" is one tensor of the header; its data_offsets
// [begin, end) are byte offsets into the data section that follows the
// header.
#include "io/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <exception>
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
#include "io/json_members.h"
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
  bool kept;  // its data is read
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
                                         std::string& name,
                                         const nlohmann::json& info,
                                         uint64_t data_size) {
  // The messages' prefix, built only for a message.
  const auto what = [&] {
    return where + ": tensor '" + printable(name) + "'";
  };
  TORCH_CHECK(info.is_object(), what(),
              ": expected an object {\"dtype\", \"shape\", \"data_offsets\"}",
              ", got ", info.type_name());
  for (auto it = info.begin(); it != info.end(); ++it) {
    TORCH_CHECK(it.key() == "dtype" || it.key() == "shape" ||
                    it.key() == "data_offsets",
                what(), ": unknown field '", printable(it.key()),
                "' (expected dtype, shape, data_offsets)");
  }
  TORCH_CHECK(info.contains("dtype") && info.contains("shape") &&
                  info.contains("data_offsets"),
              what(), ": needs the fields dtype, shape and data_offsets");

  SafetensorsEntry entry;
  const auto& dtype = info["dtype"];
  TORCH_CHECK(dtype.is_string(), what(), ": dtype must be a string, got ",
              dtype.type_name());
  entry.dtype = find_safetensors_dtype(dtype.get<std::string>());
  TORCH_CHECK(entry.dtype != nullptr, what(), ": unsupported dtype '",
              printable(dtype.get<std::string>()),
              "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
              "BOOL)");

  const auto& shape = info["shape"];
  TORCH_CHECK(shape.is_array(), what(), ": shape must be an array, got ",
              shape.type_name());
  // As the pickle reader: a tensor of a state dict has a few dimensions.
  constexpr size_t kMaxDims = 64;
  TORCH_CHECK(shape.size() <= kMaxDims, what(), ": shape has ", shape.size(),
              " dimensions (at most ", kMaxDims, " accepted)");
  for (const auto& dim : shape) {
    uint64_t d = 0;
    TORCH_CHECK(
        json_unsigned(dim, &d) &&
            d <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
        what(), ": shape entries must be integers >= 0, got ",
        printable(dim.dump()));
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  const auto& offsets = info["data_offsets"];
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2 &&
                  json_unsigned(offsets[0], &entry.begin) &&
                  json_unsigned(offsets[1], &entry.end),
              what(), ": data_offsets must be two integers [begin, end], got ",
              printable(offsets.dump()));
  TORCH_CHECK(entry.begin <= entry.end && entry.end <= data_size, what(),
              ": data_offsets [", entry.begin, ", ", entry.end,
              "] out of range: the data section holds ", data_size,
              " bytes (expected begin <= end <= ", data_size,
              "); is the file truncated?");

  uint64_t numel = 0;
  uint64_t nbytes = 0;
  TORCH_CHECK(checked_numel(entry.shape, &numel) &&
                  checked_mul(numel, element_size(*entry.dtype), &nbytes),
              what(), ": shape ", c10::IntArrayRef(entry.shape),
              " is too large");
  TORCH_CHECK(entry.end - entry.begin == nbytes, what(), ": data_offsets [",
              entry.begin, ", ", entry.end, "] span ", entry.end - entry.begin,
              " bytes, but shape ", c10::IntArrayRef(entry.shape), " of ",
              entry.dtype->safetensors, " needs ", nbytes, " bytes");
  entry.name = std::move(name);
  return entry;
}

/// The heap bytes of `s` (none while it fits in the string itself).
uint64_t heap_bytes(const std::string& s) {
  return s.capacity() > 15 ? s.capacity() + 17 : 0;
}

/// The header read member by member (json_members.h): each tensor's entry
/// checked as soon as it is complete and charged to the budget;
/// __metadata__'s strings checked one by one.
class HeaderReader : public JsonMemberVisitor {
 public:
  HeaderReader(const std::string& where, uint64_t data_size,
               MemoryBudget& budget,
               const std::function<bool(const std::string&)>& keep,
               std::map<std::string, std::string>* metadata)
      : where_(where),
        data_size_(data_size),
        budget_(budget),
        keep_(keep),
        metadata_(metadata) {}

  /// The entries in the header's order.
  std::deque<SafetensorsEntry> entries;

  bool streamed(const std::string& key) const override {
    return key == "__metadata__";
  }

  void member(std::string& key, nlohmann::json& value) override {
    // __metadata__ reaches here only when it is not an object.
    TORCH_CHECK(key != "__metadata__", where_,
                ": __metadata__ must be an object, got ", value.type_name());
    SafetensorsEntry entry =
        parse_safetensors_entry(where_, key, value, data_size_);
    entry.kept = !keep_ || keep_(entry.name);
    // The entry and its place in the orders of names and offsets; what its
    // tensor holds is charged once the header is gone (read_safetensors).
    const uint64_t bytes = sizeof(SafetensorsEntry) + heap_bytes(entry.name) +
                           entry.shape.size() * sizeof(int64_t) + 16 +
                           sizeof(uint32_t) + sizeof(void*);
    if (!budget_.try_charge(bytes)) {
      budget_.refuse("tensor '" + printable(entry.name) + "'");
    }
    entries.push_back(std::move(entry));
  }

  void begin_streamed(const std::string&) override {}

  void inner(const std::string&, std::string& key,
             nlohmann::json& value) override {
    // Free-form string-to-string map (the spec); validated, then ignored
    // unless asked for.
    TORCH_CHECK(value.is_string(), where_,
                ": __metadata__ values must be strings, got ",
                value.type_name());
    if (metadata_ != nullptr) {
      auto& text = value.get_ref<std::string&>();
      if (!budget_.try_charge(64 + heap_bytes(key) + heap_bytes(text))) {
        budget_.refuse("__metadata__ '" + printable(key) + "'");
      }
      (*metadata_)[std::move(key)] = std::move(text);
    }
  }

  [[noreturn]] void too_large(const std::string& outer,
                              const std::string& key) override {
    TORCH_CHECK(false, where_, ": the value of '", printable(key), "'",
                outer.empty() ? "" : " (in '" + outer + "')",
                " holds more than ", kMaxEntryValues,
                " JSON values (a tensor's entry holds at most 70)");
  }

  [[noreturn]] void invalid(const std::exception& e) override {
    TORCH_CHECK(false, where_, ": the header is not valid JSON: ", e.what());
  }

  /// The most JSON values one member's value may hold.
  static constexpr size_t kMaxEntryValues = 4096;

 private:
  const std::string& where_;
  uint64_t data_size_;
  MemoryBudget& budget_;
  const std::function<bool(const std::string&)>& keep_;
  std::map<std::string, std::string>* metadata_;
};

}  // namespace

StateDict read_safetensors(const std::string& path, std::ifstream& in,
                           uint64_t file_size,
                           const std::function<bool(const std::string&)>& keep,
                           std::map<std::string, std::string>* metadata) {
  const std::string where = file_label(path) + " (safetensors)";
  MemoryBudget budget(file_size, where);
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
  // The text and, while it is parsed, one token of it twice (the parser's
  // raw and decoded copies, or the value the decoded one went to).
  budget.charge(3 * header_size,
                "the header of " + std::to_string(header_size) + " bytes");
  std::string header(header_size, '\0');
  read_exact(in, 8, &header[0], header_size, where, "the header");
  TORCH_CHECK(!header.empty() && header[0] == '{', where,
              ": the header must be a JSON object starting with '{'");
  const size_t depth = json_depth(header);
  TORCH_CHECK(depth <= kMaxJsonDepth, where, ": the header nests ", depth,
              " levels deep (a safetensors header needs 3, at most ",
              kMaxJsonDepth, " accepted)");
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;
  HeaderReader reader(where, data_size, budget, keep, metadata);
  std::string type;
  TORCH_CHECK(
      read_json_members(header, reader, HeaderReader::kMaxEntryValues, &type),
      where, ": the header must be a JSON object, got ", type);
  std::string().swap(header);
  budget.release(3 * header_size);

  // Of two entries of one name, the last counts (as in a JSON object); the
  // rest in the order of names, then of their data (as before the header
  // was read member by member: a std::map's order, then std::sort).
  std::deque<SafetensorsEntry>& all = reader.entries;
  std::vector<uint32_t> by_name(all.size());
  for (uint32_t i = 0; i < by_name.size(); ++i) {
    by_name[i] = i;
  }
  std::sort(by_name.begin(), by_name.end(), [&](uint32_t a, uint32_t b) {
    const int order = all[a].name.compare(all[b].name);
    return order < 0 || (order == 0 && a < b);
  });
  std::vector<const SafetensorsEntry*> entries;
  entries.reserve(by_name.size());
  for (size_t i = 0; i < by_name.size(); ++i) {
    if (i + 1 == by_name.size() ||
        all[by_name[i]].name != all[by_name[i + 1]].name) {
      entries.push_back(&all[by_name[i]]);
    }
  }
  std::vector<uint32_t>().swap(by_name);

  // The tensors must cover the data section exactly: no holes, no overlaps.
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
              return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
            });
  uint64_t covered = 0;
  for (const auto* entry : entries) {
    TORCH_CHECK(entry->begin == covered, where, ": tensor '",
                printable(entry->name), "' occupies bytes [", entry->begin,
                ", ", entry->end,
                ") of the data section, but the tensors "
                "before it end at byte ",
                covered,
                " (tensors must cover the data section without holes or "
                "overlaps)");
    covered = entry->end;
  }
  TORCH_CHECK(covered == data_size, where, ": the tensors cover ", covered,
              " bytes, but the data section holds ", data_size,
              " (the rest is not indexed by any tensor)");

  // What the tensors read will hold: LibTorch's tensor, the dict's entry
  // with the name twice, the data (a bool tensor's twice: read as bytes,
  // then compared with 0). The data lie in the file without overlaps: no
  // overflow.
  uint64_t result_bytes = 0;
  uint64_t kept = 0;
  for (const auto* entry : entries) {
    if (entry->kept) {
      const uint64_t data = entry->end - entry->begin;
      result_bytes += kTensorOverheadBytes + kDictEntryBytes +
                      2 * heap_bytes(entry->name) +
                      (entry->dtype->dtype == torch::kBool ? 2 * data : data);
      ++kept;
    }
  }
  budget.charge(result_bytes,
                "reading its " + std::to_string(kept) + " tensors");

  StateDict result;
  for (const auto* entry : entries) {
    if (!entry->kept) {
      continue;
    }
    torch::Tensor t =
        tensor_from_bytes(*entry->dtype, entry->shape, [&](void* dst) {
          read_exact(in, data_start + entry->begin, dst,
                     entry->end - entry->begin, where, "tensor data");
        });
    result.insert(entry->name, std::move(t));
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
