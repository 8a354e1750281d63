// mha-parity's command line: the options, the checks that end in exit
// status 2, and the case list (the default matrix or one custom case per
// dtype, then --filter and --show).
#include <fmt/core.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>

#include "common/cli.h"
#include "parity/parity_tool.h"

namespace mha::tools::parity {

namespace {

using mha::parity::Case;
using mha::parity::MaskKind;

constexpr const char* kTool = "mha-parity";

const std::map<std::string, MaskKind> kMaskKinds = {
    {"none", MaskKind::kNone},
    {"bool", MaskKind::kBool},
    {"float", MaskKind::kFloat}};

/// The dtypes to run: --dtype's, else float32 and float64 (and the half
/// types on CUDA). bfloat16 runs on the CPU too; float16 there where
/// LibTorch has a CPU float16 matmul (2.x). nullopt after a usage error.
std::optional<std::vector<torch::ScalarType>> select_dtypes(const Args& args,
                                                            bool cuda) {
  std::vector<torch::ScalarType> dtypes;
  if (!args.dtype_filter.empty()) {
    dtypes = {dtype_from_name(args.dtype_filter)};
  } else {
    dtypes = {torch::kFloat32, torch::kFloat64};
    if (cuda) {
      dtypes.push_back(torch::kFloat16);
      dtypes.push_back(torch::kBFloat16);
    }
  }
  for (auto dtype : dtypes) {
    if (!cuda && dtype == torch::kFloat16 &&
        !mha::tools::cpu_float16_matmul()) {
      usage_error(kTool,
                  fmt::format("--dtype float16 on the CPU needs LibTorch 2.x "
                              "(this is {}: no float16 matmul on the CPU); "
                              "use --device cuda or --dtype bfloat16",
                              TORCH_VERSION));
      return std::nullopt;
    }
  }
  return dtypes;
}

/// The custom case once per dtype; nullopt after a usage error.
std::optional<std::vector<Case>> custom_cases(
    const CLI::App& app, const Args& args,
    const std::vector<torch::ScalarType>& dtypes) {
  Case custom = args.custom;
  if (custom.self_attention) {
    if (app.count("--src-len") > 0 || custom.kdim || custom.vdim) {
      usage_error(kTool,
                  "--self uses the query as key and value: --src-len, --kdim "
                  "and --vdim do not apply");
      return std::nullopt;
    }
    custom.src_len = custom.tgt_len;
  }
  if (custom.embed_dim % custom.num_heads != 0) {
    usage_error(
        kTool, fmt::format("--embed-dim {} must be divisible by --num-heads {}",
                           custom.embed_dim, custom.num_heads));
    return std::nullopt;
  }
  std::vector<Case> cases;
  for (auto dtype : dtypes) {
    Case c = custom;
    c.dtype = dtype;
    c.name = "custom/" + dtype_name(dtype);
    cases.push_back(c);
  }
  return cases;
}

/// The default matrix in `dtypes`: its float32 cases also run as the half
/// types (renamed .../f16, .../bf16).
std::vector<Case> matrix_cases(const std::vector<torch::ScalarType>& dtypes) {
  std::vector<Case> cases;
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
  return cases;
}

/// Keeps the cases (and their seeds) for which `keep` holds.
template <class Keep>
void keep_cases(Plan& plan, Keep&& keep) {
  std::vector<Case> kept;
  std::vector<uint64_t> kept_seeds;
  for (size_t i = 0; i < plan.cases.size(); ++i) {
    if (keep(plan.cases[i])) {
      kept.push_back(plan.cases[i]);
      kept_seeds.push_back(plan.seeds[i]);
    }
  }
  plan.cases = kept;
  plan.seeds = kept_seeds;
}

/// --filter and --show; false after a usage error.
bool select_cases(Plan& plan, const Args& args) {
  if (!args.filter.empty()) {
    std::regex re;
    try {
      re = std::regex(args.filter);
    } catch (const std::regex_error& e) {
      usage_error(kTool, fmt::format("--filter {}: invalid regex ({})",
                                     args.filter, e.what()));
      return false;
    }
    keep_cases(plan,
               [&](const Case& c) { return std::regex_search(c.name, re); });
    if (plan.cases.empty()) {
      usage_error(kTool,
                  fmt::format("--filter {} matches no case", args.filter));
      return false;
    }
  }
  if (!args.show.empty()) {
    auto shown = plan;
    keep_cases(shown, [&](const Case& c) { return c.name == args.show; });
    if (shown.cases.empty()) {
      usage_error(kTool, fmt::format("--show {}: no such case (see --list)",
                                     args.show));
      return false;
    }
    plan = shown;
  }
  return true;
}

/// Creates --plot's directory; false after a usage error.
bool make_plot_dir(const std::string& dir) {
  if (dir.empty()) {
    return true;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    usage_error(kTool,
                fmt::format("--plot {}: cannot create the directory ({})", dir,
                            ec ? ec.message() : "not a directory"));
    return false;
  }
  return true;
}

}  // namespace

void add_options(CLI::App& app, Args& args) {
  app.add_option("--device", args.device_name, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", args.dtype_filter,
                 "only this dtype: float32, float64, float16, bfloat16 "
                 "(the half types: bounded by 2x the error of the same "
                 "computation in that dtype; float16 on the CPU needs "
                 "LibTorch 2.x)")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}));
  app.add_option("--seed", args.seed, "random seed of weights and inputs");
  app.add_option("--filter", args.filter,
                 "only cases whose name matches (regex)");
  app.add_option("--json", args.json_path,
                 "write every row and the environment");
  app.add_flag("--list", args.list, "list the case names and exit");
  app.add_option("--show", args.show,
                 "run only this case (exact name, see --list) and print its "
                 "attention weights in the terminal");
  app.add_option("--plot", args.plot_dir,
                 "write an SVG heatmap of the weights of every case that has "
                 "them into this directory");
  app.add_option("--reference", args.references,
                 "check mha against recorded outputs of a Python model "
                 "instead of the matrix (a file of "
                 "scripts/record_reference.py; repeatable)")
      ->check(CLI::ExistingFile);
  // For the tool's own tests: proves exit 1.
  app.add_flag("--plant-fault", args.plant_fault,
               "corrupt one weight of mha's copy (a self-test: cases FAIL)")
      ->group("");

  auto& custom = args.custom;
  custom.name = "custom";
  auto* g = app.add_option_group("custom case",
                                 "any of these runs one custom case instead "
                                 "of the matrix");
  args.custom_flags = {
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
      g->add_option("--padding", args.padding,
                    "key_padding_mask: none|bool|float")
          ->check(CLI::IsMember({"none", "bool", "float"})),
      g->add_option("--attn-mask", args.attn_mask, "attn_mask: none|bool|float")
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
}

void read_custom_case(const CLI::App& app, Args& args) {
  args.use_custom =
      std::any_of(args.custom_flags.begin(), args.custom_flags.end(),
                  [](const CLI::Option* o) { return o->count() > 0; });
  auto& custom = args.custom;
  custom.bias = app.count("--no-bias") == 0;
  custom.batch_first = app.count("--seq-first") == 0;
  custom.average_attn_weights = app.count("--per-head") == 0;
  custom.need_weights = app.count("--no-weights") == 0;
  custom.key_padding_mask = kMaskKinds.at(args.padding);
  custom.attn_mask = kMaskKinds.at(args.attn_mask);
}

std::optional<Plan> plan(const CLI::App& app, const Args& args) {
  const bool cuda = args.device_name == "cuda";
  if (cuda_missing(kTool, cuda)) {
    return std::nullopt;
  }
  const auto dtypes = select_dtypes(args, cuda);
  if (!dtypes) {
    return std::nullopt;
  }
  Plan plan;
  plan.device = torch::Device(cuda ? torch::kCUDA : torch::kCPU);
  if (args.use_custom) {
    auto cases = custom_cases(app, args, *dtypes);
    if (!cases) {
      return std::nullopt;
    }
    plan.cases = *cases;
  } else {
    plan.cases = matrix_cases(*dtypes);
  }
  for (size_t i = 0; i < plan.cases.size(); ++i) {
    plan.seeds.push_back(args.seed + i);
  }
  if (!select_cases(plan, args) || !make_plot_dir(args.plot_dir)) {
    return std::nullopt;
  }
  return plan;
}

int run_references(const CLI::App& app, const Args& args) {
  if (args.use_custom || !args.filter.empty() || !args.show.empty() ||
      !args.plot_dir.empty() || !args.dtype_filter.empty() ||
      app.count("--seed") > 0) {
    return usage_error(kTool,
                       "--reference runs the recorded inputs as they are: "
                       "custom-case flags, --filter, --show, --plot, --dtype "
                       "and --seed do not apply");
  }
  const bool cuda = args.device_name == "cuda";
  if (cuda_missing(kTool, cuda)) {
    return 2;
  }
  const torch::Device device(cuda ? torch::kCUDA : torch::kCPU);
  std::ofstream json_file;
  if (!args.json_path.empty()) {
    json_file.open(args.json_path);
    if (!json_file.is_open()) {
      return usage_error(kTool, fmt::format("--json {}: cannot open for "
                                            "writing",
                                            args.json_path));
    }
  }
  fmt::print(
      "mha-parity --reference: mha (via mha::hf) against outputs "
      "recorded from Python, on {}\n",
      args.device_name);
  fmt::print("{:<34} {:<16} {:>10} {:>10}  {:<18} {}\n", "reference",
             "compared", "max abs", "max rel", "tolerance", "status");
  nlohmann::json rows = nlohmann::json::array();
  int failures = 0;
  for (const auto& path : args.references) {
    nlohmann::json row = {{"file", path}};
    try {
      std::function<void(torch::nn::Module&)> tamper;
      if (args.plant_fault) {
        // The output projection: out_proj (MultiHeadAttention, Gated
        // DeltaNet) or o_proj (Multi-head Latent Attention).
        tamper = [](torch::nn::Module& m) {
          auto params = m.named_parameters(/*recurse=*/true);
          auto* w = params.find("out_proj.weight");
          w = w != nullptr ? w : params.find("o_proj.weight");
          TORCH_CHECK(w != nullptr,
                      "--plant-fault: the module has no "
                      "out_proj.weight or o_proj.weight");
          w->index_put_({0, 0}, (*w)[0][0] + 0.1);
        };
      }
      const auto r = mha::parity::check_reference(path, device, {}, tamper);
      double max_abs = 0.0;
      double max_rel = 0.0;
      std::string compared;
      for (const auto& part : r.parts) {
        max_abs = std::max(max_abs, part.max_abs);
        max_rel = std::max(max_rel, part.max_rel);
        // Cached steps: "step2.output" counts as "output" here (the note
        // says how many steps ran).
        const auto dot = part.what.find('.');
        const std::string kind =
            part.what.rfind("step", 0) == 0 && dot != std::string::npos
                ? part.what.substr(dot + 1)
                : part.what;
        if (("+" + compared + "+").find("+" + kind + "+") ==
            std::string::npos) {
          compared += (compared.empty() ? "" : "+") + kind;
        }
      }
      const std::string tolerance =
          fmt::format("{:.0e}+{:.0e}|ref|", r.tolerance.atol, r.tolerance.rtol);
      fmt::print("{:<34} {:<16} {:>10.3e} {:>10.3e}  {:<18} {}\n", path,
                 compared, max_abs, max_rel, tolerance,
                 r.within ? "PASS" : "FAIL");
      fmt::print("  worst {}; {}\n", r.worst, r.note);
      failures += r.within ? 0 : 1;
      row.update({{"status", r.within ? "PASS" : "FAIL"},
                  {"max_abs", max_abs},
                  {"max_rel", max_rel},
                  {"atol", r.tolerance.atol},
                  {"rtol", r.tolerance.rtol},
                  {"worst", r.worst},
                  {"note", r.note}});
    } catch (const c10::Error& e) {
      fmt::print("{:<34} {:<16} {:>10} {:>10}  {:<18} FAIL\n  {}\n", path, "-",
                 "-", "-", "-", e.what_without_backtrace());
      failures += 1;
      row.update({{"status", "FAIL"}, {"error", e.what_without_backtrace()}});
    }
    rows.push_back(row);
  }
  fmt::print("{} of {} references pass\n", args.references.size() - failures,
             args.references.size());
  if (json_file.is_open()) {
    json_file << nlohmann::json{{"references", rows},
                                {"summary", {{"fail", failures}}}}
                     .dump(2)
              << '\n';
  }
  return failures == 0 ? 0 : 1;
}

mha::parity::CaseResult run_one(const Case& c, const torch::Device& device,
                                uint64_t seed, bool plant_fault) {
  mha::parity::CaseResult r;
  try {
    Case run = c;
    if (plant_fault) {
      run.tamper = [](mha::MultiHeadAttentionImpl& m) {
        auto& w = m.out_proj->weight;
        w[0][0].add_(0.1);
      };
    }
    r = mha::parity::run_case(run, device, seed);
  } catch (const c10::Error& e) {
    r.name = c.name;
    r.status = mha::parity::Status::kFail;
    r.note = std::string("mha threw: ") + e.what_without_backtrace();
  }
  return r;
}

}  // namespace mha::tools::parity
