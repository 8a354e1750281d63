// mha::hf, reading config.json's values (hf_internal.h): typed lookups that
// name the file, the key and what was found in their errors.
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "hf_internal.h"

namespace mha::hf::detail {

using nlohmann::json;

/// The value of the first of `keys` that config holds and is not null, or
/// nullptr.
std::optional<std::string> layer_types_entry(const json& config, int64_t layer,
                                             const std::string& where) {
  const json* types = find_key(config, {"layer_types"});
  if (types == nullptr) {
    return std::nullopt;
  }
  TORCH_CHECK(
      types->is_array() && static_cast<int64_t>(types->size()) > layer &&
          (*types)[layer].is_string(),
      where, ": layer_types must list a string per layer, got ", types->dump());
  return (*types)[layer].get<std::string>();
}

const json* find_key(const json& config,
                     std::initializer_list<const char*> keys,
                     std::string* found) {
  for (const char* key : keys) {
    auto it = config.find(key);
    if (it != config.end() && !it->is_null()) {
      if (found != nullptr) {
        *found = key;
      }
      return &*it;
    }
  }
  return nullptr;
}

std::string key_list(std::initializer_list<const char*> keys) {
  std::string out;
  for (const char* key : keys) {
    out += (out.empty() ? "" : " or ") + std::string(key);
  }
  return out;
}

/// A required integer: the first of `keys` present.
int64_t get_int(const json& config, std::initializer_list<const char*> keys,
                const std::string& where) {
  std::string key;
  const json* value = find_key(config, keys, &key);
  TORCH_CHECK(value != nullptr, where, ": needs ", key_list(keys),
              " (an integer), which it lacks");
  TORCH_CHECK(value->is_number_integer() && value->get<int64_t>() > 0, where,
              ": ", key, " must be an integer > 0, got ", value->dump());
  return value->get<int64_t>();
}

/// An optional integer, `fallback` when absent or null.
int64_t opt_int(const json& config, const char* key, int64_t fallback,
                const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_number_integer(), where, ": ", key,
              " must be an integer, got ", value->dump());
  return value->get<int64_t>();
}

double opt_double(const json& config, const char* key, double fallback,
                  const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_number(), where, ": ", key, " must be a number, got ",
              value->dump());
  return value->get<double>();
}

bool opt_bool(const json& config, const char* key, bool fallback,
              const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_boolean(), where, ": ", key,
              " must be true or false, got ", value->dump());
  return value->get<bool>();
}

std::string opt_string(const json& config, const char* key,
                       const std::string& fallback, const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_string(), where, ": ", key, " must be a string, got ",
              value->dump());
  return value->get<std::string>();
}

}  // namespace mha::hf::detail
