// kvring store: maintenance of chunk stores (docs/kvpack-format.md).
#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "args.h"
#include "core/text.h"
#include "commands.h"
#include "kvring/chunk_store.h"

namespace kvring::cli {

namespace {

const char* kStoreUsage = R"(usage: kvring store gc dir:PATH [--min-age SECONDS]
       kvring store gc --help
)";

// Why `spec` is not a directory store. Of a spec with a scheme only the
// scheme is shown (the rest may hold a password); a spec without one is a
// path, shown as given.
std::string not_a_dir_store(const std::string& spec) {
  const std::string tail = "; only directory stores (dir:PATH) keep temporary files";
  if (spec == "dir:") return "store gc: 'dir:' names no directory" + tail;
  const std::size_t colon = spec.find(':');
  const std::string scheme = spec.substr(0, colon);
  const bool is_scheme = colon != std::string::npos && !scheme.empty() && scheme.size() <= 16 &&
                         std::all_of(scheme.begin(), scheme.end(), [](char ch) {
                           return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '+' ||
                                  ch == '-' || ch == '.';
                         });
  if (is_scheme) return "store gc: '" + scheme + ":' is not a directory store" + tail;
  if (colon == std::string::npos) return "store gc: '" + spec + "' has no scheme; name a directory as dir:" + spec;
  return "store gc: the store has no scheme this tool knows" + tail;
}

const std::set<std::string> kGcOptions = {"min-age"};

int gc(const std::vector<std::string>& argv) {
  auto args = Args::parse(argv, {}, kGcOptions);
  if (!args) return fail(args.error());
  if (args->positional().size() != 1)
    return fail("store gc takes one store (dir:PATH), got " + std::to_string(args->positional().size()));
  const std::string spec = args->positional()[0];
  if (!spec.starts_with("dir:") || spec.size() == 4) return fail(not_a_dir_store(spec));
  auto age = args->integer("min-age", kDirStoreTempMinAge.count(), 0, std::numeric_limits<std::int32_t>::max());
  if (!age) return fail(age.error());
  auto report = gc_dir_store(spec.substr(4), std::chrono::seconds(*age));
  if (!report) return fail(report.error());
  std::printf("%s: removed %lld temporary file%s of dead writers; kept %lld (held by a writer or newer than "
              "%lld s); %lld quarantined director%s\n",
              printable(spec).c_str(), static_cast<long long>(report->removed), report->removed == 1 ? "" : "s",
              static_cast<long long>(report->kept), static_cast<long long>(*age),
              static_cast<long long>(report->quarantined), report->quarantined == 1 ? "y" : "ies");
  return kExitOk;
}

}  // namespace

int cmd_store(const std::vector<std::string>& argv) {
  if (argv.empty()) {
    std::fputs(kStoreUsage, stderr);
    return kExitUsage;
  }
  const std::string sub = argv[0];
  if (sub == "help" || sub == "--help" || sub == "-h") return print_help("store");
  if (sub != "gc") {
    std::fputs(kStoreUsage, stderr);
    return fail("unknown store command '" + sub + "' (gc)");
  }
  if (wants_help(argv, kGcOptions)) return print_help("store gc");
  return gc({argv.begin() + 1, argv.end()});
}

}  // namespace kvring::cli
