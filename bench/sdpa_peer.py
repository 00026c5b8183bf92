#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention as the decode peer of kvring-bench.

One decode query of muse-glimmer's attention (16 query heads over 2 KV heads,
head_dim 128, f16) over L cached tokens, timed as kvring-bench times its
decode: CUDA events around each call after warm-up, the median of many runs,
the L2 evicted before each run, random data. The L2 is evicted by reading a
256 MiB buffer (clean lines left behind), and, as a second figure, by
writing it (up to the L2's size of dirty lines left behind, whose write-back
then falls into the timed call).

Two formulations, both reported; the faster is the peer:
  gqa:     q [1, 16, 1, 128], k/v [1, 2, L, 128], enable_gqa=True
  grouped: q [1, 2, 8, 128] (the 8 heads of a group as 8 queries, no mask),
           k/v [1, 2, L, 128]: the same arithmetic without GQA support

Prefill peer (kvring-bench's "prefill attention" rows, no target): 512
queries q [1, 16, 512, 128] over k/v [1, 2, L, 128], enable_gqa=True, with
no mask, so every query sees all L keys (kvring's query at L - 512 + i sees
L - 511 + i of them: the peer does slightly more work).

Batch peer (kvring-bench's "batch decode" rows): one query per sequence,
run whichever way is faster and both reported:
  padded:  q [B, 16, 1, 128], k/v [B, 2, Lmax, 128], enable_gqa=True, with a
           boolean mask [B, 1, 1, Lmax] hiding each sequence's padding (no
           mask when every length is Lmax);
  loop:    one call per sequence over its own k/v [1, 2, L_i, 128].
The mixed batch draws its 64 lengths as kvring-bench does (splitmix64 of
20261201 + i, 1 + draw % 32768).

usage: sdpa_peer.py [--json FILE] [--runs N] [--only decode|prefill|batch]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def time_us(fn, runs, flush):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    # Warm-up: rounds of 5 runs until 100 ms have passed, as kvring-bench.
    warm_start = time.monotonic()
    while True:
        for _ in range(5):
            flush()
            fn()
        torch.cuda.synchronize()
        if time.monotonic() - warm_start >= 0.1:
            break
    times = []
    for _ in range(runs):
        flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def mixed_lengths(n, top):
    mask = (1 << 64) - 1
    out = []
    for i in range(n):
        z = (20261201 + 0x9E3779B97F4A7C15 * (i + 1)) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(1 + z % top)
    return out


def batch_peer(name, lens, runs, flush, dev):
    b, lmax = len(lens), max(lens)
    k = torch.randn(b, 2, lmax, 128, device=dev, dtype=torch.float16)
    v = torch.randn(b, 2, lmax, 128, device=dev, dtype=torch.float16)
    q = torch.randn(b, 16, 1, 128, device=dev, dtype=torch.float16)
    equal = all(n == lmax for n in lens)
    mask = None
    if not equal:
        mask = torch.zeros(b, 1, 1, lmax, device=dev, dtype=torch.bool)
        for i, n in enumerate(lens):
            mask[i, :, :, :n] = True
    views = [(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n]) for i, n in enumerate(lens)]
    with torch.no_grad():
        padded = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731

        def loop():
            for qi, ki, vi in views:
                F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
        # The two formulations compute the same function.
        a = padded()
        c = torch.cat([F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True) for qi, ki, vi in views])
        assert torch.allclose(a.float(), c.float(), atol=2e-3), "formulations disagree"
        t_pad = time_us(padded, runs, flush)
        t_loop = time_us(loop, max(runs // 5, 5), flush)
    best = min(t_pad, t_loop)
    nbytes = sum(lens) * 1024
    row = {"name": name, "sequences": b, "padded_us": round(t_pad, 3), "loop_us": round(t_loop, 3),
           "best_us": round(best, 3), "bytes": nbytes, "gb_per_s": round(nbytes / best / 1e3, 1)}
    print(f"SDPA {name}: padded{' + mask' if mask is not None else ''} {t_pad:9.2f} us, "
          f"one call per sequence {t_loop:9.2f} us, best {best:9.2f} us ({row['gb_per_s']} GB/s of visible rows)")
    del k, v, q, mask, views
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_peer: no GPU visible", file=sys.stderr)
        return 1
    torch.manual_seed(20261129)
    dev = torch.device("cuda")
    buf = torch.ones(256 << 20, dtype=torch.uint8, device=dev)
    read_flush = lambda: buf.sum(dtype=torch.int64)  # noqa: E731
    write_flush = lambda: buf.zero_()  # noqa: E731
    results = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    part = lambda name: not args.only or args.only == name  # noqa: E731
    for n in (2048, 32768, 131072) if part("decode") else ():
        k = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        v = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        q = torch.randn(1, 16, 1, 128, device=dev, dtype=torch.float16)
        qg = q.view(1, 2, 8, 128)
        with torch.no_grad():
            # Same function both ways.
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).view(1, 2, 8, 128)
            b = F.scaled_dot_product_attention(qg, k, v)
            assert torch.allclose(a.float(), b.float(), atol=2e-3), "formulations disagree"
            gqa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            t_gqa = time_us(gqa, args.runs, read_flush)
            t_grp = time_us(lambda: F.scaled_dot_product_attention(qg, k, v), args.runs, read_flush)
            t_gqa_w = time_us(gqa, args.runs, write_flush)
        best = min(t_gqa, t_grp)
        row = {"tokens": n, "gqa_us": round(t_gqa, 3), "grouped_us": round(t_grp, 3), "best_us": round(best, 3),
               "gb_per_s": round(n * 1024 / best / 1e3, 1), "gqa_write_flush_us": round(t_gqa_w, 3)}
        results.append(row)
        print(f"SDPA decode {n:>6} tokens: gqa {t_gqa:9.2f} us, grouped {t_grp:9.2f} us, best {best:9.2f} us "
              f"({row['gb_per_s']} GB/s); gqa after a write flush {t_gqa_w:9.2f} us")
        del k, v
    prefill = []
    for n in (4096, 32768, 131072) if part("prefill") else ():
        k = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        v = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        q = torch.randn(1, 16, 512, 128, device=dev, dtype=torch.float16)
        with torch.no_grad():
            t = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), max(args.runs // 5, 5),
                        read_flush)
        prefill.append({"tokens": n, "queries": 512, "gqa_us": round(t, 3)})
        print(f"SDPA prefill of 512 queries over {n:>6} tokens (no mask): gqa {t:10.2f} us")
        del k, v
    if part("prefill"):
        # A sliding layer's chunk: 512 queries over 2048 rows each (no mask).
        k = torch.randn(1, 2, 2048, 128, device=dev, dtype=torch.float16)
        v = torch.randn(1, 2, 2048, 128, device=dev, dtype=torch.float16)
        q = torch.randn(1, 16, 512, 128, device=dev, dtype=torch.float16)
        with torch.no_grad():
            t = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), max(args.runs // 5, 5),
                        read_flush)
        prefill.append({"tokens": 2048, "queries": 512, "sliding": True, "gqa_us": round(t, 3)})
        print(f"SDPA prefill of 512 queries over 2048 rows each (a sliding layer's chunk): gqa {t:10.2f} us")
        # A whole 131072-token prompt in 512-token chunks through one full
        # layer (each chunk over every row up to its end, no mask) and one
        # sliding layer (over the last 2560 rows at most, no mask), once.
        n = 131072
        k = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        v = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)

        def prompt():
            for start in range(0, n, 512):
                F.scaled_dot_product_attention(q, k[:, :, :start + 512], v[:, :, :start + 512], enable_gqa=True)
                lo = max(0, start + 512 - 2560)
                F.scaled_dot_product_attention(q, k[:, :, lo:start + 512], v[:, :, lo:start + 512], enable_gqa=True)
        with torch.no_grad():
            t = time_us(prompt, 3, read_flush)
        prefill.append({"tokens": n, "queries": n, "whole_prompt": True, "gqa_us": round(t, 3)})
        print(f"SDPA whole {n}-token prompt in 512-token chunks, one full + one sliding layer: {t / 1000:10.2f} ms")
        del k, v
    batch = []
    if part("batch"):
        batch.append(batch_peer("batch decode 32 seqs x 32768", [32768] * 32, args.runs, read_flush, dev))
        batch.append(batch_peer("batch decode 4 seqs x 131072", [131072] * 4, args.runs, read_flush, dev))
        batch.append(batch_peer("batch decode 64 seqs, lengths 1..32768", mixed_lengths(64, 32768), args.runs,
                                read_flush, dev))
        batch.append(batch_peer("batch decode 128 rings of 2048", [2048] * 128, args.runs, read_flush, dev))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "sdpa_peer", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results, "prefill": prefill, "batch": batch}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
