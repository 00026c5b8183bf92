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

usage: sdpa_peer.py [--json FILE] [--runs N]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def time_us(fn, runs, flush):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        flush()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--runs", type=int, default=50)
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
    for n in (2048, 32768, 131072):
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
    for n in (4096, 32768, 131072):
        k = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        v = torch.randn(1, 2, n, 128, device=dev, dtype=torch.float16)
        q = torch.randn(1, 16, 512, 128, device=dev, dtype=torch.float16)
        with torch.no_grad():
            t = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), max(args.runs // 5, 5),
                        read_flush)
        prefill.append({"tokens": n, "queries": 512, "gqa_us": round(t, 3)})
        print(f"SDPA prefill of 512 queries over {n:>6} tokens (no mask): gqa {t:10.2f} us")
        del k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "sdpa_peer", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results, "prefill": prefill}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
