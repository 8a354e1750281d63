// Glossary: H heads (panels), L query rows, S key columns.
#include "mha/plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "io/atomic_file.h"
#include "plot/svg.h"

namespace mha::plot {
namespace {

/// The checked weights as float64 (H, L, S) on the CPU.
torch::Tensor checked_panels(const torch::Tensor& weights,
                             const HeatmapOptions& options) {
  TORCH_CHECK(weights.defined(), "heatmap: weights is an undefined tensor");
  TORCH_CHECK(weights.dim() == 2 || weights.dim() == 3,
              "heatmap: weights must be (L, S) or (H, L, S), but got ",
              weights.sizes());
  TORCH_CHECK(torch::isFloatingType(weights.scalar_type()),
              "heatmap: weights must be floating, but got dtype ",
              weights.scalar_type());
  auto w = weights.detach().to(torch::kCPU, torch::kFloat64);
  if (w.dim() == 2) {
    w = w.unsqueeze(0);  // (1, L, S)
  }
  TORCH_CHECK(torch::isfinite(w).all().item<bool>(),
              "heatmap: weights must be finite, but got NaN or inf (shape ",
              weights.sizes(), ")");
  TORCH_CHECK(w.numel() == 0 || w.min().item<double>() >= 0.0,
              "heatmap: weights must be >= 0, but the smallest is ",
              w.min().item<double>());
  const auto H = w.size(0), L = w.size(1), S = w.size(2);
  auto check_count = [](const std::vector<std::string>& v, int64_t n,
                        const char* name, const char* dim) {
    TORCH_CHECK(v.empty() || static_cast<int64_t>(v.size()) == n,
                "heatmap: ", name, " must be empty or have ", dim, " = ", n,
                " entries, but got ", v.size());
  };
  check_count(options.row_labels, L, "row_labels", "L");
  check_count(options.col_labels, S, "col_labels", "S");
  check_count(options.panel_titles, H, "panel_titles", "H");
  TORCH_CHECK(options.cell_size > 0, "heatmap: cell_size must be > 0, but got ",
              options.cell_size);
  return w.contiguous();
}

/// The largest weight, or 1 when every weight is 0.
double scale_max(const torch::Tensor& w) {
  const double m = w.numel() > 0 ? w.max().item<double>() : 0.0;
  return m > 0.0 ? m : 1.0;
}

std::string label(const std::vector<std::string>& labels, int64_t i) {
  return labels.empty() ? std::to_string(i) : labels[i];
}

std::string panel_title(const HeatmapOptions& options, int64_t h) {
  return options.panel_titles.empty() ? "head " + std::to_string(h)
                                      : options.panel_titles[h];
}

/// Viridis (the matplotlib colour map, perceptually uniform) at t in [0, 1],
/// interpolated between 9 anchors, as "#rrggbb".
std::string viridis(double t) {
  static constexpr std::array<std::array<double, 3>, 9> kAnchors = {{
      {68, 1, 84},
      {71, 44, 122},
      {59, 81, 139},
      {44, 113, 142},
      {33, 144, 141},
      {39, 173, 129},
      {92, 200, 99},
      {170, 220, 50},
      {253, 231, 37},
  }};
  t = std::clamp(t, 0.0, 1.0) * (kAnchors.size() - 1);
  const auto i = std::min<size_t>(static_cast<size_t>(t), kAnchors.size() - 2);
  const double f = t - static_cast<double>(i);
  std::ostringstream s;
  s << '#' << std::hex << std::setfill('0');
  for (int c = 0; c < 3; ++c) {
    const double v = kAnchors[i][c] * (1.0 - f) + kAnchors[i + 1][c] * f;
    s << std::setw(2) << static_cast<int>(std::lround(v));
  }
  return s.str();
}

std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(3) << v;
  return s.str();
}

}  // namespace

std::string heatmap_svg(const torch::Tensor& weights,
                        const HeatmapOptions& options) {
  const auto w = checked_panels(weights, options);
  const auto H = w.size(0), L = w.size(1), S = w.size(2);
  const double vmax = scale_max(w);
  const int cell = options.cell_size;
  // Room for labels: about 7 px per character at font size 11.
  size_t row_chars = 1, col_chars = 1;
  for (int64_t i = 0; i < L; ++i) {
    row_chars = std::max(row_chars, label(options.row_labels, i).size());
  }
  for (int64_t j = 0; j < S; ++j) {
    col_chars = std::max(col_chars, label(options.col_labels, j).size());
  }
  const int left = 10 + 7 * static_cast<int>(row_chars);
  const int top = 24 + 7 * static_cast<int>(col_chars);
  const int panel_w = left + static_cast<int>(S) * cell + 20;
  const int panel_h = top + static_cast<int>(L) * cell + 16;
  const auto columns =
      static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(H))));
  const auto grid_rows = (H + columns - 1) / columns;
  const int title_h = options.title.empty() ? 0 : 28;
  const int legend_h = 56;
  // About 8 px per character of the 14 px title.
  const int width = std::max({static_cast<int>(columns) * panel_w, 330,
                              20 + 8 * static_cast<int>(options.title.size())});
  const int height = title_h + static_cast<int>(grid_rows) * panel_h + legend_h;

  const auto n = [](int64_t v) { return std::to_string(v); };
  detail::SvgWriter svg(width, height, /*font_size=*/11,
                        /*xml_declaration=*/true);
  svg.raw(
      "<defs><pattern id=\"masked\" width=\"6\" height=\"6\" "
      "patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">"
      "<rect width=\"6\" height=\"6\" fill=\"#e0e0e0\"/>"
      "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#a0a0a0\" "
      "stroke-width=\"2\"/></pattern></defs>\n");
  svg.rect({{"width", "100%"}, {"height", "100%"}, {"fill", "white"}});
  if (!options.title.empty()) {
    svg.text({{"x", "10"}, {"y", "19"}, {"font-size", "14"}}, options.title);
  }
  const auto* data = w.data_ptr<double>();
  for (int64_t h = 0; h < H; ++h) {
    const int x0 = static_cast<int>(h % columns) * panel_w;
    const int y0 = title_h + static_cast<int>(h / columns) * panel_h;
    svg.open("g", {{"class", "panel"},
                   {"data-head", n(h)},
                   {"transform", "translate(" + n(x0) + "," + n(y0) + ")"}});
    svg.text({{"x", n(left)}, {"y", "14"}, {"font-size", "12"}},
             panel_title(options, h));
    for (int64_t j = 0; j < S; ++j) {
      const int x = left + static_cast<int>(j) * cell + cell / 2 + 4;
      svg.text({{"transform",
                 "translate(" + n(x) + "," + n(top - 4) + ") rotate(-90)"}},
               label(options.col_labels, j));
    }
    for (int64_t i = 0; i < L; ++i) {
      const int y = top + static_cast<int>(i) * cell;
      svg.text({{"x", n(left - 4)},
                {"y", n(y + cell / 2 + 4)},
                {"text-anchor", "end"}},
               label(options.row_labels, i));
      for (int64_t j = 0; j < S; ++j) {
        const double v = data[(h * L + i) * S + j];
        const bool masked = v == 0.0;
        svg.element("rect",
                    {{"class", masked ? "cell masked" : "cell"},
                     {"data-head", n(h)},
                     {"data-row", n(i)},
                     {"data-col", n(j)},
                     {"x", n(left + static_cast<int>(j) * cell)},
                     {"y", n(y)},
                     {"width", n(cell)},
                     {"height", n(cell)},
                     {"fill", masked ? "url(#masked)" : viridis(v / vmax)}},
                    "<title>" + number(v) + "</title>");
      }
    }
    svg.close("g");
  }
  // Legend: the colour scale from 0 to vmax, and the masked swatch.
  const int ly = title_h + static_cast<int>(grid_rows) * panel_h + 8;
  const int bar = 160;
  svg.open("g",
           {{"class", "legend"}, {"transform", "translate(10," + n(ly) + ")"}});
  std::string stops;
  for (int k = 0; k <= 8; ++k) {
    std::ostringstream offset;
    offset << k * 12.5;
    stops += "<stop offset=\"" + offset.str() + "%\" stop-color=\"" +
             viridis(k / 8.0) + "\"/>";
  }
  svg.raw("<defs><linearGradient id=\"scale\">" + stops +
          "</linearGradient></defs>\n");
  svg.rect({{"width", n(bar)},
            {"height", "12"},
            {"fill", "url(#scale)"},
            {"stroke", "#666"}});
  svg.text({{"x", "0"}, {"y", "26"}}, "> 0");
  svg.text({{"x", n(bar)}, {"y", "26"}, {"text-anchor", "end"}}, number(vmax));
  svg.rect({{"x", n(bar + 20)},
            {"width", "12"},
            {"height", "12"},
            {"fill", "url(#masked)"},
            {"stroke", "#666"}});
  svg.text({{"x", n(bar + 38)}, {"y", "10"}}, "exactly 0 (masked)");
  svg.close("g");
  return svg.finish();
}

void write_heatmap_svg(const torch::Tensor& weights, const std::string& path,
                       const HeatmapOptions& options) {
  detail::write_text_file(path, heatmap_svg(weights, options),
                          "write_heatmap_svg");
}

std::string heatmap_text(const torch::Tensor& weights, TerminalStyle style,
                         const HeatmapOptions& options) {
  const auto w = checked_panels(weights, options);
  const auto H = w.size(0), L = w.size(1), S = w.size(2);
  const double vmax = scale_max(w);
  static constexpr const char* kAsciiLevels = ":-=+*#%@";
  static constexpr std::array<const char*, 4> kShades = {"░", "▒", "▓", "█"};
  size_t width = 1;
  for (int64_t i = 0; i < L; ++i) {
    width = std::max(width, label(options.row_labels, i).size());
  }
  const auto* data = w.data_ptr<double>();
  std::ostringstream out;
  if (!options.title.empty()) {
    out << options.title << '\n';
  }
  for (int64_t h = 0; h < H; ++h) {
    out << panel_title(options, h) << '\n';
    for (int64_t i = 0; i < L; ++i) {
      const auto name = label(options.row_labels, i);
      out << std::string(width - std::min(width, name.size()), ' ') << name
          << ' ';
      for (int64_t j = 0; j < S; ++j) {
        const double v = data[(h * L + i) * S + j];
        const double t = v / vmax;  // (0, 1] for v > 0
        switch (style) {
          case TerminalStyle::kAscii:
            out << (v == 0.0 ? '.'
                             : kAsciiLevels[std::min<int>(
                                   7, static_cast<int>(t * 8.0))]);
            break;
          case TerminalStyle::kUnicode:
            out << (v == 0.0
                        ? "·"
                        : kShades[std::min<int>(3, static_cast<int>(t * 4.0))]);
            break;
          case TerminalStyle::kColor256:
            if (v == 0.0) {
              out << "··";
            } else {
              // The 24 greys 232..255, darkest for the smallest weights.
              const int grey = 232 + std::min(23, static_cast<int>(t * 24.0));
              out << "\x1b[48;5;" << grey << "m  \x1b[0m";
            }
            break;
        }
      }
      out << '\n';
    }
  }
  switch (style) {
    case TerminalStyle::kAscii:
      out << "scale: '.' = exactly 0 (masked), " << kAsciiLevels << " = (0, "
          << number(vmax) << "]\n";
      break;
    case TerminalStyle::kUnicode:
      out << "scale: · = exactly 0 (masked), ░▒▓█ = (0, " << number(vmax)
          << "]\n";
      break;
    case TerminalStyle::kColor256:
      out << "scale: ·· = exactly 0 (masked), dark to light grey = (0, "
          << number(vmax) << "]\n";
      break;
  }
  return out.str();
}

TerminalStyle terminal_style_for(bool is_terminal) {
  if (!is_terminal) {
    return TerminalStyle::kAscii;
  }
  const char* term = std::getenv("TERM");
  const std::string t = term ? term : "";
  if (t.find("256color") != std::string::npos ||
      t.find("truecolor") != std::string::npos) {
    return TerminalStyle::kColor256;
  }
  return t.empty() || t == "dumb" ? TerminalStyle::kAscii
                                  : TerminalStyle::kUnicode;
}

}  // namespace mha::plot
