// A small command-line option parser: --name VALUE, --name=VALUE and flags,
// with strict integer parsing and errors that name the option.
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvring/status.h"

namespace kvring::cli {

class Args {
 public:
  // `flags` take no value; `options` take one, never empty; an option
  // given again must repeat its value (another would silently replace
  // the first). A value given
  // as the next argument may not start with "--": that is an option, and
  // the value was left out (`--save --json`); `--name=VALUE` takes any.
  static Result<Args> parse(const std::vector<std::string>& argv, const std::set<std::string>& flags,
                            const std::set<std::string>& options) {
    Args a;
    for (std::size_t i = 0; i < argv.size(); ++i) {
      const std::string& s = argv[i];
      if (s.rfind("--", 0) != 0) {
        a.positional_.push_back(s);
        continue;
      }
      std::string name = s.substr(2), value;
      bool has_value = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      if (flags.count(name)) {
        if (has_value) return invalid_argument("--" + name + " takes no value");
        a.flags_.insert(name);
      } else if (options.count(name)) {
        if (!has_value) {
          if (i + 1 >= argv.size()) return invalid_argument("--" + name + " needs a value");
          if (argv[i + 1].rfind("--", 0) == 0)
            return invalid_argument("--" + name + " needs a value, got the option " + argv[i + 1] +
                                    " (a value that starts with -- goes as --" + name + "=VALUE)");
          value = argv[++i];
        }
        if (value.empty()) return invalid_argument("--" + name + " needs a value, got an empty one");
        if (auto [it, added] = a.values_.emplace(name, value); !added && it->second != value)
          return invalid_argument("--" + name + " is given twice ('" + it->second + "' and '" + value + "')");
      } else {
        return invalid_argument("unknown option --" + name);
      }
    }
    return a;
  }

  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string str(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  // A decimal integer in [lo, hi]; absent -> fallback.
  Result<std::int64_t> integer(const std::string& name, std::int64_t fallback, std::int64_t lo,
                               std::int64_t hi) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    return parse_integer(name, it->second, lo, hi);
  }
  // `s` as a decimal integer in [lo, hi], or an error naming --name.
  static Result<std::int64_t> parse_integer(const std::string& name, const std::string& s, std::int64_t lo,
                                            std::int64_t hi) {
    std::int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size())
      return invalid_argument("--" + name + " must be an integer, got '" + s + "'");
    if (v < lo || v > hi)
      return invalid_argument("--" + name + " = " + s + " is outside [" + std::to_string(lo) +
                              ", " + std::to_string(hi) + "]");
    return v;
  }
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace kvring::cli
