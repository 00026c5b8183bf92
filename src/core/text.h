// Text from untrusted sources (a pack's run record, its metadata, a chunk
// server's replies) on its way to a terminal.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvring {

// `s` with every byte that could act on a terminal written as \xNN: C0
// controls (newline and tab included), DEL, the C1 controls U+0080 to
// U+009F, and bytes that are not part of valid UTF-8. A backslash is
// written as \x5c, so the result reads back unambiguously, unless
// `escape_backslash` is false (text that may already hold printable()'s
// output, such as an error message quoting it). Other UTF-8 passes through.
inline std::string printable(std::string_view s, bool escape_backslash = true) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f || (c == '\\' && escape_backslash)) escape(c);
      else out += static_cast<char>(c);
      ++i;
      continue;
    }
    // The length of a well-formed UTF-8 sequence starting with c, or 0.
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07;
    bool ok = n > 0 && i + n <= s.size();
    for (std::size_t k = 1; ok && k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      ok = (b & 0xc0) == 0x80;
      cp = (cp << 6) | (b & 0x3f);
    }
    // Overlong forms, surrogates, values past U+10FFFF and C1 controls.
    ok = ok && !(n == 3 && cp < 0x800) && !(n == 4 && cp < 0x10000) && !(cp >= 0xd800 && cp <= 0xdfff) &&
         cp <= 0x10ffff && !(cp >= 0x80 && cp <= 0x9f);
    if (!ok) {
      escape(c);
      ++i;
      continue;
    }
    out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

// Text a peer chose (a server's error reply, a handoff peer's error), as a
// message may show it: printable() of at most `max_bytes` of it, and the
// length of what was cut.
inline std::string shown(std::string_view text, std::size_t max_bytes, bool escape_backslash = true) {
  if (text.size() <= max_bytes) return printable(text, escape_backslash);
  return printable(text.substr(0, max_bytes), escape_backslash) + "... (" + std::to_string(text.size()) +
         " bytes)";
}

// The deepest nesting of arrays and objects in JSON `text`, outside
// strings: checked before a parse, which takes tens of bytes of memory for
// each byte of deeply nested text.
inline int json_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace kvring
