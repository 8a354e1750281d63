// Progress lines of a training run: when to show one (ProgressThrottle)
// and its text (format_progress, format_duration).
#include "mha/train/progress.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common.h"

namespace mha::train {

using detail::printf_string;

// --------------------------------------------------------------- progress ---

ProgressThrottle::ProgressThrottle(bool interactive, int64_t steps,
                                   double min_interval_s, int64_t max_lines)
    : interactive_(interactive),
      steps_(steps),
      min_interval_s_(min_interval_s),
      every_(
          std::max<int64_t>(1, (steps + std::max<int64_t>(max_lines, 1) - 1) /
                                   std::max<int64_t>(max_lines, 1))) {}

bool ProgressThrottle::should_show(const Progress& progress, double now_s) {
  bool show;
  if (progress.step >= steps_ || progress.val_loss || progress.checkpointed) {
    show = true;
  } else if (interactive_) {
    show = now_s - last_shown_s_ >= min_interval_s_;
  } else {
    show = progress.step % every_ == 0;
  }
  if (show) {
    last_shown_s_ = now_s;
  }
  return show;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<long long>(std::llround(std::max(seconds, 0.0)));
  if (s < 60) {
    return printf_string("%llds", s);
  }
  if (s < 3600) {
    return printf_string("%lldm%02llds", s / 60, s % 60);
  }
  return printf_string("%lldh%02lldm", s / 3600, (s % 3600) / 60);
}

std::string format_progress(const Progress& p) {
  const int width = static_cast<int>(std::to_string(p.steps).size());
  const double rate = p.tokens_per_s;
  const std::string tokens =
      rate >= 1e6 ? printf_string("%.2fM", rate / 1e6)
                  : (rate >= 1e3 ? printf_string("%.1fk", rate / 1e3)
                                 : printf_string("%.0f", rate));
  std::string line = printf_string(
      "step %*lld/%lld | loss %.4f | lr %.2e | %s tok/s | ETA %s", width,
      static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss,
      p.lr, tokens.c_str(), format_duration(p.eta_s).c_str());
  if (p.val_loss) {
    line += printf_string(" | val %.4f", *p.val_loss);
  }
  if (p.checkpointed) {
    line += " | saved";
  }
  return line;
}

}  // namespace mha::train
