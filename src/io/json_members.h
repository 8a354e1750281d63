// Internal, part of the bottom layer of state-dict I/O: a JSON object read
// member by member (nlohmann-json's SAX parser), never built whole, for the
// files whose size an attacker chooses: the safetensors header, mha::hf's
// model.safetensors.index.json. Only one member's value is built at a time,
// and at most a given number of JSON values in it; a member named as
// streamed (safetensors' __metadata__, the index's weight_map) is itself read
// member by member. Depends on nlohmann-json. Not installed.
//
// Glossary: a "member" is one key and its value in an object; the "top"
// object is the text's outermost value.
#pragma once

#include <cstddef>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>

namespace mha::detail {

/// What read_json_members calls as it reads.
class JsonMemberVisitor {
 public:
  virtual ~JsonMemberVisitor() = default;
  /// Whether the top member `key`, when its value is an object, is read
  /// member by member (begin_streamed, then inner() for each member) rather
  /// than whole (member()).
  virtual bool streamed(const std::string& key) const = 0;
  /// A member of the top object, its value built whole.
  virtual void member(std::string& key, nlohmann::json& value) = 0;
  /// The streamed member `outer` begins (its value is an object).
  virtual void begin_streamed(const std::string& outer) = 0;
  /// A member of the streamed member `outer`, its value built whole.
  virtual void inner(const std::string& outer, std::string& key,
                     nlohmann::json& value) = 0;
  /// The value of the member `key` (of the streamed member `outer`, when not
  /// empty) holds more JSON values than the limit; must throw.
  [[noreturn]] virtual void too_large(const std::string& outer,
                                      const std::string& key) = 0;
  /// The text is not valid JSON (nlohmann's parse error `e`); must throw.
  [[noreturn]] virtual void invalid(const std::exception& e) = 0;
};

/// Reads `text`, a JSON object, calling `visitor` for its members in the
/// text's order; each value built holds at most `max_values` JSON values.
/// What the visitor throws is thrown once the whole text has parsed (the
/// visitor is called no more after it throws): invalid JSON anywhere is
/// reported first, through `visitor.invalid`.
/// Returns false, having called nothing, when the text's value is not an
/// object (`type` gets its type: "array", "number", ...).
bool read_json_members(const std::string& text, JsonMemberVisitor& visitor,
                       size_t max_values, std::string* type);

}  // namespace mha::detail
