// mha-bench's command line: the options, the checks that end in exit
// status 2, the settings every row shares, and the child process that
// measures one contender's peak memory (--memory fork).
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#include <fmt/core.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>

#include "bench/bench_tool.h"
#include "common/cli.h"

namespace mha::bench {

namespace {

const std::vector<Shape> kDefaultShapes = {{2, 128, 256, 4},
                                           {8, 256, 512, 8},
                                           {4, 1024, 512, 8},
                                           {1, 4096, 512, 8},
                                           {1, 8192, 256, 4}};
const std::vector<Shape> kQuickShapes = {{2, 16, 32, 4}, {1, 32, 16, 2}};

std::string self_executable() {
  std::vector<char> buffer(4096);
  const ssize_t n = readlink("/proc/self/exe", buffer.data(), buffer.size());
  if (n <= 0 || static_cast<size_t>(n) >= buffer.size()) {
    return "/proc/self/exe";
  }
  return std::string(buffer.data(), static_cast<size_t>(n));
}

}  // namespace

void add_options(CLI::App& app, Args& args) {
  std::vector<std::string> modes;  // every mode's name, in report order
  std::string mode_names;
  for (auto m : all_modes()) {
    modes.emplace_back(name(m));
    mode_names += std::string(mode_names.empty() ? "" : ", ") + name(m);
  }
  app.add_option("--json", args.json_path, "also write the report as JSON");
  app.add_flag("--quick", args.quick,
               "tiny sizes, 3 repetitions, 256^3 GEMM: seconds (for tests)");
  app.add_option("--config", args.config_texts,
                 "N,L,E,H (repeatable); default: 2,128,256,4 8,256,512,8 "
                 "4,1024,512,8 1,4096,512,8 1,8192,256,4");
  app.add_option("--mode", args.mode_texts,
                 "modes to run (repeatable or comma-separated): " + mode_names +
                     "; default: all")
      ->delimiter(',')
      ->check(CLI::IsMember(modes));
  app.add_option("--reps", args.reps,
                 "timed repetitions per contender; 0 (default): as many as "
                 "fit in --budget, 3 to 31")
      ->check(CLI::Range(0, 100000));
  app.add_option("--budget", args.budget_s,
                 "seconds of timed repetitions per row when --reps is 0")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", args.warmup,
                 "untimed runs per contender before timing, at least 1 (the "
                 "first measures peak memory and its results are compared)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--threads", args.threads,
                 "at::set_num_threads for both contenders (default 2)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--device", args.device_name, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", args.dtype_name,
                 "float32, float64, bfloat16 or float16")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16", "float16"}));
  app.add_option("--seed", args.seed, "random seed of weights and inputs");
  app.add_option("--gemm-size", args.gemm_size,
                 "n of the n^3 torch::mm that measures the GEMM ceiling")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  app.add_option("--memory", args.memory_name,
                 "peak memory: auto (clear_refs if writable, else fork), "
                 "clear_refs (in process) or fork (a child per measurement)")
      ->check(CLI::IsMember({"auto", "clear_refs", "fork"}));
  app.add_option("--variants", args.variant_texts,
                 "tables after the comparison (repeatable or "
                 "comma-separated): projections (torch::nn's projections "
                 "alone, timed with both contenders at L <= 256: the time "
                 "they share), window (causal cost with and without a "
                 "256-key sliding window, L = 1024..8192), generation "
                 "(mha-train's default char LM, 256 characters after a "
                 "256-character prompt, KV cache vs recomputation; and "
                 "batched-decode), batched-decode (B prompts of different "
                 "lengths through one left-padded KV cache vs one at a "
                 "time, tokens/s, outputs compared), flex (FlexAttention "
                 "calls against the built-in options, L = 1024..16384, "
                 "forward and forward+backward, peak memory; only when "
                 "named), linear (each attention_kind against the softmax "
                 "core, L = 1k..64k, time and peak memory, and decoding "
                 "ms/token: minutes; only when named), none; default: all "
                 "but flex and linear")
      ->delimiter(',')
      ->check(CLI::IsMember({"projections", "window", "generation",
                             "batched-decode", "flex", "linear", "none"}));
  app.add_option("--memory-child", args.memory_child_spec)->group("");
  app.add_flag("--plant-fault", args.plant_fault,
               "self-test: shift one bias of mha's and the SDPA contender's "
               "copies, leave batched decoding's padding mask out (checks "
               "FAIL)")
      ->group("");
}

std::optional<Plan> plan(const CLI::App& app, Args& args) {
  Plan plan;
  plan.shapes = args.quick ? kQuickShapes : kDefaultShapes;
  if (!args.config_texts.empty()) {
    plan.shapes.clear();
    for (const auto& text : args.config_texts) {
      std::string error;
      auto shape = parse_shape(text, error);
      if (!shape) {
        mha::tools::usage_error("mha-bench", error);
        return std::nullopt;
      }
      plan.shapes.push_back(*shape);
    }
  }
  for (auto m : all_modes()) {
    if (args.mode_texts.empty() ||
        std::find(args.mode_texts.begin(), args.mode_texts.end(), name(m)) !=
            args.mode_texts.end()) {
      plan.modes.push_back(m);
    }
  }
  args.gemm_size_given = app.count("--gemm-size") > 0;
  if (mha::tools::cuda_missing("mha-bench", args.device_name == "cuda")) {
    return std::nullopt;
  }
  if (args.dtype_name == "float16" && args.device_name == "cpu" &&
      !mha::tools::cpu_float16_matmul()) {
    mha::tools::usage_error(
        "mha-bench",
        "--dtype float16 on the CPU needs LibTorch 2.x: LibTorch " +
            std::string(TORCH_VERSION) +
            " has no float16 matrix product on the CPU, which torch::nn, "
            "the GEMM ceiling and the modules' projections use");
    return std::nullopt;
  }
  return plan;
}

std::optional<Settings> make_settings(const Args& args) {
  at::set_num_threads(args.threads);
  const bool cuda = args.device_name == "cuda";
  Settings settings;
  settings.device = torch::Device(cuda ? torch::kCUDA : torch::kCPU);
  settings.dtype = mha::tools::dtype_from_name(args.dtype_name);
  settings.warmup = args.warmup;
  settings.reps = args.quick && args.reps == 0 ? 3 : args.reps;
  settings.budget_s = args.budget_s;
  settings.seed = args.seed;
  settings.plant_fault = args.plant_fault;
  settings.child_command = {self_executable(),
                            "--device",
                            args.device_name,
                            "--dtype",
                            args.dtype_name,
                            "--threads",
                            std::to_string(args.threads),
                            "--seed",
                            std::to_string(args.seed)};
  if (cuda) {
    settings.memory = MemoryMethod::kNone;
  } else if (args.memory_name == "fork") {
    settings.memory = MemoryMethod::kFork;
  } else if (clear_refs_writable()) {
    settings.memory = MemoryMethod::kClearRefs;
  } else if (args.memory_name == "clear_refs") {
    mha::tools::usage_error(
        "mha-bench",
        "--memory clear_refs: /proc/self/clear_refs is not writable here "
        "(use --memory fork)");
    return std::nullopt;
  } else {
    settings.memory = MemoryMethod::kFork;
  }
  return settings;
}

int memory_child(const std::string& spec, const Settings& settings) {
  const auto first = spec.find(':');
  const auto second = spec.find(':', first + 1);
  std::string error;
  auto shape = parse_shape(spec.substr(0, first), error);
  auto mode = parse_mode(spec.substr(first + 1, second - first - 1));
  if (first == std::string::npos || second == std::string::npos || !shape ||
      !mode) {
    fmt::print(stderr, "mha-bench: --memory-child {}: bad spec {}\n", spec,
               error);
    return 2;
  }
  try {
    const auto kib =
        child_peak_kib(*shape, *mode, spec.substr(second + 1), settings);
    fmt::print("peak_kib {}\n", kib);
    return 0;
  } catch (const std::exception& e) {
    if (is_out_of_memory(e)) {
      return 3;
    }
    fmt::print(stderr, "mha-bench: --memory-child {}: {}\n", spec, e.what());
    return 1;
  }
}

}  // namespace mha::bench
