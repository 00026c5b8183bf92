// kvring-pack-bench: saving and restoring one full KV-cache slot as a kvpack
// on the CPU backend, against the ceilings measured in the same run.
//
//   kvring-pack-bench [--model NAME] [--context N] [--dir DIR] [--repeat N] [--keep]
//
// Default: muse-glimmer at 131072 tokens (1,826,619,392 B of planes, every
// row live: the sliding rings wrapped, the full planes full). It measures
//   - SHA-256 over the planes' bytes on all cores (and on one),
//   - the disk: writing a file of the same size on all cores with fsync, and
//     reading it back cold (its pages dropped with posix_fadvise),
//   - the first touch of the same amount of fresh memory,
//   - save: take_snapshot, then write_pack (hash and write in one pass,
//     fsync, rename, fsync of the directory), with fresh and reused buffers,
//     and write_pack of the cache itself, a group of planes at a time,
//   - restore: read_pack from the cold file (read and verify every chunk)
//     then restore into an allocated cache, with fresh and reused buffers,
//     and through the detached path (a new cache without the zero-fill);
//     restore_pack into a new sequence of a store, a group of planes at a
//     time, beside read_pack into a fresh snapshot and restore_new_sequence,
// and prints each time with its ratio to the ceilings. Restored planes are
// compared with the live ones, byte for byte.
#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "../tools/args.h"
#include "cpu/parallel.h"
#include "kvring/backend.h"
#include "kvring/footprint.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"

namespace kvring {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double gbps(std::int64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0; }

constexpr const char* kUsage =
    "usage: kvring-pack-bench [--model NAME] [--context N] [--dir DIR] [--repeat N] [--keep]\n"
    "                         [--store-backend cpu|cuda]\n"
    "\n"
    "Saves and restores one full KV-cache slot as a kvpack on the CPU backend,\n"
    "beside SHA-256, disk and first-touch ceilings measured in the same run.\n"
    "\n"
    "  --model NAME   a preset (default muse-glimmer)\n"
    "  --context N    tokens in the slot (default: the model's max_context)\n"
    "  --dir DIR      where the pack and the disk ceiling's file go (default .);\n"
    "                 they are removed at the end, on an error and on SIGINT\n"
    "  --repeat N     alternated rounds, best of N reported (default 4, 2..100)\n"
    "  --keep         keep the pack file\n"
    "  --store-backend cpu|cuda\n"
    "                 the backend of the store whose new sequence restore_pack\n"
    "                 fills (default cpu)\n";

// The bench's own files: the pack and the disk ceiling's file, each
// removed on an error, SIGINT or SIGTERM once this run has written it (a
// pack kept by an earlier run, or a file of the same name, is left alone
// until then), and write_pack's temporaries of this process beside it.
std::string g_dir, g_pack, g_plain;  // set before any thread starts
std::atomic<bool> g_pack_ours{false}, g_plain_ours{false};
void remove_files() {
  if (g_pack_ours) ::unlink(g_pack.c_str());
  if (g_plain_ours) ::unlink(g_plain.c_str());
  if (g_dir.empty()) return;
  const std::string prefix = ".tmp-kvring-bench.kvpack-" + std::to_string(::getpid()) + "-";
  if (DIR* d = ::opendir(g_dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) ::unlinkat(::dirfd(d), e->d_name, 0);
    ::closedir(d);
  }
}

// SIGINT and SIGTERM are blocked in every thread (the mask is set before
// the first starts) and taken by this one, which removes the files in
// ordinary code and ends the process as the signal would.
void clean_up_on_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) return;
    remove_files();
    std::_Exit(128 + sig);
  }).detach();
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kvring-pack-bench: %s\n", what.c_str());
  remove_files();
  std::exit(1);
}
// `what` and errno's reason, for a failed system call.
[[noreturn]] void die_errno(const std::string& what) { die(what + ": " + std::strerror(errno)); }
void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

// Seeded random f16 bits, 4 per splitmix64 step, filled in parallel blocks.
void random_bits(std::uint16_t* dst, std::int64_t n, std::uint64_t seed) {
  const std::int64_t block = 1 << 20;
  const std::int64_t blocks = (n + block - 1) / block;
  cpu::parallel_for(blocks, n * 4, [&](std::int64_t b) {
    std::uint64_t x = seed ^ (static_cast<std::uint64_t>(b) * 0x9e3779b97f4a7c15ULL);
    const std::int64_t end = std::min(n, (b + 1) * block);
    for (std::int64_t i = b * block; i < end; i += 4) {
      x += 0x9e3779b97f4a7c15ULL;
      std::uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      for (std::int64_t j = 0; j < 4 && i + j < end; ++j) dst[i + j] = static_cast<std::uint16_t>(z >> (16 * j));
    }
  });
}

// Every plane holds `context` positions' worth of live rows.
void fill(KvCache& cache, std::int64_t tokens) {
  const std::int64_t kv = cache.config().kv_dim();
  std::vector<std::uint16_t> k, v;
  for (std::int64_t l = 0; l < cache.n_layers(); ++l) {
    const RingState& r = cache.ring(l);
    auto ring = RingState::sequential(r.capacity(), r.wraps(), tokens);
    if (!ring) die(ring.error().to_string());
    k.resize(static_cast<std::size_t>(ring->len() * kv));
    v.resize(k.size());
    random_bits(k.data(), static_cast<std::int64_t>(k.size()), 2 * static_cast<std::uint64_t>(l) + 1);
    random_bits(v.data(), static_cast<std::int64_t>(v.size()), 2 * static_cast<std::uint64_t>(l) + 2);
    check(cache.install(l, *ring, k.data(), v.data()), "install");
  }
}

// A snapshot's row bytes cut into pieces of at most `piece` bytes.
struct Piece {
  const std::uint8_t* p;
  std::size_t n;
};
std::vector<Piece> pieces_of(const Snapshot& s, std::size_t piece) {
  std::vector<Piece> pieces;
  for (const PlaneSnapshot& p : s.planes)
    for (const auto* buf : {&p.k, &p.v}) {
      const auto* b = reinterpret_cast<const std::uint8_t*>(buf->data());
      const std::size_t bytes = buf->size() * 2;
      for (std::size_t at = 0; at < bytes; at += piece) pieces.push_back({b + at, std::min(piece, bytes - at)});
    }
  return pieces;
}

// SHA-256 of every plane's rows in 256 KiB pieces, on `threads` (0: all).
double hash_seconds(const Snapshot& s, unsigned threads) {
  const std::vector<Piece> pieces = pieces_of(s, 256 << 10);
  std::vector<Digest> out(pieces.size());
  cpu::set_thread_limit(threads);
  const auto t0 = Clock::now();
  cpu::parallel_for(static_cast<std::int64_t>(pieces.size()), s.row_bytes(), [&](std::int64_t i) {
    out[static_cast<std::size_t>(i)] = sha256(pieces[static_cast<std::size_t>(i)].p, pieces[static_cast<std::size_t>(i)].n);
  });
  const double t = since(t0);
  cpu::set_thread_limit(0);
  return t;
}

void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) die_errno("open " + path);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Reads a whole file from a cold page cache in 1 MiB pieces on all cores,
// into memory already faulted in: the disk's read ceiling for that file.
double cold_read_seconds(const std::string& path) {
  drop_cache(path);
  const int fd = ::open(path.c_str(), O_RDONLY);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) die_errno("open " + path);
  std::vector<std::uint8_t> buf(static_cast<std::size_t>(st.st_size), 1);
  const std::int64_t piece = 1 << 20;
  const std::int64_t pieces = (st.st_size + piece - 1) / piece;
  const auto t0 = Clock::now();
  cpu::parallel_for(pieces, st.st_size, [&](std::int64_t i) {
    const std::int64_t end = std::min<std::int64_t>(st.st_size, (i + 1) * piece);
    for (std::int64_t at = i * piece; at < end;) {
      const ssize_t r = ::pread(fd, buf.data() + at, static_cast<std::size_t>(end - at), at);
      if (r <= 0) die_errno("read " + path);
      at += r;
    }
  });
  const double s = since(t0);
  ::close(fd);
  return s;
}

// The disk ceiling: the snapshot's bytes written to a plain file in 1 MiB
// pieces on all cores with fsync, then read back cold.
std::pair<double, double> disk_seconds(const Snapshot& s, const std::string& path) {
  const std::vector<Piece> pieces = pieces_of(s, 1 << 20);
  std::vector<std::int64_t> offset(pieces.size() + 1, 0);
  for (std::size_t i = 0; i < pieces.size(); ++i) offset[i + 1] = offset[i] + static_cast<std::int64_t>(pieces[i].n);
  g_plain_ours = true;  // from here on this run's file
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) die_errno("create " + path);
  auto t0 = Clock::now();
  cpu::parallel_for(static_cast<std::int64_t>(pieces.size()), offset.back(), [&](std::int64_t i) {
    const auto& [p, n] = pieces[static_cast<std::size_t>(i)];
    for (std::size_t done = 0; done < n;) {
      const ssize_t w = ::pwrite(fd, p + done, n - done, offset[static_cast<std::size_t>(i)] + static_cast<std::int64_t>(done));
      if (w <= 0) die_errno("write " + path);
      done += static_cast<std::size_t>(w);
    }
  });
  if (::fsync(fd) != 0) die_errno("fsync " + path);
  const double write_s = since(t0);
  ::close(fd);
  const double read_s = cold_read_seconds(path);
  ::unlink(path.c_str());
  return {write_s, read_s};
}

bool same_planes(const KvStore& a, SeqId as, const KvStore& b, SeqId bs) {
  std::vector<std::uint16_t> ak, av, bk, bv;
  for (std::int64_t l = 0; l < a.n_layers(); ++l) {
    auto ra = a.ring(as, l);
    auto rb = b.ring(bs, l);
    if (!ra || !rb || !(*ra == *rb)) return false;
    const auto n = static_cast<std::size_t>(ra->capacity() * a.config().kv_dim());
    ak.resize(n), av.resize(n), bk.resize(n), bv.resize(n);
    check(a.read_plane(as, l, ak.data(), av.data()), "read_plane");
    check(b.read_plane(bs, l, bk.data(), bv.data()), "read_plane");
    if (ak != bk || av != bv) return false;
  }
  return true;
}
bool same_planes(const KvCache& a, const KvCache& b) { return same_planes(a.store(), a.seq(), b.store(), b.seq()); }

// Allocating and touching `bytes` of fresh memory: what any buffer that is
// not reused costs first (on some virtual machines, more than the copy).
template <class Buffer>
double first_touch_seconds(std::int64_t bytes) {
  const auto t0 = Clock::now();
  Buffer fresh(static_cast<std::size_t>(bytes));
  const double s = since(t0);
  if (fresh[static_cast<std::size_t>(bytes / 2)] != 0) die("fresh memory is not zero");
  return s;
}

void line(const char* what, double s, std::int64_t bytes) {
  std::printf("  %-38s %7.3f s  %6.2f GB/s\n", what, s, gbps(bytes, s));
}

struct Best {
  double s = 1e300;
  void add(double t) { s = std::min(s, t); }
};

int run(const std::vector<std::string>& argv) {
  // Every large buffer is a fresh mapping, returned to the system when freed,
  // so "fresh buffers" means fresh pages (glibc would otherwise recycle freed
  // heap memory once its dynamic mmap threshold has grown).
  ::mallopt(M_MMAP_THRESHOLD, 4 << 20);
  clean_up_on_signals();
  auto args = cli::Args::parse(argv, {"keep", "help"}, {"model", "context", "dir", "repeat", "store-backend"});
  if (!args) die(args.error().message + "\n" + kUsage);
  if (args->flag("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!args->positional().empty()) die("unexpected argument '" + args->positional()[0] + "'\n" + kUsage);
  auto config = preset_config(args->str("model", "muse-glimmer"));
  if (!config) die(config.error().to_string());
  auto context = args->integer("context", config->max_context, 1, config->max_context);
  if (!context) die(context.error().to_string());
  auto repeat = args->integer("repeat", 4, 2, 100);
  if (!repeat) die(repeat.error().to_string());
  auto store_backend = parse_backend(args->str("store-backend", "cpu"));
  if (!store_backend) die("--store-backend: " + store_backend.error().to_string());
  const std::string dir = args->str("dir", ".");
  const std::string pack = dir + "/kvring-bench.kvpack";
  const std::string plain = dir + "/kvring-bench.raw";
  if (Status s = check_pack_destination(pack); !s.ok()) die("--dir: " + s.to_string());
  g_dir = dir, g_pack = pack, g_plain = plain;
  // A file size limit fails a write (EFBIG) rather than ending the process
  // with its files half-written.
  std::signal(SIGXFSZ, SIG_IGN);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  std::printf("kvring-pack-bench %s: model %s, context %lld, %u cores, pack in %s, best of %lld\n", date,
              config->name.c_str(), static_cast<long long>(*context), cpu::worker_count(), dir.c_str(),
              static_cast<long long>(*repeat));

  auto live = make_cpu_cache(*config, {.context = *context});
  if (!live) die(live.error().to_string());
  auto t0 = Clock::now();
  fill(**live, *context);
  std::printf("  %-38s %7.3f s  %s of planes\n", "fill (random f16 bits, install)", since(t0),
              format_bytes((*live)->allocated_bytes()).c_str());

  // Save with fresh buffers: once, as a process that saves once does.
  t0 = Clock::now();
  auto snap = take_snapshot(**live);
  if (!snap) die(snap.error().to_string());
  const double snapshot_fresh_s = since(t0);
  const std::int64_t bytes = snap->row_bytes();
  t0 = Clock::now();
  check(write_pack(*snap, pack), "write_pack");
  g_pack_ours = true;
  const double write_fresh_s = since(t0);

  // The ceilings and the reused-buffer paths, alternated, best of N each:
  // this machine's disk varies run to run.
  Best hash_all, hash_one, disk_write, disk_read, pack_read, snapshot_reused, write_reused,
      read_reused, install_reused, touch_plain, touch_rows, write_streamed, store_grouped, store_whole;
  auto target = make_cpu_cache(*config, {.context = *context});
  if (!target) die(target.error().to_string());
  check(restore(*snap, **target), "restore");  // fault in the target's pages
  // A store for restore_pack into a new sequence, its pages faulted in by a
  // first restore.
  auto store_target = make_store(*store_backend, *config, {.max_sequences = 1, .context = *context});
  if (!store_target) die(store_target.error().to_string());
  {
    auto seq = restore_new_sequence(*snap, **store_target);
    if (!seq) die(seq.error().to_string());
    check((*store_target)->remove_sequence(*seq), "remove_sequence");
  }
  bool identical = true;
  for (std::int64_t r = 0; r < *repeat; ++r) {
    hash_all.add(hash_seconds(*snap, 0));
    hash_one.add(hash_seconds(*snap, 1));
    const auto [w, rd] = disk_seconds(*snap, plain);
    disk_write.add(w);
    disk_read.add(rd);
    t0 = Clock::now();
    check(take_snapshot(**live, *snap), "take_snapshot");
    snapshot_reused.add(since(t0));
    t0 = Clock::now();
    check(write_pack(*snap, pack), "write_pack");
    write_reused.add(since(t0));
    // The same file from the cache, a group of planes at a time; what is read back
    // below is this one.
    t0 = Clock::now();
    check(write_pack(**live, pack, {}), "write_pack of the cache");
    write_streamed.add(since(t0));
    // Below the guest's page cache the host may cache what was just read, so
    // the raw read and read_pack take turns at going first.
    if (r % 2 == 0) pack_read.add(cold_read_seconds(pack));
    drop_cache(pack);
    auto src = open_pack_file(pack);
    if (!src) die(src.error().to_string());
    t0 = Clock::now();
    check(read_pack(**src, {}, *snap), "read_pack");
    read_reused.add(since(t0));
    if (r % 2 == 1) pack_read.add(cold_read_seconds(pack));
    t0 = Clock::now();
    check(restore(*snap, **target), "restore");
    install_reused.add(since(t0));
    identical = identical && same_planes(**live, **target);
    // restore_pack into a new sequence of a store, a group of planes at a
    // time, and the whole-sequence way it replaced (read_pack into a fresh
    // snapshot, then restore_new_sequence), taking turns at going first.
    for (int turn = 0; turn < 2; ++turn) {
      const bool grouped = (turn + r) % 2 == 0;
      drop_cache(pack);
      auto from = open_pack_file(pack);
      if (!from) die(from.error().to_string());
      KvStore& st = **store_target;
      t0 = Clock::now();
      Result<SeqId> seq = SeqId{};
      if (grouped) {
        seq = restore_pack(**from, {}, st);
      } else {
        auto whole = read_pack(**from);
        seq = whole ? restore_new_sequence(*whole, st) : Result<SeqId>(whole.error());
      }
      (grouped ? store_grouped : store_whole).add(since(t0));
      check(seq.status(), grouped ? "restore_pack into a store" : "read_pack + restore_new_sequence");
      identical = identical && same_planes((*live)->store(), (*live)->seq(), st, *seq);
      check(st.remove_sequence(*seq), "remove_sequence");
    }
    touch_plain.add(first_touch_seconds<std::vector<std::uint8_t>>(bytes));
    touch_rows.add(first_touch_seconds<RowBuffer>(bytes / 2));  // bytes / 2 values of 2 bytes
  }

  // Restore with fresh buffers and a fresh cache: once.
  target = Result<std::unique_ptr<KvCache>>(std::unique_ptr<KvCache>());
  snap = Snapshot{};
  auto fresh_target = make_cpu_cache(*config, {.context = *context});
  if (!fresh_target) die(fresh_target.error().to_string());
  drop_cache(pack);
  t0 = Clock::now();
  auto fresh = read_pack_file(pack);
  if (!fresh) die(fresh.error().to_string());
  const double read_fresh_s = since(t0);
  t0 = Clock::now();
  check(restore(*fresh, **fresh_target), "restore");
  const double install_fresh_s = since(t0);
  identical = identical && same_planes(**live, **fresh_target);
  fresh_target = Result<std::unique_ptr<KvCache>>(std::unique_ptr<KvCache>());
  t0 = Clock::now();
  auto detached = restore_detached(*fresh);
  if (!detached) die(detached.error().to_string());
  const double detached_s = since(t0);
  identical = identical && same_planes(**live, **detached);
  struct stat st {};
  ::stat(pack.c_str(), &st);
  if (args->flag("keep")) g_pack_ours = false;
  remove_files();

  const double save_reused_s = snapshot_reused.s + write_reused.s;
  const double restore_reused_s = read_reused.s + install_reused.s;
  const double save_fresh_s = snapshot_fresh_s + write_fresh_s;
  const double restore_fresh_s = read_fresh_s + install_fresh_s;
  std::printf("  %-38s %s\n", "planes' live rows", format_bytes(bytes).c_str());
  std::printf("  %-38s %s\n", "pack file", format_bytes(st.st_size).c_str());
  std::printf("ceilings, same run:\n");
  char label[64];
  std::snprintf(label, sizeof label, "SHA-256, %u cores", cpu::worker_count());
  line(label, hash_all.s, bytes);
  line("SHA-256, 1 core", hash_one.s, bytes);
  line("disk write + fsync, all cores", disk_write.s, bytes);
  line("disk read, cold, all cores", disk_read.s, bytes);
  line("pack file read, cold, all cores", pack_read.s, bytes);
  line("fresh memory, first touch, 4 KiB pages", touch_plain.s, bytes);
  line("fresh memory, first touch, RowBuffer", touch_rows.s, bytes);
  std::printf("save, reused buffers (a server saving again and again):\n");
  line("take_snapshot", snapshot_reused.s, bytes);
  line("write_pack: hash + write + fsync", write_reused.s, bytes);
  line("save", save_reused_s, bytes);
  line("save from the cache, planes a group at a time", write_streamed.s, bytes);
  std::printf("restore, reused buffers, pack file cold:\n");
  line("read_pack: read + verify", read_reused.s, bytes);
  line("restore: install", install_reused.s, bytes);
  line("restore", restore_reused_s, bytes);
  std::printf("restore into a new sequence of a %s store, pack file cold:\n",
              *store_backend == BackendKind::kCuda ? "CUDA" : "CPU");
  line("restore_pack, planes a group at a time", store_grouped.s, bytes);
  line("read_pack, fresh snapshot, restore_new_sequence", store_whole.s, bytes);
  std::printf("fresh buffers (a process that saves or restores once):\n");
  line("take_snapshot", snapshot_fresh_s, bytes);
  line("write_pack", write_fresh_s, bytes);
  line("save", save_fresh_s, bytes);
  line("read_pack_file, pack file cold", read_fresh_s, bytes);
  line("restore into a new cache", install_fresh_s, bytes);
  line("restore", restore_fresh_s, bytes);
  line("restore_detached (cache without zero-fill)", detached_s, bytes);
  std::printf("ratios (time / ceiling time; 1.00 = at the ceiling):\n");
  auto ratio = [](const char* what, double r) { std::printf("  %-38s %7.2f\n", what, r); };
  ratio("write_pack / disk write", write_reused.s / disk_write.s);
  ratio("write_pack / (hash 1 core + write)", write_reused.s / (hash_one.s + disk_write.s));
  ratio("save / disk write", save_reused_s / disk_write.s);
  ratio("save from the cache / disk write", write_streamed.s / disk_write.s);
  ratio("hash share of write_pack", hash_all.s / write_reused.s);
  ratio("read_pack / pack read", read_reused.s / pack_read.s);
  ratio("restore / pack read", restore_reused_s / pack_read.s);
  ratio("hash share of read_pack", hash_all.s / read_reused.s);
  ratio("restore_pack into a store / pack read", store_grouped.s / pack_read.s);
  ratio("restore_pack into a store / whole way", store_grouped.s / store_whole.s);
  ratio("save, fresh / disk write", save_fresh_s / disk_write.s);
  ratio("restore, fresh / pack read", restore_fresh_s / pack_read.s);
  std::printf("restored planes byte-identical to the live ones: %s\n", identical ? "yes" : "NO");
  return identical ? 0 : 1;
}

}  // namespace
}  // namespace kvring

int main(int argc, char** argv) { return kvring::run(std::vector<std::string>(argv + 1, argv + argc)); }
