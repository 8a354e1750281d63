// The loss curve of a run: loss.csv (exact numbers) and loss.svg (a plot
// with log loss axis, moving average and validation points).
#include "mha/train/report.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

#include "common.h"
#include "io/atomic_file.h"
#include "plot/svg.h"

namespace mha::train {

using detail::exact_decimal;
using detail::printf_string;

// ------------------------------------------------------------ loss curve ---

namespace {

/// Round tick positions covering [lo, hi], about `target` of them.
std::vector<double> linear_ticks(double lo, double hi, int target) {
  const double raw = (hi - lo) / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * magnitude;
    if ((hi - lo) / step <= target) {
      break;
    }
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + 1e-9 * step;
       t += step) {
    ticks.push_back(t);
  }
  return ticks;
}

/// Tick values on a log axis spanning [10^lo, 10^hi]: the finest of the
/// mantissa sets {1..9}, {1, 2, 5}, {1} that gives at most 10 ticks.
std::vector<double> log_ticks(double lo, double hi) {
  const std::vector<std::vector<double>> mantissa_sets = {
      {1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 2, 5}, {1}};
  std::vector<double> ticks;
  for (const auto& mantissas : mantissa_sets) {
    ticks.clear();
    for (int e = static_cast<int>(std::floor(lo)) - 1;
         e <= static_cast<int>(std::ceil(hi)); ++e) {
      for (const double m : mantissas) {
        const double v = m * std::pow(10.0, e);
        const double lv = std::log10(v);
        if (lv >= lo && lv <= hi) {
          ticks.push_back(v);
        }
      }
    }
    if (ticks.size() <= 10) {
      break;
    }
  }
  return ticks;
}

}  // namespace

void write_loss_csv(const std::vector<LossRecord>& records,
                    const std::string& path) {
  std::ostringstream file;
  file << "step,lr,train_loss,val_loss,tokens_per_s,elapsed_s\n";
  for (const auto& r : records) {
    file << r.step << ',' << exact_decimal(r.lr) << ','
         << exact_decimal(r.train_loss) << ','
         << (std::isnan(r.val_loss) ? "" : exact_decimal(r.val_loss)) << ','
         << printf_string("%.1f", r.tokens_per_s) << ','
         << printf_string("%.3f", r.elapsed_s) << '\n';
  }
  mha::detail::write_text_file(path, file.str(), "write_loss_csv");
}

void write_loss_svg(const std::vector<LossRecord>& records,
                    const std::string& title, const std::string& path) {
  TORCH_CHECK(!records.empty(), "write_loss_svg: no records to plot for '",
              path, "'");
  // Plot area in SVG pixels.
  constexpr double kWidth = 800, kHeight = 460;
  constexpr double kLeft = 70, kRight = 20, kTop = 44, kBottom = 56;
  constexpr double kPlotW = kWidth - kLeft - kRight;
  constexpr double kPlotH = kHeight - kTop - kBottom;

  // Ranges: steps linearly, losses on a log10 scale.
  const double x0 = static_cast<double>(records.front().step);
  const double x1 = std::max(static_cast<double>(records.back().step), x0 + 1);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& r : records) {
    for (const double v : {r.train_loss, r.val_loss}) {
      if (std::isfinite(v) && v > 0) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  }
  if (!std::isfinite(lo)) {
    lo = 0.1;
    hi = 10.0;
  }
  double y0 = std::log10(lo), y1 = std::log10(hi);
  const double pad = std::max(0.05 * (y1 - y0), 0.02);
  y0 -= pad;
  y1 += pad;
  auto px = [&](double step) {
    return kLeft + (step - x0) / (x1 - x0) * kPlotW;
  };
  auto py = [&](double loss) {
    return kTop + (y1 - std::log10(loss)) / (y1 - y0) * kPlotH;
  };
  auto plottable = [](double v) { return std::isfinite(v) && v > 0; };

  // The raw training loss, averaged in buckets to at most ~1000 points, and
  // its exponential moving average (bias-corrected, over ~2% of the run).
  // Both average log(loss), the quantity the axis shows.
  const auto count = static_cast<int64_t>(records.size());
  const int64_t bucket = std::max<int64_t>(1, (count + 999) / 1000);
  std::string raw_points, smooth_points;
  const double beta = 1.0 - 1.0 / std::clamp<double>(count / 50.0, 1.0, 200.0);
  double ema = 0.0, ema_weight = 0.0;
  for (int64_t begin = 0; begin < count; begin += bucket) {
    const int64_t end = std::min(count, begin + bucket);
    double step_sum = 0, log_sum = 0;
    int64_t n = 0;
    for (int64_t i = begin; i < end; ++i) {
      const auto& r = records[i];
      if (plottable(r.train_loss)) {
        const double log_loss = std::log(r.train_loss);
        step_sum += static_cast<double>(r.step);
        log_sum += log_loss;
        ++n;
        ema = beta * ema + (1 - beta) * log_loss;
        ema_weight = beta * ema_weight + (1 - beta);
      }
    }
    if (n > 0) {
      raw_points += printf_string("%.1f,%.1f ", px(step_sum / n),
                                  py(std::exp(log_sum / n)));
    }
    if (ema_weight > 0) {
      smooth_points += printf_string(
          "%.1f,%.1f ", px(static_cast<double>(records[end - 1].step)),
          py(std::exp(ema / ema_weight)));
    }
  }
  std::string val_points;
  for (const auto& r : records) {
    if (plottable(r.val_loss)) {
      val_points += printf_string("%.1f,%.1f ", px(static_cast<double>(r.step)),
                                  py(r.val_loss));
    }
  }

  auto f1 = [](double v) { return mha::detail::svg_number(v, 1); };
  mha::detail::SvgWriter svg(kWidth, kHeight, /*font_size=*/12);
  svg.rect({{"width", "100%"}, {"height", "100%"}, {"fill", "white"}});
  svg.text({{"x", f1(kWidth / 2)},
            {"y", "26"},
            {"text-anchor", "middle"},
            {"font-size", "15"}},
           title);
  // Grid and tick labels.
  for (const double t : linear_ticks(x0, x1, 8)) {
    const double x = px(t);
    svg.line(x, kTop, x, kTop + kPlotH, {{"stroke", "#e5e5e5"}});
    svg.text({{"x", f1(x)},
              {"y", f1(kTop + kPlotH + 16)},
              {"text-anchor", "middle"}},
             printf_string("%.0f", t));
  }
  for (const double t : log_ticks(y0, y1)) {
    const double y = py(t);
    svg.line(kLeft, y, kLeft + kPlotW, y, {{"stroke", "#e5e5e5"}});
    svg.text({{"x", f1(kLeft - 6)}, {"y", f1(y + 4)}, {"text-anchor", "end"}},
             printf_string("%g", t));
  }
  svg.rect({{"x", f1(kLeft)},
            {"y", f1(kTop)},
            {"width", f1(kPlotW)},
            {"height", f1(kPlotH)},
            {"fill", "none"},
            {"stroke", "#333"}});
  svg.text({{"x", f1(kLeft + kPlotW / 2)},
            {"y", f1(kHeight - 14)},
            {"text-anchor", "middle"}},
           "step");
  svg.text(
      {{"transform", "translate(18 " + f1(kTop + kPlotH / 2) + ") rotate(-90)"},
       {"text-anchor", "middle"}},
      "loss (nats per token, log scale)");
  // Curves.
  svg.polyline({{"fill", "none"}, {"stroke", "#9ecae1"}, {"stroke-width", "1"}},
               raw_points);
  svg.polyline({{"fill", "none"}, {"stroke", "#08519c"}, {"stroke-width", "2"}},
               smooth_points);
  if (!val_points.empty()) {
    svg.polyline(
        {{"fill", "none"}, {"stroke", "#e6550d"}, {"stroke-width", "1.5"}},
        val_points);
    for (const auto& r : records) {
      if (plottable(r.val_loss)) {
        svg.element("circle", {{"cx", f1(px(static_cast<double>(r.step)))},
                               {"cy", f1(py(r.val_loss))},
                               {"r", "3.5"},
                               {"fill", "#e6550d"}});
      }
    }
  }
  // Legend, top right.
  const double lx = kLeft + kPlotW - 214, ly = kTop + 12;
  const std::array<std::pair<const char*, const char*>, 3> legend = {
      {{"#9ecae1", "training loss"},
       {"#08519c", "training loss, moving average"},
       {"#e6550d", "validation loss"}}};
  svg.rect({{"x", f1(lx - 6)},
            {"y", f1(ly - 8)},
            {"width", "206"},
            {"height", "58"},
            {"fill", "white"},
            {"fill-opacity", "0.85"},
            {"stroke", "#ccc"}});
  for (size_t i = 0; i < legend.size(); ++i) {
    const double y = ly + 18.0 * static_cast<double>(i);
    svg.line(lx, y + 2, lx + 20, y + 2,
             {{"stroke", legend[i].first}, {"stroke-width", "3"}});
    svg.text({{"x", f1(lx + 26)}, {"y", f1(y + 6)}}, legend[i].second);
  }
  mha::detail::write_text_file(path, svg.finish(), "write_loss_svg");
}

}  // namespace mha::train
