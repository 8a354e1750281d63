// One rank of a data-parallel training job, for test_distributed.cpp: trains
// a tiny digit-reversal model with mha::train::train on the ProcessGroup
// described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or alone when
// they are unset), then writes what the test compares:
//   OUT/rank<r>.safetensors   this rank's parameters after training
//   OUT/rank<r>.csv           this rank's loss history (mha's loss.csv)
//   OUT/rank<r>.grads.safetensors  the gradients of the first step run,
//                             as the optimizer used them
// and, while training, OUT/rank<r>.step (the last step done), so that a
// test can wait for training to be under way.
//
// Usage: distributed_worker OUT STEPS [key=value...]
//   stop_at=K  resume=1  timeout_ms=T  batch=B  grad_clip=0|1
//   checkpoints=DIR
// Exit status: 0 done, 1 failed (the message on stderr).
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>

#include "mha/distributed.h"
#include "mha/state_dict.h"
#include "mha/train.h"

namespace train = mha::train;
namespace dist = mha::distributed;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: distributed_worker OUT STEPS [key=value...]\n";
    return 2;
  }
  const std::string out = argv[1];
  const int64_t steps = std::atoll(argv[2]);
  std::map<std::string, std::string> settings;
  for (int i = 3; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    settings[arg.substr(0, eq)] =
        eq == std::string::npos ? "" : arg.substr(eq + 1);
  }
  auto setting = [&](const std::string& key, int64_t fallback) {
    const auto it = settings.find(key);
    return it == settings.end() ? fallback : std::atoll(it->second.c_str());
  };

  try {
    at::set_num_threads(1);
    const auto job = dist::launch_env_from_environment();
    std::optional<dist::ProcessGroup> group;
    if (job) {
      group.emplace(
          *job, dist::ProcessGroupOptions().timeout(
                    std::chrono::milliseconds(setting("timeout_ms", 30000))));
    }
    const int64_t rank = job ? job->rank : 0;

    // Variable lengths make the shards' token counts differ, which the
    // global normalisation must absorb.
    train::DigitTask task(train::DigitDataOptions(train::DigitRule::kReverse)
                              .min_len(1)
                              .max_len(8),
                          train::DigitTransformerOptions(8)
                              .d_model(32)
                              .nhead(4)
                              .num_layers(2)
                              .dim_feedforward(64)
                              .dropout(0.0),
                          /*batch_size=*/setting("batch", 16), /*seed=*/7);
    const auto checkpoints = settings.count("checkpoints") != 0
                                 ? settings["checkpoints"]
                                 : std::string();
    const auto options =
        train::TrainOptions()
            .steps(steps)
            .lr(3e-3)
            .warmup_steps(2)
            .eval_every(3)
            .checkpoint_every(0)
            .out_dir(checkpoints)
            .resume(setting("resume", 0) != 0)
            .grad_clip(static_cast<double>(setting("grad_clip", 1)))
            .stop_at(setting("stop_at", 0));
    const std::string prefix = out + "/rank" + std::to_string(rank);
    bool grads_written = false;
    auto on_progress = [&](const train::Progress& progress) {
      // Called after the optimizer step: the gradients are still there.
      if (!grads_written) {
        torch::OrderedDict<std::string, torch::Tensor> grads;
        for (const auto& item : task.model().named_parameters()) {
          grads.insert(item.key(), item.value().grad());
        }
        mha::write_state_dict(grads, prefix + ".grads.safetensors");
        grads_written = true;
      }
      std::ofstream(prefix + ".step") << progress.step << "\n";
    };
    const auto result =
        train::train(task, options, on_progress, group ? &*group : nullptr);
    mha::save_state_dict(task.model(), prefix + ".safetensors");
    train::write_loss_csv(result.history, prefix + ".csv");
  } catch (const c10::Error& e) {
    std::cerr << "distributed_worker: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
