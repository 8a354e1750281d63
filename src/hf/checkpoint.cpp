// mha::hf, the checkpoint layer (hf_internal.h): the tensors of one layer
// from a transformers model directory, read through the state-dict readers
// (src/io/safetensors.h, src/io/pytorch_format.h). Single files or shards named
// by an index's weight_map; only the shards that hold a wanted tensor are
// opened, and of a safetensors file only the wanted tensors' data is read.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "hf_internal.h"
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

/// weight_map of a sharded checkpoint's index: tensor name -> shard file.
std::map<std::string, std::string> weight_map(const fs::path& index) {
  std::ifstream in(index);
  TORCH_CHECK(in.is_open(), "mha::hf: cannot open '", index.string(), "'");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, index.string(), ": not valid JSON: ", e.what());
  }
  TORCH_CHECK(json.is_object() && json.contains("weight_map") &&
                  json["weight_map"].is_object(),
              index.string(),
              ": expected an object with a weight_map {tensor: shard file}");
  std::map<std::string, std::string> out;
  for (auto it = json["weight_map"].begin(); it != json["weight_map"].end();
       ++it) {
    TORCH_CHECK(it.value().is_string(), index.string(), ": weight_map['",
                it.key(), "'] must be a file name, got ", it.value().dump());
    const std::string file = it.value().get<std::string>();
    TORCH_CHECK(
        file.find('/') == std::string::npos && file != ".." && !file.empty(),
        index.string(), ": weight_map['", it.key(),
        "'] must name a file in the model directory, got '", file, "'");
    out[it.key()] = file;
  }
  return out;
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
      for (const auto& [name, shard] : weight_map(dir / index)) {
        if (wanted(name)) {
          by_shard[shard].insert(name);
        }
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
