#!/usr/bin/env python3
"""Writes the golden fixtures of mha's FlexAttention port into
tests/fixtures/flex/ (DESIGN.md, "Programmable attention").

Python's torch.nn.attention.flex_attention, run eagerly (no torch.compile)
on CPU, with the score and mask modifications below on small random
inputs: its output, its log-sum-exp and the block mask made by
create_block_mask are stored for the C++ tests to rebuild the same mods from
their "kind" and parameters and compare against. Block sizes are mostly
below Python's 128 so that blocks are actually skipped, one differs between
queries and keys, one leaves a block running past the sequence's end.

Every fixture is also checked here against a dense float64 reference
computed independently of flex_attention (scores = q k^T scale, score_mod,
-inf where mask_mod forbids, softmax; a row that may see no key gives 0 and
lse -inf), and every block mask against the dense mask (a skipped block
allows nothing, a full block allows every in-range element, a partial block
is neither); the script stops on any difference.

Run it from the repository root with PyTorch 2.x (it was written against
2.14, the Python of the Debian sid lab chroot):

    /work/shared/tools/in-trixie.sh -r /opt/sid "$PWD" -- \\
        python3 scripts/make_flex_fixtures.py

Everything is seeded: a rerun with the same PyTorch writes the same bytes.
It reuses the safetensors writer of scripts/make_fixtures.py.

Fixture format (version 1)
--------------------------
tests/fixtures/flex/flex.json:
    {"format": 1, "generator": "scripts/make_flex_fixtures.py",
     "torch_version": "...", "fixtures": [FIXTURE, ...]}

FIXTURE:
    "name":   unique; NAME.safetensors holds its tensors ("data").
    "dtype":  "float32" | "float64": of query, key, value, output.
    "B", "Hq", "Hkv", "L", "S", "E", "Ev": query (B, Hq, L, E),
              key (B, Hkv, S, E), value (B, Hkv, S, Ev).
    "scale":  null (Python's default 1/sqrt(E)) or the float passed.
    "enable_gqa": bool, as passed.
    "score_mod": {"kind": K, ...parameters}, K one of
        "none"     identity (no score_mod passed)
        "softcap"  {"cap": c}: c * tanh(score / c)
        "alibi"    score + alibi_slopes[h] * (kv_idx - q_idx); tensor
                   alibi_slopes (Hq,), query's dtype
        "rel_bias" score + rel_bias[h, kv_idx - q_idx + L - 1]; tensor
                   rel_bias (Hq, L + S - 1), query's dtype
    "mask_mod": {"kind": K, ...parameters} or null (no block mask passed;
              then the file holds no block-mask tensors, "block_q" and
              "block_kv" are 128 and "sparsity" 0.0, Python's defaults for
              its internal empty mask, for information only). K one of
        "causal"                 q_idx >= kv_idx
        "sliding_window" {"window": W}: causal and q_idx - kv_idx < W
        "prefix_lm" {"prefix": P}: kv_idx < P or q_idx >= kv_idx
        "document" {"causal": bool}: doc[q_idx] == doc[kv_idx] (and
                   q_idx >= kv_idx when causal), doc[i] the index of the
                   document holding token i; tensor doc_lengths (int64,
                   number of documents), summing to L (= S)
        "per_head_causal_window" {"window": W}: even h causal, odd h
                   sliding_window W (torch.where on h % 2)
        "key_lengths"            kv_idx < key_lengths[b]; tensor
                   key_lengths (int64, (B,))
        "fully_masked_rows" {"rows_from": R}: q_idx < R and q_idx >= kv_idx
    "block_q", "block_kv": the BLOCK_SIZE given to create_block_mask (an
              int when both are equal, else the tuple; 128 and 128 where it
              was left to its default).
    "mask_B", "mask_H": the B and H given to create_block_mask (null: None).
    "sparsity": BlockMask.sparsity().
    "data":   NAME.safetensors, with the tensors
        query, key, value, output (B, Hq, L, Ev), lse (B, Hq, L) (natural
        log, as Python returns it: float32 for float32, float64 for
        float64), the captured tensors named above, and, unless mask_mod is
        null, Python's BlockMask fields as int32, with their shapes:
        kv_num_blocks (mB, mH, nq), kv_indices (mB, mH, nq, nkv),
        full_kv_num_blocks, full_kv_indices (same shapes); mB = mask_B or 1,
        mH = mask_H or 1, nq = ceil(L / block_q), nkv = ceil(S / block_kv).
        A kv_indices row lists the kv_num_blocks visited blocks in
        ascending order, then every other block, ascending too (Python
        makes it by a stable descending argsort of the 0/1 block row); only
        the first kv_num_blocks entries mean anything to a kernel.
"""

import json
import math
import os
import sys
import warnings

import torch
from torch.nn.attention import flex_attention as fa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import write_safetensors  # noqa

OUT_DIR = (sys.argv[1] if len(sys.argv) > 1 else
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                        "tests", "fixtures", "flex"))
MAX_BYTES = 1_500_000

# Eager flex_attention warns that it materialises the scores: that is what
# the fixtures want.
warnings.filterwarnings("ignore", message=".*flex_attention called without")


# --- the mods, built from a fixture's kind and parameters -------------------
# Each is elementwise: flex_attention calls it under vmap with 0-d indices,
# the reference below with broadcast (B, H, L, S) index tensors.

def make_score_mod(spec, tensors):
    kind = spec["kind"]
    if kind == "none":
        return None
    if kind == "softcap":
        cap = spec["cap"]
        return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)
    if kind == "alibi":
        slopes = tensors["alibi_slopes"]
        return lambda score, b, h, q_idx, kv_idx: (
            score + slopes[h] * (kv_idx - q_idx))
    if kind == "rel_bias":
        table = tensors["rel_bias"]
        offset = spec["L"] - 1
        return lambda score, b, h, q_idx, kv_idx: (
            score + table[h, kv_idx - q_idx + offset])
    raise ValueError(kind)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_mask_mod(spec, tensors):
    if spec is None:
        return None
    kind = spec["kind"]
    if kind == "causal":
        return causal
    if kind == "sliding_window":
        w = spec["window"]
        return lambda b, h, q_idx, kv_idx: (
            (q_idx >= kv_idx) & (q_idx - kv_idx < w))
    if kind == "prefix_lm":
        p = spec["prefix"]
        return lambda b, h, q_idx, kv_idx: (kv_idx < p) | (q_idx >= kv_idx)
    if kind == "document":
        lengths = tensors["doc_lengths"]
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        if spec["causal"]:
            return lambda b, h, q_idx, kv_idx: (
                (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx))
        return lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]
    if kind == "per_head_causal_window":
        w = spec["window"]
        return lambda b, h, q_idx, kv_idx: torch.where(
            h % 2 == 0, q_idx >= kv_idx,
            (q_idx >= kv_idx) & (q_idx - kv_idx < w))
    if kind == "key_lengths":
        key_lengths = tensors["key_lengths"]
        return lambda b, h, q_idx, kv_idx: kv_idx < key_lengths[b]
    if kind == "fully_masked_rows":
        r = spec["rows_from"]
        return lambda b, h, q_idx, kv_idx: (q_idx < r) & (q_idx >= kv_idx)
    raise ValueError(kind)


# --- the independent dense float64 reference --------------------------------

def dense_indices(B, H, L, S):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S))


def dense_mask(mask_mod, B, H, L, S):
    if mask_mod is None:
        return torch.ones(B, H, L, S, dtype=torch.bool)
    return mask_mod(*dense_indices(B, H, L, S)).expand(B, H, L, S)


def reference(q, k, v, score_mod, mask_mod, scale, enable_gqa):
    """float64 output and lse; rows that may see no key: 0 and -inf."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, L, E = q.shape
    S = k.shape[2]
    if enable_gqa:
        k = k.repeat_interleave(Hq // k.shape[1], dim=1)
        v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if score_mod is not None:
        s = score_mod(s, *dense_indices(B, Hq, L, S)).double()
    allowed = dense_mask(mask_mod, B, Hq, L, S)
    s = s.masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(-1)
    lse = torch.logsumexp(s, -1).masked_fill(empty, -math.inf)
    p = torch.exp(s - lse.masked_fill(empty, 0).unsqueeze(-1))
    return p @ v, lse


def check_block_mask(name, bm, mask_mod, mB, mH, L, S, bq, bkv):
    """Each block of bm against the dense mask (padded with false)."""
    nq, nkv = -(-L // bq), -(-S // bkv)
    m = torch.zeros(mB, mH, nq * bq, nkv * bkv, dtype=torch.bool)
    m[:, :, :L, :S] = dense_mask(mask_mod, mB, mH, L, S)
    tiles = m.view(mB, mH, nq, bq, nkv, bkv)
    any_ = tiles.any(5).any(3)
    inr = torch.zeros(nq * bq, nkv * bkv, dtype=torch.bool)
    inr[:L, :S] = True
    # A block is full when every element is allowed, padding included (the
    # padding is false, so a block running past L or S is never full).
    all_ = tiles.all(5).all(3)
    kind = torch.zeros(mB, mH, nq, nkv, dtype=torch.int64)   # 0 skip
    for b in range(mB):
        for h in range(mH):
            for i in range(nq):
                n = int(bm.kv_num_blocks[b, h, i])
                kind[b, h, i, bm.kv_indices[b, h, i, :n].long()] += 1
                n = int(bm.full_kv_num_blocks[b, h, i])
                kind[b, h, i, bm.full_kv_indices[b, h, i, :n].long()] += 2
    want = torch.where(all_, 2, torch.where(any_, 1, 0))
    if not torch.equal(kind, want):
        sys.exit(f"{name}: block mask differs from the dense mask:\n"
                 f"python {kind.tolist()}\nwant {want.tolist()}")


# --- fixtures ---------------------------------------------------------------

def fixture(name, mask_mod, score_mod=None, dtype=torch.float32, B=1, Hq=2,
            Hkv=None, L=128, S=None, E=16, Ev=8, block=32, mask_B=None,
            mask_H=None, scale=None, enable_gqa=False, tensors=None):
    Hkv = Hq if Hkv is None else Hkv
    S = L if S is None else S
    score_mod = score_mod or {"kind": "none"}
    torch.manual_seed(sum(map(ord, name)))
    q = torch.randn(B, Hq, L, E, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, dtype=dtype)
    v = torch.randn(B, Hkv, S, Ev, dtype=dtype)
    tensors = dict(tensors or {})
    if score_mod["kind"] == "alibi":
        tensors["alibi_slopes"] = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], dtype=dtype)
    if score_mod["kind"] == "rel_bias":
        tensors["rel_bias"] = 0.5 * torch.randn(Hq, L + S - 1, dtype=dtype)
    smod = make_score_mod(dict(score_mod, L=L), tensors)
    mmod = make_mask_mod(mask_mod, tensors)
    if block is None or mask_mod is None:       # Python's default: 128
        bq = bkv = 128
    else:
        bq, bkv = (block, block) if isinstance(block, int) else block

    kwargs = {}
    bm = None
    if mmod is not None:
        size = {} if block is None else {"BLOCK_SIZE": block}
        bm = fa.create_block_mask(mmod, B=mask_B, H=mask_H, Q_LEN=L,
                                  KV_LEN=S, device="cpu", **size)
        kwargs["block_mask"] = bm
    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, score_mod=smod, scale=scale,
                                     enable_gqa=enable_gqa,
                                     return_aux=fa.AuxRequest(lse=True),
                                     **kwargs)
        lse = aux.lse
    else:
        out, lse = fa.flex_attention(q, k, v, score_mod=smod, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=True,
                                     **kwargs)

    # Proof: the dense float64 reference, computed without flex_attention.
    ref_tensors = {n: (t.double() if t.is_floating_point() else t)
                   for n, t in tensors.items()}
    ref_out, ref_lse = reference(q, k, v,
                                 make_score_mod(dict(score_mod, L=L),
                                                ref_tensors),
                                 make_mask_mod(mask_mod, ref_tensors),
                                 scale, enable_gqa)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert out.dtype == dtype and out.shape == (B, Hq, L, Ev), name
    assert lse.shape == (B, Hq, L), name
    if not torch.allclose(out.double(), ref_out, rtol=tol, atol=tol):
        sys.exit(f"{name}: output differs from the reference by "
                 f"{(out.double() - ref_out).abs().max().item():.3g}")
    fin = torch.isfinite(ref_lse)
    if not (torch.equal(torch.isfinite(lse), fin) and
            torch.equal(lse[~fin].double(), ref_lse[~fin]) and
            torch.allclose(lse[fin].double(), ref_lse[fin], rtol=tol,
                           atol=tol)):
        sys.exit(f"{name}: lse differs from the reference")

    print(f"{name}: max |output - reference| "
          f"{(out.double() - ref_out).abs().max().item():.2g}")
    data = {"query": q, "key": k, "value": v, "output": out, "lse": lse}
    data.update(tensors)
    entry = {"name": name, "dtype": str(dtype).replace("torch.", ""),
             "B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "S": S, "E": E, "Ev": Ev,
             "scale": scale, "enable_gqa": enable_gqa,
             "score_mod": score_mod, "mask_mod": mask_mod,
             "block_q": bq, "block_kv": bkv, "mask_B": mask_B,
             "mask_H": mask_H, "sparsity": 0.0, "data": name + ".safetensors"}
    if bm is not None:
        assert tuple(bm.BLOCK_SIZE) == (bq, bkv), (name, bm.BLOCK_SIZE)
        check_block_mask(name, bm, mmod, mask_B or 1, mask_H or 1, L, S,
                         bq, bkv)
        entry["sparsity"] = float(bm.sparsity())
        for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                      "full_kv_indices"):
            t = getattr(bm, field)
            assert t.dtype == torch.int32, (name, field, t.dtype)
            data[field] = t
    write_safetensors(os.path.join(OUT_DIR, name + ".safetensors"), data)
    return entry


def doc_lengths(total, n):
    """n random document lengths (at least 8 tokens each) summing to total."""
    cuts = torch.randperm(total // 8 - 1)[:n - 1].sort().values + 1
    edges = torch.cat([torch.tensor([0]), cuts * 8, torch.tensor([total])])
    return (edges[1:] - edges[:-1]).to(torch.int64)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for n in os.listdir(OUT_DIR):
        if n.endswith(".safetensors") or n == "flex.json":
            os.remove(os.path.join(OUT_DIR, n))
    f64 = torch.float64
    causal_ = {"kind": "causal"}
    torch.manual_seed(0)
    docs_c = doc_lengths(176, 4)
    docs_n = doc_lengths(144, 3)
    docs_f = doc_lengths(112, 5)
    fixtures = [
        fixture("causal", causal_, B=2, L=128),
        fixture("causal_f64", causal_, dtype=f64, L=100),
        fixture("causal_mask_bh", causal_, B=2, L=100, mask_B=2, mask_H=2),
        fixture("sliding_window", {"kind": "sliding_window", "window": 40},
                L=144),
        fixture("prefix_lm", {"kind": "prefix_lm", "prefix": 50}, L=128,
                block=(32, 64)),
        fixture("document_causal", {"kind": "document", "causal": True},
                L=176, tensors={"doc_lengths": docs_c}),
        fixture("document_full", {"kind": "document", "causal": False},
                L=144, block=(64, 32), tensors={"doc_lengths": docs_n}),
        fixture("document_causal_f64", {"kind": "document", "causal": True},
                dtype=f64, L=112, block=16, tensors={"doc_lengths": docs_f}),
        fixture("softcap_causal", causal_, {"kind": "softcap", "cap": 2.0},
                L=128, block=64),
        fixture("alibi_gqa_causal", causal_, {"kind": "alibi"}, Hq=4, Hkv=2,
                L=128, enable_gqa=True),
        fixture("alibi_gqa_causal_f64", causal_, {"kind": "alibi"},
                dtype=f64, Hq=4, Hkv=2, L=100, enable_gqa=True),
        fixture("rel_bias_causal", causal_, {"kind": "rel_bias"}, L=128),
        fixture("per_head_causal_window",
                {"kind": "per_head_causal_window", "window": 48}, Hq=4,
                L=112, mask_H=4),
        fixture("cross_key_lengths", {"kind": "key_lengths"}, B=2, L=100,
                S=160, mask_B=2,
                tensors={"key_lengths": torch.tensor([160, 77])}),
        fixture("fully_masked_rows",
                {"kind": "fully_masked_rows", "rows_from": 90}, L=128),
        fixture("fully_masked_rows_f64",
                {"kind": "fully_masked_rows", "rows_from": 50}, dtype=f64,
                L=96, block=16),
        fixture("causal_l200_block64", causal_, L=200, block=64),
        fixture("causal_l300_default_block", causal_, Hq=1, L=300, block=None),
        fixture("causal_scale", causal_, L=128, Ev=16, block=64, scale=0.3),
        fixture("softcap_no_mask", None, {"kind": "softcap", "cap": 2.0},
                L=100, S=120),
        fixture("rel_bias_no_mask_cross", None, {"kind": "rel_bias"}, L=64,
                S=96),
    ]
    index = {"format": 1, "generator": "scripts/make_flex_fixtures.py",
             "torch_version": torch.__version__, "fixtures": fixtures}
    with open(os.path.join(OUT_DIR, "flex.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT_DIR, n))
                for n in os.listdir(OUT_DIR))
    print(f"make_flex_fixtures: {len(fixtures)} fixtures, {total} bytes "
          f"in {os.path.relpath(OUT_DIR)} (PyTorch {torch.__version__})")
    if total > MAX_BYTES:
        sys.exit("make_flex_fixtures: fixtures exceed 1.5 MB")


if __name__ == "__main__":
    main()
