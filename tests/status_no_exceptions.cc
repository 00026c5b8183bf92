// Built with -fno-exceptions: taking the value of a Result that holds an
// error prints the error's words and aborts, where a build with
// exceptions throws BadResultAccess (tests/status_test.cc).
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>

#include "kvring/status.h"

int main() {
  const kvring::Result<int> failed = kvring::invalid_argument("odd 3");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) return std::puts("fork failed"), 1;
  if (pid == 0) {
    std::printf("value %d\n", *failed);
    ::_exit(0);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return std::puts("waitpid failed"), 1;
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) return std::puts("aborted"), 0;
  std::puts("did not abort");
  return 1;
}
