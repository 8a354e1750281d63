// mha-parity: proves that mha::MultiHeadAttention equals
// torch::nn::MultiheadAttention (and a float64 reference) on this machine.
// Exit status: 0 all cases PASS or REF-DIFF, 1 some case FAILs, 2 bad usage.
#include <fmt/core.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "mha/parity.h"
#include "mha/plot.h"
#include "mha/version.h"
#include "tool_common.h"

namespace {

using mha::parity::Case;
using mha::parity::CaseResult;
using mha::parity::MaskKind;
using mha::parity::Status;

const std::map<std::string, torch::ScalarType> kDtypes = {
    {"float32", torch::kFloat32},
    {"float64", torch::kFloat64},
    {"float16", torch::kFloat16},
    {"bfloat16", torch::kBFloat16}};

const std::map<std::string, MaskKind> kMaskKinds = {
    {"none", MaskKind::kNone},
    {"bool", MaskKind::kBool},
    {"float", MaskKind::kFloat}};

std::string dtype_name(torch::ScalarType dtype) {
  for (const auto& [name, type] : kDtypes) {
    if (type == dtype) {
      return name;
    }
  }
  return "?";
}

/// "self/f32" → "self_f32": a file name from a case name.
std::string file_stem(const std::string& name) {
  std::string stem = name;
  for (auto& ch : stem) {
    const bool ok = std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' ||
                    ch == '+' || ch == '.' || ch == '=';
    ch = ok ? ch : '_';
  }
  return stem;
}

bool has_nan(const torch::Tensor& t) {
  return torch::isnan(t).any().item<bool>();
}

/// The attention weights of a case, in the terminal: mha's, the float64
/// reference's and torch::nn's (where it ran and gave numbers).
void print_weights(const CaseResult& r) {
  if (!r.weights.defined()) {
    fmt::print("\n{}: this case returns no weights (need_weights=false)\n",
               r.name);
    return;
  }
  const auto style = mha::plot::terminal_style_for(isatty(STDOUT_FILENO));
  auto show_one = [&](const char* who, const torch::Tensor& w) {
    if (!w.defined()) {
      fmt::print("\n{}: not computed\n", who);
    } else if (has_nan(w)) {
      fmt::print("\n{}: weights contain NaN (fully masked rows)\n", who);
    } else {
      mha::plot::HeatmapOptions options;
      options.title = fmt::format("{}, batch element 0, {}", r.name, who);
      fmt::print("\n{}", mha::plot::heatmap_text(w, style, options));
    }
  };
  show_one("mha", r.weights);
  show_one("float64 reference", r.float64_weights);
  show_one("torch::nn", r.torch_nn_weights);
}

/// DIR/<case>.svg with mha's weights; on REF-DIFF rows also
/// DIR/<case>.torch_nn.svg with torch::nn's, where they are numbers.
void plot_weights(const CaseResult& r, const std::string& dir) {
  if (!r.weights.defined()) {
    return;
  }
  const auto stem = (std::filesystem::path(dir) / file_stem(r.name)).string();
  mha::plot::HeatmapOptions options;
  options.title =
      fmt::format("{} ({}), batch element 0: mha", r.name, to_string(r.status));
  mha::plot::write_heatmap_svg(r.weights, stem + ".svg", options);
  if (r.status == Status::kRefDiff && r.torch_nn_weights.defined() &&
      !has_nan(r.torch_nn_weights)) {
    options.title =
        fmt::format("{} (REF-DIFF), batch element 0: torch::nn", r.name);
    mha::plot::write_heatmap_svg(r.torch_nn_weights, stem + ".torch_nn.svg",
                                 options);
  }
}

std::string format_error(const mha::parity::ReferenceResult& r) {
  if (!r.used) {
    return fmt::format("{:>19}", "-");
  }
  if (r.parts.empty()) {
    return fmt::format("{:>19}", "threw");
  }
  return fmt::format("{:>9.2e} {:>9.2e}", r.max_abs, r.max_rel);
}

nlohmann::json to_json(const mha::parity::ReferenceResult& r) {
  nlohmann::json j;
  j["used"] = r.used;
  if (!r.used) {
    return j;
  }
  j["max_abs"] = r.max_abs;
  j["max_rel"] = r.max_rel;
  j["within_tolerance"] = r.within;
  for (const auto& p : r.parts) {
    j["parts"].push_back({{"what", p.what},
                          {"max_abs", p.max_abs},
                          {"max_rel", p.max_rel},
                          {"within_tolerance", p.within}});
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "mha-parity: checks mha::MultiHeadAttention against "
      "torch::nn::MultiheadAttention and a float64 reference (outputs, "
      "weights, gradients). Exit 0: all PASS or REF-DIFF; 1: a FAIL; 2: bad "
      "usage."};
  std::string device_name = "cpu";
  std::string dtype_filter;
  uint64_t seed = 0;
  std::string filter;
  std::string json_path;
  bool list = false;
  app.add_option("--device", device_name, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype_filter,
                 "only this dtype: float32, float64, float16, bfloat16 "
                 "(half types need --device cuda)")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}));
  app.add_option("--seed", seed, "random seed of weights and inputs");
  app.add_option("--filter", filter, "only cases whose name matches (regex)");
  app.add_option("--json", json_path, "write every row and the environment");
  app.add_flag("--list", list, "list the case names and exit");
  std::string show, plot_dir;
  app.add_option("--show", show,
                 "run only this case (exact name, see --list) and print its "
                 "attention weights in the terminal");
  app.add_option("--plot", plot_dir,
                 "write an SVG heatmap of the weights of every case that has "
                 "them into this directory");
  bool plant_fault = false;  // for the tool's own tests: proves exit 1
  app.add_flag("--plant-fault", plant_fault,
               "corrupt one weight of mha's copy (a self-test: cases FAIL)")
      ->group("");

  Case custom;
  custom.name = "custom";
  std::string padding = "none", attn_mask = "none";
  auto* g = app.add_option_group("custom case",
                                 "any of these runs one custom case instead "
                                 "of the matrix");
  std::vector<CLI::Option*> custom_flags = {
      g->add_option("--batch", custom.batch, "N")->check(CLI::PositiveNumber),
      g->add_option("--tgt-len", custom.tgt_len, "L")
          ->check(CLI::PositiveNumber),
      g->add_option("--src-len", custom.src_len, "S")
          ->check(CLI::PositiveNumber),
      g->add_option("--embed-dim", custom.embed_dim, "E")
          ->check(CLI::PositiveNumber),
      g->add_option("--num-heads", custom.num_heads, "H")
          ->check(CLI::PositiveNumber),
      g->add_option("--kdim", custom.kdim, "key features")
          ->check(CLI::PositiveNumber),
      g->add_option("--vdim", custom.vdim, "value features")
          ->check(CLI::PositiveNumber),
      g->add_flag("--self", custom.self_attention, "self-attention"),
      g->add_flag("--causal", custom.is_causal, "is_causal"),
      g->add_option("--padding", padding, "key_padding_mask: none|bool|float")
          ->check(CLI::IsMember({"none", "bool", "float"})),
      g->add_option("--attn-mask", attn_mask, "attn_mask: none|bool|float")
          ->check(CLI::IsMember({"none", "bool", "float"})),
      g->add_flag("--attn-mask-3d", custom.attn_mask_3d,
                  "attn_mask as (N*H, L, S)"),
      g->add_flag("--no-bias", "projections without bias"),
      g->add_flag("--add-bias-kv", custom.add_bias_kv, "add_bias_kv"),
      g->add_flag("--add-zero-attn", custom.add_zero_attn, "add_zero_attn"),
      g->add_flag("--seq-first", "batch_first=false"),
      g->add_flag("--per-head", "average_attn_weights=false"),
      g->add_flag("--no-weights", "need_weights=false"),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage error exits 2 (CLI11's own codes vary).
    return app.exit(e) == 0 ? 0 : 2;
  }

  const bool use_custom =
      std::any_of(custom_flags.begin(), custom_flags.end(),
                  [](const CLI::Option* o) { return o->count() > 0; });
  custom.bias = app.count("--no-bias") == 0;
  custom.batch_first = app.count("--seq-first") == 0;
  custom.average_attn_weights = app.count("--per-head") == 0;
  custom.need_weights = app.count("--no-weights") == 0;
  custom.key_padding_mask = kMaskKinds.at(padding);
  custom.attn_mask = kMaskKinds.at(attn_mask);

  const bool cuda = device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    fmt::print(stderr,
               "mha-parity: --device cuda: CUDA is not available (LibTorch {} "
               "built without CUDA, or no GPU)\n",
               mha::torch_version());
    return 2;
  }
  std::vector<torch::ScalarType> dtypes;
  if (!dtype_filter.empty()) {
    dtypes = {kDtypes.at(dtype_filter)};
  } else {
    dtypes = {torch::kFloat32, torch::kFloat64};
    if (cuda) {
      dtypes.push_back(torch::kFloat16);
      dtypes.push_back(torch::kBFloat16);
    }
  }
  for (auto dtype : dtypes) {
    if (!cuda && (dtype == torch::kFloat16 || dtype == torch::kBFloat16)) {
      fmt::print(stderr, "mha-parity: --dtype {} needs --device cuda\n",
                 dtype_name(dtype));
      return 2;
    }
  }

  // The case list: the matrix, or one custom case per dtype. Each case's seed
  // is fixed by its place in the full list, so --filter reproduces a row.
  std::vector<Case> cases;
  if (use_custom) {
    if (custom.self_attention) {
      if (app.count("--src-len") > 0 || custom.kdim || custom.vdim) {
        fmt::print(stderr,
                   "mha-parity: --self uses the query as key and value: "
                   "--src-len, --kdim and --vdim do not apply\n");
        return 2;
      }
      custom.src_len = custom.tgt_len;
    }
    if (custom.embed_dim % custom.num_heads != 0) {
      fmt::print(stderr,
                 "mha-parity: --embed-dim {} must be divisible by --num-heads "
                 "{}\n",
                 custom.embed_dim, custom.num_heads);
      return 2;
    }
    for (auto dtype : dtypes) {
      Case c = custom;
      c.dtype = dtype;
      c.name = "custom/" + dtype_name(dtype);
      cases.push_back(c);
    }
  } else {
    for (const auto& base : mha::parity::default_cases()) {
      if (base.dtype != torch::kFloat32 && base.dtype != torch::kFloat64) {
        continue;
      }
      for (auto dtype : dtypes) {
        const bool half = dtype == torch::kFloat16 || dtype == torch::kBFloat16;
        if (base.dtype == dtype || (half && base.dtype == torch::kFloat32)) {
          Case c = base;
          c.dtype = dtype;
          if (half) {
            c.name = c.name.substr(0, c.name.rfind('/')) + "/" +
                     (dtype == torch::kFloat16 ? "f16" : "bf16");
          }
          cases.push_back(c);
        }
      }
    }
  }
  std::vector<uint64_t> seeds;
  for (size_t i = 0; i < cases.size(); ++i) {
    seeds.push_back(seed + i);
  }
  if (!filter.empty()) {
    std::regex re;
    try {
      re = std::regex(filter);
    } catch (const std::regex_error& e) {
      fmt::print(stderr, "mha-parity: --filter {}: invalid regex ({})\n",
                 filter, e.what());
      return 2;
    }
    std::vector<Case> kept;
    std::vector<uint64_t> kept_seeds;
    for (size_t i = 0; i < cases.size(); ++i) {
      if (std::regex_search(cases[i].name, re)) {
        kept.push_back(cases[i]);
        kept_seeds.push_back(seeds[i]);
      }
    }
    cases = kept;
    seeds = kept_seeds;
    if (cases.empty()) {
      fmt::print(stderr, "mha-parity: --filter {} matches no case\n", filter);
      return 2;
    }
  }
  if (!show.empty()) {
    std::vector<Case> kept;
    std::vector<uint64_t> kept_seeds;
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases[i].name == show) {
        kept.push_back(cases[i]);
        kept_seeds.push_back(seeds[i]);
      }
    }
    if (kept.empty()) {
      fmt::print(stderr, "mha-parity: --show {}: no such case (see --list)\n",
                 show);
      return 2;
    }
    cases = kept;
    seeds = kept_seeds;
  }
  if (!plot_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(plot_dir, ec);
    if (ec || !std::filesystem::is_directory(plot_dir)) {
      fmt::print(stderr,
                 "mha-parity: --plot {}: cannot create the directory ({})\n",
                 plot_dir, ec ? ec.message() : "not a directory");
      return 2;
    }
  }
  if (list) {
    for (const auto& c : cases) {
      fmt::print("{}\n", c.name);
    }
    return 0;
  }

  std::ofstream json_file;
  if (!json_path.empty()) {
    json_file.open(json_path);
    if (!json_file) {
      fmt::print(stderr, "mha-parity: --json {}: cannot write the file\n",
                 json_path);
      return 2;
    }
  }
  const torch::Device device(cuda ? torch::kCUDA : torch::kCPU);
  const auto blas = mha::tools::loaded_blas();
  fmt::print(
      "mha-parity: LibTorch {}, device {}, {} intra-op thread(s), "
      "seed {}\nBLAS: {}\nattention without weights: {}\n",
      mha::torch_version(), device_name, at::get_num_threads(), seed, blas,
      mha::has_fused_sdpa()
          ? "LibTorch's fused scaled_dot_product_attention"
          : "mha's explicit softmax path (no fused kernel before LibTorch "
            "2.5)");
  fmt::print(
      "Errors are max |mha - ref| and max |mha - ref| / (|ref| + atol) "
      "over output, weights and every gradient.\n"
      "PASS: within tolerance of torch::nn and of float64 (of float64 alone "
      "where torch::nn lacks the\noption: \"float64 only\"). REF-DIFF: "
      "torch::nn is known wrong here; mha matches float64.\n\n");
  fmt::print("{:<36} {:<13} {:>19} {:>19} {:>15} {:<8} {}\n", "", "",
             "vs torch::nn", "vs float64", "", "", "");
  fmt::print("{:<36} {:<13} {:>19} {:>19} {:>15} {:<8} {}\n", "case",
             "compared", "max abs   max rel", "max abs   max rel", "atol/rtol",
             "status", "note");

  std::map<Status, int> counts;
  std::map<std::string, double> worst;  // dtype → worst abs error
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    CaseResult r;
    try {
      Case run = c;
      if (plant_fault) {
        run.tamper = [](mha::MultiHeadAttentionImpl& m) {
          auto& w = m.out_proj->weight;
          w[0][0].add_(0.1);
        };
      }
      r = mha::parity::run_case(run, device, seeds[i]);
    } catch (const c10::Error& e) {
      r.name = c.name;
      r.status = Status::kFail;
      r.note = std::string("mha threw: ") + e.what_without_backtrace();
    }
    counts[r.status]++;
    auto& w = worst[dtype_name(c.dtype)];
    // torch::nn's errors count only where it is the reference (not REF-DIFF).
    w = std::max({w, r.status == Status::kPass ? r.torch_nn.max_abs : 0.0,
                  r.float64.used ? r.float64.max_abs : 0.0});
    fmt::print("{:<36} {:<13} {} {} {:>7.0e}/{:<7.0e} {:<8} {}\n", r.name,
               r.compared, format_error(r.torch_nn), format_error(r.float64),
               r.tolerance.atol, r.tolerance.rtol, to_string(r.status), r.note);
    rows.push_back({{"case", r.name},
                    {"dtype", dtype_name(c.dtype)},
                    {"status", to_string(r.status)},
                    {"compared", r.compared},
                    {"atol", r.tolerance.atol},
                    {"rtol", r.tolerance.rtol},
                    {"note", r.note},
                    {"torch_nn", to_json(r.torch_nn)},
                    {"float64", to_json(r.float64)}});
    try {
      if (!show.empty()) {
        print_weights(r);
      }
      if (!plot_dir.empty()) {
        plot_weights(r, plot_dir);
      }
    } catch (const c10::Error& e) {
      fmt::print(stderr, "mha-parity: {}\n", e.what_without_backtrace());
      return 2;
    }
  }
  fmt::print(
      "\n{} cases: {} PASS, {} REF-DIFF (known torch::nn difference, "
      "mha matches float64), {} FAIL\n",
      cases.size(), counts[Status::kPass], counts[Status::kRefDiff],
      counts[Status::kFail]);
  for (const auto& [dtype, err] : worst) {
    fmt::print("worst max abs error, {}: {:.2e}\n", dtype, err);
  }
  if (!json_path.empty()) {
    nlohmann::json doc;
    doc["environment"] = {{"libtorch", mha::torch_version()},
                          {"device", device_name},
                          {"blas", blas},
                          {"intra_op_threads", at::get_num_threads()},
                          {"seed", seed}};
    doc["cases"] = rows;
    doc["summary"] = {{"pass", counts[Status::kPass]},
                      {"ref_diff", counts[Status::kRefDiff]},
                      {"fail", counts[Status::kFail]}};
    json_file << doc.dump(2) << '\n';
  }
  return counts[Status::kFail] == 0 ? 0 : 1;
}
