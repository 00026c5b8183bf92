#include "pack_test_util.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>


namespace kvring::testing {

void seeded_rows(std::uint64_t seed, std::int64_t layer, std::int64_t position, std::int64_t count,
                 std::int64_t kv_dim, float* k, float* v) {
  for (std::int64_t r = 0; r < count; ++r) {
    std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<std::uint64_t>(layer) << 40) ^
                        static_cast<std::uint64_t>(position + r));
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    for (std::int64_t e = 0; e < kv_dim; ++e) {
      k[r * kv_dim + e] = dist(rng);
      v[r * kv_dim + e] = dist(rng);
    }
  }
}

void fill(KvCache& cache, std::int64_t from, std::int64_t to, std::uint64_t seed, std::int64_t batch,
          std::int64_t split, std::uint64_t seed_after) {
  const std::int64_t kv = cache.config().kv_dim();
  std::vector<float> k, v;
  for (std::int64_t p = from; p < to;) {
    const std::int64_t n = std::min(batch, to - p);
    k.resize(static_cast<std::size_t>(n * kv));
    v.resize(k.size());
    for (std::int64_t l = 0; l < cache.n_layers(); ++l) {
      for (std::int64_t r = 0; r < n; ++r) {
        const std::int64_t pos = p + r;
        seeded_rows(split >= 0 && pos >= split ? seed_after : seed, l, pos, 1, kv,
                    k.data() + r * kv, v.data() + r * kv);
      }
      const Status s = cache.store_batch(l, p, n, k.data(), v.data());
      if (!s.ok()) std::abort();
    }
    p += n;
  }
}

std::unique_ptr<KvCache> filled_cache(const ModelConfig& config, std::int64_t context,
                                      std::int64_t tokens, std::uint64_t seed) {
  auto c = make_cpu_cache(config, {.context = context});
  if (!c.ok()) std::abort();
  fill(**c, 0, tokens, seed);
  return std::move(*c);
}

CacheImage image(const KvCache& cache) {
  CacheImage im;
  for (std::int64_t l = 0; l < cache.n_layers(); ++l) {
    im.rings.push_back(cache.ring(l));
    const auto n = static_cast<std::size_t>(cache.ring(l).capacity() * cache.config().kv_dim());
    im.k.emplace_back(n);
    im.v.emplace_back(n);
    if (!cache.read_plane(l, im.k.back().data(), im.v.back().data()).ok()) std::abort();
  }
  return im;
}

bool same_rows(const Snapshot& a, const Snapshot& b) {
  if (a.planes.size() != b.planes.size() || a.token_count != b.token_count ||
      a.token_ids != b.token_ids || a.metadata != b.metadata || a.context != b.context ||
      a.config.fingerprint() != b.config.fingerprint())
    return false;
  for (std::size_t l = 0; l < a.planes.size(); ++l) {
    const PlaneSnapshot& x = a.planes[l];
    const PlaneSnapshot& y = b.planes[l];
    if (!(x.ring == y.ring) || x.kind != y.kind || x.layout != y.layout || x.k != y.k || x.v != y.v)
      return false;
  }
  return true;
}

Snapshot snapshot_with_extras(const KvCache& cache, std::uint64_t seed) {
  auto s = take_snapshot(cache);
  if (!s.ok()) std::abort();
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < s->token_count; ++i)
    s->token_ids.push_back(static_cast<std::int32_t>(rng() % 50000));
  s->metadata = R"({"run":{"seed":)" + std::to_string(seed) + R"(,"hidden":64}})";
  return std::move(*s);
}

std::string make_temp_dir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/kvring-" + tag + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) std::abort();
  return templ;
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace kvring::testing
