// Internal, the pickle reader of state-dict I/O (declared in pickle.h): a
// small stack machine for the `data.pkl` of a PyTorch zip file, which builds
// only what a state dict needs and never runs anything. Depends on
// tensor_file.h and the opcode names of pickle_opcodes.cpp.
//
// Glossary: an "object" is one value the pickle builds, named by its index in
// the arena; the "stack" and the "memo" hold such indices; a "frame" is the
// part of the stack above the innermost MARK; a "storage" is the flat buffer
// (numel elements of one dtype) that a tensor views through an offset, sizes
// and strides.
#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/pickle.h"
#include "io/tensor_file.h"

namespace mha::detail {
namespace {

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
        load_storage_(std::move(load_storage)),
        max_objects_(1024 + size / 3) {}

  StateDict run();

 private:
  enum class Kind : uint8_t {  // kind_name() names them in this order
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
  enum class Global : uint8_t {
    kOrderedDict,
    kRebuildTensorV2,
    kRebuildParameter,
    kStorageType
  };

  struct Object {
    Kind kind = Kind::kNone;
    Global global = Global::kOrderedDict;  // kGlobal
    int64_t integer = 0;                   // kBool, kInt
    std::string text;                      // kString; kGlobal: "module.name"
    std::vector<size_t> items;         // kTuple, kList; kDict: key, value, ...
    const DtypeName* dtype = nullptr;  // kGlobal kStorageType, kStorage
    torch::Tensor tensor;              // kStorage (1-D), kTensor
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
  std::deque<Object> objects_;
  std::vector<size_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, size_t> memo_;
  std::unordered_map<std::string, size_t> storages_;  // by record key
  // Bounds on memory, from data.pkl's size and the storages' bytes.
  size_t max_objects_;
  uint64_t storage_bytes_ = 0;  // of the storages loaded
  uint64_t tensor_bytes_ = 0;   // of the tensors built from them
};

const char* StateDictUnpickler::kind_name(Kind kind) {
  static const char* const kNames[] = {"None",    "bool",  "int",  "str",
                                       "tuple",   "list",  "dict", "global",
                                       "storage", "tensor"};
  return kNames[static_cast<size_t>(kind)];
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
  // pickle can claim by its size. A state dict's pickle spends 5 to 7 bytes
  // per object (about 15 objects per tensor); 1 byte per object is a flood.
  // (objects_ is a deque: growing it never copies, nor doubles, the arena.)
  if (objects_.size() >= max_objects_) {
    fail("data.pkl builds more than " + std::to_string(max_objects_) +
         " objects (1024 + 1 per 3 of its " + std::to_string(size_) +
         " bytes), far more than a state dict needs");
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
  storage_bytes_ += o.tensor.nbytes();  // read from the file: no overflow
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
  // Views share their storage, but each is copied out: the copies together
  // may hold at most kMaxCopies times the storages' bytes (tied weights view
  // one storage twice), so that a stride-0 view of a few bytes cannot ask for
  // gigabytes.
  constexpr uint64_t kMaxCopies = 4;
  uint64_t bytes = 0;
  if (!checked_mul(numel, element_size(*storage.dtype), &bytes) ||
      !checked_add(tensor_bytes_, bytes, &tensor_bytes_) ||
      tensor_bytes_ > kMaxCopies * storage_bytes_) {
    fail("a tensor of size " + c10::str(c10::IntArrayRef(sizes)) + ", stride " +
         c10::str(c10::IntArrayRef(strides)) + " (" + std::to_string(numel) +
         " " + storage.dtype->torch_name +
         " elements) would bring the "
         "tensors built to more than " +
         std::to_string(kMaxCopies) + " times the " +
         std::to_string(storage_bytes_) +
         " bytes of their storages (an expanded view of a small storage?)");
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

}  // namespace

StateDict unpickle_state_dict(const char* data, size_t size, std::string where,
                              StorageLoader load_storage) {
  return StateDictUnpickler(data, size, std::move(where),
                            std::move(load_storage))
      .run();
}

}  // namespace mha::detail
