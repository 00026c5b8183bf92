// The kvring tool's subcommands; each takes the arguments after its name
// and returns the process exit code.
#pragma once

#include <string>
#include <vector>

#include "kvring/status.h"

namespace kvring::cli {

int cmd_footprint(const std::vector<std::string>& argv);
int cmd_config(const std::vector<std::string>& argv);
int cmd_run(const std::vector<std::string>& argv);
int cmd_pack(const std::vector<std::string>& argv);
int cmd_handoff(const std::vector<std::string>& argv);

// Prints "kvring: MESSAGE" to stderr and returns the failure exit code 2.
int fail(const std::string& message);
int fail(const Error& e);

}  // namespace kvring::cli
