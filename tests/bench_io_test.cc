// The bench programs' results files and peer processes (bench/bench_io.h):
// a results file is written whole, through a link where the path is one;
// a peer runs without a shell, ends at its deadline with its process group,
// and only its last JSON line of bounded length is kept.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../bench/bench_io.h"

namespace kvring {
namespace {

namespace fs = std::filesystem;

class BenchIo : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvring-bench-io-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string read(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The names in the folder, so that a temporary left behind shows.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  fs::path dir_;
};

TEST_F(BenchIo, AResultsFileIsWrittenWholeAndReplaced) {
  const fs::path f = dir_ / "out.json";
  EXPECT_EQ(bench::output_problem(f.string()), "");
  EXPECT_EQ(bench::write_whole(f.string(), "{\"a\":1}\n"), "");
  EXPECT_EQ(read(f), "{\"a\":1}\n");
  EXPECT_EQ(bench::write_whole(f.string(), "{\"b\":2}\n"), "");
  EXPECT_EQ(read(f), "{\"b\":2}\n");
  EXPECT_EQ(names(), std::vector<std::string>{"out.json"});
}

TEST_F(BenchIo, AResultsPathThatIsALinkIsWrittenThroughIt) {
  fs::create_directories(dir_ / "real");
  const fs::path target = dir_ / "real" / "results.json";
  {
    std::ofstream(target) << "old";
  }
  // A chain of two links, the first relative to its own folder.
  fs::create_symlink("real/results.json", dir_ / "hop.json");
  fs::create_symlink(dir_ / "hop.json", dir_ / "link.json");
  EXPECT_EQ(bench::output_problem((dir_ / "link.json").string()), "");
  EXPECT_EQ(bench::write_whole((dir_ / "link.json").string(), "{\"new\":1}\n"), "");
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.json"));
  EXPECT_TRUE(fs::is_symlink(dir_ / "hop.json"));
  EXPECT_EQ(read(target), "{\"new\":1}\n");
  EXPECT_EQ(read(dir_ / "link.json"), "{\"new\":1}\n");
  EXPECT_EQ(names(), (std::vector<std::string>{"hop.json", "link.json", "real"}));
  // A link to a file not there yet makes it.
  fs::create_symlink("real/later.json", dir_ / "dangling.json");
  EXPECT_EQ(bench::write_whole((dir_ / "dangling.json").string(), "x"), "");
  EXPECT_TRUE(fs::is_symlink(dir_ / "dangling.json"));
  EXPECT_EQ(read(dir_ / "real" / "later.json"), "x");
  // A relative link is read from its own folder, not the first link's.
  fs::create_directories(dir_ / "real" / "deeper");
  fs::create_symlink("../results.json", dir_ / "real" / "deeper" / "up.json");
  fs::create_symlink("real/deeper/up.json", dir_ / "via.json");
  EXPECT_EQ(bench::write_whole((dir_ / "via.json").string(), "{\"up\":1}\n"), "");
  EXPECT_EQ(read(target), "{\"up\":1}\n");
  EXPECT_TRUE(fs::is_symlink(dir_ / "via.json"));
}

TEST_F(BenchIo, ALinkLoopOrAChainPast40IsRefusedAndKept) {
  fs::create_symlink("b.json", dir_ / "a.json");
  fs::create_symlink("a.json", dir_ / "b.json");
  for (const char* name : {"a.json", "b.json"}) {
    const std::string path = (dir_ / name).string();
    EXPECT_NE(bench::output_problem(path).find("too many levels"), std::string::npos);
    EXPECT_NE(bench::write_whole(path, "x").find("too many levels"), std::string::npos);
    EXPECT_TRUE(fs::is_symlink(path));
  }
  // 40 links resolve, as the kernel resolves them; 41 do not.
  {
    std::ofstream(dir_ / "f") << "real";
  }
  auto link = [](int i) {
    std::string name = std::to_string(i);
    name.insert(name.begin(), 'l');
    return fs::path(name);
  };
  fs::create_symlink("f", dir_ / link(1));
  for (int i = 2; i <= 41; ++i) fs::create_symlink(link(i - 1), dir_ / link(i));
  EXPECT_EQ(bench::write_whole((dir_ / "l40").string(), "through 40"), "");
  EXPECT_EQ(read(dir_ / "f"), "through 40");
  EXPECT_NE(bench::write_whole((dir_ / "l41").string(), "x").find("too many levels"), std::string::npos);
  EXPECT_EQ(read(dir_ / "f"), "through 40");
  for (int i = 1; i <= 41; ++i) EXPECT_TRUE(fs::is_symlink(dir_ / link(i)));
  EXPECT_NE(bench::output_problem("").find("empty path"), std::string::npos);
  EXPECT_NE(bench::write_whole("", "x").find("empty path"), std::string::npos);
}

TEST_F(BenchIo, APathThatCannotTakeAFileIsNamedAndLeftAsItWas) {
  fs::create_directories(dir_ / "sub");
  const std::string problem = bench::output_problem((dir_ / "sub").string());
  EXPECT_NE(problem.find("not a regular file"), std::string::npos) << problem;
  const std::string missing = (dir_ / "no" / "such" / "out.json").string();
  EXPECT_NE(bench::output_problem(missing).find("cannot create"), std::string::npos);
  EXPECT_NE(bench::write_whole(missing, "x").find("cannot create"), std::string::npos);
  // Writing over a folder fails at the rename and leaves no temporary.
  const std::string over = bench::write_whole((dir_ / "sub").string(), "x");
  EXPECT_NE(over.find("cannot write"), std::string::npos) << over;
  EXPECT_TRUE(fs::is_directory(dir_ / "sub"));
  EXPECT_EQ(names(), std::vector<std::string>{"sub"});
}

TEST_F(BenchIo, APeerRunsWithoutAShellAndItsLastJsonLineIsKept) {
  // The last line starting with '{' counts, a last one without a newline
  // too; other lines do not.
  auto r = bench::run_child({"sh", "-c", "echo '{\"a\":1}'; echo noise; printf '{\"b\":2}'"}, 30, true);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.last_json, "{\"b\":2}");
  // Arguments reach the program as they are: no shell reads them.
  const std::string quoted = "{\"q\":\"'; touch " + (dir_ / "ran").string() + "; '\"}";
  r = bench::run_child({"printf", "%s\n", quoted}, 30, true);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.last_json, quoted);
  EXPECT_FALSE(fs::exists(dir_ / "ran"));
  r = bench::run_child({"sh", "-c", "exit 3"}, 30, true);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.describe(), "exited with status 3");
  r = bench::run_child({(dir_ / "no-such-program").string()}, 30, true);
  EXPECT_FALSE(r.started);
  EXPECT_EQ(r.describe(), "could not be started");
}

TEST_F(BenchIo, AnOverlongLineIsNotKept) {
  // A line past 1 MiB is dropped whole; the JSON line before it stays.
  auto r = bench::run_child(
      {"sh", "-c", "echo '{\"kept\":1}'; head -c 1100000 /dev/zero | tr '\\000' '{'; echo; echo tail"}, 60, true);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.last_json, "{\"kept\":1}");
}

TEST_F(BenchIo, APeerEndsAtItsDeadlineWithItsGroup) {
  using Clock = std::chrono::steady_clock;
  const fs::path marker = dir_ / "grandchild-ran";
  // The child and a process it started both sleep past the deadline; the
  // grandchild would leave a file if it outlived the group's end.
  const std::string script = "(sleep 3; touch " + marker.string() + ") & sleep 30";
  const auto start = Clock::now();
  const auto r = bench::run_child({"sh", "-c", script}, 0.5, true);
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(r.started);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.describe(), "timed out");
  EXPECT_LT(took, 2.5);
  ::sleep(4);
  EXPECT_FALSE(fs::exists(marker)) << "a process of the peer's group outlived its deadline";
}

TEST_F(BenchIo, APeerThatLeavesAProcessHoldingItsOutputEndsAtItsExit) {
  using Clock = std::chrono::steady_clock;
  const fs::path marker = dir_ / "left-behind-ran";
  // The child prints, starts a process that keeps its stdout open and
  // exits: the wait ends about 1 s after the exit, not at the deadline,
  // and the process left behind goes with the group.
  const std::string script = "echo '{\"done\":1}'; (sleep 4; touch " + marker.string() + ") & exit 0";
  const auto start = Clock::now();
  const auto r = bench::run_child({"sh", "-c", script}, 20, true);
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.last_json, "{\"done\":1}");
  EXPECT_LT(took, 3.5);
  ::sleep(5);
  EXPECT_FALSE(fs::exists(marker)) << "the process left behind outlived the wait";
}

}  // namespace
}  // namespace kvring
