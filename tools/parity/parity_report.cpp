// mha-parity's report: the environment lines, one aligned row per case, the
// summary, the weights of a case in the terminal (--show) or as SVG
// heatmaps (--plot), and the --json document.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "common/cli.h"
#include "core/attention_core.h"  // kBlockedFirstScores
#include "mha/plot.h"
#include "mha/version.h"
#include "parity/parity_tool.h"

namespace mha::tools::parity {

namespace {

using mha::parity::CaseResult;
using mha::parity::Status;

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

int Tally::count(Status status) const {
  const auto it = counts.find(status);
  return it == counts.end() ? 0 : it->second;
}

void print_header(const Args& args, const std::string& blas) {
  // As choose_path (src/core/attention_core.cpp) decides for float32 and
  // float64.
  static_assert(mha::detail::kBlockedFirstScores == int64_t{1} << 20 &&
                    mha::detail::kBlockedLargeScores == int64_t{1} << 25,
                "the text below names the limits");
  const bool cpu = args.device_name == "cpu";
  const char* without_weights =
      mha::has_fused_sdpa()
          ? (cpu ? "mha's blocked path up to 2^20 and from 2^25 scores "
                   "(N*H*L*S), LibTorch's fused scaled_dot_product_attention "
                   "between"
                 : "LibTorch's fused scaled_dot_product_attention")
          : (cpu ? "mha's blocked path (no fused kernel before LibTorch 2.5)"
                 : "mha's explicit softmax path (no fused kernel before "
                   "LibTorch 2.5)");
  fmt::print(
      "mha-parity: LibTorch {}, device {}, {} intra-op thread(s), "
      "seed {}\nBLAS: {}\nattention without weights: {}\n",
      mha::torch_version(), args.device_name, at::get_num_threads(), args.seed,
      blas, without_weights);
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
}

void report_row(const CaseResult& r, torch::ScalarType dtype, Tally& tally) {
  tally.counts[r.status]++;
  auto& w = tally.worst[dtype_name(dtype)];
  // torch::nn's errors count only where it is the reference (not REF-DIFF).
  w = std::max({w, r.status == Status::kPass ? r.torch_nn.max_abs : 0.0,
                r.float64.used ? r.float64.max_abs : 0.0});
  fmt::print("{:<36} {:<13} {} {} {:>7.0e}/{:<7.0e} {:<8} {}\n", r.name,
             r.compared, format_error(r.torch_nn), format_error(r.float64),
             r.tolerance.atol, r.tolerance.rtol, to_string(r.status), r.note);
  tally.rows.push_back({{"case", r.name},
                        {"dtype", dtype_name(dtype)},
                        {"status", to_string(r.status)},
                        {"compared", r.compared},
                        {"atol", r.tolerance.atol},
                        {"rtol", r.tolerance.rtol},
                        {"note", r.note},
                        {"torch_nn", to_json(r.torch_nn)},
                        {"float64", to_json(r.float64)}});
}

bool show_and_plot(const CaseResult& r, const Args& args) {
  try {
    if (!args.show.empty()) {
      print_weights(r);
    }
    if (!args.plot_dir.empty()) {
      plot_weights(r, args.plot_dir);
    }
  } catch (const c10::Error& e) {
    fmt::print(stderr, "mha-parity: {}\n", e.what_without_backtrace());
    return false;
  }
  return true;
}

void print_summary(const Tally& tally, size_t num_cases) {
  fmt::print(
      "\n{} cases: {} PASS, {} REF-DIFF (known torch::nn difference, "
      "mha matches float64), {} FAIL\n",
      num_cases, tally.count(Status::kPass), tally.count(Status::kRefDiff),
      tally.count(Status::kFail));
  for (const auto& [dtype, err] : tally.worst) {
    fmt::print("worst max abs error, {}: {:.2e}\n", dtype, err);
  }
}

nlohmann::json json_report(const Args& args, const std::string& blas,
                           const Tally& tally) {
  nlohmann::json doc;
  doc["environment"] = {{"libtorch", mha::torch_version()},
                        {"device", args.device_name},
                        {"blas", blas},
                        {"intra_op_threads", at::get_num_threads()},
                        {"seed", args.seed}};
  doc["cases"] = tally.rows;
  doc["summary"] = {{"pass", tally.count(Status::kPass)},
                    {"ref_diff", tally.count(Status::kRefDiff)},
                    {"fail", tally.count(Status::kFail)}};
  return doc;
}

}  // namespace mha::tools::parity
