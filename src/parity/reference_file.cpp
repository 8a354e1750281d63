// Recorded references (include/mha/parity.h): mha against the input and
// output of one attention layer recorded from a Python model by
// scripts/record_reference.py, the module built by mha::hf. The file format
// is in docs/porting.md ("Prove your port").
//
// Glossary: N batch, L query rows of a forward, S keys (L, or the cache
// length plus T in a cached step), T new tokens of a step, E hidden size,
// H heads.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "hf/hf_internal.h"
#include "io/safetensors.h"
#include "io/tensor_file.h"
#include "mha/gated_delta_net.h"
#include "mha/hf.h"
#include "mha/latent_attention.h"
#include "mha/parity.h"

namespace mha::parity {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "mha-attention-reference";

const std::string& meta(const RecordedReference& r, const std::string& key) {
  const auto it = r.metadata.find(key);
  TORCH_CHECK(it != r.metadata.end(), r.path, ": __metadata__ lacks '", key,
              "'");
  return it->second;
}

const torch::Tensor& tensor(const RecordedReference& r,
                            const std::string& name) {
  TORCH_CHECK(r.tensors.contains(name), r.path, ": lacks the tensor '", name,
              "'");
  return r.tensors[name];
}

int64_t layer_of(const RecordedReference& r) {
  const std::string text = meta(r, "layer");
  try {
    size_t used = 0;
    const int64_t layer = std::stoll(text, &used);
    TORCH_CHECK(used == text.size() && layer >= 0, "");
    return layer;
  } catch (const std::exception&) {
    TORCH_CHECK(false, r.path,
                ": __metadata__ layer must be an integer >= 0, "
                "got '",
                text, "'");
  }
}

std::string stack_of(const RecordedReference& r) {
  const auto it = r.metadata.find("stack");
  return it == r.metadata.end() ? "encoder" : it->second;
}

/// The config.json text of the reference's model.
std::string config_of(const RecordedReference& r) {
  const auto dir = r.metadata.find("model_dir");
  if (dir != r.metadata.end()) {
    const fs::path path =
        fs::path(r.path).parent_path() / dir->second / "config.json";
    std::ifstream in(path);
    TORCH_CHECK(in.is_open(), r.path, ": cannot open ", path.string(),
                " (the metadata's model_dir)");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  return meta(r, "config");
}

/// The element of one comparison farthest outside (or nearest to the edge
/// of) the tolerance.
struct Worst {
  double ratio = -1.0;  // |a - b| / (atol + rtol |b|): > 1 is outside
  std::string text;     // "output[1, 3, 7]: mha ... vs reference ..."
};

/// One comparison of `actual` with `expected` where `rows` (broadcastable,
/// bool) is true; adds it to `check` and updates `worst`.
void compare(const std::string& what, const torch::Tensor& actual,
             const torch::Tensor& expected, const torch::Tensor& rows,
             RecordedCheck& check, Worst& worst) {
  TORCH_CHECK(actual.sizes() == expected.sizes(), "mha's ", what, " has shape ",
              actual.sizes(), " but the reference's ", expected.sizes());
  const auto a = actual.to(torch::kCPU, torch::kFloat64);
  const auto b = expected.to(torch::kCPU, torch::kFloat64);
  const auto keep = rows.to(torch::kCPU).expand_as(b);
  const Tolerance& tol = check.tolerance;
  const auto diff = (a - b).abs().masked_fill(~keep, 0.0);
  const auto ratio = diff / (tol.atol + tol.rtol * b.abs());
  Comparison c;
  c.what = what;
  c.max_abs = diff.max().item<double>();
  c.max_rel = (diff / (b.abs() + tol.atol)).max().item<double>();
  c.within = (ratio <= 1.0).all().item<bool>();
  check.within = check.within && c.within;
  check.parts.push_back(c);

  const int64_t flat = ratio.argmax().item<int64_t>();
  const double here = ratio.reshape(-1)[flat].item<double>();
  if (here <= worst.ratio) {
    return;
  }
  worst.ratio = here;
  std::vector<int64_t> index(b.dim());
  int64_t rest = flat;
  for (int64_t d = b.dim() - 1; d >= 0; --d) {
    index[d] = rest % b.size(d);
    rest /= b.size(d);
  }
  std::ostringstream s;
  s << what << "[";
  for (size_t d = 0; d < index.size(); ++d) {
    s << (d ? ", " : "") << index[d];
  }
  s << std::setprecision(7) << "]: mha " << a.reshape(-1)[flat].item<double>()
    << " vs reference " << b.reshape(-1)[flat].item<double>() << " ("
    << std::setprecision(2) << here << " of the tolerance)";
  worst.text = s.str();
}

}  // namespace

RecordedReference read_reference(const std::string& path) {
  RecordedReference r;
  r.path = path;
  const std::string where = mha::detail::file_label(path);
  std::error_code error;
  TORCH_CHECK(fs::is_regular_file(path, error), where, ": no such file");
  const uint64_t size = fs::file_size(path, error);
  TORCH_CHECK(!error && size >= 8, where, ": not a safetensors file");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), where, ": cannot open the file for reading");
  const auto tensors =
      mha::detail::read_safetensors(path, in, size, {}, &r.metadata);
  for (const auto& item : tensors) {
    r.tensors.insert(item.key(), item.value());
  }
  const auto format = r.metadata.find("format");
  TORCH_CHECK(format != r.metadata.end() && format->second == kFormat, where,
              ": __metadata__ format must be '", kFormat, "', got '",
              format == r.metadata.end() ? "(none)" : format->second,
              "' (write the file with scripts/record_reference.py)");
  const bool single =
      r.tensors.contains("hidden_states") && r.tensors.contains("output");
  const bool steps = r.tensors.contains("step0.hidden_states") &&
                     r.tensors.contains("step0.output");
  TORCH_CHECK(single || steps, where,
              ": needs the tensors hidden_states and output (or "
              "step0.hidden_states and step0.output)");
  return r;
}

MultiHeadAttention reference_module(const RecordedReference& r) {
  const auto dir = r.metadata.find("model_dir");
  if (dir != r.metadata.end()) {
    const fs::path model_dir = fs::path(r.path).parent_path() / dir->second;
    return hf::load_attention(model_dir.string(), layer_of(r), stack_of(r));
  }
  return hf::attention_from_tensors(meta(r, "config"), r.tensors, layer_of(r),
                                    stack_of(r), r.path);
}

namespace {

/// (N, L) bool, true = token, from the reference's attention_mask (all true
/// without one).
torch::Tensor keep_mask(const RecordedReference& r, int64_t N, int64_t L) {
  if (!r.tensors.contains("attention_mask")) {
    return torch::ones({N, L}, torch::kBool);  // (N, L)
  }
  const auto keep = tensor(r, "attention_mask") != 0;  // (N, L)
  TORCH_CHECK(keep.sizes() == torch::IntArrayRef({N, L}), r.path,
              ": attention_mask must be (N, L) = (", N, ", ", L, "), got ",
              keep.sizes());
  return keep;
}

/// The recorded position_ids `name` as int64 (N, T) on `device`, or an
/// undefined tensor (the module's default positions) when absent.
torch::Tensor positions_of(const RecordedReference& r, const std::string& name,
                           int64_t N, int64_t T, const torch::Device& device) {
  if (!r.tensors.contains(name)) {
    return {};
  }
  const auto& positions = tensor(r, name);
  TORCH_CHECK(positions.sizes() == torch::IntArrayRef({N, T}), r.path, ": ",
              name, " must be (N, T) = (", N, ", ", T, "), got ",
              positions.sizes());
  TORCH_CHECK(!torch::isFloatingType(positions.scalar_type()) &&
                  positions.scalar_type() != torch::kBool,
              r.path, ": ", name, " must hold integers, got dtype ",
              positions.scalar_type());
  return positions.to(device, torch::kInt64);  // (N, T)
}

/// One forward over the recorded hidden_states (N, L, E), with the
/// attention_mask as key_padding_mask and position_ids as positions.
void check_forward(const RecordedReference& r, MultiHeadAttention& module,
                   bool causal, const torch::Device& device,
                   RecordedCheck& check, Worst& worst) {
  const auto x = tensor(r, "hidden_states");  // (N, L, E)
  TORCH_CHECK(x.dim() == 3, r.path, ": hidden_states must be (N, L, E), got ",
              x.sizes());
  const int64_t N = x.size(0);
  const int64_t L = x.size(1);
  const auto keep = keep_mask(r, N, L);  // (N, S = L)
  const auto positions = positions_of(r, "position_ids", N, L, device);
  const bool padded = !keep.all().item<bool>();
  auto [out, weights] = module->forward(
      x.to(device), {}, {}, padded ? (~keep).to(device) : torch::Tensor(),
      /*need_weights=*/true, {}, /*average_attn_weights=*/false, causal,
      positions);  // (N, L, E), (N, H, L, S)
  // Query rows that are padding carry no meaning (HF: uniform weights).
  check.skipped_rows = (~keep).sum().item<int64_t>();
  compare("output", out, tensor(r, "output"), keep.view({N, L, 1}), check,
          worst);
  if (r.tensors.contains("weights")) {
    compare("weights", weights, tensor(r, "weights"), keep.view({N, 1, L, 1}),
            check, worst);
  }
  std::ostringstream note;
  note << "layer " << layer_of(r) << (causal ? ", causal" : "") << ", " << N
       << "x" << L << " tokens"
       << (positions.defined() ? ", position_ids" : "");
  if (check.skipped_rows > 0) {
    note << ", " << check.skipped_rows << " padding rows left out";
  }
  check.note = note.str();
}

/// "step<k>.<what>": a recorded decoding step's tensor.
std::string step_name(int64_t k, const char* what) {
  return "step" + std::to_string(k) + "." + what;
}

/// The recorded decoding steps step0.*, step1.*, ...: how many, the
/// tokens of all, and the batch (N of every step's hidden_states).
struct StepCount {
  int64_t steps = 0, total = 0, N = 0;
};

StepCount count_steps(const RecordedReference& r) {
  StepCount c;
  while (r.tensors.contains(step_name(c.steps, "hidden_states"))) {
    const auto x = tensor(r, step_name(c.steps, "hidden_states"));
    TORCH_CHECK(x.dim() == 3 && (c.steps == 0 || x.size(0) == c.N), r.path,
                ": ", step_name(c.steps, "hidden_states"),
                " must be (N, T, E) with the N of step0, got ", x.sizes());
    c.N = x.size(0);
    c.total += x.size(1);
    ++c.steps;
  }
  return c;
}

/// Recorded decoding steps step0.*, step1.*, ... through one KVCache
/// (forward_cached), each with the attention_mask's first P + T columns as
/// key_padding_mask and its position_ids.
void check_steps(const RecordedReference& r, MultiHeadAttention& module,
                 bool causal, const torch::Device& device, RecordedCheck& check,
                 Worst& worst) {
  const auto [steps, total, N] = count_steps(r);
  const auto keep = keep_mask(r, N, total);  // (N, total)
  const bool padded = !keep.all().item<bool>();
  auto cache = module->make_kv_cache(N, total);
  int64_t P = 0;
  for (int64_t k = 0; k < steps; ++k) {
    const auto x = tensor(r, step_name(k, "hidden_states"));  // (N, T, E)
    const int64_t T = x.size(1);
    const auto positions =
        positions_of(r, step_name(k, "position_ids"), N, T, device);
    const auto padding = padded ? (~keep.narrow(1, 0, P + T)).to(device)
                                : torch::Tensor();  // (N, P + T)
    auto [out, weights] = module->forward_cached(
        x.to(device), cache, causal, /*need_weights=*/true,
        /*average_attn_weights=*/false, padding,
        positions);                          // (N, T, E), (N, H, T, P + T)
    const auto rows = keep.narrow(1, P, T);  // (N, T): token query rows
    check.skipped_rows += (~rows).sum().item<int64_t>();
    compare(step_name(k, "output"), out, tensor(r, step_name(k, "output")),
            rows.reshape({N, T, 1}), check, worst);
    if (r.tensors.contains(step_name(k, "weights"))) {
      compare(step_name(k, "weights"), weights,
              tensor(r, step_name(k, "weights")), rows.reshape({N, 1, T, 1}),
              check, worst);
    }
    P += T;
  }
  std::ostringstream note;
  note << "layer " << layer_of(r) << (causal ? ", causal" : "") << ", " << N
       << " sequences, " << steps << " steps through one KV cache (" << total
       << " tokens" << (padded ? ", key padding" : "") << ")";
  if (check.skipped_rows > 0) {
    note << ", " << check.skipped_rows << " padding rows left out";
  }
  check.note = note.str();
}

/// The module a reference's layer needs: MultiHeadAttention, Multi-head
/// Latent Attention (deepseek_v2 / deepseek_v3) or Gated DeltaNet
/// (qwen3_next's linear_attention layers).
enum class LayerKind { kAttention, kLatent, kGatedDeltaNet };

LayerKind layer_kind(const RecordedReference& r, const std::string& config) {
  const auto json = hf::detail::parse_config(config, r.path);
  const std::string type =
      hf::detail::opt_string(json, "model_type", "", r.path);
  if (type == "deepseek_v2" || type == "deepseek_v3") {
    return LayerKind::kLatent;
  }
  if (type == "qwen3_next" &&
      hf::detail::qwen3_next_layer_type(json, layer_of(r), r.path) ==
          "linear_attention") {
    return LayerKind::kGatedDeltaNet;
  }
  return LayerKind::kAttention;
}

/// A layer that is not a MultiHeadAttention, as check_sequence runs it:
/// forward(x, key_padding_mask or undefined, positions or undefined), and
/// decoding steps after start(N, total tokens) by step(x, key_padding_mask
/// (N, P + T) or undefined, positions or undefined).
struct SequenceLayer {
  std::string what;  // "Multi-head Latent Attention", ...
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                              const torch::Tensor&)>
      forward, step;
  std::function<void(int64_t, int64_t)> start;
};

/// The recorded forward (hidden_states) and the recorded steps (step<k>.*),
/// whichever the file holds, outputs only (neither module returns
/// weights). The attention_mask is the forward's key padding when the file
/// has a forward, else the steps' (its first P + T columns per step).
void check_sequence(const RecordedReference& r, SequenceLayer& layer,
                    const torch::Device& device, RecordedCheck& check,
                    Worst& worst) {
  std::ostringstream note;
  note << layer.what << ", layer " << layer_of(r);
  const bool has_forward = r.tensors.contains("hidden_states");
  if (has_forward) {
    const auto x = tensor(r, "hidden_states");  // (N, L, E)
    TORCH_CHECK(x.dim() == 3, r.path, ": hidden_states must be (N, L, E), got ",
                x.sizes());
    const int64_t N = x.size(0), L = x.size(1);
    const auto keep = keep_mask(r, N, L);  // (N, L)
    const bool padded = !keep.all().item<bool>();
    const auto out = layer.forward(
        x.to(device), padded ? (~keep).to(device) : torch::Tensor(),
        positions_of(r, "position_ids", N, L, device));  // (N, L, E)
    check.skipped_rows += (~keep).sum().item<int64_t>();
    compare("output", out, tensor(r, "output"), keep.view({N, L, 1}), check,
            worst);
    note << ", " << N << "x" << L << " tokens";
  }
  const auto [steps, total, N] = count_steps(r);
  if (steps > 0) {
    const auto keep = has_forward ? torch::ones({N, total}, torch::kBool)
                                  : keep_mask(r, N, total);  // (N, total)
    const bool padded = !keep.all().item<bool>();
    layer.start(N, total);
    for (int64_t k = 0, P = 0; k < steps; ++k) {
      const auto x = tensor(r, step_name(k, "hidden_states"));  // (N, T, E)
      const int64_t T = x.size(1);
      const auto out = layer.step(
          x.to(device),
          padded ? (~keep.narrow(1, 0, P + T)).to(device) : torch::Tensor(),
          positions_of(r, step_name(k, "position_ids"), N, T, device));
      const auto rows = keep.narrow(1, P, T);  // (N, T)
      check.skipped_rows += (~rows).sum().item<int64_t>();
      compare(step_name(k, "output"), out, tensor(r, step_name(k, "output")),
              rows.reshape({N, T, 1}), check, worst);
      P += T;
    }
    note << ", " << N << " sequences, " << steps << " decoding steps (" << total
         << " tokens" << (padded ? ", key padding" : "") << ")";
  }
  if (check.skipped_rows > 0) {
    note << ", " << check.skipped_rows << " padding rows left out";
  }
  check.note = note.str();
}

/// The MLA or Gated DeltaNet layer of the reference's model directory, on
/// `device`, after `tamper_module`.
SequenceLayer sequence_layer(
    const RecordedReference& r, LayerKind kind, const torch::Device& device,
    const std::function<void(torch::nn::Module&)>& tamper_module,
    torch::ScalarType& dtype) {
  const auto dir = r.metadata.find("model_dir");
  TORCH_CHECK(dir != r.metadata.end(), r.path,
              ": __metadata__ lacks 'model_dir' (a Multi-head Latent "
              "Attention or Gated DeltaNet layer is read from its checkpoint)");
  const auto model_dir =
      (fs::path(r.path).parent_path() / dir->second).string();
  SequenceLayer layer;
  std::shared_ptr<torch::nn::Module> module;
  if (kind == LayerKind::kLatent) {
    auto m = hf::load_latent_attention(model_dir, layer_of(r));
    auto cache = std::make_shared<std::optional<LatentCache>>();
    layer.what = "Multi-head Latent Attention";
    layer.forward = [m](const torch::Tensor& x, const torch::Tensor& padding,
                        const torch::Tensor& positions) mutable {
      return m->forward(x, padding, /*is_causal=*/true, positions);
    };
    layer.start = [m, cache](int64_t N, int64_t total) mutable {
      cache->emplace(m->make_cache(N, total));
    };
    layer.step = [m, cache](const torch::Tensor& x,
                            const torch::Tensor& padding,
                            const torch::Tensor& positions) mutable {
      return m->forward_cached(x, **cache, /*is_causal=*/true, padding,
                               positions);
    };
    module = m.ptr();
  } else {
    auto m = hf::load_gated_delta_net(model_dir, layer_of(r));
    auto state = std::make_shared<GatedDeltaNetState>();
    layer.what = "Gated DeltaNet";
    layer.forward = [m](const torch::Tensor& x, const torch::Tensor& padding,
                        const torch::Tensor&) mutable {
      return m->forward(x, padding);
    };
    layer.start = [m, state](int64_t N, int64_t) mutable {
      *state = m->make_state(N);
    };
    layer.step = [m, state, path = r.path](const torch::Tensor& x,
                                           const torch::Tensor& padding,
                                           const torch::Tensor&) mutable {
      TORCH_CHECK(!padding.defined(), path,
                  ": Gated DeltaNet's decoding steps take no attention_mask "
                  "(transformers' recurrent state has no padding)");
      return m->forward_cached(x, *state);
    };
    module = m.ptr();
  }
  module->to(device);
  if (tamper_module) {
    torch::NoGradGuard no_grad;
    tamper_module(*module);
  }
  dtype = module->parameters().front().scalar_type();
  return layer;
}

}  // namespace

RecordedCheck check_reference(
    const std::string& path, const torch::Device& device,
    const std::function<void(MultiHeadAttentionImpl&)>& tamper,
    const std::function<void(torch::nn::Module&)>& tamper_module) {
  const RecordedReference r = read_reference(path);
  RecordedCheck check;
  check.name = fs::path(path).filename().string();
  const std::string config = config_of(r);
  const auto tolerance = [](torch::ScalarType dtype) {
    return (dtype == torch::kFloat32 || dtype == torch::kFloat64)
               ? Tolerance{1e-5, 1e-4}
               : tolerance_for(dtype);
  };
  const LayerKind kind = layer_kind(r, config);
  if (kind != LayerKind::kAttention) {
    auto dtype = torch::kFloat32;
    auto layer = sequence_layer(r, kind, device, tamper_module, dtype);
    check.tolerance = tolerance(dtype);
    torch::NoGradGuard no_grad;
    Worst worst;
    check_sequence(r, layer, device, check, worst);
    check.worst = worst.text;
    return check;
  }
  const bool causal = hf::causal_attention(config, stack_of(r));
  auto module = reference_module(r);
  module->to(device);
  if (tamper || tamper_module) {
    torch::NoGradGuard no_grad;
    if (tamper) {
      tamper(*module);
    }
    if (tamper_module) {
      tamper_module(*module);
    }
  }
  check.tolerance = tolerance(module->in_proj_bias.defined()
                                  ? module->in_proj_bias.scalar_type()
                                  : module->out_proj->weight.scalar_type());
  torch::NoGradGuard no_grad;
  Worst worst;
  if (r.tensors.contains("hidden_states")) {
    check_forward(r, module, causal, device, check, worst);
  } else {
    check_steps(r, module, causal, device, check, worst);
  }
  check.worst = worst.text;
  return check;
}

}  // namespace mha::parity
