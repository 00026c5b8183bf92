// The kvring tool's subcommands; each takes the arguments after its name
// and returns the process exit code.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "kvring/status.h"

namespace kvring::cli {

int cmd_footprint(const std::vector<std::string>& argv);
int cmd_config(const std::vector<std::string>& argv);
int cmd_run(const std::vector<std::string>& argv);
int cmd_pack(const std::vector<std::string>& argv);
int cmd_handoff(const std::vector<std::string>& argv);
int cmd_store(const std::vector<std::string>& argv);

// Exit codes (kvring --help): 0 success, 1 verification failed, 2 a usage
// error or an input that cannot be used.
inline constexpr int kExitOk = 0;
inline constexpr int kExitVerifyFailed = 1;
inline constexpr int kExitUsage = 2;

// True when argv asks for help: --help or -h anywhere but as the value of
// one of `options` (those that take a value, as Args::parse reads them:
// `--save -h` saves to the file -h).
bool wants_help(const std::vector<std::string>& argv, const std::set<std::string>& options = {});
// Prints the help of `command` ("run", "pack verify"; "pack" prints every
// pack command) to stdout and returns 0.
int print_help(const std::string& command);

// Prints "kvring: MESSAGE" to stderr and returns the failure exit code 2.
int fail(const std::string& message);
int fail(const Error& e);

}  // namespace kvring::cli
