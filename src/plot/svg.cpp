// The SVG writer of src/plot/svg.h, shared by the attention heatmap
// (src/plot/plot.cpp) and the loss curve (src/train/report.cpp).
#include "plot/svg.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace mha::detail {

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t') {
          out += ' ';
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string svg_number(double value, int decimals) {
  const int size = std::snprintf(nullptr, 0, "%.*f", decimals, value);
  std::string out(static_cast<size_t>(std::max(size, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, "%.*f", decimals, value);
  return out;
}

SvgWriter::SvgWriter(double width, double height, int font_size,
                     bool xml_declaration) {
  if (xml_declaration) {
    out_ << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  }
  const std::string w = svg_number(width, 0), h = svg_number(height, 0);
  open("svg", {{"xmlns", "http://www.w3.org/2000/svg"},
               {"width", w},
               {"height", h},
               {"viewBox", "0 0 " + w + " " + h},
               {"font-family", "sans-serif"},
               {"font-size", std::to_string(font_size)}});
}

void SvgWriter::write_attributes(SvgAttributes attributes) {
  for (const auto& [name, value] : attributes) {
    out_ << ' ' << name << "=\"" << xml_escape(value) << '"';
  }
}

void SvgWriter::start_tag(const char* tag, SvgAttributes attributes) {
  out_ << '<' << tag;
  write_attributes(attributes);
}

void SvgWriter::element(const char* tag, SvgAttributes attributes) {
  start_tag(tag, attributes);
  out_ << "/>\n";
}

void SvgWriter::element(const char* tag, SvgAttributes attributes,
                        const std::string& inner) {
  start_tag(tag, attributes);
  out_ << '>' << inner << "</" << tag << ">\n";
}

void SvgWriter::text(SvgAttributes attributes, const std::string& text) {
  element("text", attributes, xml_escape(text));
}

void SvgWriter::line(double x1, double y1, double x2, double y2,
                     SvgAttributes attributes) {
  start_tag("line", {{"x1", svg_number(x1, 1)},
                     {"y1", svg_number(y1, 1)},
                     {"x2", svg_number(x2, 1)},
                     {"y2", svg_number(y2, 1)}});
  write_attributes(attributes);
  out_ << "/>\n";
}

void SvgWriter::polyline(SvgAttributes attributes, const std::string& points) {
  start_tag("polyline", attributes);
  out_ << " points=\"" << points << "\"/>\n";
}

void SvgWriter::open(const char* tag, SvgAttributes attributes) {
  start_tag(tag, attributes);
  out_ << ">\n";
}

void SvgWriter::close(const char* tag) { out_ << "</" << tag << ">\n"; }

void SvgWriter::raw(const std::string& markup) { out_ << markup; }

std::string SvgWriter::finish() {
  close("svg");
  return out_.str();
}

}  // namespace mha::detail
