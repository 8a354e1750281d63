// Progress of a training run (part of mha/train.h): what train() reports
// after each step, when to show it, and the one-line text of it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mha::train {

/// What train() reports after each step.
struct Progress {
  int64_t step = 0;           ///< the step just done (1-based)
  int64_t steps = 0;          ///< total steps of the run
  double loss = 0.0;          ///< this step's training loss
  double lr = 0.0;            ///< this step's learning rate
  double tokens_per_s = 0.0;  ///< since the start (or resume) of this process
  double elapsed_s = 0.0;     ///< training time, resumes included
  double eta_s = 0.0;         ///< estimated time to `steps` (or stop_at)
  std::optional<double> val_loss;  ///< when this step validated
  bool checkpointed = false;       ///< when this step wrote a checkpoint
};

// --------------------------------------------------------------- progress ---

/// Decides when to show a progress line: on a terminal (interactive) at
/// most every `min_interval_s` seconds, redrawn in place; in a log at most
/// `max_lines` times a run (every ceil(steps / max_lines) steps), plus steps
/// that validated or checkpointed, plus the last step.
class ProgressThrottle {
 public:
  /// A throttle for a run of `steps` steps; `interactive`: on a terminal.
  ProgressThrottle(bool interactive, int64_t steps, double min_interval_s = 0.2,
                   int64_t max_lines = 20);
  /// True if `progress` (at `now_s` seconds on any steady clock) should be
  /// shown.
  bool should_show(const Progress& progress, double now_s);

 private:
  bool interactive_;
  int64_t steps_;
  double min_interval_s_;
  int64_t every_;
  double last_shown_s_ = -1e300;
};

/// One progress line, e.g.
/// `step  120/3000 | loss 1.2345 | lr 1.00e-03 | 52.3k tok/s | ETA 1m05s`,
/// with ` | val 1.1000` when the step validated and ` | saved` when it
/// checkpointed.
std::string format_progress(const Progress& progress);

/// A duration as `42s`, `3m05s` or `1h02m`.
std::string format_duration(double seconds);

}  // namespace mha::train
