// Value-or-error results for the host side of kvring.
//
// Every fallible host operation returns Status or Result<T>. Errors carry a
// code, a message that names what failed and where, and, for continuity
// errors, the layer and the expected and received positions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace kvring {

enum class ErrorCode {
  kInvalidArgument,     // bad input from the caller (sizes, names, options)
  kCacheDiscontinuity,  // a skipped or replayed logical position
  // More positions than a plane, a sequence or a limit can ever hold (a
  // full plane past its capacity, a short ring past its context, rows past
  // a caller's byte limit): retrying the same request cannot succeed.
  kCapacityExceeded,
  kConfig,              // a model config that is missing or inconsistent
  kCorruption,          // bytes that do not decode (packs, chunks)
  kMismatch,            // data for another geometry or model
  kNotFound,            // a chunk, file or key that is absent
  kIOError,             // the operating system or a store refused
  kUnsupported,         // a valid request this build cannot serve
  kCuda,                // a CUDA runtime call failed
  kInternal,            // an invariant of kvring itself broke
  // What a store shares is taken for now: its pool's blocks or its sequence
  // slots. Freeing some (removing, resetting or truncating sequences) and
  // retrying can succeed, unless the request needs more blocks than the
  // whole pool (KvStore::blocks_to_store above pool_blocks()).
  kResourceExhausted,
};

const char* error_code_name(ErrorCode code);

struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  // Set for kCacheDiscontinuity; -1 otherwise.
  std::int64_t layer = -1;
  std::int64_t expected = -1;
  std::int64_t got = -1;

  // "<code name>: <message>"
  std::string to_string() const;
};

Error make_error(ErrorCode code, std::string message);
Error invalid_argument(std::string message);
Error config_error(std::string message);
Error corruption(std::string message);
Error io_error(std::string message);
Error cache_discontinuity(std::int64_t layer, std::int64_t expected,
                          std::int64_t got);

// Status: ok, or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT

  static Status Ok() { return Status(); }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }
  std::string to_string() const { return ok_ ? "ok" : error_.to_string(); }

 private:
  Error error_;
  bool ok_ = true;
};

// Thrown by Result::value(), operator* and operator-> on a Result that
// holds an error, and by Result::error() on one that holds a value. what()
// is "<code name>: <message>" of the error held (or of the kInternal error
// that says a value was held), so an engine that skips a check learns
// what failed. A std::bad_variant_access, as the Result's storage throws.
// Copies (moves too) share the words and never throw. Built without
// exceptions, those accessors print the words and abort instead.
class BadResultAccess : public std::bad_variant_access {
 public:
  explicit BadResultAccess(Error error) : held_(std::make_shared<const Held>(std::move(error))) {}
  BadResultAccess(const BadResultAccess&) noexcept = default;
  BadResultAccess& operator=(const BadResultAccess&) noexcept = default;
  const char* what() const noexcept override { return held_->text.c_str(); }
  const Error& error() const noexcept { return held_->error; }

 private:
  struct Held {
    explicit Held(Error e) : error(std::move(e)), text(error.to_string()) {}
    Error error;
    std::string text;
  };
  std::shared_ptr<const Held> held_;  // never null: moves are copies
};
static_assert(std::is_nothrow_copy_constructible_v<BadResultAccess>);

namespace detail {
[[noreturn]] void abort_bad_result_access(const Error& error);
[[noreturn]] inline void throw_bad_result_access(Error error) {
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
  throw BadResultAccess(std::move(error));
#else
  abort_bad_result_access(error);
#endif
}
}  // namespace detail

// Result<T>: a T, or an Error.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}      // NOLINT
  Result(Error error) : v_(std::move(error)) {}  // NOLINT
  // From a failed Status, its error. An ok Status holds no T: the Result
  // is then a kInternal error that says so, never an error without words.
  Result(Status status)  // NOLINT
      : v_(status.ok() ? Error{ErrorCode::kInternal, "a Result was made from an ok Status, which holds no value"}
                       : status.error()) {}

  bool ok() const { return v_.index() == 0; }
  // Whether a value is held. Not for a Result<bool>, where `if (r)` would
  // read as the value: say r.ok() or *r.
  explicit operator bool() const
    requires(!std::is_same_v<T, bool>)
  {
    return ok();
  }
  // The value; BadResultAccess, carrying the error, where none is held.
  T& value() & {
    if (!ok()) detail::throw_bad_result_access(error());
    return std::get<0>(v_);
  }
  const T& value() const& {
    if (!ok()) detail::throw_bad_result_access(error());
    return std::get<0>(v_);
  }
  T&& value() && {
    if (!ok()) detail::throw_bad_result_access(error());
    return std::get<0>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  // The error; BadResultAccess where a value is held, or where neither is
  // (an assignment that threw left the Result empty).
  const Error& error() const {
    if (ok())
      detail::throw_bad_result_access(Error{ErrorCode::kInternal, "error() of a Result that holds a value"});
    if (v_.valueless_by_exception())
      detail::throw_bad_result_access(
          Error{ErrorCode::kInternal, "a Result left empty by an assignment that threw"});
    return std::get<1>(v_);
  }
  Status status() const { return ok() ? Status() : Status(error()); }

 private:
  std::variant<T, Error> v_;
};

inline const Error& error_of(const Status& s) { return s.error(); }
template <class T>
const Error& error_of(const Result<T>& r) {
  return r.error();
}

}  // namespace kvring

// Propagate a failed Status or Result from the enclosing function, which
// returns Status or Result<U>.
#define KVRING_RETURN_IF_ERROR(expr)                      \
  do {                                                    \
    const auto& kvring_status_ = (expr);                  \
    if (!kvring_status_.ok())                             \
      return ::kvring::Status(::kvring::error_of(kvring_status_)); \
  } while (0)
