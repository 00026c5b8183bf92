#!/usr/bin/env python3
"""The peer of kvring-cpu-bench: PyTorch's CPU attention on its shapes.

Decode of one query (16 heads, head_dim 128) over 2 KV heads of n rows
(n = 2048, 32768, 131072), and 8 such queries over 8 sequences of 32768
rows. K/V are f16 where the build's f16 path is usable, else f32 (named in
the output). scaled_dot_product_attention with GQA where this torch has it;
else the same arithmetic as two batched matmuls and a softmax over the 8
query heads of each KV head (the formulation SDPA's math path runs).

Prints one JSON line: {"torch": version, "threads": n, "method": ...,
"kv_dtype": ..., "rows": {name: median seconds}}.
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--only", choices=["decode", "batch"], default=None)
    ap.add_argument("--kv-dtype", choices=["auto", "f16", "bf16", "f32"], default="auto")
    a = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch is not importable", file=sys.stderr)
        return 2
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    heads, kv_heads, hd = 16, 2, 128
    group = heads // kv_heads
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    gqa = False
    if sdpa is not None:
        try:
            q = torch.randn(1, heads, 1, hd)
            k = torch.randn(1, kv_heads, 4, hd)
            sdpa(q, k, k, enable_gqa=True)
            gqa = True
        except TypeError:
            pass

    def attend_fn(dtype):
        if sdpa is not None and gqa:
            return "sdpa(enable_gqa=True)", lambda q, k, v: sdpa(q.to(dtype), k, v, enable_gqa=True)
        def matmuls(q, k, v):
            # q [b, heads, 1, hd] -> [b, kv_heads, group, hd]: the group's
            # query heads as rows against their KV head.
            b = q.shape[0]
            qg = q.reshape(b, kv_heads, group, hd).to(dtype)
            s = torch.matmul(qg, k.transpose(-1, -2)) * (hd ** -0.5)
            p = torch.softmax(s.float(), dim=-1).to(dtype)
            return torch.matmul(p, v).reshape(b, heads, 1, hd)
        return "matmul-softmax-matmul over the query heads of each KV head", matmuls

    def usable(dtype):
        try:
            _, fn = attend_fn(dtype)
            q = torch.randn(1, heads, 1, hd)
            k = torch.randn(1, kv_heads, 64, hd).to(dtype)
            fn(q, k, k)
            return True
        except RuntimeError:
            return False

    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}.get(a.kv_dtype)
    if dtype is None:
        dtype = next(t for t in (torch.float16, torch.bfloat16, torch.float32) if usable(t))
    method, fn = attend_fn(dtype)

    def median_s(b, n):
        q = torch.rand(b, heads, 1, hd) * 2 - 1
        k = (torch.rand(b, kv_heads, n, hd) * 2 - 1).to(dtype)
        v = (torch.rand(b, kv_heads, n, hd) * 2 - 1).to(dtype)
        times = []
        with torch.inference_mode():
            for r in range(a.warmup + a.runs):
                t0 = time.perf_counter()
                fn(q, k, v)
                t = time.perf_counter() - t0
                if r >= a.warmup:
                    times.append(t)
        times.sort()
        m = len(times)
        return times[m // 2] if m % 2 else 0.5 * (times[m // 2 - 1] + times[m // 2])

    rows = {}
    if a.only in (None, "decode"):
        for n in (2048, 32768, 131072):
            rows["decode_%d" % n] = median_s(1, n)
    if a.only in (None, "batch"):
        rows["batch_8x32768"] = median_s(8, 32768)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "method": method, "kv_dtype": str(dtype).replace("torch.", ""),
                      "runs": a.runs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
