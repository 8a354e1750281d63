// State dicts on disk: safetensors and PyTorch zip files (formats and
// sources in include/mha/state_dict.h).
//
// Glossary: an "entry" is one (name, tensor) pair of a state dict; a "record"
// is one file inside a PyTorch zip archive; a "storage" is the flat buffer
// (numel elements of one dtype) that a PyTorch tensor views through an
// offset, sizes and strides. Every size read from a file is checked before it
// is used: against the file size, the record size or the storage size, with
// overflow-checked arithmetic.
#include "mha/state_dict.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

// Both formats store little-endian data, copied here as it is.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mha's state-dict I/O assumes a little-endian machine"
#endif

namespace mha {
namespace {

using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

// --------------------------------------------------------------------------
// Shared helpers: dtypes, checked arithmetic, printable text, file access.

/// One supported dtype under the names the two formats give it.
struct DtypeName {
  torch::ScalarType dtype;
  const char* torch_name;   // for messages: "float32"
  const char* safetensors;  // safetensors "dtype" field: "F32"
  const char* storage;      // PyTorch storage class torch.<storage>
};

const DtypeName kDtypes[] = {
    {torch::kFloat64, "float64", "F64", "DoubleStorage"},
    {torch::kFloat32, "float32", "F32", "FloatStorage"},
    {torch::kFloat16, "float16", "F16", "HalfStorage"},
    {torch::kBFloat16, "bfloat16", "BF16", "BFloat16Storage"},
    {torch::kInt64, "int64", "I64", "LongStorage"},
    {torch::kInt32, "int32", "I32", "IntStorage"},
    {torch::kInt16, "int16", "I16", "ShortStorage"},
    {torch::kInt8, "int8", "I8", "CharStorage"},
    {torch::kUInt8, "uint8", "U8", "ByteStorage"},
    {torch::kBool, "bool", "BOOL", "BoolStorage"},
};

const DtypeName* find_dtype(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return &d;
    }
  }
  return nullptr;
}

const DtypeName* find_safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.safetensors) {
      return &d;
    }
  }
  return nullptr;
}

const DtypeName* find_storage_type(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.storage) {
      return &d;
    }
  }
  return nullptr;
}

std::string supported_dtypes() {
  std::string list;
  for (const auto& d : kDtypes) {
    list += list.empty() ? "" : ", ";
    list += d.torch_name;
  }
  return list;
}

uint64_t element_size(const DtypeName& d) {
  return static_cast<uint64_t>(c10::elementSize(d.dtype));
}

/// a * b, false on overflow.
bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    return false;
  }
  *out = a * b;
  return true;
}

/// a + b, false on overflow.
bool checked_add(uint64_t a, uint64_t b, uint64_t* out) {
  if (b > std::numeric_limits<uint64_t>::max() - a) {
    return false;
  }
  *out = a + b;
  return true;
}

/// The number of elements of `shape` (entries >= 0), false on overflow past
/// int64.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* numel) {
  uint64_t n = 1;
  for (const int64_t s : shape) {
    if (!checked_mul(n, static_cast<uint64_t>(s), &n)) {
      return false;
    }
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return false;
  }
  *numel = n;
  return true;
}

/// Untrusted text made safe to print: at most 80 characters, with control
/// and non-ASCII bytes written as \xNN.
std::string printable(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (text.size() > 80) {
    out += "...";
  }
  return out;
}

/// The prefix of every message about the file `path`.
std::string file_label(const std::string& path) {
  return "state dict file '" + path + "'";
}

/// Reads exactly `n` bytes at `offset` of `in` into `dst`.
void read_exact(std::ifstream& in, uint64_t offset, void* dst, uint64_t n,
                const std::string& where, const char* what) {
  if (n == 0) {
    return;
  }
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  TORCH_CHECK(in.good() && static_cast<uint64_t>(in.gcount()) == n, where,
              ": cannot read ", what, " (", n, " bytes at offset ", offset,
              ")");
}

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

/// A tensor read from `n` raw little-endian bytes. Bool data is read as
/// bytes and compared with 0, so that a byte other than 0 or 1 cannot make
/// an invalid bool.
torch::Tensor tensor_from_bytes(const DtypeName& d,
                                const std::vector<int64_t>& shape,
                                const std::function<void(void*)>& fill) {
  const bool is_bool = d.dtype == torch::kBool;
  torch::Tensor t =
      torch::empty(shape, torch::dtype(is_bool ? torch::kUInt8 : d.dtype));
  if (t.numel() > 0) {
    fill(t.data_ptr());
  }
  return is_bool ? t.ne(0) : t;
}

// --------------------------------------------------------------------------
// safetensors

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

StateDict read_safetensors(const std::string& path, std::ifstream& in,
                           uint64_t file_size) {
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
    torch::Tensor t =
        tensor_from_bytes(*entry.dtype, entry.shape, [&](void* dst) {
          read_exact(in, data_start + entry.begin, dst, entry.end - entry.begin,
                     where, "tensor data");
        });
    result.insert(entry.name, std::move(t));
  }
  return result;
}

/// Writes `entries` as safetensors to `file`.
void write_safetensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& entries,
    const std::string& file, const std::string& where) {
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

  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.is_open(), where, ": cannot open '", file, "' for writing");
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) {
    length_bytes[i] = static_cast<unsigned char>(
        (static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  out.write(reinterpret_cast<const char*>(length_bytes), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& entry : entries) {
    out.write(static_cast<const char*>(entry.second.data_ptr()),
              static_cast<std::streamsize>(entry.second.nbytes()));
  }
  out.close();
  TORCH_CHECK(!out.fail(), where, ": writing '", file, "' failed");
}

// --------------------------------------------------------------------------
// PyTorch zip files: the pickle reader.

/// Loads the storage record `key` ("data/<key>") as a 1-D tensor of `numel`
/// elements.
using StorageLoader = std::function<torch::Tensor(
    const std::string& key, const DtypeName& dtype, uint64_t numel)>;

/// Python pickle opcodes (Python's Lib/pickletools.py documents them).
/// Every opcode is named here so that a refused one is named in the error;
/// only those marked (*) are accepted.
const char* opcode_name(unsigned char op) {
  switch (op) {
    case '(':
      return "MARK";  // (*)
    case '.':
      return "STOP";  // (*)
    case '0':
      return "POP";
    case '1':
      return "POP_MARK";
    case '2':
      return "DUP";
    case 'F':
      return "FLOAT";
    case 'I':
      return "INT";
    case 'J':
      return "BININT";  // (*)
    case 'K':
      return "BININT1";  // (*)
    case 'L':
      return "LONG";
    case 'M':
      return "BININT2";  // (*)
    case 'N':
      return "NONE";  // (*)
    case 'P':
      return "PERSID";
    case 'Q':
      return "BINPERSID";  // (*)
    case 'R':
      return "REDUCE";  // (*)
    case 'S':
      return "STRING";
    case 'T':
      return "BINSTRING";
    case 'U':
      return "SHORT_BINSTRING";
    case 'V':
      return "UNICODE";
    case 'X':
      return "BINUNICODE";  // (*)
    case 'a':
      return "APPEND";  // (*)
    case 'b':
      return "BUILD";  // (*)
    case 'c':
      return "GLOBAL";  // (*)
    case 'd':
      return "DICT";
    case '}':
      return "EMPTY_DICT";  // (*)
    case 'e':
      return "APPENDS";  // (*)
    case 'g':
      return "GET";
    case 'h':
      return "BINGET";  // (*)
    case 'i':
      return "INST";
    case 'j':
      return "LONG_BINGET";  // (*)
    case 'l':
      return "LIST";
    case ']':
      return "EMPTY_LIST";  // (*)
    case 'o':
      return "OBJ";
    case 'p':
      return "PUT";
    case 'q':
      return "BINPUT";  // (*)
    case 'r':
      return "LONG_BINPUT";  // (*)
    case 's':
      return "SETITEM";  // (*)
    case 't':
      return "TUPLE";  // (*)
    case ')':
      return "EMPTY_TUPLE";  // (*)
    case 'u':
      return "SETITEMS";  // (*)
    case 'G':
      return "BINFLOAT";
    case 'B':
      return "BINBYTES";
    case 'C':
      return "SHORT_BINBYTES";
    case 0x80:
      return "PROTO";  // (*)
    case 0x81:
      return "NEWOBJ";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x85:
      return "TUPLE1";  // (*)
    case 0x86:
      return "TUPLE2";  // (*)
    case 0x87:
      return "TUPLE3";  // (*)
    case 0x88:
      return "NEWTRUE";  // (*)
    case 0x89:
      return "NEWFALSE";  // (*)
    case 0x8a:
      return "LONG1";  // (*)
    case 0x8b:
      return "LONG4";
    case 0x8c:
      return "SHORT_BINUNICODE";  // (*)
    case 0x8d:
      return "BINUNICODE8";  // (*)
    case 0x8e:
      return "BINBYTES8";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    case 0x92:
      return "NEWOBJ_EX";
    case 0x93:
      return "STACK_GLOBAL";  // (*)
    case 0x94:
      return "MEMOIZE";  // (*)
    case 0x95:
      return "FRAME";  // (*)
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    default:
      return "unknown";
  }
}

/// A deliberately small unpickler for `data.pkl` of a state dict. It builds
/// plain values (None, bool, int, str, tuple, list, dict) and, for the few
/// globals a state dict names, dicts (collections.OrderedDict), storages
/// (persistent ids) and tensors (torch._utils._rebuild_tensor_v2). Anything
/// else is refused by name. Objects live in one arena and refer to each other
/// by index, so nothing is recursive (no stack depth to exhaust) and shared
/// or cyclic references cost nothing.
class StateDictUnpickler {
 public:
  StateDictUnpickler(const char* data, size_t size, std::string where,
                     StorageLoader load_storage)
      : data_(reinterpret_cast<const unsigned char*>(data)),
        size_(size),
        where_(std::move(where)),
        load_storage_(std::move(load_storage)) {}

  StateDict run();

 private:
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kString,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor
  };
  enum class Global {
    kOrderedDict,
    kRebuildTensorV2,
    kRebuildParameter,
    kStorageType
  };

  struct Object {
    Kind kind = Kind::kNone;
    int64_t integer = 0;        // kBool, kInt
    std::string text;           // kString; kGlobal: "module.name"
    std::vector<size_t> items;  // kTuple, kList; kDict: key, value, ...
    Global global = Global::kOrderedDict;  // kGlobal
    const DtypeName* dtype = nullptr;      // kGlobal kStorageType, kStorage
    torch::Tensor tensor;                  // kStorage (1-D), kTensor
  };

  static const char* kind_name(Kind kind);

  // Reading the byte stream; `n` bytes must remain.
  void need(size_t n) const;
  uint64_t read_uint(size_t n);
  std::string read_bytes(size_t n);
  std::string read_line();

  // The stack, split into frames by MARK as Python's unpickler does: no
  // opcode reaches below the frame of the innermost MARK.
  size_t frame_start() const { return marks_.empty() ? 0 : marks_.back(); }
  size_t pop();
  size_t top() const;
  std::vector<size_t> pop_frame();
  size_t push(Object object);
  void put_memo(uint64_t index);
  void get_memo(uint64_t index);

  const Object& at(size_t id) const { return objects_[id]; }
  std::string describe(size_t id) const;
  size_t make_global(const std::string& module, const std::string& name);
  size_t call(size_t callable, size_t args);
  size_t rebuild_tensor(const std::vector<size_t>& args);
  std::vector<int64_t> int_tuple(size_t id, const char* what) const;
  size_t persistent_load(size_t pid);
  StateDict to_state_dict(size_t id) const;

  [[noreturn]] void fail(const std::string& message) const;

  const unsigned char* data_;
  size_t size_;
  size_t pos_ = 0;
  unsigned char op_ = 0;  // the opcode being run, for messages
  size_t op_pos_ = 0;
  std::string where_;
  StorageLoader load_storage_;
  std::vector<Object> objects_;
  std::vector<size_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, size_t> memo_;
  std::unordered_map<std::string, size_t> storages_;  // by record key
};

const char* StateDictUnpickler::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kString:
      return "str";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kGlobal:
      return "global";
    case Kind::kStorage:
      return "storage";
    case Kind::kTensor:
      return "tensor";
  }
  return "?";
}

void StateDictUnpickler::fail(const std::string& message) const {
  TORCH_CHECK(false, where_, ": data.pkl, opcode ", opcode_name(op_), " (0x",
              c10::str(std::hex, static_cast<int>(op_)), ") at byte ", op_pos_,
              ": ", message);
}

std::string StateDictUnpickler::describe(size_t id) const {
  const Object& o = at(id);
  switch (o.kind) {
    case Kind::kInt:
      return "int " + std::to_string(o.integer);
    case Kind::kString:
      return "str '" + printable(o.text) + "'";
    case Kind::kGlobal:
      return "global " + printable(o.text);
    case Kind::kTuple:
      return "tuple of " + std::to_string(o.items.size());
    default:
      return kind_name(o.kind);
  }
}

void StateDictUnpickler::need(size_t n) const {
  if (n > size_ - pos_) {
    fail("needs " + std::to_string(n) + " more bytes, but data.pkl ends " +
         std::to_string(size_ - pos_) + " bytes later (truncated?)");
  }
}

uint64_t StateDictUnpickler::read_uint(size_t n) {
  need(n);
  uint64_t value = 0;
  for (size_t i = n; i-- > 0;) {
    value = (value << 8) | data_[pos_ + i];
  }
  pos_ += n;
  return value;
}

std::string StateDictUnpickler::read_bytes(size_t n) {
  need(n);
  std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
  pos_ += n;
  return s;
}

std::string StateDictUnpickler::read_line() {
  constexpr size_t kMaxLine = 256;  // module and class names are short
  for (size_t i = pos_; i < size_ && i - pos_ <= kMaxLine; ++i) {
    if (data_[i] == '\n') {
      std::string line(reinterpret_cast<const char*>(data_ + pos_), i - pos_);
      pos_ = i + 1;
      return line;
    }
  }
  fail("expects a newline-terminated name of at most " +
       std::to_string(kMaxLine) + " bytes");
}

size_t StateDictUnpickler::pop() {
  if (stack_.size() <= frame_start()) {
    fail("needs a value, but the stack (above the last MARK) is empty");
  }
  const size_t id = stack_.back();
  stack_.pop_back();
  return id;
}

size_t StateDictUnpickler::top() const {
  if (stack_.size() <= frame_start()) {
    fail("needs a value, but the stack (above the last MARK) is empty");
  }
  return stack_.back();
}

std::vector<size_t> StateDictUnpickler::pop_frame() {
  if (marks_.empty()) {
    fail("needs a MARK, but there is none");
  }
  const size_t start = marks_.back();
  marks_.pop_back();
  std::vector<size_t> items(stack_.begin() + static_cast<ptrdiff_t>(start),
                            stack_.end());
  stack_.resize(start);
  return items;
}

size_t StateDictUnpickler::push(Object object) {
  // Each opcode makes at most one object; the cap bounds the memory a hostile
  // pickle can claim (a state dict needs about 15 objects per tensor).
  constexpr size_t kMaxObjects = 4'000'000;
  if (objects_.size() >= kMaxObjects) {
    fail("data.pkl builds more than " + std::to_string(kMaxObjects) +
         " objects, far more than a state dict needs");
  }
  objects_.push_back(std::move(object));
  stack_.push_back(objects_.size() - 1);
  return objects_.size() - 1;
}

void StateDictUnpickler::put_memo(uint64_t index) { memo_[index] = top(); }

void StateDictUnpickler::get_memo(uint64_t index) {
  const auto it = memo_.find(index);
  if (it == memo_.end()) {
    fail("memo entry " + std::to_string(index) + " was never stored");
  }
  stack_.push_back(it->second);
}

size_t StateDictUnpickler::make_global(const std::string& module,
                                       const std::string& name) {
  Object o;
  o.kind = Kind::kGlobal;
  o.text = module + "." + name;
  if (module == "collections" && name == "OrderedDict") {
    o.global = Global::kOrderedDict;
  } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
    o.global = Global::kRebuildTensorV2;
  } else if (module == "torch._utils" && name == "_rebuild_parameter") {
    o.global = Global::kRebuildParameter;
  } else if ((module == "torch" || module == "torch.cuda") &&
             find_storage_type(name) != nullptr) {
    // PyTorch < 1.12 named CUDA storages torch.cuda.<Type>Storage; the
    // location is ignored either way (tensors are read to the CPU).
    o.global = Global::kStorageType;
    o.dtype = find_storage_type(name);
  } else {
    fail("refusing the global '" + printable(module) + "." + printable(name) +
         "': a state dict needs only collections.OrderedDict, "
         "torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter "
         "and torch.<Type>Storage of the dtypes " +
         supported_dtypes() + " (nothing in the file is ever run)");
  }
  return push(std::move(o));
}

std::vector<int64_t> StateDictUnpickler::int_tuple(size_t id,
                                                   const char* what) const {
  const Object& o = at(id);
  if (o.kind != Kind::kTuple) {
    fail(std::string(what) + " must be a tuple of ints, got " + describe(id));
  }
  if (o.items.size() > 64) {
    fail(std::string(what) + " has " + std::to_string(o.items.size()) +
         " dimensions (at most 64 accepted)");
  }
  std::vector<int64_t> values;
  for (const size_t item : o.items) {
    if (at(item).kind != Kind::kInt || at(item).integer < 0) {
      fail(std::string(what) + " must hold ints >= 0, got " + describe(item));
    }
    values.push_back(at(item).integer);
  }
  return values;
}

size_t StateDictUnpickler::persistent_load(size_t pid) {
  // ('storage', torch.<Type>Storage, key, location, numel)
  const Object& id = at(pid);
  if (id.kind != Kind::kTuple || id.items.size() != 5 ||
      at(id.items[0]).kind != Kind::kString ||
      at(id.items[0]).text != "storage" ||
      at(id.items[1]).kind != Kind::kGlobal ||
      at(id.items[1]).global != Global::kStorageType ||
      at(id.items[2]).kind != Kind::kString ||
      at(id.items[3]).kind != Kind::kString ||
      at(id.items[4]).kind != Kind::kInt || at(id.items[4]).integer < 0) {
    fail(
        "a persistent id must be ('storage', torch.<Type>Storage, key, "
        "location, numel >= 0), got " +
        describe(pid) +
        (id.kind == Kind::kTuple && !id.items.empty()
             ? " starting with " + describe(id.items[0])
             : std::string()));
  }
  const DtypeName* dtype = at(id.items[1]).dtype;
  const std::string key = at(id.items[2]).text;
  const auto numel = static_cast<uint64_t>(at(id.items[4]).integer);
  const bool valid_key =
      !key.empty() && key.size() <= 64 &&
      std::all_of(key.begin(), key.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
      });
  if (!valid_key) {
    fail("storage key '" + printable(key) +
         "' must be 1 to 64 letters, digits or underscores");
  }
  const auto cached = storages_.find(key);
  if (cached != storages_.end()) {
    const Object& s = at(cached->second);
    if (s.dtype != dtype || static_cast<uint64_t>(s.tensor.numel()) != numel) {
      fail("storage '" + key + "' is used as " +
           std::to_string(s.tensor.numel()) + " " + s.dtype->torch_name +
           " elements and as " + std::to_string(numel) + " " +
           dtype->torch_name + " elements");
    }
    stack_.push_back(cached->second);
    return cached->second;
  }
  Object o;
  o.kind = Kind::kStorage;
  o.dtype = dtype;
  o.tensor = load_storage_(key, *dtype, numel);
  const size_t object = push(std::move(o));
  storages_[key] = object;
  return object;
}

size_t StateDictUnpickler::rebuild_tensor(const std::vector<size_t>& args) {
  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  //                    backward_hooks[, metadata])
  if (args.size() != 6 && args.size() != 7) {
    fail("torch._utils._rebuild_tensor_v2 takes 6 or 7 arguments, got " +
         std::to_string(args.size()));
  }
  const Object& storage = at(args[0]);
  if (storage.kind != Kind::kStorage) {
    fail("the tensor's storage must be a persistent storage, got " +
         describe(args[0]));
  }
  if (at(args[1]).kind != Kind::kInt || at(args[1]).integer < 0) {
    fail("the storage offset must be an int >= 0, got " + describe(args[1]));
  }
  const int64_t offset = at(args[1]).integer;
  const std::vector<int64_t> sizes = int_tuple(args[2], "the size");
  const std::vector<int64_t> strides = int_tuple(args[3], "the stride");
  if (sizes.size() != strides.size()) {
    fail("the size has " + std::to_string(sizes.size()) +
         " dimensions but the stride " + std::to_string(strides.size()));
  }
  if (at(args[4]).kind != Kind::kBool) {
    fail("requires_grad must be a bool, got " + describe(args[4]));
  }
  if (at(args[5]).kind != Kind::kDict) {
    fail("backward_hooks must be a dict, got " + describe(args[5]));
  }
  if (args.size() == 7 && at(args[6]).kind != Kind::kDict &&
      at(args[6]).kind != Kind::kNone) {
    fail("the tensor metadata must be a dict, got " + describe(args[6]));
  }

  // The elements the view touches must lie inside the storage.
  const auto storage_numel = static_cast<uint64_t>(storage.tensor.numel());
  uint64_t numel = 0;
  if (!checked_numel(sizes, &numel)) {
    fail("the tensor size " + c10::str(c10::IntArrayRef(sizes)) +
         " is too large");
  }
  uint64_t last = static_cast<uint64_t>(offset);  // highest element index
  bool fits = last <= storage_numel;
  if (numel > 0) {
    for (size_t d = 0; d < sizes.size() && fits; ++d) {
      uint64_t span = 0;
      fits = checked_mul(static_cast<uint64_t>(sizes[d] - 1),
                         static_cast<uint64_t>(strides[d]), &span) &&
             checked_add(last, span, &last);
    }
    fits = fits && last < storage_numel;
  }
  if (!fits) {
    fail("a tensor of size " + c10::str(c10::IntArrayRef(sizes)) + ", stride " +
         c10::str(c10::IntArrayRef(strides)) + " and storage offset " +
         std::to_string(offset) + " reaches past the end of its storage of " +
         std::to_string(storage_numel) + " " + storage.dtype->torch_name +
         " elements");
  }
  Object o;
  o.kind = Kind::kTensor;
  o.tensor = storage.tensor.as_strided(sizes, strides, offset)
                 .clone(at::MemoryFormat::Contiguous);
  return push(std::move(o));
}

size_t StateDictUnpickler::call(size_t callable, size_t args_id) {
  if (at(callable).kind != Kind::kGlobal) {
    fail("can call only an accepted global, got " + describe(callable));
  }
  if (at(args_id).kind != Kind::kTuple || at(args_id).items.size() > 7) {
    fail("the arguments must be a tuple of at most 7, got " +
         describe(args_id));
  }
  const std::vector<size_t> args = at(args_id).items;
  switch (at(callable).global) {
    case Global::kOrderedDict: {
      if (!args.empty()) {
        fail("collections.OrderedDict is accepted only without arguments");
      }
      Object o;
      o.kind = Kind::kDict;
      return push(std::move(o));
    }
    case Global::kRebuildTensorV2:
      return rebuild_tensor(args);
    case Global::kRebuildParameter: {
      // _rebuild_parameter(data, requires_grad, backward_hooks)
      if (args.size() != 3 || at(args[0]).kind != Kind::kTensor ||
          at(args[1]).kind != Kind::kBool || at(args[2]).kind != Kind::kDict) {
        fail("torch._utils._rebuild_parameter takes (tensor, bool, dict)");
      }
      stack_.push_back(args[0]);
      return args[0];
    }
    case Global::kStorageType:
      break;
  }
  fail("the storage class " + at(callable).text +
       " may appear only in a persistent id, not be called");
}

StateDict StateDictUnpickler::to_state_dict(size_t id) const {
  const Object& dict = at(id);
  if (dict.kind != Kind::kDict) {
    fail(
        "the pickled object must be a dict or collections.OrderedDict of "
        "tensors, got " +
        describe(id));
  }
  StateDict result;
  for (size_t i = 0; i + 1 < dict.items.size(); i += 2) {
    const Object& key = at(dict.items[i]);
    if (key.kind != Kind::kString) {
      fail("state dict keys must be strings, got " + describe(dict.items[i]));
    }
    const Object& value = at(dict.items[i + 1]);
    if (value.kind != Kind::kTensor) {
      fail("entry '" + printable(key.text) + "' must be a tensor, got " +
           describe(dict.items[i + 1]));
    }
    if (result.contains(key.text)) {
      fail("the key '" + printable(key.text) + "' appears twice");
    }
    result.insert(key.text, value.tensor);
  }
  return result;
}

StateDict StateDictUnpickler::run() {
  while (true) {
    op_pos_ = pos_;
    if (pos_ >= size_) {
      op_ = 0;
      fail("data.pkl ends without STOP (truncated?)");
    }
    op_ = data_[pos_++];
    switch (op_) {
      case 0x80: {  // PROTO
        const uint64_t version = read_uint(1);
        if (version < 2 || version > 5) {
          fail("pickle protocol " + std::to_string(version) +
               " is not supported (2 to 5 are)");
        }
        break;
      }
      case 0x95:  // FRAME: a length hint, nothing to do
        read_uint(8);
        break;
      case '.': {  // STOP
        if (!marks_.empty() || stack_.size() != 1) {
          fail("leaves " + std::to_string(stack_.size()) +
               " values on the stack and " + std::to_string(marks_.size()) +
               " MARKs open; expected exactly one value");
        }
        return to_state_dict(stack_.back());
      }
      case '(':  // MARK
        marks_.push_back(stack_.size());
        break;
      case 'N': {
        push(Object{});
        break;
      }
      case 0x88:    // NEWTRUE
      case 0x89: {  // NEWFALSE
        Object o;
        o.kind = Kind::kBool;
        o.integer = op_ == 0x88 ? 1 : 0;
        push(std::move(o));
        break;
      }
      case 'J':     // BININT: signed 4 bytes
      case 'K':     // BININT1: unsigned 1 byte
      case 'M':     // BININT2: unsigned 2 bytes
      case 0x8a: {  // LONG1: n bytes, two's complement
        Object o;
        o.kind = Kind::kInt;
        if (op_ == 'J') {
          o.integer = static_cast<int32_t>(static_cast<uint32_t>(read_uint(4)));
        } else if (op_ == 'K') {
          o.integer = static_cast<int64_t>(read_uint(1));
        } else if (op_ == 'M') {
          o.integer = static_cast<int64_t>(read_uint(2));
        } else {
          const auto n = static_cast<size_t>(read_uint(1));
          if (n > 8) {
            fail("an integer of " + std::to_string(n) +
                 " bytes does not fit in 64 bits");
          }
          uint64_t raw = read_uint(n);
          if (n > 0 && n < 8 && (raw >> (8 * n - 1)) != 0) {
            raw |= ~uint64_t{0} << (8 * n);  // sign-extend
          }
          o.integer = static_cast<int64_t>(raw);
        }
        push(std::move(o));
        break;
      }
      case 'X':     // BINUNICODE: 4-byte length
      case 0x8c:    // SHORT_BINUNICODE: 1-byte length
      case 0x8d: {  // BINUNICODE8: 8-byte length
        const uint64_t n = read_uint(op_ == 'X' ? 4 : op_ == 0x8c ? 1 : 8);
        if (n > size_ - pos_) {
          fail("a string of " + std::to_string(n) + " bytes, but only " +
               std::to_string(size_ - pos_) + " remain (truncated?)");
        }
        Object o;
        o.kind = Kind::kString;
        o.text = read_bytes(static_cast<size_t>(n));
        push(std::move(o));
        break;
      }
      case ')': {  // EMPTY_TUPLE
        Object o;
        o.kind = Kind::kTuple;
        push(std::move(o));
        break;
      }
      case 't':     // TUPLE
      case 0x85:    // TUPLE1
      case 0x86:    // TUPLE2
      case 0x87: {  // TUPLE3
        Object o;
        o.kind = Kind::kTuple;
        if (op_ == 't') {
          o.items = pop_frame();
        } else {
          const size_t n = op_ - 0x84u;
          o.items.resize(n);
          for (size_t i = n; i-- > 0;) {
            o.items[i] = pop();
          }
        }
        push(std::move(o));
        break;
      }
      case '}':    // EMPTY_DICT
      case ']': {  // EMPTY_LIST
        Object o;
        o.kind = op_ == '}' ? Kind::kDict : Kind::kList;
        push(std::move(o));
        break;
      }
      case 's': {  // SETITEM
        const size_t value = pop();
        const size_t key = pop();
        const size_t dict = top();
        if (at(dict).kind != Kind::kDict) {
          fail("needs a dict, got " + describe(dict));
        }
        objects_[dict].items.push_back(key);
        objects_[dict].items.push_back(value);
        break;
      }
      case 'u': {  // SETITEMS
        const std::vector<size_t> items = pop_frame();
        const size_t dict = top();
        if (at(dict).kind != Kind::kDict) {
          fail("needs a dict, got " + describe(dict));
        }
        if (items.size() % 2 != 0) {
          fail("needs key-value pairs, got " + std::to_string(items.size()) +
               " values");
        }
        auto& target = objects_[dict].items;
        target.insert(target.end(), items.begin(), items.end());
        break;
      }
      case 'a':    // APPEND
      case 'e': {  // APPENDS
        const std::vector<size_t> items =
            op_ == 'a' ? std::vector<size_t>{pop()} : pop_frame();
        const size_t list = top();
        if (at(list).kind != Kind::kList) {
          fail("needs a list, got " + describe(list));
        }
        auto& target = objects_[list].items;
        target.insert(target.end(), items.begin(), items.end());
        break;
      }
      case 'q':  // BINPUT
        put_memo(read_uint(1));
        break;
      case 'r':  // LONG_BINPUT
        put_memo(read_uint(4));
        break;
      case 0x94:  // MEMOIZE
        put_memo(memo_.size());
        break;
      case 'h':  // BINGET
        get_memo(read_uint(1));
        break;
      case 'j':  // LONG_BINGET
        get_memo(read_uint(4));
        break;
      case 'c': {  // GLOBAL: "module\nname\n"
        const std::string module = read_line();
        const std::string name = read_line();
        make_global(module, name);
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const size_t name = pop();
        const size_t module = pop();
        if (at(module).kind != Kind::kString ||
            at(name).kind != Kind::kString) {
          fail("needs two strings, got " + describe(module) + " and " +
               describe(name));
        }
        make_global(at(module).text, at(name).text);
        break;
      }
      case 'R': {  // REDUCE: callable(*args)
        const size_t args = pop();
        const size_t callable = pop();
        call(callable, args);
        break;
      }
      case 'Q':  // BINPERSID
        persistent_load(pop());
        break;
      case 'b': {  // BUILD: obj.__setstate__(state)
        // Python's state_dict() is an OrderedDict with the attribute
        // _metadata (module versions), restored by BUILD; it is ignored.
        const size_t state = pop();
        const size_t object = top();
        if (at(object).kind != Kind::kDict ||
            (at(state).kind != Kind::kDict && at(state).kind != Kind::kNone)) {
          fail(
              "BUILD is accepted only for an OrderedDict's attributes "
              "(a dict), got " +
              describe(object) + " with " + describe(state));
        }
        break;
      }
      default:
        fail(
            std::string("this opcode does not occur in a state dict and is "
                        "refused"));
    }
  }
}

// --------------------------------------------------------------------------
// PyTorch zip files: reading and writing.

StateDict read_pytorch(const std::string& path) {
  const std::string where = file_label(path) + " (PyTorch zip)";
  using caffe2::serialize::PyTorchStreamReader;
  auto reader = with_context(where, "not a readable PyTorch zip archive", [&] {
    return std::make_unique<PyTorchStreamReader>(path);
  });
  auto has_record = [&](const std::string& name) {
    return with_context(where, "reading the archive's index",
                        [&] { return reader->hasRecord(name); });
  };
  auto get_record = [&](const std::string& name) {
    return with_context(where, ("reading the record " + name).c_str(),
                        [&] { return reader->getRecord(name); });
  };

  if (has_record("byteorder")) {
    auto [data, size] = get_record("byteorder");
    const std::string order(static_cast<const char*>(data.get()), size);
    TORCH_CHECK(order == "little", where, ": byte order '", printable(order),
                "' is not supported (only little)");
  }
  TORCH_CHECK(has_record("data.pkl"), where,
              ": the archive has no data.pkl record, so it was not written "
              "by torch.save (a TorchScript archive from torch.jit.save or "
              "torch::save?)");
  auto [pickle, pickle_size] = get_record("data.pkl");

  StorageLoader load_storage = [&](const std::string& key,
                                   const DtypeName& dtype, uint64_t numel) {
    const std::string name = "data/" + key;
    TORCH_CHECK(has_record(name), where,
                ": data.pkl refers to the storage record '", name,
                "', which the archive lacks");
    const auto record = get_record(name);
    const void* data = std::get<0>(record).get();
    const size_t size = std::get<1>(record);
    uint64_t nbytes = 0;
    TORCH_CHECK(
        checked_mul(numel, element_size(dtype), &nbytes) && nbytes == size,
        where, ": storage record '", name, "' holds ", size,
        " bytes, but data.pkl declares ", numel, " ", dtype.torch_name,
        " elements (", numel, " x ", element_size(dtype), " bytes)");
    return tensor_from_bytes(dtype, {static_cast<int64_t>(numel)},
                             [&](void* dst) { std::memcpy(dst, data, size); });
  };
  StateDictUnpickler unpickler(static_cast<const char*>(pickle.get()),
                               pickle_size, where, load_storage);
  return unpickler.run();
}

/// Writes the pickle of an OrderedDict of tensors, each with its own storage
/// record "data/<index>" (protocol 2, the opcodes and globals Python's
/// torch.save uses for a state dict, so that torch.load reads it with
/// weights_only=True).
class StateDictPickler {
 public:
  std::string run(
      const std::vector<std::pair<std::string, torch::Tensor>>& entries) {
    op(0x80);  // PROTO 2
    out_.push_back(2);
    ordered_dict();
    if (!entries.empty()) {
      op('(');
      for (size_t i = 0; i < entries.size(); ++i) {
        const torch::Tensor& t = entries[i].second;  // contiguous, CPU
        string(entries[i].first);
        global("torch._utils", "_rebuild_tensor_v2");
        op('(');
        // Persistent id: ('storage', torch.<Type>Storage, key, location,
        // numel).
        op('(');
        string("storage");
        global("torch", find_dtype(t.scalar_type())->storage);
        string(std::to_string(i));
        string("cpu");
        integer(t.numel());
        op('t');
        op('Q');     // BINPERSID
        integer(0);  // storage offset
        int_tuple(t.sizes());
        int_tuple(t.strides());
        op(0x89);        // requires_grad: NEWFALSE
        ordered_dict();  // backward_hooks
        op('t');
        op('R');
      }
      op('u');  // SETITEMS
    }
    op('.');  // STOP
    return out_;
  }

 private:
  void op(unsigned char c) { out_.push_back(static_cast<char>(c)); }

  void uint(uint64_t value, int n) {
    for (int i = 0; i < n; ++i) {
      out_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
    }
  }

  void string(const std::string& s) {
    op('X');  // BINUNICODE
    uint(s.size(), 4);
    out_ += s;
  }

  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      uint(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      op('M');
      uint(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() &&
               v <= std::numeric_limits<int32_t>::max()) {
      op('J');
      uint(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      op(0x8a);  // LONG1, 8 bytes of two's complement
      uint(8, 1);
      uint(static_cast<uint64_t>(v), 8);
    }
  }

  void int_tuple(c10::IntArrayRef values) {
    if (values.empty()) {
      op(')');
      return;
    }
    op('(');
    for (const int64_t v : values) {
      integer(v);
    }
    op('t');
  }

  /// GLOBAL, memoized: written once, fetched with BINGET afterwards.
  void global(const std::string& module, const std::string& name) {
    const std::string key = module + "\n" + name + "\n";
    const auto it = memo_.find(key);
    if (it != memo_.end()) {
      if (it->second < 256) {
        op('h');
        uint(it->second, 1);
      } else {
        op('j');
        uint(it->second, 4);
      }
      return;
    }
    op('c');
    out_ += key;
    const uint64_t index = memo_.size();
    memo_[key] = index;
    if (index < 256) {
      op('q');
      uint(index, 1);
    } else {
      op('r');
      uint(index, 4);
    }
  }

  /// collections.OrderedDict()
  void ordered_dict() {
    global("collections", "OrderedDict");
    op(')');
    op('R');
  }

  std::string out_;
  std::unordered_map<std::string, uint64_t> memo_;
};

void write_pytorch(
    const std::vector<std::pair<std::string, torch::Tensor>>& entries,
    const std::string& file, const std::string& where) {
  const std::string pickle = StateDictPickler().run(entries);
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.is_open(), where, ": cannot open '", file, "' for writing");
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
      writer.writeRecord("data/" + std::to_string(i), t.data_ptr(), t.nbytes());
    }
    writer.writeEndOfFile();
  });
  out.close();
  TORCH_CHECK(!out.fail(), where, ": writing '", file, "' failed");
}

// --------------------------------------------------------------------------
// Modules.

/// Python's state_dict order: own parameters, own buffers, then children.
void collect(const torch::nn::Module& module, const std::string& prefix,
             bool detach, StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    if (item.value().defined()) {
      out.insert(prefix + item.key(),
                 detach ? item.value().detach() : item.value());
    }
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) {
      out.insert(prefix + item.key(),
                 detach ? item.value().detach() : item.value());
    }
  }
  for (const auto& child : module.named_children()) {
    collect(*child.value(), prefix + child.key() + ".", detach, out);
  }
}

std::string join(const std::vector<std::string>& items,
                 const std::string& separator) {
  std::string out;
  for (const auto& item : items) {
    out += out.empty() ? "" : separator;
    out += item;
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

torch::OrderedDict<std::string, torch::Tensor> state_dict(
    const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", /*detach=*/true, out);
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> read_state_dict(
    const std::string& path) {
  const std::string where = file_label(path);
  std::error_code error;
  TORCH_CHECK(std::filesystem::exists(path, error), where, ": no such file");
  TORCH_CHECK(std::filesystem::is_regular_file(path, error), where,
              ": not a regular file");
  const uint64_t file_size = std::filesystem::file_size(path, error);
  TORCH_CHECK(!error, where, ": cannot get the file size: ", error.message());
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), where, ": cannot open the file for reading");
  TORCH_CHECK(file_size >= 8, where, ": the file has ", file_size,
              " bytes, too short for a safetensors or PyTorch file");
  unsigned char magic[9] = {};
  read_exact(in, 0, magic, std::min<uint64_t>(file_size, 9), where,
             "the first bytes");
  if (magic[0] == 'P' && magic[1] == 'K') {
    in.close();
    return read_pytorch(path);
  }
  if (file_size > 8 && magic[8] == '{') {
    return read_safetensors(path, in, file_size);
  }
  TORCH_CHECK(magic[0] != 0x80, where,
              ": a legacy (non-zip) PyTorch file, as torch.save writes with "
              "_use_new_zipfile_serialization=False, is not supported; "
              "re-save it with a plain torch.save(state_dict, path)");
  TORCH_CHECK(false, where,
              ": unrecognized format: expected a safetensors file (8-byte "
              "header length, then '{') or a PyTorch zip file (starting "
              "with 'PK'); the file starts with '",
              printable(std::string(reinterpret_cast<char*>(magic), 8)), "'");
}

void write_state_dict(
    const torch::OrderedDict<std::string, torch::Tensor>& tensors,
    const std::string& path) {
  const std::string where = file_label(path);
  // Everything is checked and copied to contiguous CPU memory first, so
  // that the writers below cannot fail halfway on a bad tensor.
  std::vector<std::pair<std::string, torch::Tensor>> entries;
  for (const auto& item : tensors) {
    const torch::Tensor& t = item.value();
    TORCH_CHECK(t.defined(), where, ": tensor '", item.key(), "' is undefined");
    TORCH_CHECK(t.layout() == torch::kStrided && !t.is_quantized(), where,
                ": tensor '", item.key(), "' has layout ", t.layout(),
                "; only dense (strided) tensors can be saved");
    TORCH_CHECK(find_dtype(t.scalar_type()) != nullptr, where, ": tensor '",
                item.key(), "' has dtype ", t.scalar_type(),
                "; supported: ", supported_dtypes());
    entries.emplace_back(item.key(), t.detach().to(torch::kCPU).contiguous());
  }
  const bool safetensors = ends_with(path, ".safetensors");
  const std::string temporary = path + ".tmp";
  try {
    if (safetensors) {
      write_safetensors(entries, temporary, where);
    } else {
      write_pytorch(entries, temporary, where);
    }
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    TORCH_CHECK(!error, where, ": cannot rename '", temporary, "' to '", path,
                "': ", error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

LoadResult load_state_dict(torch::nn::Module& module, const std::string& path,
                           bool strict) {
  const StateDict file = read_state_dict(path);
  StateDict target;
  collect(module, "", /*detach=*/false, target);

  LoadResult result;
  std::vector<std::string> mismatches;
  for (const auto& item : target) {
    const torch::Tensor* value = file.find(item.key());
    if (value == nullptr) {
      result.missing_keys.push_back(item.key());
    } else if (value->sizes() != item.value().sizes()) {
      mismatches.push_back(item.key() + ": file " + c10::str(value->sizes()) +
                           ", module " + c10::str(item.value().sizes()));
    }
  }
  for (const auto& item : file) {
    if (!target.contains(item.key())) {
      result.unexpected_keys.push_back(item.key());
    }
  }

  const bool key_errors = strict && (!result.missing_keys.empty() ||
                                     !result.unexpected_keys.empty());
  if (key_errors || !mismatches.empty()) {
    std::string message =
        "load_state_dict: " + file_label(path) +
        " does not fit the module (strict=" + (strict ? "true" : "false") +
        "); nothing loaded:";
    if (key_errors && !result.missing_keys.empty()) {
      message += "\n  missing keys (in the module, not in the file): " +
                 join(result.missing_keys, ", ");
    }
    if (key_errors && !result.unexpected_keys.empty()) {
      message += "\n  unexpected keys (in the file, not in the module): " +
                 join(result.unexpected_keys, ", ");
    }
    if (!mismatches.empty()) {
      message += "\n  shape mismatches: " + join(mismatches, "; ");
    }
    TORCH_CHECK(false, message);
  }

  torch::NoGradGuard no_grad;
  for (auto& item : target) {
    if (const torch::Tensor* value = file.find(item.key())) {
      item.value().copy_(*value);
    }
  }
  return result;
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  write_state_dict(state_dict(module), path);
}

}  // namespace mha
