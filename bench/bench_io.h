// What the bench programs share about their files and child processes:
// an output file is written whole or not at all, and a peer (PyTorch) runs
// without a shell, under a deadline, with its output bounded.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace kvring::bench {

// Why `path` cannot take a results file, or "" where it can: something
// other than a regular file is there, or its directory refuses a new file
// (tried with a temporary that is removed at once).
inline std::string output_problem(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return path + " exists and is not a regular file";
  const std::string probe = path + ".tmp-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create a file beside " + path + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

// Writes `text` to `path` through a temporary beside it and a rename, so
// that a failed or interrupted run leaves what was there before. "" on
// success, else why.
inline std::string write_whole(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create " + tmp + ": " + std::strerror(errno);
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return "cannot write " + tmp + ": " + why;
    }
    done += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return "cannot write " + path + ": " + why;
  }
  return "";
}

struct ChildResult {
  bool started = false;
  bool timed_out = false;
  int status = -1;        // waitpid's status; exited(0) is success
  std::string last_json;  // the last line of its stdout that starts with '{'
  bool ok() const { return started && !timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  std::string describe() const {
    if (!started) return "could not be started";
    if (timed_out) return "timed out";
    if (WIFSIGNALED(status)) return "ended by signal " + std::to_string(WTERMSIG(status));
    return "exited with status " + std::to_string(WEXITSTATUS(status));
  }
};

// Runs argv (looked up on PATH, no shell) in a process group of its own.
// With `read_stdout` its stdout is read here and its stderr is the bench's;
// without, both go to /dev/null. Past `timeout_s` the group is killed.
// Only the last '{' line of at most kMaxLine bytes is kept, so a peer that
// prints without end costs bounded memory.
inline ChildResult run_child(const std::vector<std::string>& argv, double timeout_s, bool read_stdout) {
  constexpr std::size_t kMaxLine = std::size_t{1} << 20;
  ChildResult r;
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC) != 0) return r;
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  if (read_stdout)
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  else
    for (const int fd : {STDOUT_FILENO, STDERR_FILENO})
      posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_WRONLY, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return r;
  }
  r.started = true;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string line;
  bool overlong = false;
  char buf[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    const ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;  // end of its stdout
    for (ssize_t i = 0; i < got; ++i) {
      if (buf[i] == '\n') {
        if (!overlong && !line.empty() && line[0] == '{') r.last_json = line;
        line.clear();
        overlong = false;
      } else if (line.size() < kMaxLine) {
        line += buf[i];
      } else {
        overlong = true;
      }
    }
  }
  ::close(fds[0]);
  if (r.timed_out) ::kill(-pid, SIGKILL);
  // Its stdout is closed: wait for it to exit within what is left, then kill.
  for (;;) {
    const pid_t w = ::waitpid(pid, &r.status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() >= end && !r.timed_out) {
      r.timed_out = true;
      ::kill(-pid, SIGKILL);
    }
    ::usleep(10000);
  }
  return r;
}

}  // namespace kvring::bench
