#!/usr/bin/env python3
"""Times Python's compiled FlexAttention on the CPU, for the comparison with
mha::flex_attention (DESIGN.md, "Programmable attention"; docs/speed.md).

torch.compile(torch.nn.attention.flex_attention), forward only (PyTorch's
compiled CPU FlexAttention does inference only, without lse, float32 /
float16 / bfloat16), at (B, H, L, E) = (1, 8, 4096, 64) float32 by default,
torch.set_num_threads(2), with the block masks of create_block_mask at
Python's default block size 128 (B = H = None):

    causal             q_idx >= kv_idx
    sliding_window     causal and q_idx - kv_idx < 256
    documents          7 packed documents (random lengths, seeded, sum L),
                       causal within each document
    softcap_causal     30 * tanh(score / 30), causal
    alibi_causal       score + slope[h] * (kv_idx - q_idx),
                       slope[h] = 2^(-8 (h + 1) / H), causal
    sdpa_causal        for scale only, not FlexAttention:
                       F.scaled_dot_product_attention(is_causal=True)

For each case: the block mask's sparsity and creation time (eager), the
time of the first call (compilation plus one run: inductor's caches point to
a fresh temporary folder, removed at exit, unless TORCHINDUCTOR_CACHE_DIR is
set, so nothing is reused from an earlier run; for sdpa_causal it is just
the first call), then, after --warmup more calls, the median and the
minimum of --runs timed calls (steady state). Each output is checked against a dense float64
reference on the last 128 query rows (err). OMP_WAIT_POLICY is PASSIVE
unless set otherwise, as in mha's own tools (mha-bench).

Run it in the Debian sid lab chroot (PyTorch 2.14), from the repository
root. Debian's inductor does not link SLEEF, which the generated CPU
kernels need, so it is preloaded:

    /work/shared/tools/in-trixie.sh -r /opt/sid \\
        -e LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libsleef.so.3 "$PWD" -- \\
        python3 scripts/bench_python_flex.py [--runs 7] [--warmup 2]
        [--threads 2] [--L 4096] [--H 8] [--E 64] [--cases causal,...]

(libsleef-dev in the chroot: trixie-lab.sh --extra "python3-torch
libsleef-dev".) Compilation needs a C++ compiler in the chroot (g++).
"""

import argparse
import atexit
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

# As mha's tools (README): OpenMP threads sleep rather than spin when idle;
# on 2 busy cores spinning made small calls several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="bench_python_flex-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"],
                    ignore_errors=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import flex_attention as fa  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention called without")

CASES = ["causal", "sliding_window", "documents", "softcap_causal",
         "alibi_causal", "sdpa_causal"]


def doc_lengths(total, n, generator):
    """n random positive document lengths summing to total."""
    cuts = torch.randperm(total - 1, generator=generator)[:n - 1].sort()
    edges = torch.cat([torch.tensor([0]), cuts.values + 1,
                       torch.tensor([total])])
    return edges[1:] - edges[:-1]


def make_case(name, H, L):
    """(score_mod, mask_mod, description); tensors are captured."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if name == "causal":
        return None, causal, "causal"
    if name == "sliding_window":
        def window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)
        return None, window, "causal window 256"
    if name == "documents":
        g = torch.Generator().manual_seed(7)
        lengths = doc_lengths(L, 7, g)
        doc = torch.repeat_interleave(torch.arange(7), lengths)

        def document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return None, document, f"7 documents {lengths.tolist()}, causal"
    if name == "softcap_causal":
        def softcap(score, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(score / 30.0)
        return softcap, causal, "softcap 30, causal"
    if name == "alibi_causal":
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        return alibi, causal, "ALiBi, causal"
    raise ValueError(name)


def reference_rows(q, k, v, score_mod, mask_mod, rows):
    """Dense float64 attention of the query rows `rows` (a range)."""
    B, H, L, E = q.shape
    S = k.shape[2]
    qi = torch.arange(rows.start, rows.stop).view(1, 1, -1, 1)
    ki = torch.arange(S).view(1, 1, 1, S)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    s = q[:, :, rows].double() @ k.double().transpose(-2, -1) / math.sqrt(E)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).double()
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), -math.inf)
    return torch.softmax(s, -1) @ v.double()


def timed(fn, runs):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--L", type=int, default=4096)
    p.add_argument("--E", type=int, default=64)
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, H, L, E = a.B, a.H, a.L, a.E
    q = torch.randn(B, H, L, E)
    k = torch.randn(B, H, L, E)
    v = torch.randn(B, H, L, E)
    check = range(L - 128, L)

    print(f"PyTorch {torch.__version__}, (B, H, L, E) = ({B}, {H}, {L}, {E})"
          f" float32, {torch.get_num_threads()} threads, forward only, "
          f"median and min of {a.runs} runs after {a.warmup} warm-up calls, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, inductor cache "
          f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    print(f"{'case':<16} {'sparsity %':>10} {'mask s':>7} {'compile s':>9} "
          f"{'median ms':>10} {'min ms':>9} {'err':>8}  description")
    for name in a.cases.split(","):
        torch._dynamo.reset()
        with torch.no_grad():
            if name == "sdpa_causal":
                def call():
                    return F.scaled_dot_product_attention(q, k, v,
                                                          is_causal=True)
                score_mod, mask_mod = None, (lambda b, h, i, j: i >= j)
                desc, sparsity, mask_s = "F.sdpa is_causal (not flex)", "", ""
            else:
                score_mod, mask_mod, desc = make_case(name, H, L)
                t0 = time.perf_counter()
                bm = fa.create_block_mask(mask_mod, None, None, L, L,
                                          device="cpu")
                mask_s = f"{time.perf_counter() - t0:.2f}"
                sparsity = f"{bm.sparsity():.1f}"
                compiled = torch.compile(fa.flex_attention, dynamic=False)

                def call():
                    return compiled(q, k, v, score_mod=score_mod,
                                    block_mask=bm)
            t0 = time.perf_counter()
            out = call()
            first = time.perf_counter() - t0
            timed(call, a.warmup)
            times = timed(call, a.runs)
            ref = reference_rows(q, k, v, score_mod, mask_mod, check)
            err = (out[:, :, check].double() - ref).abs().max().item()
        print(f"{name:<16} {sparsity:>10} {mask_s:>7} {first:>9.1f} "
              f"{1e3 * statistics.median(times):>10.1f} "
              f"{1e3 * min(times):>9.1f} {err:>8.1e}  {desc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
