// Internal, the pickle reader of state-dict I/O (declared in pickle.h, its
// machine in pickle_unpickler.h): what the objects of `data.pkl` mean to a
// state dict. The globals accepted (collections.OrderedDict,
// torch._utils._rebuild_tensor_v2 and _rebuild_parameter, the storage
// classes), the storages of persistent ids, the tensors rebuilt from them
// and the dict returned; pickle_reader.cpp runs the opcodes that build them.
// Depends on tensor_file.h.
//
// Glossary: as pickle_unpickler.h.
#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/pickle_unpickler.h"
#include "io/tensor_file.h"

namespace mha::detail {
namespace {

/// What a storage holds beyond its bytes and its tensor, as charged to the
/// budget: its node of storages_ (key of at most 64 bytes) and bucket.
constexpr uint64_t kStorageKeyBytes = 192;

}  // namespace

std::vector<StateDictUnpickler::Id> StateDictUnpickler::tuple_items(
    Id id) const {
  std::vector<Id> items(at(id).size);
  for (size_t i = 0; i < items.size(); ++i) {
    items[i] = item(id, i);
  }
  return items;
}

std::string StateDictUnpickler::global_name(Id id) const {
  const Object& o = at(id);
  switch (o.global) {
    case Global::kOrderedDict:
      return "collections.OrderedDict";
    case Global::kRebuildTensorV2:
      return "torch._utils._rebuild_tensor_v2";
    case Global::kRebuildParameter:
      return "torch._utils._rebuild_parameter";
    case Global::kStorageType:
      break;
  }
  return std::string(o.cuda ? "torch.cuda." : "torch.") + o.dtype->storage;
}

std::string StateDictUnpickler::describe(Id id) const {
  const Object& o = at(id);
  switch (o.kind) {
    case Kind::kInt:
      return "int " + std::to_string(o.integer);
    case Kind::kString:
      return "str '" + printable(std::string(text(id).substr(0, 81))) + "'";
    case Kind::kGlobal:
      return "global " + printable(global_name(id));
    case Kind::kTuple:
      return "tuple of " + std::to_string(o.size);
    default:
      return kind_name(o.kind);
  }
}

StateDictUnpickler::Id StateDictUnpickler::make_global(std::string_view module,
                                                       std::string_view name) {
  Object o;
  o.kind = Kind::kGlobal;
  const std::string type(name);
  if (module == "collections" && name == "OrderedDict") {
    o.global = Global::kOrderedDict;
  } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
    o.global = Global::kRebuildTensorV2;
  } else if (module == "torch._utils" && name == "_rebuild_parameter") {
    o.global = Global::kRebuildParameter;
  } else if ((module == "torch" || module == "torch.cuda") &&
             find_storage_type(type) != nullptr) {
    // PyTorch < 1.12 named CUDA storages torch.cuda.<Type>Storage; the
    // location is ignored either way (tensors are read to the CPU).
    o.global = Global::kStorageType;
    o.cuda = module == "torch.cuda";
    o.dtype = find_storage_type(type);
  } else {
    fail("refusing the global '" + printable(std::string(module)) + "." +
         printable(type) +
         "': a state dict needs only collections.OrderedDict, "
         "torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter "
         "and torch.<Type>Storage of the dtypes " +
         supported_dtypes() + " (nothing in the file is ever run)");
  }
  return push(o);
}

std::vector<int64_t> StateDictUnpickler::int_tuple(Id id,
                                                   const char* what) const {
  const Object& o = at(id);
  if (o.kind != Kind::kTuple) {
    fail(std::string(what) + " must be a tuple of ints, got " + describe(id));
  }
  if (o.size > 64) {
    fail(std::string(what) + " has " + std::to_string(o.size) +
         " dimensions (at most 64 accepted)");
  }
  std::vector<int64_t> values;
  for (size_t i = 0; i < o.size; ++i) {
    const Id value = item(id, i);
    if (at(value).kind != Kind::kInt || at(value).integer < 0) {
      fail(std::string(what) + " must hold ints >= 0, got " + describe(value));
    }
    values.push_back(at(value).integer);
  }
  return values;
}

StateDictUnpickler::Id StateDictUnpickler::persistent_load(Id pid) {
  // ('storage', torch.<Type>Storage, key, location, numel)
  const Object& id = at(pid);
  const bool valid_id = id.kind == Kind::kTuple && id.size == 5 &&
                        at(item(pid, 0)).kind == Kind::kString &&
                        text(item(pid, 0)) == "storage" &&
                        at(item(pid, 1)).kind == Kind::kGlobal &&
                        at(item(pid, 1)).global == Global::kStorageType &&
                        at(item(pid, 2)).kind == Kind::kString &&
                        at(item(pid, 3)).kind == Kind::kString &&
                        at(item(pid, 4)).kind == Kind::kInt &&
                        at(item(pid, 4)).integer >= 0;
  if (!valid_id) {
    fail(
        "a persistent id must be ('storage', torch.<Type>Storage, key, "
        "location, numel >= 0), got " +
        describe(pid) +
        (id.kind == Kind::kTuple && id.size > 0
             ? " starting with " + describe(item(pid, 0))
             : std::string()));
  }
  const DtypeName* dtype = at(item(pid, 1)).dtype;
  const std::string_view key_text = text(item(pid, 2));
  const auto numel = static_cast<uint64_t>(at(item(pid, 4)).integer);
  const bool valid_key =
      !key_text.empty() && key_text.size() <= 64 &&
      std::all_of(key_text.begin(), key_text.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
      });
  if (!valid_key) {
    fail("storage key '" + printable(std::string(key_text.substr(0, 81))) +
         "' must be 1 to 64 letters, digits or underscores");
  }
  const std::string key(key_text);
  const auto cached = storages_.find(key);
  if (cached != storages_.end()) {
    const Object& s = at(cached->second);
    const torch::Tensor& storage = tensors_[s.size];
    if (s.dtype != dtype || static_cast<uint64_t>(storage.numel()) != numel) {
      fail("storage '" + key + "' is used as " +
           std::to_string(storage.numel()) + " " + s.dtype->torch_name +
           " elements and as " + std::to_string(numel) + " " +
           dtype->torch_name + " elements");
    }
    push_id(cached->second);
    return cached->second;
  }
  // The bytes the record must hold; a record of another size is refused by
  // load_storage_ (which reads it within the zip layer's budget).
  uint64_t nbytes = 0;
  if (!checked_mul(numel, element_size(*dtype), &nbytes) ||
      !budget_.try_charge(kStorageKeyBytes + kTensorOverheadBytes) ||
      !budget_.try_charge(nbytes)) {
    fail(budget_.exceeded("the storage '" + key + "' of " +
                          std::to_string(numel) + " " + dtype->torch_name +
                          " elements"));
  }
  Object o;
  o.kind = Kind::kStorage;
  o.dtype = dtype;
  o.size = static_cast<uint32_t>(tensors_.size());
  tensors_.push_back(load_storage_(key, *dtype, numel));
  storage_bytes_ += nbytes;  // read from the file: no overflow
  const Id object = push(o);
  storages_[key] = object;
  return object;
}

StateDictUnpickler::Id StateDictUnpickler::rebuild_tensor(
    const std::vector<Id>& args) {
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
  const torch::Tensor& data = tensors_[storage.size];
  const auto storage_numel = static_cast<uint64_t>(data.numel());
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
  // The first view of a storage that covers it whole and contiguous takes
  // the storage itself (the storage object goes with the machine, so that
  // the tensor alone holds it, as it would hold a copy); any other view is
  // copied out.
  const torch::Tensor view = data.as_strided(sizes, strides, offset);
  const bool whole = !storage.taken && offset == 0 && numel == storage_numel &&
                     view.is_contiguous();
  if (!budget_.try_charge(whole ? kTensorOverheadBytes / 2
                                : kTensorOverheadBytes) ||
      (!whole && !budget_.try_charge(bytes))) {
    fail(budget_.exceeded("a tensor of size " +
                          c10::str(c10::IntArrayRef(sizes)) + " (" +
                          std::to_string(numel) + " " +
                          storage.dtype->torch_name + " elements)"));
  }
  objects_[args[0]].taken = objects_[args[0]].taken || whole;
  Object o;
  o.kind = Kind::kTensor;
  o.size = static_cast<uint32_t>(tensors_.size());
  // (A plain tensor on the storage, not a view of the storage's tensor;
  // with a copy's contiguous strides.)
  tensors_.push_back(
      whole ? torch::empty({0}, data.options()).set_(data.storage(), 0, sizes)
            : view.clone(at::MemoryFormat::Contiguous));
  return push(o);
}

StateDictUnpickler::Id StateDictUnpickler::call(Id callable, Id args_id) {
  if (at(callable).kind != Kind::kGlobal) {
    fail("can call only an accepted global, got " + describe(callable));
  }
  if (at(args_id).kind != Kind::kTuple || at(args_id).size > 7) {
    fail("the arguments must be a tuple of at most 7, got " +
         describe(args_id));
  }
  const std::vector<Id> args = tuple_items(args_id);
  switch (at(callable).global) {
    case Global::kOrderedDict: {
      if (!args.empty()) {
        fail("collections.OrderedDict is accepted only without arguments");
      }
      Object o;
      o.kind = Kind::kDict;
      o.chain = Chain{kNone32, kNone32};
      return push(o);
    }
    case Global::kRebuildTensorV2:
      return rebuild_tensor(args);
    case Global::kRebuildParameter: {
      // _rebuild_parameter(data, requires_grad, backward_hooks)
      if (args.size() != 3 || at(args[0]).kind != Kind::kTensor ||
          at(args[1]).kind != Kind::kBool || at(args[2]).kind != Kind::kDict) {
        fail("torch._utils._rebuild_parameter takes (tensor, bool, dict)");
      }
      push_id(args[0]);
      return args[0];
    }
    case Global::kStorageType:
      break;
  }
  fail("the storage class " + global_name(callable) +
       " may appear only in a persistent id, not be called");
}

StateDict StateDictUnpickler::to_state_dict(Id id) {
  const Object& dict = at(id);
  if (dict.kind != Kind::kDict) {
    fail(
        "the pickled object must be a dict or collections.OrderedDict of "
        "tensors, got " +
        describe(id));
  }
  StateDict result;
  uint32_t link = dict.chain.first;
  while (link != kNone32 && links_[link].next != kNone32) {
    const Id key_id = links_[link].item;
    const Id value_id = links_[links_[link].next].item;
    link = links_[links_[link].next].next;
    if (at(key_id).kind != Kind::kString) {
      fail("state dict keys must be strings, got " + describe(key_id));
    }
    std::string key(text(key_id));
    if (at(value_id).kind != Kind::kTensor) {
      fail("entry '" + printable(key) + "' must be a tensor, got " +
           describe(value_id));
    }
    if (result.contains(key)) {
      fail("the key '" + printable(key) + "' appears twice");
    }
    if (!budget_.try_charge(kDictEntryBytes + 2 * key.size())) {
      fail(budget_.exceeded("the state dict's entry '" + printable(key) + "'"));
    }
    result.insert(std::move(key), tensors_[at(value_id).size]);
  }
  return result;
}

}  // namespace mha::detail
