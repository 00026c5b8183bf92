// A parsed JSON document whose memory running out is an error, never an
// abort. nlohmann::json frees a container by moving its elements onto a
// heap-allocated stack (it never recurses), so freeing a tree of millions of
// elements allocates; when that allocation fails inside a destructor, and
// when json::parse frees its half-built result while a std::bad_alloc
// unwinds, the process terminates. JsonTree builds the document into a tree
// it owns and frees it leaves first, each container emptied before it is
// destroyed: freeing allocates nothing, so a failed parse and a finished
// document both come down in any memory.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvring {

class JsonTree {
 public:
  // The deepest nesting parse() builds: freeing recurses once per level.
  // Callers refuse deeper text first (json_depth, core/text.h) with their
  // own message; past this, parse throws std::length_error.
  static constexpr std::size_t kMaxDepth = 64;

  JsonTree() = default;
  JsonTree(const JsonTree&) = delete;
  JsonTree& operator=(const JsonTree&) = delete;
  ~JsonTree() { release(root_); }

  // Parses `text`, replacing the tree. Throws what nlohmann::json::parse
  // throws (json::parse_error with its byte, json::out_of_range for a
  // number past a double) and std::bad_alloc; after a throw the tree holds
  // what was built, freed as any other.
  void parse(std::string_view text) {
    release(root_);
    root_ = nullptr;
    Builder b{root_, {}, nullptr};
    nlohmann::json::sax_parse(text.begin(), text.end(), &b);
  }

  nlohmann::json& root() { return root_; }
  const nlohmann::json& root() const { return root_; }

 private:
  // Empties every container below `v`, then `v` itself: a container's
  // destructor then has no elements to move and allocates nothing.
  static void release(nlohmann::json& v) noexcept {
    if (v.is_array()) {
      auto& a = v.get_ref<nlohmann::json::array_t&>();
      for (auto& e : a) release(e);
      a.clear();
    } else if (v.is_object()) {
      auto& o = v.get_ref<nlohmann::json::object_t&>();
      for (auto& [key, e] : o) release(e);
      o.clear();
    }
  }

  // The SAX events as a tree under `root`, in the order the text gives
  // them (nlohmann::json's own builder, with the root outside the parse).
  struct Builder {
    nlohmann::json& root;
    std::vector<nlohmann::json*> open;  // the containers being filled
    nlohmann::json* member;             // the object member a key named

    template <class T>
    nlohmann::json* add(T&& v) {
      if (open.empty()) {
        root = std::forward<T>(v);
        return &root;
      }
      if (open.back()->is_array()) {
        auto& a = open.back()->get_ref<nlohmann::json::array_t&>();
        a.emplace_back(std::forward<T>(v));
        return &a.back();
      }
      *member = std::forward<T>(v);
      return member;
    }
    bool enter(nlohmann::json::value_t kind) {
      if (open.size() >= kMaxDepth)
        throw std::length_error("JSON nested deeper than " + std::to_string(kMaxDepth));
      open.push_back(add(nlohmann::json(kind)));
      return true;
    }

    bool null() { return add(nullptr), true; }
    bool boolean(bool v) { return add(v), true; }
    bool number_integer(nlohmann::json::number_integer_t v) { return add(v), true; }
    bool number_unsigned(nlohmann::json::number_unsigned_t v) { return add(v), true; }
    bool number_float(nlohmann::json::number_float_t v, const std::string&) { return add(v), true; }
    bool string(std::string& v) { return add(std::move(v)), true; }
    bool binary(nlohmann::json::binary_t& v) { return add(nlohmann::json::binary(std::move(v))), true; }
    bool start_object(std::size_t) { return enter(nlohmann::json::value_t::object); }
    bool key(std::string& k) {
      member = &open.back()->get_ref<nlohmann::json::object_t&>()[k];
      // A key the object already holds: the last value wins (as in
      // nlohmann::json's own parse and Python's json), and the earlier one
      // is emptied first, so that replacing it frees without allocating.
      release(*member);
      return true;
    }
    bool end_object() { return open.pop_back(), true; }
    bool start_array(std::size_t) { return enter(nlohmann::json::value_t::array); }
    bool end_array() { return open.pop_back(), true; }
    template <class Exception>
    bool parse_error(std::size_t, const std::string&, const Exception& e) {
      throw e;
    }
  };

  nlohmann::json root_;
};

}  // namespace kvring
