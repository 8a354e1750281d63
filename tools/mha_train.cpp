// mha-train: trains toy models with mha, end to end: a TransformerEncoder
// that learns to reverse (or sort) digit sequences, or a small GPT-style
// character language model. The training loop, tasks, checkpoints and loss
// curve live in the library (mha/train.h); this is the command line.
// Exit status: 0 done, 1 training failed, 2 bad arguments.
#include <fmt/core.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "launch.h"
#include "mha/distributed.h"
#include "mha/train.h"
#include "mha/version.h"
#include "tool_common.h"

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

constexpr const char* kDefaultText = "/usr/share/common-licenses/GPL-3";

/// One line on stderr and exit status 2.
int usage_error(const std::string& message) {
  fmt::print(stderr, "mha-train: {}\n", message);
  return 2;
}

/// Sets OpenBLAS's thread count when OpenBLAS is loaded (looked up by
/// name, so nothing links against it). Returns false when it is not.
bool set_openblas_threads(int threads) {
  using SetThreads = void (*)(int);
  auto set = reinterpret_cast<SetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) {
    return false;
  }
  set(threads);
  return true;
}

/// Set in the environment across tune_runtime_environment's re-execution.
constexpr const char* kReexecMarker = "MHA_TRAIN_REEXECUTED";
/// Set in the environment of the workers that --nproc starts.
constexpr const char* kWorkerMarker = "MHA_TRAIN_NPROC_WORKER";

/// Prints progress lines: redrawn in place on a terminal, whole lines at a
/// throttled rate otherwise (train::ProgressThrottle decides which).
class ProgressPrinter {
 public:
  ProgressPrinter(bool quiet, int64_t steps)
      : quiet_(quiet),
        interactive_(isatty(fileno(stdout)) != 0),
        throttle_(interactive_, steps) {}

  void operator()(const train::Progress& progress) {
    if (quiet_ || !throttle_.should_show(progress, now_s())) {
      return;
    }
    const auto line = train::format_progress(progress);
    const bool keep = progress.val_loss || progress.checkpointed ||
                      progress.step == progress.steps;
    if (interactive_) {
      // Redraw the line; keep it when it reports something.
      fmt::print("\r{}\x1b[K{}", line, keep ? "\n" : "");
    } else {
      fmt::print("{}\n", line);
    }
    std::fflush(stdout);
  }

  /// Ends a line left open by an interrupted redraw.
  void finish() {
    if (!quiet_ && interactive_) {
      fmt::print("\r\x1b[K");
    }
  }

 private:
  static double now_s() {
    return std::chrono::duration<double>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool quiet_;
  bool interactive_;
  train::ProgressThrottle throttle_;
};

int64_t count_parameters(torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& parameter : module.parameters()) {
    count += parameter.numel();
  }
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string runtime_note =
      mha::tools::tune_runtime_environment(argv, kReexecMarker);
  CLI::App app{
      "mha-train: trains toy models with the mha library. Tasks: reverse "
      "(default) and sort teach a TransformerEncoder to reverse or sort "
      "random digit sequences of variable length (padding masked); charlm "
      "trains a small GPT-style character language model on a text. "
      "Writes checkpoints, loss.csv and loss.svg under --out. Task-dependent "
      "defaults are shown as [digit tasks / charlm]. Exit status: 0 done, 1 "
      "training failed, 2 bad arguments."};
  std::string task_name = "reverse";
  app.add_option("--task", task_name, "reverse, sort or charlm")
      ->check(CLI::IsMember({"reverse", "sort", "charlm"}));

  // Training (defaults depend on the task, shown as digit / charlm).
  std::optional<int64_t> steps, batch_size, warmup;
  std::optional<double> lr, min_lr, weight_decay;
  double grad_clip = 1.0;
  app.add_option("--steps", steps, "optimisation steps [800]");
  app.add_option("--batch-size", batch_size, "sequences per step [64 / 32]");
  app.add_option("--lr", lr, "peak learning rate [2e-3 / 3e-3]");
  app.add_option("--min-lr", min_lr, "final learning rate [1e-4]");
  app.add_option("--warmup", warmup,
                 "linear warmup steps [100, at most steps / 5]");
  app.add_option("--weight-decay", weight_decay,
                 "AdamW weight decay on matrices [0.01 / 0.1]");
  app.add_option("--grad-clip", grad_clip,
                 "clip the gradient norm to this, 0 = off")
      ->capture_default_str();

  // Model (defaults depend on the task).
  std::optional<int64_t> d_model, heads, layers, ff;
  std::optional<double> dropout;
  app.add_option("--d-model", d_model, "model width [64 / 96]");
  app.add_option("--heads", heads, "attention heads [4]");
  app.add_option("--layers", layers, "encoder layers / blocks [2 / 3]");
  app.add_option("--ff", ff,
                 "feed-forward width of the digit model [256] (charlm: "
                 "4 x d-model)");
  app.add_option("--dropout", dropout, "dropout [0 / 0.1]");

  // Digit tasks.
  int64_t min_len = 1, max_len = 16, eval_sequences = 2000;
  app.add_option("--min-len", min_len, "shortest digit sequence")
      ->capture_default_str();
  app.add_option("--max-len", max_len, "longest digit sequence")
      ->capture_default_str();
  app.add_option("--eval-sequences", eval_sequences,
                 "held-out sequences for the final accuracy")
      ->capture_default_str();

  // Character language model.
  std::string text_path = kDefaultText;
  int64_t context = 64, sample_len = 400, top_k = 10;
  double val_fraction = 0.1, temperature = 0.8;
  std::string prompt;
  app.add_option("--text", text_path, "charlm: training text file")
      ->capture_default_str();
  app.add_option("--context", context, "charlm: context length T")
      ->capture_default_str();
  app.add_option("--val-fraction", val_fraction,
                 "charlm: the end of the text held out for validation")
      ->capture_default_str();
  app.add_option("--sample-len", sample_len,
                 "charlm: characters to generate at the end")
      ->capture_default_str();
  app.add_option("--temperature", temperature, "charlm: sampling temperature")
      ->capture_default_str();
  app.add_option("--top-k", top_k,
                 "charlm: sample among the k likeliest, 0 = all")
      ->capture_default_str();
  std::string positions = "rotary";
  app.add_option("--positions", positions,
                 "charlm: rotary (RoPE, a sliding window of --context "
                 "positions, any length) or learned (nanoGPT's wpe)")
      ->check(CLI::IsMember({"rotary", "learned"}))
      ->capture_default_str();
  bool no_kv_cache = false;
  app.add_flag("--no-kv-cache", no_kv_cache,
               "charlm: sample by recomputing the context every step");
  app.add_option("--prompt", prompt,
                 "charlm: text the sample continues (default: the first "
                 "validation character)");
  std::string plot_dir;
  std::optional<int64_t> plot_length;
  app.add_option("--plot-attention", plot_dir,
                 "charlm: write DIR/layer<l>.svg at the end, the attention "
                 "maps of every head over a validation sample");
  app.add_option("--plot-length", plot_length,
                 "charlm: characters of that sample [48, at most --context]");

  // Run control.
  uint64_t seed = 0;
  std::string device_name = "cpu";
  int threads = std::min(2, mha::tools::usable_cpus());  // see PERF-NOTES
  std::string out_dir;
  std::optional<int64_t> checkpoint_every, eval_every;
  int64_t stop_at = 0;
  bool resume = false, quiet = false;
  app.add_option("--seed", seed, "seed of weights, data and dropout")
      ->capture_default_str();
  app.add_option("--device", device_name, "cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--threads", threads, "CPU threads of LibTorch and OpenBLAS")
      ->capture_default_str();
  app.add_option("--out", out_dir,
                 "directory of checkpoints, loss.csv and loss.svg "
                 "[mha-train-<task>]");
  app.add_option("--checkpoint-every", checkpoint_every,
                 "checkpoint every N steps, and at the end [steps / 4]");
  app.add_option("--eval-every", eval_every,
                 "validate every N steps, and at the end [steps / 10]");
  app.add_flag("--resume", resume,
               "continue from the checkpoint in --out (same settings)");
  app.add_option("--stop-at", stop_at,
                 "stop after this step as if interrupted (the schedule still "
                 "spans --steps); for --resume tests")
      ->capture_default_str();
  app.add_flag("--quiet", quiet, "no progress lines");

  // Data-parallel training (c10d).
  int64_t nproc = 1;
  std::string backend_name;
  double timeout_s = 120.0;
  std::string interface;
  app.add_option("--nproc", nproc,
                 "train data-parallel in this many processes on this machine "
                 "(each takes a shard of every batch; --threads is split "
                 "among them unless given). Across machines, start one "
                 "process per rank with RANK, WORLD_SIZE, MASTER_ADDR and "
                 "MASTER_PORT set instead")
      ->capture_default_str();
  app.add_option("--backend", backend_name,
                 "c10d backend of a data-parallel run: gloo or nccl [gloo on "
                 "cpu, nccl on cuda]")
      ->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--timeout", timeout_s,
                 "seconds a data-parallel rank waits for the others (joining, "
                 "every collective) before it gives up with an error")
      ->capture_default_str();
  app.add_option(
      "--interface", interface,
      "network interface Gloo binds (e.g. eth0) [GLOO_SOCKET_IFNAME, "
      "else 127.0.0.1 when MASTER_ADDR is loopback, else the host "
      "name's address]");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e);  // --help
    }
    return usage_error(e.what());
  }

  // Settings: the task's defaults, overridden by what was given.
  const bool charlm = task_name == "charlm";
  const TaskDefaults& d = charlm ? kCharDefaults : kDigitDefaults;
  const int64_t n_steps = steps.value_or(d.steps);
  train::TrainOptions options;
  options.steps(n_steps)
      .lr(lr.value_or(d.lr))
      .min_lr(min_lr.value_or(d.min_lr))
      .warmup_steps(warmup.value_or(std::min(d.warmup, n_steps / 5)))
      .weight_decay(weight_decay.value_or(d.weight_decay))
      .grad_clip(grad_clip)
      .eval_every(eval_every.value_or(std::max<int64_t>(1, n_steps / 10)))
      .checkpoint_every(
          checkpoint_every.value_or(std::max<int64_t>(1, n_steps / 4)))
      .out_dir(out_dir.empty() ? "mha-train-" + task_name : out_dir)
      .resume(resume)
      .stop_at(stop_at);
  const int64_t n_batch = batch_size.value_or(d.batch_size);

  // Checks that give one line and exit 2.
  if (n_steps < 1) {
    return usage_error(fmt::format("--steps must be >= 1, got {}", n_steps));
  }
  if (n_batch < 1) {
    return usage_error(
        fmt::format("--batch-size must be >= 1, got {}", n_batch));
  }
  if (threads < 1) {
    return usage_error(fmt::format("--threads must be >= 1, got {}", threads));
  }
  if (charlm && (sample_len < 0 || temperature <= 0.0 || top_k < 0)) {
    return usage_error(fmt::format(
        "need --sample-len >= 0, --temperature > 0 and --top-k >= 0, got {}, "
        "{:g} and {}",
        sample_len, temperature, top_k));
  }
  if (!charlm && (!plot_dir.empty() || plot_length)) {
    return usage_error(
        "--plot-attention and --plot-length apply to --task "
        "charlm only");
  }
  const int64_t n_plot = plot_length.value_or(std::min<int64_t>(48, context));
  if (charlm && (n_plot < 1 || n_plot > context)) {
    return usage_error(
        fmt::format("--plot-length must be in [1, --context = {}], got {}",
                    context, n_plot));
  }
  if (!plot_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(plot_dir, error);
    if (error || access(plot_dir.c_str(), W_OK) != 0) {
      return usage_error(
          fmt::format("--plot-attention: cannot write to directory '{}'{}",
                      plot_dir, error ? ": " + error.message() : ""));
    }
  }
  if (!charlm && eval_sequences < 1) {
    return usage_error(
        fmt::format("--eval-sequences must be >= 1, got {}", eval_sequences));
  }
  if (stop_at < 0) {
    return usage_error(fmt::format("--stop-at must be >= 0, got {}", stop_at));
  }
  // Data-parallel settings: this process is a launcher (--nproc > 1), a
  // worker of a job (RANK and WORLD_SIZE set), or alone.
  std::optional<dist::LaunchEnv> job;
  try {
    job = dist::launch_env_from_environment();
  } catch (const c10::Error& e) {
    return usage_error(e.what_without_backtrace());
  }
  // A worker started by --nproc: its value is the launcher's pid. The worker
  // ends with the launcher (a launcher killed by SIGTERM leaves no orphans).
  const char* launcher_pid = std::getenv(kWorkerMarker);
  const bool spawned_worker = launcher_pid != nullptr;
  if (spawned_worker) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (std::to_string(getppid()) != launcher_pid) {
      return 1;  // the launcher is already gone
    }
  }
  if (nproc < 1) {
    return usage_error(fmt::format("--nproc must be >= 1, got {}", nproc));
  }
  if (nproc > 1 && job && !spawned_worker) {
    return usage_error(
        "--nproc starts its own workers; with RANK and WORLD_SIZE set, start "
        "one process per rank without --nproc");
  }
  if (!(timeout_s > 0.0 && timeout_s <= 1e7)) {
    return usage_error(fmt::format(
        "--timeout must be > 0 and <= 1e7 seconds, got {:g}", timeout_s));
  }
  const std::chrono::milliseconds timeout(
      static_cast<int64_t>(timeout_s * 1000.0));
  const bool data_parallel = nproc > 1 || job.has_value();
  if (data_parallel && !dist::available()) {
    return usage_error(
        "data-parallel training is not available: this build of mha has no "
        "c10d/Gloo support (install libgloo-dev and rebuild)");
  }
  if (data_parallel && n_batch < (job ? job->world_size : nproc)) {
    return usage_error(
        fmt::format("--batch-size ({}) must be >= the number of processes ({})",
                    n_batch, job ? job->world_size : nproc));
  }
  const auto backend = dist::parse_backend(
      backend_name.empty() ? (device_name == "cuda" ? "nccl" : "gloo")
                           : backend_name);
  if (data_parallel && backend == dist::Backend::kGloo &&
      device_name == "cuda") {
    return usage_error(
        "--backend gloo exchanges CPU tensors: use it with --device cpu, or "
        "--backend nccl with --device cuda");
  }
  if (data_parallel && backend == dist::Backend::kNccl &&
      (device_name != "cuda" || !dist::nccl_available())) {
    return usage_error(
        device_name != "cuda"
            ? std::string("--backend nccl needs --device cuda")
            : std::string("--backend nccl: this build of mha has no NCCL "
                          "support; use --backend gloo"));
  }
  const int64_t rank = job ? job->rank : 0;

  torch::Device device(torch::kCPU);
  if (device_name == "cuda") {
    if (!torch::cuda::is_available()) {
      return usage_error("--device cuda: CUDA is not available");
    }
    device = torch::Device(
        torch::kCUDA, static_cast<c10::DeviceIndex>(job ? job->local_rank : 0));
  }
  if (charlm) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(text_path, error)) {
      return usage_error(fmt::format("--text: no such file: '{}'", text_path));
    }
  }
  const train::RunFiles files(options.out_dir());
  if (resume && rank == 0 && !std::filesystem::exists(files.trainer)) {
    return usage_error(fmt::format(
        "--resume: no checkpoint in '{}' (run without --resume first)",
        files.checkpoint_dir));
  }

  if (nproc > 1 && !job) {
    // The launcher: start the workers, wait for them, report.
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
    const int worker_threads = std::max(1, threads / static_cast<int>(nproc));
    if (app.count("--threads") == 0) {
      launch.argv.push_back("--threads");
      launch.argv.push_back(std::to_string(worker_threads));
    }
    launch.nproc = nproc;
    if (const char* port = std::getenv("MASTER_PORT")) {
      char* end = nullptr;
      const long value = std::strtol(port, &end, 10);
      if (*port == '\0' || *end != '\0' || value < 1 || value > 65535) {
        return usage_error(fmt::format(
            "MASTER_PORT must be in [1, 65535], but got '{}'", port));
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
    launch.grace = timeout + std::chrono::seconds(10);
    launch.name = "mha-train";
    fmt::print(
        "mha-train: {} worker processes on 127.0.0.1:{}, backend {}, {} "
        "thread(s) each; rank 0 reports\n",
        nproc, launch.master_port, dist::backend_name(backend),
        app.count("--threads") == 0 ? worker_threads : threads);
    std::fflush(stdout);
    return mha::tools::run_local_workers(launch);
  }
  if (rank != 0) {
    quiet = true;  // rank 0 alone reports
  }

  at::set_num_threads(threads);
  const bool openblas = set_openblas_threads(threads);

  // The task: data and model. Invalid settings throw c10::Error here.
  std::unique_ptr<train::TrainTask> task;
  train::DigitTask* digit_task = nullptr;
  train::CharLMTask* char_task = nullptr;
  try {
    train::validate(options);
    if (charlm) {
      auto text = train::read_text_file(text_path);
      auto corpus = train::make_char_corpus(text, val_fraction, context);
      const auto model_options =
          train::CharLMOptions(corpus.vocab.size(), context)
              .n_embd(d_model.value_or(d.d_model))
              .n_head(heads.value_or(d.heads))
              .n_layer(layers.value_or(d.layers))
              .dropout(dropout.value_or(d.dropout))
              .rotary(positions == "rotary");
      auto owned = std::make_unique<train::CharLMTask>(
          std::move(corpus), model_options, n_batch, seed, device);
      char_task = owned.get();
      task = std::move(owned);
    } else {
      const auto data = train::DigitDataOptions(
                            task_name == "sort" ? train::DigitRule::kSort
                                                : train::DigitRule::kReverse)
                            .min_len(min_len)
                            .max_len(max_len);
      const auto model_options = train::DigitTransformerOptions(max_len)
                                     .d_model(d_model.value_or(d.d_model))
                                     .nhead(heads.value_or(d.heads))
                                     .num_layers(layers.value_or(d.layers))
                                     .dim_feedforward(ff.value_or(d.ff))
                                     .dropout(dropout.value_or(d.dropout));
      auto owned = std::make_unique<train::DigitTask>(data, model_options,
                                                      n_batch, seed, device);
      digit_task = owned.get();
      task = std::move(owned);
    }
  } catch (const c10::Error& e) {
    return usage_error(e.what_without_backtrace());
  }

  // Joining the job (every rank, before anything is printed).
  const std::string who =
      job ? fmt::format("mha-train [rank {}]", rank) : "mha-train";
  std::optional<dist::ProcessGroup> group;
  if (job) {
    try {
      group.emplace(*job, dist::ProcessGroupOptions()
                              .backend(backend)
                              .timeout(timeout)
                              .interface(interface));
    } catch (const c10::Error& e) {
      fmt::print(stderr, "{}: {}\n", who, e.what_without_backtrace());
      return 1;
    }
  }

  const double baseline =
      char_task != nullptr ? char_task->unigram_baseline() : 0.0;
  if (rank == 0) {
    fmt::print(
        "mha-train: {} | LibTorch {} | device {} | threads {}{} | seed {}\n",
        task->name(), mha::torch_version(), device.str(), threads,
        openblas
            ? fmt::format(" (OpenBLAS {} too)", mha::tools::openblas_core())
            : "",
        seed);
    if (!runtime_note.empty()) {
      fmt::print("environment set by mha-train: {}\n", runtime_note);
    }
    if (job) {
      fmt::print(
          "data-parallel: {} process{} ({} at {}:{}), {} sequences each per "
          "step\n",
          job->world_size, job->world_size == 1 ? "" : "es",
          dist::backend_name(backend), job->master_addr, job->master_port,
          n_batch % job->world_size == 0
              ? fmt::format("{}", n_batch / job->world_size)
              : fmt::format("{}-{}", n_batch / job->world_size,
                            n_batch / job->world_size + 1));
    }
    fmt::print(
        "model: {} parameters | {} steps of {} sequences | lr {:g} -> {:g}, "
        "warmup {} | out {}\n",
        count_parameters(task->model()), options.steps(), n_batch, options.lr(),
        options.min_lr(), options.warmup_steps(), options.out_dir());
    if (char_task != nullptr) {
      fmt::print(
          "text: {} ({} characters, {} distinct); unigram baseline {:.4f} "
          "nats/char\n",
          text_path,
          char_task->corpus().train.size(0) + char_task->corpus().val.size(0),
          char_task->corpus().vocab.size(), baseline);
    }
    std::fflush(stdout);
  }

  ProgressPrinter printer(quiet, options.steps());
  const auto start = std::chrono::steady_clock::now();
  train::TrainResult result;
  try {
    result = train::train(*task, options, std::ref(printer),
                          group ? &*group : nullptr);
  } catch (const c10::Error& e) {
    printer.finish();
    fmt::print(stderr, "{}: {}\n", who, e.what_without_backtrace());
    return 1;
  }
  if (rank != 0) {
    return 0;  // rank 0 evaluates, samples and reports
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  printer.finish();

  if (result.last_step < result.first_step) {
    fmt::print("nothing to do: the checkpoint is at step {} of {}\n",
               result.first_step - 1, options.steps());
  } else {
    fmt::print(
        "trained steps {}-{} in {}; checkpoint {}, loss curve {} and {}\n",
        result.first_step, result.last_step, train::format_duration(seconds),
        files.checkpoint_dir, files.loss_csv, files.loss_svg);
  }
  if (result.last_step < options.steps() &&
      result.last_step >= result.first_step) {
    fmt::print("stopped at step {} (--stop-at); continue with --resume\n",
               result.last_step);
    return 0;
  }

  if (digit_task != nullptr) {
    const auto accuracy = digit_task->accuracy(eval_sequences);
    fmt::print(
        "held-out accuracy: {:.2f}% of {} sequences exactly right ({:.3f}% of "
        "digits)\n",
        100.0 * accuracy.sequence, accuracy.num_sequences,
        100.0 * accuracy.token);
  } else {
    const double val = char_task->validation_loss();
    fmt::print(
        "validation loss {:.4f} nats/char vs unigram baseline {:.4f}: {:.4f} "
        "below\n",
        val, baseline, baseline - val);
    const auto sampling =
        train::SamplingOptions()
            .temperature(temperature)
            .top_k(top_k)
            .seed(train::derive_seed(seed, 0, train::SeedStream::kSampling));
    std::string sample;
    const auto sample_start = std::chrono::steady_clock::now();
    try {
      sample = char_task->sample(prompt, sample_len, sampling, !no_kv_cache);
    } catch (const c10::Error& e) {
      return usage_error(e.what_without_backtrace());
    }
    const std::chrono::duration<double> sample_time =
        std::chrono::steady_clock::now() - sample_start;
    fmt::print(
        "sample (temperature {:g}, top-k {}; {} characters in {:.2f} s, {}):"
        "\n{}\n",
        temperature, top_k, sample_len, sample_time.count(),
        no_kv_cache ? "recomputed every step" : "KV cache", sample);
    if (!plot_dir.empty()) {
      try {
        const auto paths = char_task->plot_attention(plot_dir, n_plot);
        std::string listed;
        for (const auto& path : paths) {
          listed += " " + path;
        }
        fmt::print(
            "attention maps ({} layers x {} heads, {} validation "
            "characters):{}\n",
            paths.size(), char_task->lm()->options.n_head(), n_plot, listed);
      } catch (const c10::Error& e) {
        fmt::print(stderr, "mha-train: {}\n", e.what_without_backtrace());
        return 1;
      }
    }
  }
  return 0;
}
