#include "kvring/chunk_store.h"

#include <charconv>

namespace kvring {

const char* io_step_name(IoStep step) {
  switch (step) {
    case IoStep::kOpen: return "open";
    case IoStep::kWrite: return "write";
    case IoStep::kFsync: return "fsync";
    case IoStep::kRename: return "rename";
    case IoStep::kFsyncDir: return "fsync of the directory";
  }
  return "unknown";
}

Status ChunkStore::get(const Digest& name, std::span<std::uint8_t> dst) const {
  KVRING_RETURN_IF_ERROR(read_raw(name, dst));
  const Digest got = sha256(dst.data(), dst.size());
#if defined(FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION)
  // Fuzzing builds skip digest comparisons, as the pack reader does.
  if (false)
#else
  if (got != name)
#endif
    return corruption(spec() + ": chunk " + to_hex(name) + " holds bytes that hash to " +
                      to_hex(got) + " (damaged or planted)");
  return Status::Ok();
}

Result<std::unique_ptr<ChunkStore>> open_chunk_store(std::string_view spec, IoOptions io) {
  if (spec.starts_with("dir:")) {
    const std::string path(spec.substr(4));
    if (path.empty()) return invalid_argument("chunk store 'dir:' needs a path (dir:PATH)");
    return open_dir_store(path, std::move(io));
  }
  if (spec.starts_with("redis://")) {
    std::string_view rest = spec.substr(8);
    if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
      if (slash + 1 != rest.size())
        return invalid_argument("chunk store '" + std::string(spec) +
                                "': database paths are not supported (redis://HOST:PORT)");
      rest = rest.substr(0, slash);
    }
    std::string host(rest);
    int port = 6379;
    if (const auto colon = rest.rfind(':'); colon != std::string_view::npos) {
      host = std::string(rest.substr(0, colon));
      const std::string_view p = rest.substr(colon + 1);
      auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
      if (p.empty() || ec != std::errc() || end != p.data() + p.size() || port < 1 || port > 65535)
        return invalid_argument("chunk store '" + std::string(spec) + "': port '" + std::string(p) +
                                "' is not in [1, 65535]");
    }
    if (host.empty()) return invalid_argument("chunk store '" + std::string(spec) + "' has no host");
    return open_redis_store(host, port);
  }
  return invalid_argument("unknown chunk store '" + std::string(spec) +
                          "' (dir:PATH or redis://HOST:PORT)");
}

}  // namespace kvring
