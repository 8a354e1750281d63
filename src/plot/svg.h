// Internal: the one SVG vocabulary of the library's pictures (the attention
// heatmap of mha/plot.h, the loss curve of mha-train). XML escaping lives
// here too; files are written by atomic_file.h.
#pragma once

#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

namespace mha::detail {

/// `text` safe inside XML element content and attribute values: & < > " '
/// as entities, control characters other than tab (not allowed in XML 1.0)
/// as spaces.
std::string xml_escape(const std::string& text);

/// `value` with `decimals` digits after the point ("%.*f"): SVG coordinates.
std::string svg_number(double value, int decimals);

/// The attributes of an element, in order: name and value (escaped when
/// written).
using SvgAttributes =
    std::initializer_list<std::pair<const char*, std::string>>;

/// Writes an SVG document element by element, one element a line.
///
/// Example:
///   SvgWriter svg(/*width=*/200, /*height=*/100, /*font_size=*/12);
///   svg.rect({{"width", "100%"}, {"height", "100%"}, {"fill", "white"}});
///   svg.text({{"x", "10"}, {"y", "20"}}, "a < b");  // escaped
///   const std::string document = svg.finish();
class SvgWriter {
 public:
  /// Starts the document: the XML declaration when `xml_declaration`, then
  /// <svg xmlns=... width height viewBox="0 0 width height"
  /// font-family="sans-serif" font-size=font_size> (sizes as integers).
  SvgWriter(double width, double height, int font_size,
            bool xml_declaration = false);

  /// <tag attributes/>
  void element(const char* tag, SvgAttributes attributes);
  /// <tag attributes>inner</tag>, `inner` being markup (written as is).
  void element(const char* tag, SvgAttributes attributes,
               const std::string& inner);
  /// <text attributes>text</text>, `text` escaped.
  void text(SvgAttributes attributes, const std::string& text);
  /// <line x1 y1 x2 y2 attributes/>, coordinates with one decimal.
  void line(double x1, double y1, double x2, double y2,
            SvgAttributes attributes);
  /// <polyline attributes points="x,y x,y ..."/>, `points` as given.
  void polyline(SvgAttributes attributes, const std::string& points);
  /// <rect attributes/>
  void rect(SvgAttributes attributes) { element("rect", attributes); }
  /// <tag attributes> on a line of its own; close(tag) ends it.
  void open(const char* tag, SvgAttributes attributes);
  void close(const char* tag);
  /// Markup written as is (definitions such as patterns and gradients).
  void raw(const std::string& markup);

  /// Ends the document (</svg>) and returns it.
  std::string finish();

 private:
  void write_attributes(SvgAttributes attributes);
  void start_tag(const char* tag, SvgAttributes attributes);
  std::ostringstream out_;
};

}  // namespace mha::detail
