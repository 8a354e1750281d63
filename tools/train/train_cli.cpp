// mha-train's command line: the options, the defaults that depend on the
// task, the checks that give one line on stderr and exit status 2, and the
// launcher that --nproc turns this process into.
#include <fmt/core.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "common/cli.h"
#include "common/tool_common.h"
#include "train/launch.h"
#include "train/train_tool.h"

namespace mha::train_tool {

namespace {

namespace train = mha::train;
namespace dist = mha::distributed;

/// Settings whose defaults depend on the task; unset ones take the task's.
struct TaskDefaults {
  int64_t steps, batch_size, warmup, d_model, heads, layers, ff;
  double lr, min_lr, weight_decay, dropout;
};

// Digit tasks: a 2-layer, 64-wide encoder. Character LM: 3 blocks, 96 wide,
// context 64. Both sized to reach their targets in 1-3 minutes on 2 cores.
constexpr TaskDefaults kDigitDefaults = {
    /*steps=*/800,
    /*batch_size=*/64,
    /*warmup=*/100,
    /*d_model=*/64,
    /*heads=*/4,
    /*layers=*/2,
    /*ff=*/256,
    /*lr=*/2e-3,
    /*min_lr=*/1e-4,
    /*weight_decay=*/0.01,
    /*dropout=*/0.0,
};
constexpr TaskDefaults kCharDefaults = {
    /*steps=*/800,
    /*batch_size=*/32,
    /*warmup=*/100,
    /*d_model=*/96,
    /*heads=*/4,
    /*layers=*/3,
    /*ff=*/0,  // unused: the GPT block's MLP is 4 x d_model
    /*lr=*/3e-3,
    /*min_lr=*/1e-4,
    /*weight_decay=*/0.1,
    /*dropout=*/0.1,
};

// Addition: a 2 + 2-layer, 64-wide encoder-decoder (measured: see
// docs/training.md).
constexpr TaskDefaults kAddDefaults = {
    /*steps=*/1000,
    /*batch_size=*/64,
    /*warmup=*/100,
    /*d_model=*/64,
    /*heads=*/4,
    /*layers=*/2,
    /*ff=*/256,
    /*lr=*/2e-3,
    /*min_lr=*/1e-4,
    /*weight_decay=*/0.01,
    /*dropout=*/0.0,
};

constexpr const char* kDefaultText = "/usr/share/common-licenses/GPL-3";

/// Set in the environment of the workers that --nproc starts.
constexpr const char* kWorkerMarker = "MHA_TRAIN_NPROC_WORKER";

/// One line on stderr; `exit_status` 2; nullopt (for configure's returns).
std::nullopt_t usage_error(int& exit_status, const std::string& message) {
  exit_status = mha::tools::usage_error(kTool, message);
  return std::nullopt;
}

void add_training_options(CLI::App& app, Args& a) {
  app.add_option("--steps", a.steps, "optimisation steps [800 / 1000 / 800]");
  app.add_option("--batch-size", a.batch_size,
                 "sequences per step [64 / 64 / 32]");
  app.add_option("--lr", a.lr, "peak learning rate [2e-3 / 2e-3 / 3e-3]");
  app.add_option("--min-lr", a.min_lr, "final learning rate [1e-4]");
  app.add_option("--warmup", a.warmup,
                 "linear warmup steps [100, at most steps / 5]");
  app.add_option("--weight-decay", a.weight_decay,
                 "AdamW weight decay on matrices [0.01 / 0.01 / 0.1]");
  app.add_option("--grad-clip", a.grad_clip,
                 "clip the gradient norm to this, 0 = off")
      ->capture_default_str();
}

void add_model_options(CLI::App& app, Args& a) {
  app.add_option("--d-model", a.d_model, "model width [64 / 64 / 96]");
  app.add_option("--heads", a.heads, "attention heads [4]");
  app.add_option("--layers", a.layers,
                 "encoder layers / encoder and decoder layers each / blocks "
                 "[2 / 2 / 3]");
  app.add_option("--ff", a.ff,
                 "feed-forward width of the digit and add models [256] "
                 "(charlm: 4 x d-model)");
  app.add_option("--dropout", a.dropout, "dropout [0 / 0 / 0.1]");
  app.add_option("--attention", a.attention,
                 "reverse, sort, charlm: the attention_kind: softmax, linear "
                 "(elu + 1), performer (FAVOR+) or linformer (reverse and "
                 "sort only: non-causal)")
      ->check(CLI::IsMember({"softmax", "linear", "performer", "linformer"}))
      ->capture_default_str();
  app.add_option("--projected-length", a.projected_length,
                 "--attention linformer: k, the rows keys and values are "
                 "projected to [--max-len / 2]");
  app.add_option("--min-len", a.min_len, "shortest digit sequence")
      ->capture_default_str();
  app.add_option("--max-len", a.max_len, "longest digit sequence")
      ->capture_default_str();
  app.add_option("--eval-sequences", a.eval_sequences,
                 "held-out sequences (add: additions) for the final accuracy")
      ->capture_default_str();
  app.add_option("--digits", a.digits,
                 "add: each operand has 1 to this many digits (at most 18)")
      ->capture_default_str();
}

void add_charlm_options(CLI::App& app, Args& a) {
  a.text_path = kDefaultText;
  app.add_option("--text", a.text_path, "charlm: training text file")
      ->capture_default_str();
  app.add_option("--context", a.context, "charlm: context length T")
      ->capture_default_str();
  app.add_option("--val-fraction", a.val_fraction,
                 "charlm: the end of the text held out for validation")
      ->capture_default_str();
  app.add_option("--sample-len", a.sample_len,
                 "charlm: characters to generate at the end")
      ->capture_default_str();
  app.add_option("--temperature", a.temperature, "charlm: sampling temperature")
      ->capture_default_str();
  app.add_option("--top-k", a.top_k,
                 "charlm: sample among the k likeliest, 0 = all")
      ->capture_default_str();
  app.add_option("--positions", a.positions,
                 "charlm: rotary (RoPE, a sliding window of --context "
                 "positions, any length) or learned (nanoGPT's wpe)")
      ->check(CLI::IsMember({"rotary", "learned"}))
      ->capture_default_str();
  app.add_flag("--packed", a.packed,
               "charlm: train on documents of random lengths packed into "
               "rows of --context characters (a causal document mask, "
               "positions restarting per document), and compare with "
               "padding them at the end");
  app.add_flag("--padded", a.padded,
               "charlm: train on the same documents one per row, padded to "
               "the longest (the padding masked), and compare with packing");
  app.add_option("--doc-min-len", a.doc_min_len,
                 "charlm --packed/--padded: shortest document drawn [--context "
                 "/ 8]");
  app.add_option("--doc-max-len", a.doc_max_len,
                 "charlm --packed/--padded: longest document [--context]");
  app.add_option("--doc-block", a.doc_block,
                 "charlm --packed: queries and keys per block of the "
                 "document mask")
      ->capture_default_str();
  app.add_option("--compare-batches", a.compare_batches,
                 "charlm --packed/--padded: batches timed packed and padded "
                 "at the end, 0 = none")
      ->capture_default_str();
  app.add_flag("--no-kv-cache", a.no_kv_cache,
               "charlm: sample by recomputing the context every step");
  app.add_option("--prompt", a.prompt,
                 "charlm: text the sample continues (default: the first "
                 "validation character)");
  app.add_option("--plot-attention", a.plot_dir,
                 "charlm: write DIR/layer<l>.svg at the end, the attention "
                 "maps of every head over a validation sample");
  app.add_option("--plot-length", a.plot_length,
                 "charlm: characters of that sample [48, at most --context]");
}

void add_run_options(CLI::App& app, Args& a) {
  a.threads = std::min(2, mha::tools::usable_cpus());  // see PERF-NOTES
  app.add_option("--seed", a.seed, "seed of weights, data and dropout")
      ->capture_default_str();
  app.add_option("--device", a.device_name, "cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--threads", a.threads, "CPU threads of LibTorch and OpenBLAS")
      ->capture_default_str();
  app.add_option("--out", a.out_dir,
                 "directory of checkpoints, loss.csv and loss.svg "
                 "[mha-train-<task>]");
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "checkpoint every N steps, and at the end [steps / 4]");
  app.add_option("--eval-every", a.eval_every,
                 "validate every N steps, and at the end [steps / 10]");
  app.add_flag("--resume", a.resume,
               "continue from the checkpoint in --out (same settings)");
  app.add_option("--stop-at", a.stop_at,
                 "stop after this step as if interrupted (the schedule still "
                 "spans --steps); for --resume tests")
      ->capture_default_str();
  app.add_flag("--quiet", a.quiet, "no progress lines");
}

void add_parallel_options(CLI::App& app, Args& a) {
  app.add_option("--nproc", a.nproc,
                 "train data-parallel in this many processes on this machine "
                 "(each takes a shard of every batch; --threads is split "
                 "among them unless given). Across machines, start one "
                 "process per rank with RANK, WORLD_SIZE, MASTER_ADDR and "
                 "MASTER_PORT set instead")
      ->capture_default_str();
  app.add_option("--backend", a.backend_name,
                 "c10d backend of a data-parallel run: gloo or nccl [gloo on "
                 "cpu, nccl on cuda]")
      ->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--timeout", a.timeout_s,
                 "seconds a data-parallel rank waits for the others (joining, "
                 "every collective) before it gives up with an error")
      ->capture_default_str();
  app.add_option(
      "--interface", a.interface,
      "network interface Gloo binds (e.g. eth0) [GLOO_SOCKET_IFNAME, "
      "else 127.0.0.1 when MASTER_ADDR is loopback, else the host "
      "name's address]");
}

/// The settings: the task's defaults, overridden by what was given.
Config settings(const Args& a) {
  Config c;
  c.charlm = a.task_name == "charlm";
  c.addition = a.task_name == "add";
  const TaskDefaults& d =
      c.charlm ? kCharDefaults : (c.addition ? kAddDefaults : kDigitDefaults);
  const int64_t n_steps = a.steps.value_or(d.steps);
  c.options.steps(n_steps)
      .lr(a.lr.value_or(d.lr))
      .min_lr(a.min_lr.value_or(d.min_lr))
      .warmup_steps(a.warmup.value_or(std::min(d.warmup, n_steps / 5)))
      .weight_decay(a.weight_decay.value_or(d.weight_decay))
      .grad_clip(a.grad_clip)
      .eval_every(a.eval_every.value_or(std::max<int64_t>(1, n_steps / 10)))
      .checkpoint_every(
          a.checkpoint_every.value_or(std::max<int64_t>(1, n_steps / 4)))
      .out_dir(a.out_dir.empty() ? "mha-train-" + a.task_name : a.out_dir)
      .resume(a.resume)
      .stop_at(a.stop_at);
  c.batch = a.batch_size.value_or(d.batch_size);
  c.plot_length = a.plot_length.value_or(std::min<int64_t>(48, a.context));
  c.d_model = a.d_model.value_or(d.d_model);
  c.heads = a.heads.value_or(d.heads);
  c.layers = a.layers.value_or(d.layers);
  c.ff = a.ff.value_or(d.ff);
  c.dropout = a.dropout.value_or(d.dropout);
  return c;
}

/// The checks of one process's own settings; an error message or "".
std::string check_settings(const Args& a, const Config& c) {
  const int64_t n_steps = c.options.steps();
  if (n_steps < 1) {
    return fmt::format("--steps must be >= 1, got {}", n_steps);
  }
  if (c.batch < 1) {
    return fmt::format("--batch-size must be >= 1, got {}", c.batch);
  }
  if (a.threads < 1) {
    return fmt::format("--threads must be >= 1, got {}", a.threads);
  }
  if (c.charlm && (a.sample_len < 0 || a.temperature <= 0.0 || a.top_k < 0)) {
    return fmt::format(
        "need --sample-len >= 0, --temperature > 0 and --top-k >= 0, got {}, "
        "{:g} and {}",
        a.sample_len, a.temperature, a.top_k);
  }
  if (a.attention != "softmax" && c.addition) {
    return "--attention applies to --task reverse, sort and charlm";
  }
  if (a.attention == "linformer" && c.charlm) {
    return "--attention linformer cannot be causal: use softmax, linear or "
           "performer with --task charlm";
  }
  if (a.projected_length != 0 &&
      (a.attention != "linformer" || a.projected_length < 0)) {
    return fmt::format(
        "--projected-length needs --attention linformer and must be >= 1, "
        "got {}",
        a.projected_length);
  }
  if (!a.plot_dir.empty() &&
      (a.attention == "linear" || a.attention == "performer")) {
    return fmt::format(
        "--plot-attention: --attention {} never forms the attention maps",
        a.attention);
  }
  if (!c.charlm && (!a.plot_dir.empty() || a.plot_length)) {
    return "--plot-attention and --plot-length apply to --task charlm only";
  }
  if (c.charlm && (c.plot_length < 1 || c.plot_length > a.context)) {
    return fmt::format("--plot-length must be in [1, --context = {}], got {}",
                       a.context, c.plot_length);
  }
  if (!a.plot_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(a.plot_dir, error);
    if (error || access(a.plot_dir.c_str(), W_OK) != 0) {
      return fmt::format("--plot-attention: cannot write to directory '{}'{}",
                         a.plot_dir, error ? ": " + error.message() : "");
    }
  }
  const bool documents = a.packed || a.padded;
  if (!c.charlm && (documents || a.doc_min_len || a.doc_max_len)) {
    return "--packed, --padded, --doc-min-len and --doc-max-len apply to "
           "--task charlm only";
  }
  if (a.packed && a.padded) {
    return "--packed and --padded exclude each other";
  }
  if (a.packed && a.attention != "softmax") {
    return fmt::format(
        "--packed needs --attention softmax (its document mask is a block "
        "mask of the scores, which --attention {} never forms); --padded "
        "works with every kind",
        a.attention);
  }
  if ((a.doc_min_len || a.doc_max_len) && !documents) {
    return "--doc-min-len and --doc-max-len need --packed or --padded";
  }
  if (documents) {
    const int64_t min_len =
        a.doc_min_len.value_or(std::max<int64_t>(1, a.context / 8));
    const int64_t max_len = a.doc_max_len.value_or(a.context);
    if (!(1 <= min_len && min_len <= max_len && max_len <= a.context)) {
      return fmt::format(
          "document lengths must satisfy 1 <= --doc-min-len <= --doc-max-len "
          "<= --context = {}, got {} and {}",
          a.context, min_len, max_len);
    }
  }
  if (a.doc_block < 1) {
    return fmt::format("--doc-block must be >= 1, got {}", a.doc_block);
  }
  if (a.compare_batches < 0) {
    return fmt::format("--compare-batches must be >= 0, got {}",
                       a.compare_batches);
  }
  if (c.addition && (a.digits < 1 || a.digits > 18)) {
    return fmt::format("--digits must be in [1, 18], got {}", a.digits);
  }
  if (!c.charlm && a.eval_sequences < 1) {
    return fmt::format("--eval-sequences must be >= 1, got {}",
                       a.eval_sequences);
  }
  if (a.stop_at < 0) {
    return fmt::format("--stop-at must be >= 0, got {}", a.stop_at);
  }
  return "";
}

/// The checks of a data-parallel run (`c.job` set); an error message or "".
std::string check_data_parallel(const Args& a, Config& c, bool spawned_worker) {
  if (a.nproc < 1) {
    return fmt::format("--nproc must be >= 1, got {}", a.nproc);
  }
  if (a.nproc > 1 && c.job && !spawned_worker) {
    return "--nproc starts its own workers; with RANK and WORLD_SIZE set, "
           "start one process per rank without --nproc";
  }
  if (!(a.timeout_s > 0.0 && a.timeout_s <= 1e7)) {
    return fmt::format("--timeout must be > 0 and <= 1e7 seconds, got {:g}",
                       a.timeout_s);
  }
  c.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000.0));
  const bool data_parallel = a.nproc > 1 || c.job.has_value();
  if (data_parallel && !dist::available()) {
    return "data-parallel training is not available: this build of mha has "
           "no c10d/Gloo support (install libgloo-dev and rebuild)";
  }
  if (data_parallel && c.batch < (c.job ? c.job->world_size : a.nproc)) {
    return fmt::format(
        "--batch-size ({}) must be >= the number of processes ({})", c.batch,
        c.job ? c.job->world_size : a.nproc);
  }
  const bool cuda = a.device_name == "cuda";
  c.backend = dist::parse_backend(
      a.backend_name.empty() ? (cuda ? "nccl" : "gloo") : a.backend_name);
  if (data_parallel && c.backend == dist::Backend::kGloo && cuda) {
    return "--backend gloo exchanges CPU tensors: use it with --device cpu, "
           "or --backend nccl with --device cuda";
  }
  if (data_parallel && c.backend == dist::Backend::kNccl &&
      (!cuda || !dist::nccl_available())) {
    return !cuda ? "--backend nccl needs --device cuda"
                 : "--backend nccl: this build of mha has no NCCL support; "
                   "use --backend gloo";
  }
  return "";
}

/// The device, the text file and the checkpoint to resume; an error
/// message or "".
std::string check_inputs(const Args& a, Config& c) {
  c.rank = c.job ? c.job->rank : 0;
  if (a.device_name == "cuda") {
    if (!torch::cuda::is_available()) {
      return "--device cuda: CUDA is not available";
    }
    c.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                               c.job ? c.job->local_rank : 0));
  }
  if (c.charlm) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(a.text_path, error)) {
      return fmt::format("--text: no such file: '{}'", a.text_path);
    }
  }
  const train::RunFiles files(c.options.out_dir());
  if (a.resume && c.rank == 0) {
    train::recover_checkpoint(files);  // finish a swap a crash interrupted
  }
  if (a.resume && c.rank == 0 && !std::filesystem::exists(files.trainer)) {
    return fmt::format(
        "--resume: no checkpoint in '{}' (run without --resume first)",
        files.checkpoint_dir);
  }
  return "";
}

}  // namespace

void add_options(CLI::App& app, Args& args) {
  app.add_option("--task", args.task_name, "reverse, sort, add or charlm")
      ->check(CLI::IsMember({"reverse", "sort", "add", "charlm"}));
  add_training_options(app, args);
  add_model_options(app, args);
  add_charlm_options(app, args);
  add_run_options(app, args);
  add_parallel_options(app, args);
}

std::optional<Config> configure(const Args& args, int& exit_status) {
  Config config = settings(args);
  if (auto error = check_settings(args, config); !error.empty()) {
    return usage_error(exit_status, error);
  }
  // Data-parallel settings: this process is a launcher (--nproc > 1), a
  // worker of a job (RANK and WORLD_SIZE set), or alone.
  try {
    config.job = dist::launch_env_from_environment();
  } catch (const c10::Error& e) {
    return usage_error(exit_status, e.what_without_backtrace());
  }
  // A worker started by --nproc: its value is the launcher's pid. The worker
  // ends with the launcher (a launcher killed by SIGTERM leaves no orphans).
  const char* launcher_pid = std::getenv(kWorkerMarker);
  const bool spawned_worker = launcher_pid != nullptr;
  if (spawned_worker) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (std::to_string(getppid()) != launcher_pid) {
      exit_status = 1;  // the launcher is already gone
      return std::nullopt;
    }
  }
  if (auto error = check_data_parallel(args, config, spawned_worker);
      !error.empty()) {
    return usage_error(exit_status, error);
  }
  if (auto error = check_inputs(args, config); !error.empty()) {
    return usage_error(exit_status, error);
  }
  config.launcher = args.nproc > 1 && !config.job;
  return config;
}

int launch_workers(const CLI::App& app, const Args& args, const Config& config,
                   int argc, char** argv) {
  mha::tools::LocalLaunch launch;
  // The workers' command line: this one without --nproc (the marker in
  // their environment says what they are).
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--nproc") {
      ++i;  // and its value
    } else if (arg.rfind("--nproc=", 0) != 0) {
      launch.argv.push_back(arg);
    }
  }
  const bool threads_given = app.count("--threads") > 0;
  const int worker_threads =
      std::max(1, args.threads / static_cast<int>(args.nproc));
  if (!threads_given) {
    launch.argv.push_back("--threads");
    launch.argv.push_back(std::to_string(worker_threads));
  }
  launch.nproc = args.nproc;
  if (const char* port = std::getenv("MASTER_PORT")) {
    char* end = nullptr;
    const long value = std::strtol(port, &end, 10);
    if (*port == '\0' || *end != '\0' || value < 1 || value > 65535) {
      return mha::tools::usage_error(
          kTool,
          fmt::format("MASTER_PORT must be in [1, 65535], but got '{}'", port));
    }
    launch.master_port = static_cast<int>(value);
  } else {
    launch.master_port = mha::tools::free_local_port();
    if (launch.master_port == 0) {
      fmt::print(stderr,
                 "mha-train: found no free TCP port on 127.0.0.1 for the "
                 "workers' rendezvous; set MASTER_PORT\n");
      return 1;
    }
  }
  launch.worker_marker = kWorkerMarker;
  launch.worker_marker_value = std::to_string(getpid());
  launch.grace = config.timeout + std::chrono::seconds(10);
  launch.name = kTool;
  fmt::print(
      "mha-train: {} worker processes on 127.0.0.1:{}, backend {}, {} "
      "thread(s) each; rank 0 reports\n",
      args.nproc, launch.master_port, dist::backend_name(config.backend),
      threads_given ? args.threads : worker_threads);
  std::fflush(stdout);
  return mha::tools::run_local_workers(launch);
}

}  // namespace mha::train_tool
