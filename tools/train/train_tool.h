// mha-train's pieces around the library's training loop (mha/train.h):
// train_cli.cpp holds the options, the task-dependent defaults, the checks
// that end in exit status 2 and the --nproc launcher; train_run.cpp builds
// the task, joins a data-parallel job, prints the progress and the report.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "mha/distributed.h"
#include "mha/train.h"

namespace mha::train_tool {

/// "mha-train": the prefix of every message.
inline constexpr const char* kTool = "mha-train";

/// Everything the command line sets. Unset optionals take the task's
/// defaults (TaskDefaults).
struct Args {
  std::string task_name = "reverse";
  // Training.
  std::optional<int64_t> steps, batch_size, warmup;
  std::optional<double> lr, min_lr, weight_decay;
  double grad_clip = 1.0;
  // Model.
  std::optional<int64_t> d_model, heads, layers, ff;
  std::optional<double> dropout;
  // The attention of the char LM and the digit tasks (attention_kind).
  std::string attention = "softmax";
  int64_t projected_length = 0;
  // Digit tasks.
  int64_t min_len = 1, max_len = 16, eval_sequences = 2000;
  // Addition (encoder-decoder).
  int64_t digits = 5;
  // Character language model.
  std::string text_path;
  int64_t context = 64, sample_len = 400, top_k = 10;
  double val_fraction = 0.1, temperature = 0.8;
  std::string prompt;
  std::string positions = "rotary";
  bool packed = false, padded = false;
  std::optional<int64_t> doc_min_len, doc_max_len;
  int64_t doc_block = 64;
  int64_t compare_batches = 10;
  bool no_kv_cache = false;
  std::string plot_dir;
  std::optional<int64_t> plot_length;
  // Run control.
  uint64_t seed = 0;
  std::string device_name = "cpu";
  int threads = 1;
  std::string out_dir;
  std::optional<int64_t> checkpoint_every, eval_every;
  int64_t stop_at = 0;
  bool resume = false, quiet = false;
  // Data-parallel training.
  int64_t nproc = 1;
  std::string backend_name;
  double timeout_s = 120.0;
  std::string interface;
};

/// The options of mha-train, bound to `args` (with their defaults).
void add_options(CLI::App& app, Args& args);

/// The run the arguments describe, after the checks.
struct Config {
  bool charlm = false;
  bool addition = false;  ///< --task add
  mha::train::TrainOptions options;
  int64_t batch = 0;  ///< sequences per step (all ranks together)
  int64_t plot_length = 0;
  // Model settings: the given ones or the task's defaults (add: layers
  // is the count of encoder layers and of decoder layers).
  int64_t d_model = 0, heads = 0, layers = 0, ff = 0;
  double dropout = 0;
  /// A worker of a data-parallel job (RANK, WORLD_SIZE set), else nullopt.
  std::optional<mha::distributed::LaunchEnv> job;
  mha::distributed::Backend backend = mha::distributed::Backend::kGloo;
  std::chrono::milliseconds timeout{0};
  int64_t rank = 0;
  torch::Device device = torch::kCPU;
  /// This process starts --nproc workers instead of training.
  bool launcher = false;
};
/// The task's defaults, the given settings and every check. nullopt with
/// `exit_status` set (2 after a one-line usage error; 1, silently, for a
/// worker whose launcher is gone).
std::optional<Config> configure(const Args& args, int& exit_status);

/// The launcher of --nproc: starts the workers (this command line without
/// --nproc) on 127.0.0.1 and waits for them. Returns the exit status.
int launch_workers(const CLI::App& app, const Args& args, const Config& config,
                   int argc, char** argv);

/// Sets LibTorch's intra-op threads and OpenBLAS's (when OpenBLAS is
/// loaded: then returns true).
bool set_threads(int threads);

/// The task (data and model) of `config`: a DigitTask, an AdditionTask or a
/// CharLMTask.
/// nullptr after a usage error was printed (exit status 2).
std::unique_ptr<mha::train::TrainTask> make_task(const Args& args,
                                                 const Config& config);

/// Joins the data-parallel job (every rank, before anything is printed);
/// nullopt without a job. Throws c10::Error when joining fails.
std::optional<mha::distributed::ProcessGroup> join_job(const Args& args,
                                                       const Config& config);

/// Rank 0's lines before training: the run, the job, the model, the text.
void print_header(const Args& args, const Config& config,
                  mha::train::TrainTask& task, bool openblas,
                  const std::string& runtime_note);

/// Trains, printing progress unless quiet. Returns the exit status:
/// nullopt to go on with the report (rank 0 after training), else 0 or 1.
std::optional<int> train(const Args& args, const Config& config,
                         mha::train::TrainTask& task,
                         mha::distributed::ProcessGroup* group,
                         mha::train::TrainResult& result, double& seconds);

/// Rank 0's report after training: the steps trained and the time per step,
/// then the accuracy (digit tasks; add: exact match by greedy decoding, and
/// a few examples) or the validation loss, a sample and the attention maps
/// (charlm). Returns the exit status.
int report(const Args& args, const Config& config, mha::train::TrainTask& task,
           const mha::train::TrainResult& result, double seconds);

}  // namespace mha::train_tool
