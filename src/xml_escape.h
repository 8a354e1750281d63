// Internal: text escaping for the SVG files the library writes.
#pragma once

#include <string>

namespace mha::detail {

/// `text` safe inside XML element content and attribute values: & < > " '
/// as entities, control characters other than tab (not allowed in XML 1.0)
/// as spaces.
inline std::string xml_escape(const std::string& text) {
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

}  // namespace mha::detail
