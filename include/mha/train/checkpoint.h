// Checkpoints of a training run (part of mha/train.h): where a run's files
// go, and saving and restoring everything exact resume needs.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "mha/train/report.h"

namespace mha::train {

/// The paths of a run's files under out_dir: checkpoint/model.safetensors
/// (the weights, for mha::load_state_dict), checkpoint/trainer.pt (optimizer,
/// step, RNG state, loss history, fingerprint; LibTorch serialization),
/// loss.csv and loss.svg.
struct RunFiles {
  /// The paths under `out_dir` (nothing is created).
  explicit RunFiles(const std::string& out_dir);
  /// out_dir/checkpoint, swapped in as a whole directory.
  std::string checkpoint_dir;
  /// checkpoint/model.safetensors: the weights.
  std::string model;
  /// checkpoint/trainer.pt: optimizer, step, RNG state, loss history.
  std::string trainer;
  /// loss.csv: step, lr, train_loss, val_loss, tokens_per_s, elapsed_s.
  std::string loss_csv;
  /// loss.svg: the loss curve (mha::train::write_loss_svg).
  std::string loss_svg;
};

/// Saves a checkpoint under `files.checkpoint_dir` (see RunFiles): written
/// into a temporary directory (every file fsync'ed), then swapped in by
/// renames (the old one to checkpoint_dir + ".old", the new one in place,
/// the old one removed), so that a process killed at any moment leaves a
/// complete checkpoint (recover_checkpoint). `history` is every record so
/// far; its last step is the checkpoint's step.
void save_checkpoint(const RunFiles& files, const torch::nn::Module& model,
                     torch::optim::Optimizer& optimizer,
                     const std::vector<LossRecord>& history,
                     const std::string& fingerprint);

/// Completes a checkpoint swap that a crash interrupted: when
/// checkpoint_dir is missing and checkpoint_dir + ".old" holds a complete
/// checkpoint, renames it back. Returns true when it did. load_checkpoint
/// and save_checkpoint call it first.
bool recover_checkpoint(const RunFiles& files);

/// Restores a checkpoint written by save_checkpoint into `model` and
/// `optimizer` (tensors go to the model's device), restores LibTorch's
/// default CPU generator, and returns the history (its last step is the
/// checkpoint's step). Throws c10::Error naming the directory if there is no
/// checkpoint, or if its fingerprint differs from `fingerprint` (both are
/// shown).
std::vector<LossRecord> load_checkpoint(const RunFiles& files,
                                        torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& fingerprint);

}  // namespace mha::train
