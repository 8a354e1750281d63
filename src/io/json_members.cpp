// Internal, part of the bottom layer of state-dict I/O (declared in
// json_members.h): a JSON object read member by member through
// nlohmann-json's SAX interface. Each member's value is built as
// nlohmann's DOM parser builds a whole document (the same values, the same
// order of an object's keys, the last of two equal keys kept), and handed
// over as soon as it is complete. What the visitor throws waits until the
// whole text has parsed, so that invalid JSON is reported first. Depends on
// nlohmann-json.
//
// Glossary: as json_members.h; the "slot" is where the next value of the
// object being built goes, set by its key.
#include "io/json_members.h"

#include <cstddef>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace mha::detail {
namespace {

using json = nlohmann::json;

/// The SAX handler of read_json_members.
class MemberReader {
 public:
  MemberReader(JsonMemberVisitor& visitor, size_t max_values, std::string* type)
      : visitor_(visitor), max_values_(max_values), type_(type) {}

  bool null() {
    return guarded([&] { return scalar(json(nullptr)); });
  }
  bool boolean(bool value) {
    return guarded([&] { return scalar(json(value)); });
  }
  bool number_integer(json::number_integer_t value) {
    return guarded([&] { return scalar(json(value)); });
  }
  bool number_unsigned(json::number_unsigned_t value) {
    return guarded([&] { return scalar(json(value)); });
  }
  bool number_float(json::number_float_t value, const json::string_t&) {
    return guarded([&] { return scalar(json(value)); });
  }
  // The parser does not use a string after handing it over: moved, not
  // copied, so that a long string is held once.
  bool string(json::string_t& value) {
    return guarded([&] { return scalar(json(std::move(value))); });
  }
  bool binary(json::binary_t& value) {
    return guarded([&] { return scalar(json::binary(std::move(value))); });
  }
  bool start_object(size_t) {
    return guarded([&] { return start(json::value_t::object); });
  }
  bool start_array(size_t) {
    return guarded([&] { return start(json::value_t::array); });
  }
  bool end_object() {
    return guarded([&] { return end(); });
  }
  bool end_array() {
    return guarded([&] { return end(); });
  }
  bool key(json::string_t& key) {
    return guarded([&] { return set_key(key); });
  }

  bool parse_error(size_t, const std::string&, const json::exception& e) {
    visitor_.invalid(e);
    return false;  // not reached: invalid() throws
  }

  /// Throws what the visitor threw, if it did.
  void rethrow() const {
    if (failed_) {
      std::rethrow_exception(failed_);
    }
  }

 private:
  enum class State { kStart, kTop, kStreamed, kDone };

  /// Runs the handler `f` unless the visitor has failed before. What the
  /// visitor throws is kept for rethrow(), and the rest of the text only
  /// parsed: an error of the JSON itself, anywhere, comes first (as when a
  /// document is parsed whole before it is looked at).
  template <typename F>
  bool guarded(F&& f) {
    if (failed_) {
      return true;
    }
    try {
      return f();
    } catch (...) {
      failed_ = std::current_exception();
      open_.clear();
      value_ = json();
      return true;
    }
  }

  bool set_key(json::string_t& key) {
    if (!open_.empty()) {
      slot_ = &(*open_.back())[std::move(key)];
    } else if (state_ == State::kTop) {
      key_ = std::move(key);
    } else {
      inner_key_ = std::move(key);
    }
    return true;
  }

  /// Adds `value` to the value being built; returns where it lies.
  json* add(json&& value) {
    if (++values_ > max_values_) {
      if (state_ == State::kStreamed) {
        visitor_.too_large(key_, inner_key_);
      }
      visitor_.too_large("", key_);
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    *slot_ = std::move(value);
    return slot_;
  }

  /// Hands the complete value over.
  void deliver() {
    if (state_ == State::kStreamed) {
      visitor_.inner(key_, inner_key_, value_);
    } else {
      visitor_.member(key_, value_);
    }
    value_ = json();
  }

  bool scalar(json&& value) {
    if (!open_.empty()) {
      add(std::move(value));
      return true;
    }
    if (state_ == State::kStart) {
      *type_ = value.type_name();
      return false;
    }
    value_ = std::move(value);
    deliver();
    return true;
  }

  bool start(json::value_t kind) {
    if (!open_.empty()) {
      open_.push_back(add(json(kind)));
      return true;
    }
    if (state_ == State::kStart) {
      if (kind != json::value_t::object) {
        *type_ = "array";
        return false;
      }
      state_ = State::kTop;
      return true;
    }
    if (state_ == State::kTop && kind == json::value_t::object &&
        visitor_.streamed(key_)) {
      state_ = State::kStreamed;
      visitor_.begin_streamed(key_);
      return true;
    }
    value_ = json(kind);
    values_ = 1;
    open_.assign(1, &value_);
    return true;
  }

  bool end() {
    if (!open_.empty()) {
      open_.pop_back();
      if (open_.empty()) {
        deliver();
      }
    } else {
      state_ = state_ == State::kStreamed ? State::kTop : State::kDone;
    }
    return true;
  }

  JsonMemberVisitor& visitor_;
  size_t max_values_;
  std::string* type_;
  State state_ = State::kStart;
  std::string key_;          // of the top object's member being read
  std::string inner_key_;    // of the streamed member's member being read
  json value_;               // the value being built
  std::vector<json*> open_;  // its arrays and objects not yet closed
  json* slot_ = nullptr;
  size_t values_ = 0;  // in value_
  std::exception_ptr failed_;
};

}  // namespace

bool read_json_members(const std::string& text, JsonMemberVisitor& visitor,
                       size_t max_values, std::string* type) {
  MemberReader reader(visitor, max_values, type);
  const bool object = json::sax_parse(text, &reader);
  reader.rethrow();
  return object;
}

}  // namespace mha::detail
