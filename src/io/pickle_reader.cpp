// Internal, the pickle reader of state-dict I/O (declared in pickle.h, its
// machine in pickle_unpickler.h): the opcodes of `data.pkl` run on a small
// stack machine that builds only what a state dict needs and never runs
// anything; here the byte stream, the stack and its MARKs, the memo, tuples,
// lists and dicts. What the objects mean (globals, storages, tensors, the
// dict returned) is pickle_objects.cpp's. Depends on tensor_file.h and the
// opcode names of pickle_opcodes.cpp.
//
// Glossary: as pickle_unpickler.h.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "io/pickle.h"
#include "io/pickle_unpickler.h"
#include "io/tensor_file.h"

namespace mha::detail {
namespace {

// What the machine's containers hold per entry, as charged to the budget:
// a vector's entry up to 3 times over while it doubles (the old and the new
// buffer), a deque's once; a node of an unordered_map with its bucket, and
// the buckets of a rehash.
constexpr uint64_t kMarkBytes = 3 * sizeof(size_t);
constexpr uint64_t kMemoBytes = sizeof(uint32_t);
constexpr uint64_t kSparseMemoBytes = 64;

constexpr const char* kEmptyStack =
    "needs a value, but the stack (above the last MARK) is empty";

}  // namespace

StateDictUnpickler::StateDictUnpickler(const char* data, size_t size,
                                       std::string where,
                                       StorageLoader load_storage,
                                       MemoryBudget& budget)
    : data_(reinterpret_cast<const unsigned char*>(data)),
      size_(size),
      where_(std::move(where)),
      load_storage_(std::move(load_storage)),
      budget_(budget),
      max_objects_(std::min<uint64_t>(1024 + size / 3, kNone32)) {}

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

void StateDictUnpickler::charge(uint64_t bytes, const char* what) {
  if (!budget_.try_charge(bytes)) {
    fail(budget_.exceeded(what));
  }
}

void StateDictUnpickler::charge_chunk(size_t size, size_t& charged,
                                      uint64_t per_entry, const char* what) {
  // A chunk at a time, so that the common push costs one comparison.
  constexpr size_t kChunk = 4096;
  const size_t more = std::max(size - charged, kChunk);
  charge(more * per_entry, what);
  charged += more;
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

std::string_view StateDictUnpickler::read_line() {
  constexpr size_t kMaxLine = 256;  // module and class names are short
  for (size_t i = pos_; i < size_ && i - pos_ <= kMaxLine; ++i) {
    if (data_[i] == '\n') {
      const std::string_view line(reinterpret_cast<const char*>(data_ + pos_),
                                  i - pos_);
      pos_ = i + 1;
      return line;
    }
  }
  fail("expects a newline-terminated name of at most " +
       std::to_string(kMaxLine) + " bytes");
}

void StateDictUnpickler::require(size_t n) const {
  if (stack_.size() < frame_start() + n) {
    fail(kEmptyStack);
  }
}

StateDictUnpickler::Id StateDictUnpickler::pop() {
  require(1);
  const Id id = stack_.back();
  stack_.pop_back();
  return id;
}

StateDictUnpickler::Id StateDictUnpickler::top() const {
  require(1);
  return stack_.back();
}

void StateDictUnpickler::mark() {
  marks_.push_back(stack_.size());
  grow(marks_.size(), marks_charged_, kMarkBytes, "the stack of MARKs");
}

size_t StateDictUnpickler::pop_mark() {
  if (marks_.empty()) {
    fail("needs a MARK, but there is none");
  }
  const size_t start = marks_.back();
  marks_.pop_back();
  return start;
}

StateDictUnpickler::Id StateDictUnpickler::push(const Object& object) {
  // Each opcode makes at most one object; the cap bounds the objects a
  // hostile pickle can claim by its size. A state dict's pickle spends 5 to 7
  // bytes per object (about 15 objects per tensor); 1 byte per object is a
  // flood. (objects_ is a deque: growing it never copies, nor doubles, the
  // arena.)
  if (objects_.size() >= max_objects_) {
    fail("data.pkl builds more than " + std::to_string(max_objects_) +
         " objects (1024 + 1 per 3 of its " + std::to_string(size_) +
         " bytes), far more than a state dict needs");
  }
  charge(sizeof(Object), "the arena of objects");
  objects_.push_back(object);
  const auto id = static_cast<Id>(objects_.size() - 1);
  push_id(id);
  return id;
}

void StateDictUnpickler::put_memo(uint64_t index) {
  // Picklers number the entries 0, 1, ... in order (Python's, LibTorch's,
  // pickletools.optimize's), which memo_ holds in 4 bytes each; any other
  // index goes to the sparse map.
  const Id id = top();
  if (index < memo_.size()) {
    memo_[index] = id;
    return;
  }
  if (index == memo_.size()) {
    memo_.push_back(id);
    grow(memo_.size(), memo_charged_, kMemoBytes, "the memo");
    if (!sparse_memo_.empty()) {
      sparse_memo_.erase(index);
    }
    return;
  }
  if (sparse_memo_.find(index) == sparse_memo_.end()) {
    charge(kSparseMemoBytes, "the memo");
  }
  sparse_memo_[index] = id;
}

void StateDictUnpickler::get_memo(uint64_t index) {
  if (index < memo_.size()) {
    push_id(memo_[index]);
    return;
  }
  const auto it = sparse_memo_.find(index);
  if (it == sparse_memo_.end()) {
    fail("memo entry " + std::to_string(index) + " was never stored");
  }
  push_id(it->second);
}

StateDictUnpickler::Id StateDictUnpickler::make_tuple(size_t begin) {
  const size_t n = stack_.size() - begin;
  if (n >= kNone32 || items_.size() + n >= kNone32) {
    fail("data.pkl builds more than 2^32 - 1 tuple items");
  }
  charge(n * sizeof(Id), "the pool of tuple items");
  Object o;
  o.kind = Kind::kTuple;
  o.size = static_cast<uint32_t>(n);
  o.start = items_.size();
  items_.insert(items_.end(), stack_.begin() + static_cast<ptrdiff_t>(begin),
                stack_.end());
  stack_.resize(begin);
  return push(o);
}

void StateDictUnpickler::append(Id container, size_t begin) {
  const size_t n = stack_.size() - begin;
  Object& o = objects_[container];
  if (links_.size() + n >= kNone32 || o.size + n >= kNone32) {
    fail("data.pkl builds more than 2^32 - 1 list or dict items");
  }
  charge(n * sizeof(Link), "the links of lists and dicts");
  for (size_t i = begin; i < stack_.size(); ++i) {
    const auto link = static_cast<uint32_t>(links_.size());
    links_.push_back(Link{stack_[i], kNone32});
    if (o.chain.first == kNone32) {
      o.chain.first = link;
    } else {
      links_[o.chain.last].next = link;
    }
    o.chain.last = link;
  }
  o.size += static_cast<uint32_t>(n);
  stack_.resize(begin);
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
        mark();
        break;
      case 'N':
        push(Object{});
        break;
      case 0x88:    // NEWTRUE
      case 0x89: {  // NEWFALSE
        Object o;
        o.kind = Kind::kBool;
        o.integer = op_ == 0x88 ? 1 : 0;
        push(o);
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
        push(o);
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
        if (n >= kNone32) {
          fail("a string of " + std::to_string(n) +
               " bytes (at most 2^32 - 2 accepted)");
        }
        Object o;  // a view of data.pkl
        o.kind = Kind::kString;
        o.size = static_cast<uint32_t>(n);
        o.start = pos_;
        pos_ += static_cast<size_t>(n);
        push(o);
        break;
      }
      case ')':  // EMPTY_TUPLE
        make_tuple(stack_.size());
        break;
      case 't':  // TUPLE
        make_tuple(pop_mark());
        break;
      case 0x85:    // TUPLE1
      case 0x86:    // TUPLE2
      case 0x87: {  // TUPLE3
        const size_t n = op_ - 0x84u;
        require(n);
        make_tuple(stack_.size() - n);
        break;
      }
      case '}':    // EMPTY_DICT
      case ']': {  // EMPTY_LIST
        Object o;
        o.kind = op_ == '}' ? Kind::kDict : Kind::kList;
        o.chain = Chain{kNone32, kNone32};
        push(o);
        break;
      }
      case 's':            // SETITEM
      case 'u': {          // SETITEMS
        size_t begin = 0;  // the keys and values are stack_[begin, size())
        if (op_ == 's') {
          require(3);
          begin = stack_.size() - 2;
        } else {
          begin = pop_mark();
          if (begin <= frame_start()) {
            fail(kEmptyStack);
          }
        }
        const Id dict = stack_[begin - 1];
        if (at(dict).kind != Kind::kDict) {
          fail("needs a dict, got " + describe(dict));
        }
        if ((stack_.size() - begin) % 2 != 0) {
          fail("needs key-value pairs, got " +
               std::to_string(stack_.size() - begin) + " values");
        }
        append(dict, begin);
        break;
      }
      case 'a':            // APPEND
      case 'e': {          // APPENDS
        size_t begin = 0;  // the items are stack_[begin, size())
        if (op_ == 'a') {
          require(2);
          begin = stack_.size() - 1;
        } else {
          begin = pop_mark();
          if (begin <= frame_start()) {
            fail(kEmptyStack);
          }
        }
        const Id list = stack_[begin - 1];
        if (at(list).kind != Kind::kList) {
          fail("needs a list, got " + describe(list));
        }
        append(list, begin);
        break;
      }
      case 'q':  // BINPUT
        put_memo(read_uint(1));
        break;
      case 'r':  // LONG_BINPUT
        put_memo(read_uint(4));
        break;
      case 0x94:  // MEMOIZE
        put_memo(memo_.size() + sparse_memo_.size());
        break;
      case 'h':  // BINGET
        get_memo(read_uint(1));
        break;
      case 'j':  // LONG_BINGET
        get_memo(read_uint(4));
        break;
      case 'c': {  // GLOBAL: "module\nname\n"
        const std::string_view module = read_line();
        const std::string_view name = read_line();
        make_global(module, name);
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const Id name = pop();
        const Id module = pop();
        if (at(module).kind != Kind::kString ||
            at(name).kind != Kind::kString) {
          fail("needs two strings, got " + describe(module) + " and " +
               describe(name));
        }
        make_global(text(module), text(name));
        break;
      }
      case 'R': {  // REDUCE: callable(*args)
        const Id args = pop();
        const Id callable = pop();
        call(callable, args);
        break;
      }
      case 'Q':  // BINPERSID
        persistent_load(pop());
        break;
      case 'b': {  // BUILD: obj.__setstate__(state)
        // Python's state_dict() is an OrderedDict with the attribute
        // _metadata (module versions), restored by BUILD; it is ignored.
        const Id state = pop();
        const Id object = top();
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

StateDict unpickle_state_dict(const char* data, size_t size, std::string where,
                              StorageLoader load_storage,
                              MemoryBudget& budget) {
  return StateDictUnpickler(data, size, std::move(where),
                            std::move(load_storage), budget)
      .run();
}

StateDict unpickle_state_dict(const char* data, size_t size, std::string where,
                              StorageLoader load_storage) {
  MemoryBudget budget(size, where);
  budget.charge(size, "data.pkl");
  return unpickle_state_dict(data, size, std::move(where),
                             std::move(load_storage), budget);
}

}  // namespace mha::detail
