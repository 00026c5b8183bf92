// POSIX file helpers for packs and the directory store: full reads and
// writes (looping over short transfers and EINTR) and the atomic
// write-then-rename protocol.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvring/chunk_store.h"
#include "kvring/status.h"

namespace kvring::pack_internal {

std::string errno_text(int err);
// The directory part of a path ("." for a bare file name).
std::string parent_dir(const std::string& path);

// Runs the fault hook of `io` for a step, if there is one.
Status inject(const IoOptions& io, IoStep step, const std::string& path);

// Exactly n bytes at `offset`; a short read (end of file) is kCorruption.
Status pread_all(int fd, std::uint8_t* dst, std::int64_t n, std::int64_t offset,
                 const std::string& path);
// Exactly n bytes at `offset`; a write that stops short (a full disk, a file
// size limit) is kIOError naming how far it got.
Status pwrite_all(int fd, const std::uint8_t* src, std::int64_t n, std::int64_t offset,
                  const std::string& path);
// True when bytes [offset, offset + n) of the open file `fd` lie wholly in a
// hole, so they read as zeros: lseek(SEEK_DATA) from `offset` finds data
// only at or past the range's end, or nowhere (ENXIO). A file system that
// does not track holes reports data everywhere (false). The file must
// still hold the range: one cut short finds no data either (ENXIO), and is
// not a hole. An empty or negative range is not one.
bool range_in_hole(int fd, std::int64_t offset, std::int64_t n);
Status fsync_dir(const std::string& dir, const IoOptions& io);

// A file written under a temporary name beside its destination and renamed
// over it on commit, so a crash or a failure never leaves a partial file at
// the destination. The temporary name starts with ".tmp-". Destroying an
// uncommitted file removes the temporary.
class AtomicFile {
 public:
  static Result<std::unique_ptr<AtomicFile>> create(const std::string& path, const IoOptions& io);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }
  // Thread-safe: concurrent writes to disjoint ranges.
  Status write_at(std::int64_t offset, std::span<const std::uint8_t> bytes) const;
  // fsync, close, rename over the destination, then (when sync_dir) fsync the
  // directory. A directory store renames many chunks and syncs once.
  Status commit(bool sync_dir = true);

 private:
  AtomicFile(std::string path, std::string temp, int fd, const IoOptions& io)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(fd), io_(io) {}

  std::string path_, temp_;
  int fd_ = -1;
  bool committed_ = false;
  IoOptions io_;
  int tracked_ = -1;  // its slot among the live temporaries, or -1
};

// The temporaries being written (an AtomicFile's, a directory store's
// chunk's), listed so that remove_live_temporaries can unlink them:
// async-signal-safe, for a program's handler of a signal that ends it (the
// tool's SIGINT, SIGTERM, SIGHUP), so that an interrupted save leaves no
// partial file behind. Up to kTrackedTemporaries at once; more go unlisted
// (a directory store's gc finds its own). A writer lists its temporary
// before creating it and unlists it after the rename or unlink.
inline constexpr int kTrackedTemporaries = 32;
// The temporary's slot, or -1 where none is free (or the name is too long).
int track_temporary(const std::string& temp);
// A file that a signal ending the program removes only while it holds
// exactly `text` (at most kTrackedTextBytes; a file another process has
// written since stays): serve's --port-file. Its slot, or -1.
inline constexpr std::size_t kTrackedTextBytes = 64;
int track_file_holding(const std::string& path, std::string_view text);
// Unlists a slot track_temporary returned; -1 is ignored.
void untrack_temporary(int slot);
// Removes the file at `path` if it holds exactly `text` (a link is not
// followed); what track_file_holding's slot does on a signal.
void remove_file_holding(const std::string& path, std::string_view text);
void remove_live_temporaries() noexcept;

}  // namespace kvring::pack_internal
