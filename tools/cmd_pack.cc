// kvring pack: inspect and verify kvpack files (docs/kvpack-format.md).
#include <cstdio>
#include <string>
#include <vector>

#include "args.h"
#include "commands.h"
#include "kvring/chunk_store.h"
#include "kvring/footprint.h"
#include "kvring/pack.h"
#include "core/text.h"
#include "run_pack.h"

namespace kvring::cli {

namespace {

const char* kPackUsage = R"(usage: kvring pack inspect FILE
       kvring pack verify FILE [--store STORE]
       kvring pack [inspect | verify] --help
)";

// The metadata blob as text when it is printable (escaped as \xNN where a
// byte could act on a terminal), else its first bytes in hex.
std::string describe_metadata(const std::string& m) {
  bool text = true;
  for (unsigned char ch : m) text = text && ch != 0;
  const std::size_t shown = 160;
  if (text) {
    const std::string head = printable(std::string_view(m).substr(0, shown));
    return m.size() <= shown ? head : head + "... (" + std::to_string(m.size()) + " bytes)";
  }
  return to_hex(reinterpret_cast<const std::uint8_t*>(m.data()), std::min(m.size(), std::size_t{32})) +
         (m.size() > 32 ? "..." : "") + " (binary)";
}

int inspect(const std::string& path) {
  auto src = open_pack_file(path);
  if (!src) return fail(src.error());
  auto mr = read_manifest(**src);
  if (!mr) return fail(mr.error());
  const Manifest& m = *mr;
  const Snapshot& h = m.header;
  const ModelConfig& c = h.config;
  std::printf("kvpack %s: version %u, %s, %s B (manifest %s B, payload %s B%s)\n", printable(path).c_str(),
              static_cast<unsigned>(m.version), m.thin ? "thin" : "self-contained",
              with_commas((*src)->size()).c_str(), with_commas(m.manifest_bytes).c_str(),
              with_commas(m.payload_bytes).c_str(), m.thin ? " in a chunk store" : "");
  std::printf("  manifest digest  %s\n", to_hex(m.digest).c_str());
  std::printf("geometry: %lld layers (%lld sliding, %lld full), %lld query heads, %lld kv heads x %lld "
              "(kv_dim %lld), window %lld, max context %lld\n",
              static_cast<long long>(c.n_layers), static_cast<long long>(c.count(LayerKind::kSlidingRope)),
              static_cast<long long>(c.count(LayerKind::kFullNope)), static_cast<long long>(c.n_heads),
              static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.head_dim),
              static_cast<long long>(c.kv_dim()), static_cast<long long>(c.sliding_window),
              static_cast<long long>(c.max_context));
  std::printf("  fingerprint      %s\n", c.fingerprint_hex().c_str());
  std::printf("cache: context %s, %s tokens, token ids %s, chunk_tokens %lld, metadata %s B\n",
              with_commas(h.context).c_str(), with_commas(h.token_count).c_str(),
              h.token_ids.empty() ? "absent" : "present", static_cast<long long>(m.chunk_tokens),
              with_commas(static_cast<std::int64_t>(h.metadata.size())).c_str());
  if (!h.metadata.empty()) std::printf("  metadata         %s\n", describe_metadata(h.metadata).c_str());
  std::printf("planes:\n  %5s  %-11s  %-11s  %-8s  %9s  %9s  %14s  %15s  %6s\n", "layer", "kind", "layout",
              "encoding", "capacity", "len", "origin_logical", "origin_physical", "chunks");
  for (std::size_t l = 0; l < h.planes.size(); ++l) {
    const PlaneSnapshot& p = h.planes[l];
    std::printf("  %5zu  %-11s  %-11s  %-8s  %9lld  %9lld  %14lld  %15lld  %6lld\n", l,
                layer_kind_name(p.kind), p.layout == Layout::kTokenMajor ? "token-major" : "head-major",
                encoding_name(m.planes[l].encoding), static_cast<long long>(p.ring.capacity()),
                static_cast<long long>(p.ring.len()), static_cast<long long>(p.ring.origin_logical()),
                static_cast<long long>(p.ring.origin_physical()),
                static_cast<long long>(m.planes[l].n_chunks));
  }
  std::printf("chunks:\n  %6s  %5s  %-21s  %6s  %11s  %13s  %s\n", "chunk", "layer", "positions", "rows",
              "bytes", "offset", "name (SHA-256)");
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    const PackChunk& ch = m.chunks[i];
    char range[48];
    std::snprintf(range, sizeof range, "[%lld, %lld)", static_cast<long long>(ch.first_position),
                  static_cast<long long>(ch.first_position + ch.rows));
    std::printf("  %6zu  %5lld  %-21s  %6lld  %11s  %13s  %s\n", i, static_cast<long long>(ch.layer), range, static_cast<long long>(ch.rows), with_commas(ch.byte_length).c_str(),
                m.thin ? "store" : with_commas(ch.offset).c_str(), to_hex(ch.name).c_str());
  }
  return 0;
}

int verify(const std::string& path, const std::string& store_spec) {
  auto src = open_pack_file(path);
  if (!src) return fail(src.error());
  auto opened = store_to_read(store_spec, **src);
  if (!opened) return fail(opened.error());
  const std::unique_ptr<ChunkStore> store = std::move(*opened);
  auto r = verify_pack(**src, store.get());
  // Exit 1 says the pack is wrong: damaged, truncated, planted or missing
  // bytes. What stops the check from being made (a thin pack without its
  // store, a store that fails or stalls) is an input error, exit 2.
  const auto verdict = [](const Error& e) {
    return e.code == ErrorCode::kInvalidArgument || e.code == ErrorCode::kIOError ||
                   e.code == ErrorCode::kUnsupported
               ? kExitUsage
               : kExitVerifyFailed;
  };
  if (!r) {
    fail(r.error());
    return verdict(r.error());
  }
  if (r->bad_chunks > 0) {
    fail(r->first_error.error());
    // A store that failed or stalled checked nothing: no chunk is called bad.
    const int rc = verdict(r->first_error.error());
    std::fprintf(stderr, "kvring: %s: %lld of %lld chunks %s\n", printable(path).c_str(),
                 static_cast<long long>(r->bad_chunks), static_cast<long long>(r->chunks),
                 rc == kExitVerifyFailed ? "are bad" : "could not be checked");
    return rc;
  }
  // The store is named only when the chunks came from it: a self-contained
  // pack's chunks are its own, whatever --store says.
  std::string where;
  if (r->thin) where = " in " + printable(store->spec());
  else if (!store_spec.empty())
    where = " in the pack itself (self-contained: --store was not read)";
  std::printf("ok: %s: manifest digest and %lld chunks (%s B) verified%s\n", printable(path).c_str(),
              static_cast<long long>(r->chunks), with_commas(r->bytes).c_str(), where.c_str());
  return 0;
}

}  // namespace

int cmd_pack(const std::vector<std::string>& argv) {
  if (argv.empty()) {
    std::fputs(kPackUsage, stderr);
    return kExitUsage;
  }
  const std::string sub = argv[0];
  if (sub == "help" || sub == "--help" || sub == "-h") return print_help("pack");
  static const std::set<std::string> kOptions = {"store"};
  if ((sub == "inspect" || sub == "verify") && wants_help(argv, kOptions)) return print_help("pack " + sub);
  auto args = Args::parse({argv.begin() + 1, argv.end()}, {}, kOptions);
  if (!args) return fail(args.error());
  if (sub != "inspect" && sub != "verify") {
    std::fputs(kPackUsage, stderr);
    return fail("unknown pack command '" + sub + "' (inspect or verify)");
  }
  if (args->positional().size() != 1)
    return fail("pack " + sub + " takes one FILE, got " + std::to_string(args->positional().size()));
  if (sub == "inspect") {
    if (args->has("store")) return fail("pack inspect reads only the manifest; --store is for verify");
    return inspect(args->positional()[0]);
  }
  return verify(args->positional()[0], args->str("store"));
}

}  // namespace kvring::cli
