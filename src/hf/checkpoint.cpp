// mha::hf, the checkpoint layer (hf_internal.h): the tensors of one layer
// from a transformers model directory, read through the state-dict readers
// (src/io/safetensors.h, src/io/pytorch_format.h). Single files or shards named
// by an index's weight_map; only the shards that hold a wanted tensor are
// opened, and of a safetensors file only the wanted tensors' data is read.
// An index is read member by member (src/io/json_members.h), its wanted
// entries kept, within the memory budget of a state-dict file of its size.
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "hf_internal.h"
#include "io/json_members.h"
#include "io/pytorch_format.h"
#include "io/safetensors.h"
#include "io/tensor_file.h"

namespace mha::hf::detail {
namespace {

namespace fs = std::filesystem;
using mha::detail::StateDict;

bool is_file(const fs::path& path) {
  std::error_code error;
  return fs::is_regular_file(path, error);
}

/// The wanted tensors of one file, safetensors or PyTorch zip.
StateDict read_file(const fs::path& path,
                    const std::function<bool(const std::string&)>& wanted) {
  const std::string p = path.string();
  const std::string where = mha::detail::file_label(p);
  std::error_code error;
  const uint64_t size = fs::file_size(path, error);
  TORCH_CHECK(!error, where, ": cannot get the file size: ", error.message());
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in.is_open(), where, ": cannot open the file for reading");
  if (path.extension() == ".safetensors") {
    return mha::detail::read_safetensors(p, in, size, wanted);
  }
  in.close();
  // The pickle of a PyTorch file names its tensors only as it is run, so
  // the whole file is read and the wanted tensors kept.
  StateDict all = mha::detail::read_pytorch(p);
  StateDict out;
  for (const auto& item : all) {
    if (wanted(item.key())) {
      out.insert(item.key(), item.value());
    }
  }
  return out;
}

/// The index read member by member (json_members.h): weight_map's entries
/// checked one by one, the wanted ones kept.
class IndexReader : public mha::detail::JsonMemberVisitor {
 public:
  IndexReader(const std::string& where, mha::detail::MemoryBudget& budget,
              const std::function<bool(const std::string&)>& wanted)
      : where_(where), budget_(budget), wanted_(wanted) {}

  /// The wanted entries: tensor name -> shard file.
  std::map<std::string, std::string> shards;
  bool has_weight_map = false;

  bool streamed(const std::string& key) const override {
    return key == "weight_map";
  }
  void member(std::string& key, nlohmann::json&) override {
    // weight_map reaches here only when it is not an object.
    TORCH_CHECK(key != "weight_map", where_,
                ": expected an object with a weight_map {tensor: shard file}");
  }
  void begin_streamed(const std::string&) override { has_weight_map = true; }
  void inner(const std::string&, std::string& key,
             nlohmann::json& value) override {
    TORCH_CHECK(value.is_string(), where_, ": weight_map['", key,
                "'] must be a file name, got ", value.dump());
    std::string& file = value.get_ref<std::string&>();
    TORCH_CHECK(
        file.find('/') == std::string::npos && file != ".." && !file.empty(),
        where_, ": weight_map['", key,
        "'] must name a file in the model directory, got '", file, "'");
    if (wanted_(key)) {
      // A std::map node and the two strings.
      if (!budget_.try_charge(96 + 2 * (key.size() + file.size()))) {
        budget_.refuse("weight_map['" + mha::detail::printable(key) + "']");
      }
      shards[std::move(key)] = std::move(file);
    }
  }
  [[noreturn]] void too_large(const std::string& outer,
                              const std::string& key) override {
    TORCH_CHECK(false, where_, ": the value of '", mha::detail::printable(key),
                "'", outer.empty() ? "" : " (in '" + outer + "')",
                " holds more than ", kMaxValues, " JSON values");
  }
  [[noreturn]] void invalid(const std::exception& e) override {
    TORCH_CHECK(false, where_, ": not valid JSON: ", e.what());
  }

  /// The most JSON values one member's value may hold (an index's metadata
  /// holds one, total_size).
  static constexpr size_t kMaxValues = 4096;

 private:
  const std::string& where_;
  mha::detail::MemoryBudget& budget_;
  const std::function<bool(const std::string&)>& wanted_;
};

/// The wanted entries of weight_map of a sharded checkpoint's index: tensor
/// name -> shard file. The index is read within the memory budget of a
/// state-dict file of its size.
std::map<std::string, std::string> weight_map(
    const fs::path& index,
    const std::function<bool(const std::string&)>& wanted) {
  const std::string where = index.string();
  std::ifstream in(where, std::ios::binary);
  TORCH_CHECK(in.is_open(), "mha::hf: cannot open '", where, "'");
  std::error_code error;
  const uint64_t size = fs::file_size(index, error);
  TORCH_CHECK(!error, where, ": cannot get the file size: ", error.message());
  mha::detail::MemoryBudget budget(size, where);
  // The text and, while it is parsed, one token twice (the parser's raw and
  // decoded copies, or the value the decoded one went to).
  budget.charge(3 * size, "the text of " + std::to_string(size) + " bytes");
  std::string text(size, '\0');
  mha::detail::read_exact(in, 0, &text[0], size, where, "the index");
  IndexReader reader(where, budget, wanted);
  std::string type;
  const bool object = mha::detail::read_json_members(
      text, reader, IndexReader::kMaxValues, &type);
  TORCH_CHECK(object && reader.has_weight_map, where,
              ": expected an object with a weight_map {tensor: shard file}");
  return std::move(reader.shards);
}

}  // namespace

LayerTensors read_checkpoint(
    const std::string& model_dir,
    const std::function<bool(const std::string&)>& wanted) {
  const fs::path dir(model_dir);
  LayerTensors out;
  auto add = [&](const StateDict& tensors, const std::string& file) {
    for (const auto& item : tensors) {
      out.tensors.insert(item.key(), item.value());
      out.file_of[item.key()] = file;
    }
  };
  for (const char* single : {"model.safetensors", "pytorch_model.bin"}) {
    const std::string index = std::string(single) + ".index.json";
    if (is_file(dir / single)) {
      out.source = (dir / single).string();
      add(read_file(dir / single, wanted), out.source);
      return out;
    }
    if (is_file(dir / index)) {
      out.source = (dir / index).string();
      std::map<std::string, std::set<std::string>> by_shard;
      for (const auto& [name, shard] : weight_map(dir / index, wanted)) {
        by_shard[shard].insert(name);
      }
      for (const auto& [shard, names] : by_shard) {
        TORCH_CHECK(is_file(dir / shard), out.source, ": names the shard '",
                    shard, "' (for '", *names.begin(),
                    "'), which the model directory lacks");
        const StateDict tensors = read_file(dir / shard, wanted);
        for (const auto& name : names) {
          TORCH_CHECK(tensors.contains(name), (dir / shard).string(),
                      ": lacks the tensor '", name, "' that ", out.source,
                      " places there");
        }
        add(tensors, (dir / shard).string());
      }
      return out;
    }
  }
  TORCH_CHECK(false, "mha::hf: ", model_dir,
              " holds no model.safetensors, model.safetensors.index.json, "
              "pytorch_model.bin or pytorch_model.bin.index.json");
}

bool LayerTensors::has(const std::string& key) const {
  return tensors.contains(base_prefix + key) || tensors.contains(key);
}

torch::Tensor LayerTensors::get(const std::string& key,
                                c10::IntArrayRef sizes) const {
  const std::string prefixed = base_prefix + key;
  const std::string name = tensors.contains(prefixed) ? prefixed : key;
  TORCH_CHECK(tensors.contains(name), source, ": no tensor '", key, "'",
              base_prefix.empty() ? std::string() : " (nor '" + prefixed + "')",
              ", which the config's layer needs");
  const auto it = file_of.find(name);
  const std::string& file = it == file_of.end() ? source : it->second;
  const torch::Tensor& t = tensors[name];
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kFloat16 ||
                  dtype == torch::kBFloat16 || dtype == torch::kFloat64,
              file, ": tensor '", name, "' has dtype ", dtype,
              ", expected float32, float16 or bfloat16");
  TORCH_CHECK(t.sizes() == sizes, file, ": tensor '", name, "' has shape ",
              t.sizes(), ", but the config expects ", sizes);
  return t;
}

}  // namespace mha::hf::detail
