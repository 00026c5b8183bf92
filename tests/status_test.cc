#include "kvring/status.h"

#include <gtest/gtest.h>

#include <type_traits>
#include <utility>
#include <variant>

namespace kvring {
namespace {

Result<int> half_of(int x) {
  if (x % 2 != 0) return invalid_argument("odd " + std::to_string(x));
  return x / 2;
}

Status quarter(int x, int* out) {
  auto h = half_of(x);
  KVRING_RETURN_IF_ERROR(h);
  auto q = half_of(*h);
  KVRING_RETURN_IF_ERROR(q);
  *out = *q;
  return Status::Ok();
}

TEST(Status, PropagatesTheFirstError) {
  int out = -1;
  EXPECT_TRUE(quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = quarter(6, &out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.error().message, "odd 3");
  EXPECT_EQ(s.to_string(), "InvalidArgument: odd 3");
}

// A Result takes a failed Status's error; an ok Status, which holds no
// value, makes a kInternal error that says so rather than one without words.
TEST(Status, AResultFromAStatusIsAlwaysAnErrorWithWords) {
  const Result<int> failed = Status(invalid_argument("bad"));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.error().message, "bad");
  const Result<int> from_ok = Status::Ok();
  ASSERT_FALSE(from_ok.ok());
  EXPECT_EQ(from_ok.error().code, ErrorCode::kInternal);
  EXPECT_NE(from_ok.error().message.find("ok Status"), std::string::npos);
}

// A Result tests as true when it holds a value, except a Result<bool>,
// where `if (r)` would read as the value: it says r.ok() or *r.
TEST(Status, AResultOfBoolDoesNotTestAsItsValue) {
  static_assert(std::is_constructible_v<bool, Result<int>>);
  static_assert(!std::is_constructible_v<bool, Result<bool>>);
  const Result<bool> absent = false;
  EXPECT_TRUE(absent.ok());
  EXPECT_FALSE(*absent);
  const Result<bool> failed = Error{ErrorCode::kIOError, "no answer"};
  EXPECT_FALSE(failed.ok());
}

// Taking the value of a Result that holds an error (a skipped check)
// throws the error's code and words, not an exception without them; so
// does asking a Result that holds a value for its error.
TEST(Status, AValueTakenFromAnErrorThrowsItsWords) {
  Result<std::string> failed = invalid_argument("odd 3");
  auto expect_words = [](auto&& take, const char* words, ErrorCode code) {
    try {
      take();
      ADD_FAILURE() << "no exception for " << words;
    } catch (const BadResultAccess& e) {
      EXPECT_STREQ(e.what(), words);
      EXPECT_EQ(e.error().code, code);
      const std::bad_variant_access& base = e;  // what the storage throws
      EXPECT_STREQ(base.what(), words);
    }
  };
  expect_words([&] { (void)failed.value(); }, "InvalidArgument: odd 3", ErrorCode::kInvalidArgument);
  expect_words([&] { (void)*std::as_const(failed); }, "InvalidArgument: odd 3", ErrorCode::kInvalidArgument);
  expect_words([&] { (void)failed->size(); }, "InvalidArgument: odd 3", ErrorCode::kInvalidArgument);
  expect_words([&] { (void)*std::move(failed); }, "InvalidArgument: odd 3", ErrorCode::kInvalidArgument);
  const Result<int> held = half_of(8);
  EXPECT_EQ(*held, 4);
  expect_words([&] { (void)held.error(); }, "Internal: error() of a Result that holds a value",
               ErrorCode::kInternal);
  // A copy of the exception shares its words.
  try {
    (void)half_of(5).value();
    ADD_FAILURE() << "no exception";
  } catch (const BadResultAccess& e) {
    const BadResultAccess copy = e;
    EXPECT_STREQ(copy.what(), "InvalidArgument: odd 5");
  }
}

// A moved-from BadResultAccess keeps its words (a move is a copy), and a
// Result left empty by an assignment that threw says so, from value() and
// error() alike.
struct ThrowsOnCopy {
  static inline bool armed = false;
  ThrowsOnCopy() = default;
  ThrowsOnCopy(const ThrowsOnCopy&) {
    if (armed) throw 7;
  }
  ThrowsOnCopy& operator=(const ThrowsOnCopy&) {
    if (armed) throw 7;
    return *this;
  }
};

TEST(Status, AnEmptyResultAndAMovedExceptionKeepTheirWords) {
  try {
    (void)half_of(7).value();
    ADD_FAILURE() << "no exception";
  } catch (BadResultAccess& e) {
    const BadResultAccess moved = std::move(e);
    EXPECT_STREQ(moved.what(), "InvalidArgument: odd 7");
    EXPECT_STREQ(e.what(), "InvalidArgument: odd 7");
    EXPECT_EQ(e.error().message, "odd 7");
  }
  Result<ThrowsOnCopy> r = Error{ErrorCode::kIOError, "no answer"};
  const Result<ThrowsOnCopy> other = ThrowsOnCopy{};
  ThrowsOnCopy::armed = true;
  EXPECT_THROW(r = other, int);
  ThrowsOnCopy::armed = false;
  ASSERT_FALSE(r.ok());
  for (int accessor = 0; accessor < 2; ++accessor) {
    try {
      if (accessor == 0) (void)r.value();
      else (void)r.error();
      ADD_FAILURE() << "no exception from accessor " << accessor;
    } catch (const BadResultAccess& e) {
      EXPECT_STREQ(e.what(), "Internal: a Result left empty by an assignment that threw");
    }
  }
}

TEST(Status, DiscontinuityCarriesItsFields) {
  Error e = cache_discontinuity(5, 10, 12);
  EXPECT_EQ(e.code, ErrorCode::kCacheDiscontinuity);
  EXPECT_EQ(e.layer, 5);
  EXPECT_EQ(e.expected, 10);
  EXPECT_EQ(e.got, 12);
  EXPECT_NE(e.to_string().find("expected position 10, got 12"), std::string::npos);
}

}  // namespace
}  // namespace kvring
