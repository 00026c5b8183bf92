// kvpack: the portable, content-addressed format of a snapshot.
// docs/kvpack-format.md is the specification; this is its codec.
//
// A pack is self-contained (one file) or thin (the manifest in a file, the
// chunks in a ChunkStore). Writers are atomic: a failed or interrupted write
// never leaves a file that reads as a valid pack. Readers verify the
// manifest digest and every chunk's hash, check every field before it sizes
// anything, and name what is wrong and where (section, plane, chunk, offset).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kvring/chunk_store.h"
#include "kvring/sha256.h"
#include "kvring/snapshot.h"
#include "kvring/status.h"

namespace kvring {

// The numeric values are part of the format; never reuse one.
enum class Encoding : std::uint8_t {
  kF16Le = 0,  // the planes' f16 bits (default, bitwise)
  kF32Le = 1,  // widened to f32 (interchange)
};
const char* encoding_name(Encoding encoding);

inline constexpr std::uint16_t kPackVersion = 1;
inline constexpr std::uint8_t kPackMagic[8] = {0x89, 'k', 'v', 'p', 'a', 'c', 'k', '\n'};
inline constexpr std::int64_t kPreambleBytes = 16;  // magic + version + flags + manifest_len
inline constexpr std::int64_t kDigestBytes = 32;    // SHA-256
inline constexpr std::int64_t kPlaneRecordBytes = 31;
inline constexpr std::int64_t kChunkRecordBytes = 48;  // position 8 + rows 4 + length 4 + name 32
inline constexpr std::uint16_t kFlagThin = 1;
inline constexpr std::int64_t kMaxManifestBytes = std::int64_t{256} << 20;
inline constexpr std::int64_t kMaxChunkBytes = std::int64_t{1} << 30;
inline constexpr std::int64_t kMaxChunkTokens = 65536;
inline constexpr std::int64_t kDefaultChunkTokens = 256;
inline constexpr std::int64_t kMaxTokenCount = std::int64_t{1} << 62;

struct WriteOptions {
  Encoding encoding = Encoding::kF16Le;
  std::int64_t chunk_tokens = kDefaultChunkTokens;
  // Set: a thin pack whose chunks go to this store. Null: self-contained.
  ChunkStore* store = nullptr;
  IoOptions io{};  // fault injection for the pack file (tests)
};

struct ReadOptions {
  // The store of a thin pack's chunks (required for thin packs).
  const ChunkStore* store = nullptr;
  // Refuse packs whose rows would take more host memory than this: all of
  // them for read_pack and restore_pack into a cache. restore_pack into a
  // store reads its groups of planes no larger than this (down to one
  // plane a group) and refuses only a plane longer than it. The memory
  // this process may use (its cgroup's limit) bounds it too.
  std::int64_t max_row_bytes = std::numeric_limits<std::int64_t>::max();
};

// One chunk record of the manifest.
struct PackChunk {
  std::int64_t layer = 0;
  std::int64_t first_position = 0;
  std::int64_t rows = 0;
  std::int64_t byte_length = 0;
  std::int64_t offset = 0;  // of its bytes in a self-contained pack, else 0
  Digest name{};
};

struct PackPlane {
  Encoding encoding = Encoding::kF16Le;
  std::int64_t first_chunk = 0;  // index into Manifest::chunks
  std::int64_t n_chunks = 0;
};

// Everything before the payload, decoded and checked.
struct Manifest {
  std::uint16_t version = kPackVersion;
  bool thin = false;
  Snapshot header;  // geometry, tokens, metadata, ring states; no rows
  std::int64_t chunk_tokens = 0;
  std::vector<PackPlane> planes;
  std::vector<PackChunk> chunks;
  Digest digest{};                  // SHA-256(preamble || manifest)
  std::int64_t manifest_bytes = 0;  // manifest_len
  std::int64_t payload_offset = 0;  // first payload byte (self-contained)
  std::int64_t payload_bytes = 0;   // sum of byte_length
};

// The bytes of a pack: a file (read with pread, safe from several threads)
// or a buffer.
class PackSource {
 public:
  virtual ~PackSource() = default;
  virtual const std::string& name() const = 0;  // for error messages
  virtual std::int64_t size() const = 0;
  // The bytes the source really holds: below size() for a sparse file. A
  // reader allocates rows beyond it only after the chunks verified.
  virtual std::int64_t stored_bytes() const { return size(); }
  // Reads exactly n bytes at offset (within size()).
  virtual Status read_at(std::int64_t offset, std::int64_t n, std::uint8_t* dst) const = 0;
  // Whether bytes [offset, offset + n), within size(), are known to lie
  // wholly in a hole of a sparse file (they hold no data and read as
  // zeros). False where that is not known: the bytes are then read.
  virtual bool in_hole(std::int64_t /*offset*/, std::int64_t /*n*/) const { return false; }
};
// Refuses anything but a regular file (a FIFO, a device) without blocking.
Result<std::unique_ptr<PackSource>> open_pack_file(const std::string& path);
// A view of `size` bytes at `data` (not copied; must outlive the source).
std::unique_ptr<PackSource> memory_pack_source(const void* data, std::int64_t size,
                                               std::string name = "<memory>");

// Writing. Every path validates the snapshot first.
// The pack as bytes (thin when options.store is set: the chunks go there).
Result<std::string> encode_pack(const Snapshot& snapshot, const WriteOptions& options = {});
// The pack as a file, written atomically (temporary file, fsync, rename,
// fsync of the directory): on an error nothing is left at `path` but what
// was there, except where the directory's sync, the last step, fails
// after the rename (the new pack is then whole there, its durability
// unknown). A thin pack's chunks are durable in the store before its
// manifest file appears; a write refused for its input (the manifest's
// size, the destination) puts none there.
Status write_pack(const Snapshot& snapshot, const std::string& path,
                  const WriteOptions& options = {});
// The pack of a store's live sequence `seq`, with these token ids (empty,
// or one a position) and metadata: the file write_pack of its snapshot
// (take_snapshot, the same ids and metadata) writes, bit for bit, with
// consecutive planes' rows in host memory a group at a time instead of
// the sequence's: at most the larger of its longest plane and 64 MiB of
// rows (and, in F32Le, their encoding, twice their size).
// The same refusals, before anything is written or put in a store, and
// the store's own (the sequence unknown or detached: kNotFound). Reads
// the sequence (read_rows), which must not change during the call.
Status write_pack(const KvStore& store, SeqId seq, const std::string& path,
                  const std::vector<std::int32_t>& token_ids, const std::string& metadata = {},
                  const WriteOptions& options = {});
// The same for a one-sequence cache.
Status write_pack(const KvCache& cache, const std::string& path,
                  const std::vector<std::int32_t>& token_ids, const std::string& metadata = {},
                  const WriteOptions& options = {});
// What write_pack would refuse about `path` itself, found before a session
// is computed for it: anything there but a regular file, a directory that
// is absent or not writable, a name too long for the temporary beside it.
// Creates the temporary and removes it; leaves nothing.
Status check_pack_destination(const std::string& path);

// Reading.
Result<Manifest> read_manifest(const PackSource& source);
// The whole snapshot, every chunk verified.
Result<Snapshot> read_pack(const PackSource& source, const ReadOptions& options = {});
// The same into `out`, reusing its row buffers (see take_snapshot). On an
// error `out` holds no valid snapshot (invalidate_snapshot), whatever it
// held before.
Status read_pack(const PackSource& source, const ReadOptions& options, Snapshot& out);
Result<Snapshot> read_pack_file(const std::string& path, const ReadOptions& options = {});
// Reads a pack into `target`: the manifest is checked against the target
// before any payload is read (check_restorable for the cache's sequence:
// the geometry and rings, and the pool blocks its full planes take;
// kResourceExhausted), every chunk is verified before the target is
// touched, and on any error the target is left as it was. With `manifest`,
// a success also hands back the pack's manifest (its header's token ids
// and metadata, which an engine resumes from), read once.
Status restore_pack(const PackSource& source, const ReadOptions& options, KvCache& target,
                    Manifest* manifest = nullptr);
// Reads a pack into a new sequence of `target`, with the rows and rings
// restore_new_sequence gives. The manifest is checked before any payload
// is read and before the store is touched: the geometry and rings
// (check_restorable), a free slot, and the pool blocks the sequence takes
// (blocks_to_restore; kResourceExhausted). The planes are then read,
// verified and installed a group of consecutive planes at a time (as many
// as fit in the larger of the longest plane and 64 MiB of rows, or
// max_row_bytes where that is less), so host memory holds one group, not
// the sequence, into a detached sequence (KvStore::add_detached_sequence)
// that no reader sees and that becomes live once every plane is in. On
// any error, and on an exception out of the chunk store (which reaches the
// caller; std::bad_alloc comes back as kIOError), it is removed: the
// store's sequences, their rows, its free slots and free blocks, and the
// handle its next sequence gets, are as they were.
// `manifest` as above.
Result<SeqId> restore_pack(const PackSource& source, const ReadOptions& options, KvStore& target,
                           Manifest* manifest = nullptr);

// What read_pack and restore_pack make sure of before they allocate any
// rows: a thin pack's chunks each in options.store at their lengths (none
// read), and a self-contained pack's chunks verified where its file holds
// fewer bytes than it claims (a sparse file). A caller that makes a store
// for a pack's rows (a tool resuming a saved session) asks this first, so
// that rows nothing backs are refused before that store is made.
Status check_pack_backed(const PackSource& source, const ReadOptions& options = {});

struct VerifyReport {
  bool thin = false;            // the chunks were read from the store
  std::int64_t chunks = 0;      // checked
  std::int64_t bytes = 0;       // payload bytes verified
  std::int64_t bad_chunks = 0;  // missing or not matching their names
  Status first_error;           // the first bad chunk in table order, or ok
};
// Checks the manifest (an error when it is bad) and every chunk's hash.
Result<VerifyReport> verify_pack(const PackSource& source, const ChunkStore* store = nullptr);

}  // namespace kvring
