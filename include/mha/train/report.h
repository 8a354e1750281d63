// What a training run leaves for a person to read (part of mha/train.h):
// the per-step loss records, as CSV and as an SVG plot.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace mha::train {

// ------------------------------------------------------------ loss curve ---

/// Marks a loss that was not measured (a quiet NaN).
constexpr double kNoValue = std::numeric_limits<double>::quiet_NaN();

/// One training step's record.
struct LossRecord {
  int64_t step = 0;            ///< 1-based
  double lr = 0.0;             ///< learning rate used by this step
  double train_loss = 0.0;     ///< nats per token, this step's batch
  double val_loss = kNoValue;  ///< nats per token; NaN: not evaluated
  double tokens_per_s = 0.0;   ///< training throughput over this step
  double elapsed_s = 0.0;      ///< training time since step 1 (resumes add up)
};

/// Writes `records` as CSV with the header
/// `step,lr,train_loss,val_loss,tokens_per_s,elapsed_s` (val_loss empty where
/// not evaluated). Throws c10::Error naming the path if it cannot be written.
void write_loss_csv(const std::vector<LossRecord>& records,
                    const std::string& path);

/// Writes an SVG plot of the loss curve (opens in any web browser): training
/// loss per step (light), its moving average (dark), validation loss
/// (points), on a logarithmic loss axis, with axes, ticks, a legend and
/// `title`. Throws c10::Error naming the path if it cannot be written or if
/// records is empty.
void write_loss_svg(const std::vector<LossRecord>& records,
                    const std::string& title, const std::string& path);

}  // namespace mha::train
