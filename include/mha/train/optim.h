// Optimisation for mha-train (part of mha/train.h): the learning rate
// schedule and AdamW with nanoGPT's two parameter groups.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>

namespace mha::train {

// ------------------------------------------------------- optimisation ---

/// Linear warmup from 0 to peak_lr over warmup_steps, then cosine decay to
/// min_lr at total_steps (Loshchilov & Hutter 2017, without restarts).
/// Steps count from 1.
struct LrSchedule {
  /// Learning rate at the end of the warmup.
  double peak_lr = 1e-3;
  /// Learning rate at total_steps and after.
  double min_lr = 1e-4;
  /// Steps of the linear warmup (0: none).
  int64_t warmup_steps = 100;
  /// Step at which the cosine decay reaches min_lr.
  int64_t total_steps = 1000;
  /// The learning rate of `step` (1-based): peak_lr * step / warmup_steps
  /// while step <= warmup_steps; then min_lr + (peak_lr - min_lr) *
  /// (1 + cos(pi * progress)) / 2 with progress = (step - warmup_steps) /
  /// (total_steps - warmup_steps), clamped to [0, 1].
  double at(int64_t step) const;
};

/// AdamW (Loshchilov & Hutter 2019) over `module`'s parameters in two
/// groups, as nanoGPT: weight decay on matrices (dim >= 2: linear and
/// embedding weights), none on vectors (biases, LayerNorm weights).
std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module,
                                                double lr, double weight_decay,
                                                double beta1 = 0.9,
                                                double beta2 = 0.95);

/// Sets the learning rate of every parameter group of an AdamW optimizer.
void set_learning_rate(torch::optim::AdamW& optimizer, double lr);

}  // namespace mha::train
