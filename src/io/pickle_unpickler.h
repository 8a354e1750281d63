// Internal, the pickle reader of state-dict I/O (pickle.h declares its entry
// point): the machine both halves of the reader share. pickle_reader.cpp runs
// the opcodes (the byte stream, the stack and its MARKs, the memo, tuples,
// lists and dicts); pickle_objects.cpp gives the objects a state dict's
// meaning (the accepted globals, storages, tensors, the dict returned).
// Depends on tensor_file.h. Not installed.
//
// Glossary: an "object" is one value the pickle builds, named by its id, its
// index in the arena; the "stack" and the "memo" hold ids; a "frame" is the
// part of the stack above the innermost MARK; a "link" is one item of a list
// or dict, chained to the next; a "storage" is the flat buffer (numel
// elements of one dtype) that a tensor views through an offset, sizes and
// strides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/pickle.h"
#include "io/tensor_file.h"

namespace mha::detail {

/// A deliberately small unpickler for `data.pkl` of a state dict. It builds
/// plain values (None, bool, int, str, tuple, list, dict) and, for the few
/// globals a state dict names, dicts (collections.OrderedDict), storages
/// (persistent ids) and tensors (torch._utils._rebuild_tensor_v2). Anything
/// else is refused by name. Objects live in one arena and refer to each other
/// by id, so nothing is recursive (no stack depth to exhaust) and shared or
/// cyclic references cost nothing.
///
/// Memory: an object is 16 bytes (strings are views of data.pkl, a tuple's
/// items lie in one shared pool, a list's or dict's in chained links), and
/// everything the machine holds is charged to the load's MemoryBudget before
/// it is allocated, so that no pickle costs more than its file allows.
class StateDictUnpickler {
 public:
  StateDictUnpickler(const char* data, size_t size, std::string where,
                     StorageLoader load_storage, MemoryBudget& budget);

  StateDict run();

 private:
  using Id = uint32_t;
  static constexpr uint32_t kNone32 = UINT32_MAX;  // no link, no object

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

  /// The links of a list or dict: the first and the last (kNone32: empty).
  struct Chain {
    uint32_t first;
    uint32_t last;
  };

  /// One object, in 16 bytes.
  struct Object {
    Kind kind = Kind::kNone;
    Global global = Global::kOrderedDict;  // kGlobal
    bool cuda = false;   // kGlobal kStorageType: named torch.cuda.<Type>Storage
    bool taken = false;  // kStorage: a tensor holds it as its own
    /// kString: its bytes; kTuple, kList, kDict: its items (a dict's keys
    /// and values); kStorage, kTensor: its index in tensors_.
    uint32_t size = 0;
    union {
      int64_t integer = 0;     // kBool, kInt
      uint64_t start;          // kString: offset in data_; kTuple: in items_
      Chain chain;             // kList, kDict
      const DtypeName* dtype;  // kGlobal kStorageType, kStorage
    };
  };
  static_assert(sizeof(Object) == 16, "an object is 16 bytes");

  /// One item of a list or dict and the link after it (kNone32: none).
  struct Link {
    Id item;
    uint32_t next;
  };

  static const char* kind_name(Kind kind);
  [[noreturn]] void fail(const std::string& message) const;
  /// Charges `bytes` to the budget, failing with `what` past it.
  void charge(uint64_t bytes, const char* what);
  /// Charges `per_entry` bytes for each entry of a container grown to
  /// `size` entries beyond the `charged` ones, a chunk at a time.
  void grow(size_t size, size_t& charged, uint64_t per_entry,
            const char* what) {
    if (size > charged) {
      charge_chunk(size, charged, per_entry, what);
    }
  }
  void charge_chunk(size_t size, size_t& charged, uint64_t per_entry,
                    const char* what);

  // Reading the byte stream (pickle_reader.cpp); `n` bytes must remain.
  void need(size_t n) const;
  uint64_t read_uint(size_t n);
  std::string_view read_line();

  // The stack, split into frames by MARK as Python's unpickler does: no
  // opcode reaches below the frame of the innermost MARK.
  size_t frame_start() const { return marks_.empty() ? 0 : marks_.back(); }
  /// Fails unless the frame holds at least `n` values.
  void require(size_t n) const;
  Id pop();
  Id top() const;
  /// Closes the innermost MARK; its frame is stack_[returned, size()).
  size_t pop_mark();
  void push_id(Id id) {
    stack_.push_back(id);
    grow(stack_.size(), stack_charged_, 3 * sizeof(Id), "the stack");
  }
  Id push(const Object& object);
  void put_memo(uint64_t index);
  void get_memo(uint64_t index);
  void mark();
  /// A tuple of stack_[begin, size()), which is popped.
  Id make_tuple(size_t begin);
  /// Appends stack_[begin, size()) to the list or dict `container`, and
  /// pops them.
  void append(Id container, size_t begin);

  // The objects (pickle_objects.cpp).
  const Object& at(Id id) const { return objects_[id]; }
  std::string_view text(Id id) const {
    return {reinterpret_cast<const char*>(data_) + at(id).start, at(id).size};
  }
  /// Item `i` of the tuple `id`.
  Id item(Id id, size_t i) const { return items_[at(id).start + i]; }
  std::vector<Id> tuple_items(Id id) const;
  std::string global_name(Id id) const;
  std::string describe(Id id) const;
  Id make_global(std::string_view module, std::string_view name);
  Id call(Id callable, Id args);
  Id rebuild_tensor(const std::vector<Id>& args);
  std::vector<int64_t> int_tuple(Id id, const char* what) const;
  Id persistent_load(Id pid);
  StateDict to_state_dict(Id id);

  const unsigned char* data_;
  size_t size_;
  size_t pos_ = 0;
  unsigned char op_ = 0;  // the opcode being run, for messages
  size_t op_pos_ = 0;
  std::string where_;
  StorageLoader load_storage_;
  MemoryBudget& budget_;

  std::deque<Object> objects_;
  std::deque<Id> items_;  // the tuples' items, each tuple's in a row
  std::deque<Link> links_;
  std::deque<torch::Tensor> tensors_;  // of kStorage and kTensor objects
  std::vector<Id> stack_;
  std::vector<size_t> marks_;
  std::deque<Id> memo_;  // entries 0, 1, ... as picklers number them
  std::unordered_map<uint64_t, Id> sparse_memo_;  // others, not in memo_
  std::unordered_map<std::string, Id> storages_;  // by record key

  // Bounds on memory: the objects, from data.pkl's size; the tensors built
  // against the storages' bytes; everything against the budget (the entries
  // charged so far of the containers charged by the chunk).
  size_t max_objects_;
  size_t stack_charged_ = 0;
  size_t marks_charged_ = 0;
  size_t memo_charged_ = 0;
  uint64_t storage_bytes_ = 0;  // of the storages loaded
  uint64_t tensor_bytes_ = 0;   // of the tensors built from them
};

}  // namespace mha::detail
