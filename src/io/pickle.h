// Internal, the pickle layer of state-dict I/O: reading and writing
// `data.pkl`, the Python pickle that a PyTorch zip file holds next to its
// storage records. Reader in pickle_reader.cpp and pickle_objects.cpp (its
// machine in pickle_unpickler.h, opcode names in pickle_opcodes.cpp), writer
// in pickle_writer.cpp. Depends on tensor_file.h.
// Not installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "io/tensor_file.h"

namespace mha::detail {

/// Loads the storage record `key` ("data/<key>") as a 1-D tensor of `numel`
/// elements.
using StorageLoader = std::function<torch::Tensor(
    const std::string& key, const DtypeName& dtype, uint64_t numel)>;

/// The name of the pickle opcode `op` ("MARK"), "unknown" for a byte that
/// is no opcode.
const char* opcode_name(unsigned char op);

/// Reads the pickle `data` (`size` bytes of data.pkl) as a state dict: a dict
/// or collections.OrderedDict of string keys and tensors, whose storages come
/// from `load_storage`. Nothing in the pickle is ever run; anything a state
/// dict does not need is refused with a c10::Error starting with `where`.
/// Everything it builds (its working memory, the storages before they are
/// loaded, the tensors, the dict) is charged to `budget` first, and refused
/// past it.
StateDict unpickle_state_dict(const char* data, size_t size, std::string where,
                              StorageLoader load_storage, MemoryBudget& budget);

/// unpickle_state_dict with the budget of a file holding only `data`
/// (already charged).
StateDict unpickle_state_dict(const char* data, size_t size, std::string where,
                              StorageLoader load_storage);

/// The pickle of `entries` as an OrderedDict of tensors, each with its own
/// storage record "data/<index>" (see pickle_writer.cpp).
std::string pickle_state_dict(const TensorEntries& entries);

}  // namespace mha::detail
