#include "runtime/common/json_check.h"

#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/common/log.h"

namespace gemvz::internal {
namespace {

using Json = nlohmann::json;

// Counts the nesting and, where asked, the keys of every open object; stops at the first fault.
class Checker : public nlohmann::json_sax<Json> {
 public:
  Checker(int max_depth, bool keys) : max_depth_(max_depth), keys_(keys) {}
  const std::string& fault() const { return fault_; }

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    if (keys_) open_.emplace_back();
    return Enter();
  }
  bool key(string_t& k) override {
    if (keys_ && !open_.empty() && !open_.back().insert(k).second) {
      fault_ = absl::StrCat("an object repeats the key '", Escaped(k), "'");
      return false;
    }
    return true;
  }
  bool end_object() override {
    if (keys_ && !open_.empty()) open_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return Enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // The parser's message repeats the text it read, escaping only bytes below 0x20: a C1
    // control (U+009B) would reach the terminal where the message is printed.
    fault_ = Escaped(e.what());
    return false;
  }

 private:
  bool Enter() {
    if (++depth_ > max_depth_) {
      fault_ = absl::StrCat("objects and arrays nest more than ", max_depth_, " deep");
      return false;
    }
    return true;
  }

  const int max_depth_;
  const bool keys_;
  int depth_ = 0;
  std::vector<std::set<std::string>> open_;
  std::string fault_;
};

}  // namespace

absl::Status CheckJsonText(std::string_view text, int max_depth, bool refuse_duplicate_keys) {
  Checker checker(max_depth, refuse_duplicate_keys);
  bool ok = false;
  try {
    ok = Json::sax_parse(text.begin(), text.end(), &checker);
  } catch (const Json::exception& e) {  // sax_parse reports through parse_error; never hidden
    return absl::InvalidArgumentError(Escaped(e.what()));
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(checker.fault().empty() ? "not valid JSON" : checker.fault());
}

bool JsonCanCarry(std::string_view s) {
  try {
    (void)Json(std::string(s)).dump();
  } catch (const Json::type_error&) {
    return false;
  }
  return true;
}

}  // namespace gemvz::internal
