// Opening files a user names (packs, configs, resume files) without ever
// blocking or reading without end: every such file goes through
// open_regular_file, which refuses anything that is not a regular file
// (a FIFO, a device, a socket, a directory) before any blocking read.
#pragma once

#include <cstdint>
#include <string>

#include "kvring/status.h"

namespace kvring::file_internal {

// A config file is small (a model's config.json is a few KiB); anything
// larger is not one. Its parse takes up to some 35 bytes of memory for each
// byte of flat arrays, so this bounds a hostile file's parse near 150 MB.
inline constexpr std::int64_t kMaxConfigBytes = std::int64_t{4} << 20;

struct OpenedFile {
  int fd = -1;            // O_RDONLY | O_CLOEXEC, blocking; the caller closes it
  std::int64_t size = 0;  // st_size at open
  std::int64_t stored = 0;  // bytes the file system holds for it (st_blocks * 512)
};

// "a FIFO", "a character device", ... for the file type bits of st_mode.
const char* file_type_name(unsigned mode);

// Opens `path` for reading. The open itself never blocks (O_NONBLOCK, so a
// FIFO without a writer or a device that waits returns at once); the type
// comes from fstat of that descriptor, so it is the file that is read, not
// one swapped in after a check. Errors name `what` ("pack", "config file"),
// the path and the reason: kNotFound for an absent file, kInvalidArgument
// for a file that is not regular, kIOError for the rest.
Result<OpenedFile> open_regular_file(const std::string& path, const std::string& what);

// The whole of a regular file of at most `max_bytes` bytes; a larger file
// (or one that grows past the limit while it is read) is kInvalidArgument.
Result<std::string> read_small_file(const std::string& path, const std::string& what,
                                    std::int64_t max_bytes);

// The memory this process may use, in bytes: the machine's physical
// memory, or less where its cgroup (v2 memory.max, v1
// memory.limit_in_bytes, of its group or any group above it) says so; the
// largest int64 where neither is known. A container's limit is usually far
// below the host's memory, and past it the kernel kills the process instead
// of failing an allocation, so what a hostile input may make the process
// hold is bounded by it.
std::int64_t memory_limit_bytes();

}  // namespace kvring::file_internal
