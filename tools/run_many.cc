// kvring run --sequences N: N sessions of the reference model in one store,
// prefilled and decoded in batches.
//
// Sequence i uses seed S + i, prefills max(1, P - 3i) prompt tokens and runs
// to max(its prompt, T - 2i) tokens (S, P, T: --seed, --prompt-tokens,
// --tokens). Each round, every unfinished sequence contributes its next
// chunk of up to C prompt tokens, or its next greedy token, and the round
// runs as one batched forward pass. A sequence's bits do not depend on the
// batch, so each sequence's summary equals that of a solo `kvring run` with
// its own seed, prompt and token count.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>

#include "commands.h"
#include "kvring/backend.h"
#include "kvring/footprint.h"
#include "kvring/sha256.h"
#include "kvring/snapshot.h"
#include "run_pack.h"
#include "run_summary.h"
#include "core/text.h"

namespace kvring::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct Member {
  SeqId seq{};
  std::uint64_t seed = 0;
  std::int64_t prompt_tokens = 0, target = 0;
  std::vector<std::int32_t> prompt;  // the seeded prompt (empty when resumed)
  std::vector<std::int32_t> tokens;  // ids whose K/V the store holds
  std::vector<std::int32_t> generated;
  std::vector<float> last_logits;
  std::int64_t prefilled = 0, decoded = 0;
};

std::int64_t prompt_of(const RunOptions& o, std::int64_t i) {
  return std::max<std::int64_t>(1, o.prompt_tokens - 3 * i);
}
std::int64_t target_of(const RunOptions& o, std::int64_t i, std::int64_t prompt) {
  return std::max(prompt, o.tokens - 2 * i);
}

}  // namespace

int run_many(const RunOptions& o, BackendKind backend) {
  const std::int64_t n = o.sequences;
  std::vector<Member> members(static_cast<std::size_t>(n));
  ModelConfig config;
  ModelOptions model_options = o.model;
  std::int64_t chunk = o.chunk;
  AttentionNumeric attention = o.attention;
  // The packs of a resumed run, their headers checked; their rows are read
  // straight into the run's store, a group of planes at a time.
  std::vector<RunPack> resumed;
  if (!o.resume.empty()) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::string path = indexed_path(o.resume, i);
      auto r = open_run_pack(path, o.store);
      if (!r) return fail(r.error());
      Member& m = members[static_cast<std::size_t>(i)];
      if (i == 0) {
        config = r->config;
        model_options = r->record.options;
        chunk = r->record.chunk;
        attention = r->record.attention;
      } else if (r->config.fingerprint() != config.fingerprint() || r->config.rope_theta != config.rope_theta ||
                 r->config.query_pre_attn_scalar != config.query_pre_attn_scalar ||
                 r->config.attention_sinks != config.attention_sinks ||
                 r->record.options.hidden != model_options.hidden ||
                 r->record.options.vocab != model_options.vocab ||
                 r->record.options.mlp != model_options.mlp ||
                 r->record.options.seed != model_options.seed) {
        return fail(path + " holds a session of another model than " + indexed_path(o.resume, 0));
      } else if (r->record.attention != attention) {
        return fail(path + " ran under the " + attention_numeric_name(r->record.attention) +
                    " attention numeric, " + indexed_path(o.resume, 0) + " under " +
                    attention_numeric_name(attention));
      } else if (r->record.chunk != chunk) {
        // One run takes one prefill chunk, recorded in every pack it saves.
        return fail(path + " ran with prefill chunks of " + std::to_string(r->record.chunk) + " tokens, " +
                    indexed_path(o.resume, 0) + " with " + std::to_string(chunk));
      }
      m.seed = r->record.seed;
      m.prompt_tokens = r->record.prompt_tokens;
      m.tokens = r->token_ids;
      m.last_logits = r->record.last_logits;
      const auto held = static_cast<std::int64_t>(m.tokens.size());
      m.generated.assign(m.tokens.begin() + std::min(m.prompt_tokens, held), m.tokens.end());
      m.target = o.tokens_given ? std::max(target_of(o, i, m.prompt_tokens), held) : held;
      resumed.push_back(std::move(*r));
    }
  } else {
    auto c = resolve_config(o.model_name, o.config_path);
    if (!c) return fail(c.error());
    config = *c;
  }
  const std::int64_t context =
      !resumed.empty() ? (o.context == 0 ? resumed[0].context : o.context)
                       : (o.context == 0 ? config.max_context : o.context);
  if (context > config.max_context)
    return fail("--context = " + std::to_string(context) + " exceeds the model's maximum " +
                std::to_string(config.max_context));
  for (std::int64_t i = 0; i < n && resumed.empty(); ++i) {
    Member& m = members[static_cast<std::size_t>(i)];
    m.seed = o.seed + static_cast<std::uint64_t>(i);
    m.prompt_tokens = prompt_of(o, i);
    m.target = target_of(o, i, m.prompt_tokens);
  }
  const std::int64_t limit = config.sequence_position_limit(context);
  for (std::int64_t i = 0; i < n; ++i)
    if (members[static_cast<std::size_t>(i)].target > limit)
      return fail("sequence " + std::to_string(i) + " runs to " +
                  std::to_string(members[static_cast<std::size_t>(i)].target) + " tokens, past " +
                  cache_context_text(limit, context));

  if (!o.save.empty())
    if (Status s = check_save(o.save, n, o.store); !s.ok()) return fail(s.error());
  auto model = create_run_model(config, model_options);
  if (!model) return fail(model.error());
  auto store = make_store(backend, config, {.max_sequences = n, .context = context, .attention = attention});
  if (!store) return fail(store.error());
  KvStore& kv = **store;
  for (std::int64_t i = 0; i < n; ++i) {
    Member& m = members[static_cast<std::size_t>(i)];
    if (!resumed.empty()) {
      auto seq = restore_run_pack(resumed[static_cast<std::size_t>(i)], kv);
      if (!seq) return fail(seq.error());
      m.seq = *seq;
    } else {
      auto seq = kv.add_sequence();
      if (!seq) return fail(seq.error());
      m.seq = *seq;
      m.prompt = seeded_tokens(m.prompt_tokens, model_options.vocab, m.seed);
    }
  }

  const std::int64_t vocab = model_options.vocab;
  double prefill_s = 0, decode_s = 0;
  std::int64_t total_tokens = 0;
  std::vector<float> logits;
  const auto start = Clock::now();
  while (true) {
    std::vector<SeqSpan> spans;
    std::vector<std::int32_t> ids;
    std::vector<std::size_t> who;
    bool prefilling = false;
    for (std::size_t i = 0; i < members.size(); ++i) {
      Member& m = members[i];
      const auto pos = static_cast<std::int64_t>(m.tokens.size());
      if (pos >= m.target) continue;
      if (pos < m.prompt_tokens) {
        const std::int64_t count = std::min(chunk, m.prompt_tokens - pos);
        ids.insert(ids.end(), m.prompt.begin() + pos, m.prompt.begin() + pos + count);
        spans.push_back(SeqSpan{m.seq, pos, count});
        prefilling = true;
      } else {
        ids.push_back(argmax(m.last_logits.data(), vocab));
        spans.push_back(SeqSpan{m.seq, pos, 1});
      }
      who.push_back(i);
    }
    if (spans.empty()) break;
    if (Status s = (*model)->check_chunk(static_cast<std::int64_t>(ids.size())); !s.ok())
      return fail(s.error());
    logits.resize(ids.size() * static_cast<std::size_t>(vocab));
    const auto t0 = Clock::now();
    if (Status s = (*model)->forward(kv, spans, ids.data(), logits.data()); !s.ok())
      return fail(s.error());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    (prefilling ? prefill_s : decode_s) += dt;
    std::size_t row = 0;
    for (std::size_t b = 0; b < spans.size(); ++b) {
      Member& m = members[who[b]];
      const auto count = static_cast<std::size_t>(spans[b].count);
      const bool decoding = spans[b].start >= m.prompt_tokens;
      m.tokens.insert(m.tokens.end(), ids.begin() + static_cast<std::ptrdiff_t>(row),
                      ids.begin() + static_cast<std::ptrdiff_t>(row + count));
      if (decoding) {
        m.generated.push_back(ids[row]);
        ++m.decoded;
      } else {
        m.prefilled += spans[b].count;
      }
      row += count;
      m.last_logits.assign(logits.begin() + static_cast<std::ptrdiff_t>((row - 1) * vocab),
                           logits.begin() + static_cast<std::ptrdiff_t>(row * vocab));
      total_tokens += spans[b].count;
    }
  }
  const double wall_s = std::chrono::duration<double>(Clock::now() - start).count();

  std::vector<std::string> saved;
  for (std::int64_t i = 0; i < n && !o.save.empty(); ++i) {
    const Member& m = members[static_cast<std::size_t>(i)];
    RunRecord record{config.name, config.rope_theta, model_options, m.seed, m.prompt_tokens, chunk,
                     m.last_logits, attention};
    record.query_pre_attn_scalar = config.query_pre_attn_scalar;
    record.attention_sinks = config.attention_sinks;
    auto line = save_sequence(kv, m.seq, m.tokens, record, indexed_path(o.save, i), o.store);
    if (!line) {
      // The command fails whole: the packs it saved before this one go too
      // (a thin pack's chunks stay in the store, named by their content).
      for (std::int64_t j = 0; j < i; ++j) ::unlink(indexed_path(o.save, j).c_str());
      const std::string removed =
          i == 0 ? "" : "; the " + std::to_string(i) + " pack" + (i == 1 ? " saved before it was" : "s saved before it were") + " removed";
      return fail(line.error().to_string() + removed);
    }
    saved.push_back(*line);
  }

  const double tokens_per_s = wall_s > 0 ? static_cast<double>(total_tokens) / wall_s : 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Member& m = members[static_cast<std::size_t>(i)];
    const std::string sha =
        to_hex(sha256(m.last_logits.data(), m.last_logits.size() * sizeof(float)));
    const PlaneUse use = plane_use(kv, m.seq);
    auto blocks = kv.blocks_held(m.seq);
    // The sequence's own storage: its rings and the blocks it holds.
    const std::int64_t own = config.count(LayerKind::kSlidingRope) * kv.ring_bytes() +
                             (blocks ? *blocks : 0) * kv.block_bytes();
    SummaryFields f{config.name, config.fingerprint_hex(), backend,
                    static_cast<std::int64_t>(m.tokens.size()), m.prompt_tokens, m.seed, chunk,
                    model_options, context, m.generated, sha, use, own, prefill_s, decode_s,
                    m.prefilled, m.decoded, attention};
    if (o.json) {
      std::printf("%s\n", summary_json(f).dump(-1, ' ', /*ensure_ascii=*/true).c_str());
      continue;
    }
    std::string gen;
    for (std::size_t g = 0; g < m.generated.size() && g < 8; ++g) gen += " " + std::to_string(m.generated[g]);
    if (m.generated.size() > 8) gen += " ...";
    std::printf("sequence %lld: seed %llu, %lld tokens (%lld prompt, %zu generated):%s\n",
                static_cast<long long>(i), static_cast<unsigned long long>(m.seed),
                static_cast<long long>(m.tokens.size()), static_cast<long long>(m.prompt_tokens),
                m.generated.size(), gen.c_str());
    std::printf("  last logits sha256 %s\n", sha.c_str());
    if (!saved.empty()) std::printf("  saved        %s\n", saved[static_cast<std::size_t>(i)].c_str());
  }
  if (o.json) {
    nlohmann::json j;
    j["sequences"] = n;
    j["model"] = config.name;
    j["backend"] = backend_name(backend);
    j["tokens"] = total_tokens;
    j["allocated_bytes"] = kv.allocated_bytes();
    j["timing"] = {{"wall_s", wall_s},
                   {"prefill_s", prefill_s},
                   {"decode_s", decode_s},
                   {"tokens_per_s", tokens_per_s}};
    std::printf("%s\n", j.dump(-1, ' ', /*ensure_ascii=*/true).c_str());
    return 0;
  }
  std::printf("kvring run: %lld sequences of model %s on %s, %lld tokens in %.3f s: %.1f tokens/s "
              "(prefill %.3f s, decode %.3f s); store %s\n",
              static_cast<long long>(n), printable(config.name, false).c_str(), backend_name(backend),
              static_cast<long long>(total_tokens), wall_s, tokens_per_s, prefill_s, decode_s,
              format_bytes(kv.allocated_bytes()).c_str());
  return 0;
}

}  // namespace kvring::cli
