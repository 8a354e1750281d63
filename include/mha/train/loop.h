// The training loop (part of mha/train.h): its options, its result, and
// train() itself, on one process or data-parallel on a ProcessGroup.
//
// Glossary: W world size (processes of a data-parallel job).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mha/distributed.h"
#include "mha/train/progress.h"
#include "mha/train/report.h"
#include "mha/train/tasks.h"

namespace mha::train {

// ------------------------------------------------------- training loop ---

/// Options of train().
struct TrainOptions {
  /// Total optimisation steps of the run (the schedule spans them).
  TORCH_ARG(int64_t, steps) = 1000;
  /// Peak learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Final learning rate of the cosine decay.
  TORCH_ARG(double, min_lr) = 1e-4;
  /// Linear warmup steps.
  TORCH_ARG(int64_t, warmup_steps) = 100;
  /// AdamW's decoupled weight decay (matrices only).
  TORCH_ARG(double, weight_decay) = 0.1;
  /// Clip the global gradient norm (L2, all parameters) to this; 0 = off.
  TORCH_ARG(double, grad_clip) = 1.0;
  /// Validate every this many steps and at step `steps` (not at stop_at);
  /// 0 = only at step `steps`.
  TORCH_ARG(int64_t, eval_every) = 0;
  /// Where checkpoints and the loss curve go; empty: nowhere (no
  /// checkpoints, no files).
  TORCH_ARG(std::string, out_dir) = "";
  /// Checkpoint every this many steps (and always at the end of the run);
  /// 0 = only at the end.
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  /// Continue from the checkpoint in out_dir instead of starting afresh.
  TORCH_ARG(bool, resume) = false;
  /// Stop after this step, as if interrupted (the schedule still spans
  /// `steps`); 0 = run to `steps`.
  TORCH_ARG(int64_t, stop_at) = 0;
};

/// Checks `options` as train() does first: throws c10::Error naming the
/// option and its value (steps < 1, lr <= 0, min_lr outside [0, lr],
/// warmup_steps outside [0, steps], negative weight_decay, grad_clip or
/// intervals, resume without out_dir).
void validate(const TrainOptions& options);

/// Called by train() after every step.
using ProgressCallback = std::function<void(const Progress&)>;

/// What train() did.
struct TrainResult {
  std::vector<LossRecord> history;  ///< every step from 1 (resumes included)
  int64_t first_step = 1;           ///< the first step this call ran
  int64_t last_step = 0;       ///< the last step done (== first_step - 1: none)
  double val_loss = kNoValue;  ///< the last validation loss
};

/// Trains `task.model()`: for each step, set the scheduled learning rate,
/// compute the batch loss, backpropagate, clip the gradient norm, take an
/// AdamW step; validate, checkpoint and write the loss curve on schedule.
/// With options.resume() it first restores the checkpoint in out_dir
/// (weights, optimizer, step, RNG state, history) and continues after its
/// step; the checkpoint must come from a run with the same fingerprint
/// (task settings, seed and these options, apart from stop_at,
/// checkpoint_every, eval_every and resume).
///
/// Validation runs every eval_every steps and at step `steps` (not at
/// stop_at), so an interrupted and resumed run records exactly what the
/// uninterrupted one does. Checkpoints (and loss.csv, loss.svg) are written
/// every checkpoint_every steps and at the run's last step (stop_at or
/// steps).
///
/// Throws c10::Error on invalid options (see validate()), when resuming
/// finds no checkpoint or one with another fingerprint, when the loss
/// becomes NaN or infinite, and when files cannot be written.
///
/// Data-parallel training: with a ProcessGroup `group` of world size W,
/// every rank calls train() with the same task settings and options, and
/// the job as a whole takes exactly the steps one process takes with the
/// same (global) batch size, as DDP does:
///   * rank 0's initial weights (or its checkpoint's weights, optimizer
///     state and history, when resuming) are broadcast to every rank; the
///     checkpoint may come from a run with any world size;
///   * rank r computes the rows task.shard().rows(batch) of every global
///     batch (Shard{r, W}); its loss is divided by the global count of real
///     tokens, so the gradients summed over ranks (GradientSynchronizer,
///     kSum) are the gradient of the whole batch's mean loss, however
///     padding falls;
///   * gradient clipping and the AdamW step then run identically on every
///     rank, and the parameters stay identical;
///   * the reported training and validation losses are the global ones
///     (validation is sharded too), the same on every rank;
///   * rank 0 alone writes checkpoints and the loss curve (other ranks
///     ignore out_dir); on_progress is called on every rank;
///   * ranks other than 0 draw dropout from LibTorch's default generator
///     reseeded per rank (SeedStream::kRankDropout), so with dropout the
///     job is not bit-identical to one process, only equal in law.
/// The task's shard is set for the run and restored to {0, 1} at the end.
/// Throws c10::Error also when the batch size is smaller than W, and when
/// a collective fails (a rank died, or the group's timeout passed).
TrainResult train(TrainTask& task, const TrainOptions& options,
                  const ProgressCallback& on_progress = {},
                  distributed::ProcessGroup* group = nullptr);

}  // namespace mha::train
