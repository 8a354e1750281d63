// The training loop: option checks, the resume and data-parallel set-up,
// and train() itself.
//
// Glossary: W world size (processes of a data-parallel job).
#include "mha/train/loop.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <sstream>

#include "common.h"
#include "mha/train/checkpoint.h"
#include "mha/train/optim.h"

namespace mha::train {

namespace fs = std::filesystem;
using detail::exact_decimal;
using detail::history_from_tensor;
using detail::history_to_tensor;
using detail::printf_string;

// ------------------------------------------------------- training loop ---

void validate(const TrainOptions& o) {
  TORCH_CHECK(o.steps() >= 1, "train: steps must be >= 1, but got ", o.steps());
  TORCH_CHECK(o.lr() > 0.0 && o.min_lr() >= 0.0 && o.min_lr() <= o.lr(),
              "train: need 0 <= min_lr <= lr and lr > 0, but got lr ", o.lr(),
              " and min_lr ", o.min_lr());
  TORCH_CHECK(o.warmup_steps() >= 0 && o.warmup_steps() <= o.steps(),
              "train: warmup_steps must be in [0, steps = ", o.steps(),
              "], but got ", o.warmup_steps());
  TORCH_CHECK(o.weight_decay() >= 0.0,
              "train: weight_decay must be >= 0, but got ", o.weight_decay());
  TORCH_CHECK(o.grad_clip() >= 0.0, "train: grad_clip must be >= 0, but got ",
              o.grad_clip());
  TORCH_CHECK(
      o.eval_every() >= 0 && o.checkpoint_every() >= 0 && o.stop_at() >= 0,
      "train: eval_every, checkpoint_every and stop_at must be >= 0, "
      "but got ",
      o.eval_every(), ", ", o.checkpoint_every(), " and ", o.stop_at());
  TORCH_CHECK(!o.resume() || !o.out_dir().empty(),
              "train: resume needs an out_dir holding a checkpoint");
}

namespace {

/// The options a resumed run must share with its checkpoint.
std::string options_fingerprint(const TrainOptions& o) {
  return printf_string(
      "steps=%lld lr=%s min_lr=%s warmup_steps=%lld weight_decay=%s "
      "grad_clip=%s",
      static_cast<long long>(o.steps()), exact_decimal(o.lr()).c_str(),
      exact_decimal(o.min_lr()).c_str(),
      static_cast<long long>(o.warmup_steps()),
      exact_decimal(o.weight_decay()).c_str(),
      exact_decimal(o.grad_clip()).c_str());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

namespace {

/// The optimizer state and history that a resumed data-parallel run sends
/// from rank 0 to the others, as the bytes of a LibTorch archive.
std::string pack_trainer_state(torch::optim::Optimizer& optimizer,
                               const std::vector<LossRecord>& history) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("history", history_to_tensor(history));
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

std::vector<LossRecord> unpack_trainer_state(const std::string& bytes,
                                             torch::optim::Optimizer& optimizer,
                                             torch::Device device) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in, device);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor history;
  archive.read("history", history);
  return history_from_tensor(history);
}

/// Restores `task.shard()` when it goes out of scope.
class ShardScope {
 public:
  ShardScope(TrainTask& task, const Shard& shard)
      : task_(task), saved_(task.shard()) {
    task_.set_shard(shard);
  }
  ~ShardScope() { task_.set_shard(saved_); }
  ShardScope(const ShardScope&) = delete;
  ShardScope& operator=(const ShardScope&) = delete;

 private:
  TrainTask& task_;
  Shard saved_;
};

/// Sums (loss sum, tokens) over the ranks of `group`; returns the pair
/// unchanged without a group.
LossSum all_reduce(distributed::ProcessGroup* group, const LossSum& local) {
  if (group == nullptr) {
    return local;
  }
  auto both = torch::tensor({local.sum, static_cast<double>(local.tokens)},
                            torch::kFloat64)
                  .to(group->device());  // (2)
  group->all_reduce_sum(both);
  return {both[0].item<double>(), static_cast<int64_t>(both[1].item<double>())};
}

}  // namespace

TrainResult train(TrainTask& task, const TrainOptions& options,
                  const ProgressCallback& on_progress,
                  distributed::ProcessGroup* group) {
  validate(options);
  const int64_t rank = group != nullptr ? group->rank() : 0;
  const int64_t world_size = group != nullptr ? group->world_size() : 1;
  TORCH_CHECK(task.batch_size() >= world_size, "train: the batch size (",
              task.batch_size(), ") must be >= the number of processes (",
              world_size, "): every rank needs at least one sequence");
  ShardScope shard_scope(task, Shard{rank, world_size});
  torch::nn::Module& model = task.model();
  auto optimizer = make_adamw(model, options.lr(), options.weight_decay());
  const LrSchedule schedule{options.lr(), options.min_lr(),
                            options.warmup_steps(), options.steps()};
  const std::string fingerprint =
      task.fingerprint() + " " + options_fingerprint(options);
  std::optional<RunFiles> files;  // rank 0 only
  if (!options.out_dir().empty() && rank == 0) {
    files.emplace(options.out_dir());
    std::error_code error;
    fs::create_directories(options.out_dir(), error);
    TORCH_CHECK(!error, "train: cannot create the directory '",
                options.out_dir(), "': ", error.message());
  }

  TrainResult result;
  if (group == nullptr) {
    if (options.resume()) {
      result.history = load_checkpoint(*files, model, *optimizer, fingerprint);
    }
  } else {
    // Rank 0 reads the checkpoint (if resuming) and every rank starts from
    // its weights, optimizer state and history.
    if (options.resume()) {
      std::string state, failure;
      if (rank == 0) {
        try {
          result.history =
              load_checkpoint(*files, model, *optimizer, fingerprint);
          state = pack_trainer_state(*optimizer, result.history);
        } catch (const c10::Error& e) {
          failure = e.what_without_backtrace();
        }
      }
      // An empty state tells the other ranks that rank 0 failed.
      state = group->broadcast_bytes(state);
      TORCH_CHECK(rank != 0 || failure.empty(), failure);
      TORCH_CHECK(!state.empty(),
                  "train: rank 0 could not resume from its "
                  "checkpoint (its own message says why)");
      if (rank != 0) {
        const auto parameters = model.parameters();
        result.history =
            unpack_trainer_state(state, *optimizer,
                                 parameters.empty() ? torch::Device(torch::kCPU)
                                                    : parameters[0].device());
      }
    }
    distributed::broadcast_module(*group, model);
    if (rank != 0) {
      const uint64_t base = at::detail::getDefaultCPUGenerator().current_seed();
      torch::manual_seed(
          derive_seed(derive_seed(base, rank, SeedStream::kRankDropout),
                      result.history.empty() ? 0 : result.history.back().step,
                      SeedStream::kRankDropout));
    }
  }
  std::optional<distributed::GradientSynchronizer> synchronizer;
  if (group != nullptr) {
    synchronizer.emplace(*group, model,
                         distributed::GradientSyncOptions().reduction(
                             distributed::GradientReduction::kSum));
  }

  const int64_t first =
      result.history.empty() ? 1 : result.history.back().step + 1;
  const int64_t last = options.stop_at() > 0
                           ? std::min(options.stop_at(), options.steps())
                           : options.steps();
  const double elapsed_before =
      result.history.empty() ? 0.0 : result.history.back().elapsed_s;
  result.first_step = first;
  result.last_step = first - 1;

  const auto run_start = std::chrono::steady_clock::now();
  double train_seconds = 0.0;
  int64_t tokens = 0;
  model.train();
  for (int64_t step = first; step <= last; ++step) {
    const auto step_start = std::chrono::steady_clock::now();

    // One optimisation step: the scheduled learning rate, the loss of this
    // step's batch, its gradient (clipped), an AdamW update.
    const double lr = schedule.at(step);
    set_learning_rate(*optimizer, lr);
    optimizer->zero_grad();
    BatchLoss batch = task.training_loss(step);
    LossRecord record;
    record.step = step;
    record.lr = lr;
    int64_t step_tokens = batch.tokens;
    if (group == nullptr) {
      batch.loss.backward();
      record.train_loss = batch.loss.item<double>();  // waits for the step
    } else {
      // This rank's share of the global mean: its tokens' summed loss over
      // the tokens of every rank; the gradients are then summed.
      const double local_loss = batch.loss.item<double>();
      const LossSum global = all_reduce(
          group,
          {local_loss * static_cast<double>(batch.tokens), batch.tokens});
      step_tokens = global.tokens;
      record.train_loss = global.mean();
      (batch.loss * (static_cast<double>(batch.tokens) /
                     static_cast<double>(std::max<int64_t>(global.tokens, 1))))
          .backward();
      synchronizer->synchronize();
    }
    TORCH_CHECK(std::isfinite(record.train_loss), "train: the loss at step ",
                step, " is ", record.train_loss,
                " (training diverged; try a smaller lr)");
    if (options.grad_clip() > 0.0) {
      torch::nn::utils::clip_grad_norm_(model.parameters(),
                                        options.grad_clip());
    }
    optimizer->step();

    const double step_seconds = seconds_since(step_start);
    train_seconds += step_seconds;
    tokens += step_tokens;
    record.tokens_per_s = step_tokens / std::max(step_seconds, 1e-9);

    // Validation on schedule and at the end of the run's schedule (not at
    // stop_at, so that an interrupted and resumed run records the same).
    if (step == options.steps() ||
        (options.eval_every() > 0 && step % options.eval_every() == 0)) {
      record.val_loss = all_reduce(group, task.validation_loss_sum()).mean();
      result.val_loss = record.val_loss;
    }
    record.elapsed_s = elapsed_before + seconds_since(run_start);
    result.history.push_back(record);
    result.last_step = step;

    const bool save =
        files && (step == last || (options.checkpoint_every() > 0 &&
                                   step % options.checkpoint_every() == 0));
    if (save) {
      save_checkpoint(*files, model, *optimizer, result.history, fingerprint);
      write_loss_csv(result.history, files->loss_csv);
      write_loss_svg(result.history, task.name(), files->loss_svg);
    }

    if (on_progress) {
      Progress progress;
      progress.step = step;
      progress.steps = options.steps();
      progress.loss = record.train_loss;
      progress.lr = lr;
      progress.tokens_per_s = tokens / std::max(train_seconds, 1e-9);
      progress.elapsed_s = record.elapsed_s;
      const double run_seconds = seconds_since(run_start);
      progress.eta_s = run_seconds / static_cast<double>(step - first + 1) *
                       static_cast<double>(last - step);
      if (!std::isnan(record.val_loss)) {
        progress.val_loss = record.val_loss;
      }
      progress.checkpointed = save;
      on_progress(progress);
    }
  }
  return result;
}

}  // namespace mha::train
