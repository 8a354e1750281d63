// Tests of mha::plot: the SVG heatmap and the terminal view.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mha/plot.h"
#include "test_helpers.h"

namespace {

/// A small well-formedness check: every tag closes in order, attributes are
/// quoted, and the document has one root element.
bool well_formed_xml(const std::string& xml, std::string& why) {
  std::vector<std::string> open;
  int roots = 0;
  size_t pos = 0;
  static const std::regex kTag(
      R"re(^<(/?)([A-Za-z_][\w:.-]*)((?:\s+[\w:.-]+="[^"<]*")*)\s*(/?)>)re");
  while ((pos = xml.find('<', pos)) != std::string::npos) {
    if (xml.compare(pos, 2, "<?") == 0) {
      pos = xml.find("?>", pos);
      if (pos == std::string::npos) {
        why = "unterminated <?";
        return false;
      }
      continue;
    }
    std::smatch m;
    const std::string rest = xml.substr(pos, 2000);
    if (!std::regex_search(rest, m, kTag)) {
      why = "malformed tag at " + std::to_string(pos) + ": " +
            xml.substr(pos, 40);
      return false;
    }
    const bool closing = m[1].length() > 0, self_closing = m[4].length() > 0;
    const std::string name = m[2];
    if (closing) {
      if (open.empty() || open.back() != name) {
        why = "</" + name + "> does not close " +
              (open.empty() ? std::string("anything") : open.back());
        return false;
      }
      open.pop_back();
    } else {
      if (open.empty()) {
        ++roots;
      }
      if (!self_closing) {
        open.push_back(name);
      }
    }
    pos += m[0].length();
  }
  if (!open.empty()) {
    why = "<" + open.back() + "> never closed";
    return false;
  }
  if (roots != 1) {
    why = std::to_string(roots) + " root elements";
    return false;
  }
  return true;
}

/// (head, row, col) of every cell with class "cell masked".
std::set<std::tuple<int, int, int>> masked_cells(const std::string& svg) {
  std::set<std::tuple<int, int, int>> cells;
  static const std::regex kMasked(
      R"re(<rect class="cell masked" data-head="(\d+)" data-row="(\d+)" data-col="(\d+)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), kMasked);
       it != std::sregex_iterator(); ++it) {
    cells.insert(
        {std::stoi((*it)[1]), std::stoi((*it)[2]), std::stoi((*it)[3])});
  }
  return cells;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t pos = 0; (pos = text.find(what, pos)) != std::string::npos;
       pos += what.size()) {
    ++n;
  }
  return n;
}

/// Causal softmax weights (H, 3, 3): exact zeros above the diagonal.
torch::Tensor causal_weights(int64_t H) {
  auto scores = torch::randn({H, 3, 3});
  auto blocked = torch::ones({3, 3}, torch::kBool).triu(1);
  return torch::softmax(scores.masked_fill(blocked, -INFINITY), -1);
}

TEST(PlotTest, CausalSvgIsXmlWithPanelsAndMaskedUpperTriangle) {
  torch::manual_seed(0);
  for (int64_t H : {1, 3}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    mha::plot::HeatmapOptions options;
    options.row_labels = {"a", "b", "<c>"};  // escaped in the XML
    options.col_labels = {"a", "b", "<c>"};
    options.title = "causal & co";
    auto weights = H == 1 ? causal_weights(1)[0] : causal_weights(H);
    const auto svg = mha::plot::heatmap_svg(weights, options);
    std::string why;
    EXPECT_TRUE(well_formed_xml(svg, why)) << why;
    EXPECT_EQ(count(svg, "<g class=\"panel\""), H);
    EXPECT_EQ(count(svg, "<rect class=\"cell"), H * 9);
    std::set<std::tuple<int, int, int>> expected;
    for (int h = 0; h < H; ++h) {
      expected.insert({{h, 0, 1}, {h, 0, 2}, {h, 1, 2}});
    }
    EXPECT_EQ(masked_cells(svg), expected);
    EXPECT_NE(svg.find("&lt;c&gt;"), std::string::npos);
    EXPECT_NE(svg.find("causal &amp; co"), std::string::npos);
  }
}

TEST(PlotTest, TinyWeightsAreNotMasked) {
  auto weights = torch::tensor({{1.0, 1e-30}, {0.0, 0.5}});
  const auto svg = mha::plot::heatmap_svg(weights);
  EXPECT_EQ(masked_cells(svg),
            (std::set<std::tuple<int, int, int>>{{0, 1, 0}}));
}

TEST(PlotTest, TerminalViewOfAKnownMatrix) {
  auto weights = torch::tensor({{1.0, 0.0, 0.1}, {0.5, 0.25, 0.875}});
  mha::plot::HeatmapOptions options;
  options.row_labels = {"q0", "query1"};
  EXPECT_EQ(mha::plot::heatmap_text(weights, mha::plot::TerminalStyle::kAscii,
                                    options),
            "head 0\n"
            "    q0 @.:\n"
            "query1 *=@\n"
            "scale: '.' = exactly 0 (masked), :-=+*#%@ = (0, 1]\n");
  EXPECT_EQ(
      mha::plot::heatmap_text(weights, mha::plot::TerminalStyle::kUnicode),
      "head 0\n"
      "0 █·░\n"
      "1 ▓▒█\n"
      "scale: · = exactly 0 (masked), ░▒▓█ = (0, 1]\n");
  const auto colour =
      mha::plot::heatmap_text(weights, mha::plot::TerminalStyle::kColor256);
  EXPECT_EQ(count(colour, "\x1b[48;5;"), 5);  // every non-zero cell
  EXPECT_EQ(count(colour, "··"), 2);          // the zero cell + legend
  EXPECT_EQ(mha::plot::terminal_style_for(false),
            mha::plot::TerminalStyle::kAscii);
}

TEST(PlotTest, BadInputGivesClearErrors) {
  EXPECT_THROW_MSG(mha::plot::heatmap_svg(torch::rand({4})),
                   "weights must be (L, S) or (H, L, S), but got [4]");
  EXPECT_THROW_MSG(mha::plot::heatmap_svg(torch::rand({1, 2, 3, 4})),
                   "but got [1, 2, 3, 4]");
  EXPECT_THROW_MSG(
      mha::plot::heatmap_svg(torch::tensor({{0.5, std::nan("")}, {1.0, 0.0}})),
      "weights must be finite, but got NaN or inf");
  EXPECT_THROW_MSG(mha::plot::heatmap_text(torch::tensor({{-0.5, 1.0}})),
                   "weights must be >= 0, but the smallest is -0.5");
  EXPECT_THROW_MSG(mha::plot::heatmap_svg(torch::ones({2, 2}, torch::kLong)),
                   "weights must be floating, but got dtype Long");
  mha::plot::HeatmapOptions options;
  options.col_labels = {"x"};
  EXPECT_THROW_MSG(mha::plot::heatmap_svg(torch::rand({2, 3}), options),
                   "col_labels must be empty or have S = 3 entries, but got 1");
  EXPECT_THROW_MSG(mha::plot::write_heatmap_svg(torch::rand({2, 2}),
                                                "/nonexistent-dir/map.svg"),
                   "cannot open '/nonexistent-dir/map.svg' for writing");
}

}  // namespace
