// Pictures of attention weights: an SVG heatmap grid (one panel per head)
// and a terminal view of the same, so that a mask or a trained head can be
// seen rather than read off a printed tensor. Pure text output, no
// dependency beyond LibTorch.
//
// Glossary: H heads (panels), L query rows, S key columns.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace mha::plot {

/// Labels and titles of a heatmap; every field is optional.
struct HeatmapOptions {
  /// One label per query row (L), e.g. the tokens; empty: row numbers.
  std::vector<std::string> row_labels;
  /// One label per key column (S); empty: column numbers.
  std::vector<std::string> col_labels;
  /// One title per panel (H); empty: "head 0", "head 1", ...
  std::vector<std::string> panel_titles;
  /// A title above the whole picture.
  std::string title;
  /// Side of one cell in SVG pixels (> 0).
  int cell_size = 18;
};

/// Renders `weights` as an SVG document: a grid of panels (one per head)
/// with a colour scale (viridis, from 0 to the largest weight) and its
/// legend. Cells exactly 0 (masked positions, fully masked rows) are drawn
/// as a grey hatch, visibly distinct from small weights, and carry
/// class="cell masked"; the others class="cell". Every cell has data-head,
/// data-row and data-col attributes.
///
/// weights: (L, S) or (H, L, S), floating, finite and >= 0 (attention
/// weights, averaged or per head), on any device.
/// Throws c10::Error for another rank, a non-floating dtype, NaN, +-inf or
/// negative values, and for label or title counts that do not match.
std::string heatmap_svg(const torch::Tensor& weights,
                        const HeatmapOptions& options = {});

/// heatmap_svg written to `path`. Throws c10::Error (naming the path) if the
/// file cannot be written, or as heatmap_svg.
void write_heatmap_svg(const torch::Tensor& weights, const std::string& path,
                       const HeatmapOptions& options = {});

/// How the terminal view draws a cell.
enum class TerminalStyle {
  kAscii,     ///< ".:-=+*#%@": '.' exactly 0, then 8 levels (any output)
  kUnicode,   ///< '·' exactly 0, then ░ ▒ ▓ █ (UTF-8 terminals)
  kColor256,  ///< two-space cells on 256-colour grey backgrounds, '··' for 0
};

/// The terminal view: per panel a title line, then one line per query row:
/// its label (right-aligned), a space, and one cell per key (two columns
/// wide for kColor256). Levels are relative to the largest weight, as in the
/// SVG; an exact 0 has its own symbol. Ends with a legend line.
/// Same input rules and errors as heatmap_svg (cell_size is ignored).
std::string heatmap_text(const torch::Tensor& weights,
                         TerminalStyle style = TerminalStyle::kAscii,
                         const HeatmapOptions& options = {});

/// kColor256 when `is_terminal` and the TERM environment variable names a
/// colour terminal, kUnicode when it is a terminal otherwise, else kAscii.
TerminalStyle terminal_style_for(bool is_terminal);

}  // namespace mha::plot
