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
#include <filesystem>
#include <string>
#include <vector>

extern char** environ;

namespace kvring::bench {

// The file a results path names: a symbolic link is followed (a chain of
// at most 40, as the kernel follows), so that a results file reached
// through a link is written where the link points and the link stays.
// `*problem` is set where the path is empty, or the chain is longer or a
// loop.
inline std::string output_target(const std::string& path, std::string* problem) {
  if (path.empty()) {
    *problem = "an empty path names no file";
    return "";
  }
  std::filesystem::path p = path;
  std::error_code ec;
  for (int hops = 0; std::filesystem::is_symlink(p, ec); ++hops) {
    const std::filesystem::path to = std::filesystem::read_symlink(p, ec);
    if (ec || hops == 40) {
      *problem = path + ": too many levels of symbolic links, or one that cannot be read";
      return "";
    }
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  return p.string();
}

// Why `path` cannot take a results file, or "" where it can: something
// other than a regular file is there, or the directory of the file it
// names refuses a new file (tried with a temporary that is removed at
// once).
inline std::string output_problem(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return path + " exists and is not a regular file";
  std::string problem;
  const std::string target = output_target(path, &problem);
  if (!problem.empty()) return problem;
  const std::string probe = target + ".tmp-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create a file beside " + path + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

// Writes `text` to the file `path` names (output_target) through a
// temporary beside it and a rename, so that a failed or interrupted run
// leaves what was there before. "" on success, else why.
inline std::string write_whole(const std::string& path, const std::string& text) {
  std::string problem;
  const std::string target = output_target(path, &problem);
  if (!problem.empty()) return problem;
  const std::string tmp = target + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
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
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = ::close(fd) == 0;
  if (!synced || !closed || ::rename(tmp.c_str(), target.c_str()) != 0) {
    const std::string why = std::strerror(!synced ? sync_errno : errno);
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

// The process group of the child run_child waits on (0: none). A child in
// a group of its own hears neither the terminal's interrupt nor a group
// signal sent to the bench, so the bench's SIGINT, SIGTERM and SIGHUP kill
// the group first, then take their default action.
inline volatile sig_atomic_t g_child_group = 0;
extern "C" inline void kill_child_and_reraise(int sig) {
  if (g_child_group != 0) ::kill(-static_cast<pid_t>(g_child_group), SIGKILL);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Runs argv (looked up on PATH, no shell) in a process group of its own.
// With `read_stdout` its stdout is read here and its stderr is the bench's;
// without, both go to /dev/null. Past `timeout_s` the group is killed; once
// the child has exited, what its stdout still holds is read for at most
// 1 s (a process it left behind may keep the pipe open), then the group is
// killed. Only the last '{' line of at most kMaxLine bytes is kept (a last
// line without a newline counts), so a peer that prints without end costs
// bounded memory.
inline ChildResult run_child(const std::vector<std::string>& argv, double timeout_s, bool read_stdout) {
  using Clock = std::chrono::steady_clock;
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
  struct sigaction on_signal{}, before[3];
  on_signal.sa_handler = kill_child_and_reraise;
  sigemptyset(&on_signal.sa_mask);
  const int signals[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; ++i) ::sigaction(signals[i], &on_signal, &before[i]);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    for (int i = 0; i < 3; ++i) ::sigaction(signals[i], &before[i], nullptr);
    return r;
  }
  g_child_group = pid;
  r.started = true;
  const Clock::time_point end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  auto drain_end = Clock::time_point::max();  // set once the child has exited
  bool exited = false, eof = false, overlong = false;
  std::string line;
  auto take_line = [&] {
    if (!overlong && !line.empty() && line[0] == '{') r.last_json = line;
    line.clear();
    overlong = false;
  };
  char buf[65536];
  for (;;) {
    if (!exited && ::waitpid(pid, &r.status, WNOHANG) == pid) {
      exited = true;
      drain_end = Clock::now() + std::chrono::seconds(1);
    }
    const auto now = Clock::now();
    if (exited && (eof || now >= drain_end)) break;
    if (!exited && now >= end) {
      r.timed_out = true;
      break;
    }
    if (eof) {  // its stdout is closed (or never was the pipe): wait for its exit
      ::usleep(10000);
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(std::min(end, drain_end) - now).count();
    pollfd p{fds[0], POLLIN, 0};
    // Short polls while it runs, so that its exit is seen soon.
    const int n = ::poll(&p, 1, static_cast<int>(std::clamp<long long>(left, 1, 100)));
    if (n < 0 && errno != EINTR) eof = true;
    if (n <= 0) continue;
    const ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {  // the end of its stdout: a last line without a newline counts
      eof = true;
      take_line();
      continue;
    }
    for (ssize_t i = 0; i < got; ++i) {
      if (buf[i] == '\n')
        take_line();
      else if (line.size() < kMaxLine)
        line += buf[i];
      else
        overlong = true;
    }
  }
  ::close(fds[0]);
  // Its group goes where it may still run: past the deadline, or where a
  // process it left holds the pipe (the group then still has a member, so
  // its id is not reused). A child that exited with its stdout closed is
  // reaped already, and its group id may belong to another by now.
  if (!exited || !eof) ::kill(-pid, SIGKILL);
  while (!exited) {
    const pid_t w = ::waitpid(pid, &r.status, 0);
    if (w == pid || (w < 0 && errno != EINTR)) break;
  }
  g_child_group = 0;
  for (int i = 0; i < 3; ++i) ::sigaction(signals[i], &before[i], nullptr);
  return r;
}

}  // namespace kvring::bench
