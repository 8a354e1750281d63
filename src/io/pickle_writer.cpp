// Internal, the pickle writer of state-dict I/O (declared in pickle.h): the
// `data.pkl` of a state dict, written with the opcodes and globals of
// Python's torch.save. Depends on tensor_file.h.
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>

#include "io/pickle.h"
#include "io/tensor_file.h"

namespace mha::detail {
namespace {

/// Writes the pickle of an OrderedDict of tensors, each with its own storage
/// record "data/<index>" (protocol 2, the opcodes and globals Python's
/// torch.save uses for a state dict, so that torch.load reads it with
/// weights_only=True).
class StateDictPickler {
 public:
  std::string run(const TensorEntries& entries) {
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

}  // namespace

std::string pickle_state_dict(const TensorEntries& entries) {
  return StateDictPickler().run(entries);
}

}  // namespace mha::detail
