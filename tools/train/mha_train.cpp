// mha-train: trains toy models with mha, end to end: a TransformerEncoder
// that learns to reverse (or sort) digit sequences, or a small GPT-style
// character language model. The training loop, tasks, checkpoints and loss
// curve live in the library (mha/train.h); this is the command line, with
// its options, checks and launcher in train_cli.cpp and the run and report
// in train_run.cpp (the mha_tools library).
// Exit status: 0 done, 1 training failed, 2 bad arguments.
#include <fmt/core.h>

#include "common/cli.h"
#include "common/tool_common.h"
#include "train/train_tool.h"

namespace {

/// Set in the environment across tune_runtime_environment's re-execution.
constexpr const char* kReexecMarker = "MHA_TRAIN_REEXECUTED";

}  // namespace

int main(int argc, char** argv) {
  namespace tool = mha::train_tool;
  const std::string runtime_note =
      mha::tools::tune_runtime_environment(argv, kReexecMarker);
  CLI::App app{
      "mha-train: trains toy models with the mha library. Tasks: reverse "
      "(default) and sort teach a TransformerEncoder to reverse or sort "
      "random digit sequences of variable length (padding masked); add "
      "teaches an encoder-decoder Transformer to add two numbers (greedy "
      "decoding through the decoder's cache); charlm "
      "trains a small GPT-style character language model on a text. "
      "Writes checkpoints, loss.csv and loss.svg under --out. Task-dependent "
      "defaults are shown as [digit tasks / add / charlm]. Exit status: 0 "
      "done, 1 "
      "training failed, 2 bad arguments."};
  tool::Args args;
  tool::add_options(app, args);
  if (auto status = mha::tools::parse_command_line(
          app, argc, argv, tool::kTool, mha::tools::UsageStyle::kOneLine)) {
    return *status;
  }
  int exit_status = 0;
  const auto config = tool::configure(args, exit_status);
  if (!config) {
    return exit_status;
  }
  if (config->launcher) {
    return tool::launch_workers(app, args, *config, argc, argv);
  }

  const bool openblas = tool::set_threads(args.threads);
  // The task: data and model. Invalid settings are usage errors.
  const auto task = tool::make_task(args, *config);
  if (!task) {
    return 2;
  }
  std::optional<mha::distributed::ProcessGroup> group;
  try {
    group = tool::join_job(args, *config);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "mha-train [rank {}]: {}\n", config->rank,
               e.what_without_backtrace());
    return 1;
  }
  if (config->rank == 0) {
    tool::print_header(args, *config, *task, openblas, runtime_note);
  }

  mha::train::TrainResult result;
  double seconds = 0;
  if (auto status = tool::train(args, *config, *task, group ? &*group : nullptr,
                                result, seconds)) {
    return *status;
  }
  return tool::report(args, *config, *task, result, seconds);
}
