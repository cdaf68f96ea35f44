"""What the canonical tree costs: every exact GEMM with its K groups combined by the pairwise tree
(G = tree_width(K), what TP-invariance needs) against one chain of the 128-K block partials (G = 1),
in one run on one machine (issue 25's cost table).

    python scripts/tree_cost.py [--reps 3] [--out results/megatron-exact]

Three measurements, each tree and chain interleaved rep by rep (medians):
  1. GEMM: jetflow.kernels.invariant's fp32, bf16 and FP8 kernels at the row-parallel shapes of
     configs/tiny-tp.yaml (o_proj K=512 and down_proj K=1536: G=4) and SmolLM2 (down_proj K=1536,
     G=4; its hidden 576 is not whole 128-blocks, so every other SmolLM2 GEMM is G=1 either way), for a
     training-sized M and a decode-sized M;
  2. a native train step (forward + backward + AdamW, exact numerics, unified FP8 and fp32) on the
     tiny-tp model (every linear has G=4) and on SmolLM2;
  3. the default run (`jetflow train`, configs/default.yaml, SmolLM2, 12 RL steps) wall time.
The chain is obtained by setting jetflow.kernels.canonical.MAX_TREE_WIDTH = 1 for the measurement:
every caller asks tree_width(K) at call time, so the whole process then runs G = 1 (the same kernels,
the same block chains, no tree). Not a user setting: a G = 1 model is not TP-invariant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.train_step import build_trainer
from jetflow.bench.workload import LoadAverage, bench_config, synthetic_experience
from jetflow.config import load_config
from jetflow.kernels import canonical, invariant
from jetflow.precision.quant import quantize_weight
from jetflow.run.build import build_policy

GEMM_SHAPES = [  # (model, layer, N, K)
    ("tiny-tp", "o_proj", 512, 512),
    ("tiny-tp", "down_proj", 512, 1536),
    ("smollm2", "down_proj", 576, 1536),
]


@contextlib.contextmanager
def structure(name: str):
    """name "tree": the canonical G = tree_width(K); "chain": G = 1 for every GEMM of the process."""
    saved = canonical.MAX_TREE_WIDTH
    canonical.MAX_TREE_WIDTH = saved if name == "tree" else 1
    try:
        yield
    finally:
        canonical.MAX_TREE_WIDTH = saved


def time_call(fn, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def gemm_rows(reps: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for model, layer, n, k in GEMM_SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        packed = {"fp32": invariant.pack_weight(w), "bf16": invariant.pack_weight(w.to(torch.bfloat16))}
        wq = quantize_weight(w)  # 128x128 E4M3 blocks
        sw = wq.scale_inv
        packed["fp8"] = invariant.pack_weight(wq.data)
        for m in (1024, 16):
            x = torch.randn(m, k, generator=g)
            xq, sx, _ = invariant.quantize_1x128(x)
            calls = {"fp32": lambda gr: invariant.gemm(x, packed["fp32"], n, groups=gr),
                     "bf16": lambda gr: invariant.gemm(x, packed["bf16"], n, groups=gr),
                     "fp8": lambda gr: invariant.fp8_gemm(xq, sx, packed["fp8"], sw, n, groups=gr)}
            iters = 20 if m == 1024 else 400
            for kind, call in calls.items():
                times = {"tree": [], "chain": []}
                for _ in range(reps):
                    for name, groups in (("tree", canonical.tree_width(k)), ("chain", 1)):
                        times[name].append(time_call(lambda: call(groups), iters))
                tree, chain = statistics.median(times["tree"]), statistics.median(times["chain"])
                rows.append({"what": "gemm", "model": model, "layer": layer, "kind": kind, "M": m, "N": n, "K": k,
                             "groups_tree": canonical.tree_width(k), "tree_us": tree * 1e6, "chain_us": chain * 1e6,
                             "tree_vs_chain": tree / chain, "gflops_tree": 2 * m * n * k / tree / 1e9})
                print(f"gemm {model} {layer} {kind} M={m}: tree {tree * 1e6:.0f} us chain {chain * 1e6:.0f} us "
                      f"({tree / chain:.3f}x)", flush=True)
    return rows


def train_step_rows(reps: int, steps: int) -> list[dict]:
    rows = []
    for model, cfg in (("tiny-tp", load_config("configs/tiny-tp.yaml", ["run.progress=false", "run.tensorboard=false"])),
                       ("smollm2", bench_config("smollm2"))):
        base, tok = build_policy(cfg)
        batch, prompt_len, resp_len = (16, 32, 96) if model == "tiny-tp" else (8, 64, 128)
        exp = synthetic_experience(batch, prompt_len, resp_len, base.config.vocab_size, tok.pad_token_id)
        for mode in ("unified", "fp32"):
            c = copy.deepcopy(cfg)
            c.precision.mode, c.precision.numerics = mode, "exact"
            times = {"tree": [], "chain": []}
            for _ in range(reps):
                for name in ("tree", "chain"):
                    with structure(name):
                        t = build_trainer(base, c)
                        for _ in range(2):
                            t.train_step_on_policy(exp, 1.0, "none")
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            t.train_step_on_policy(exp, 1.0, "none")
                        times[name].append((time.perf_counter() - t0) / steps)
                        del t
            tree, chain = statistics.median(times["tree"]), statistics.median(times["chain"])
            rows.append({"what": "train_step", "model": model, "mode": mode, "tokens": batch * (prompt_len + resp_len),
                         "tree_s": tree, "chain_s": chain, "tree_vs_chain": tree / chain,
                         "tree_s_all": times["tree"], "chain_s_all": times["chain"]})
            print(f"train step {model} {mode}: tree {tree:.2f} s chain {chain:.2f} s ({tree / chain:.3f}x)", flush=True)
    return rows


def default_run_rows(reps: int) -> list[dict]:
    from jetflow.cli import main as cli

    times = {"tree": [], "chain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name in ("tree", "chain"):
                with structure(name):
                    t0 = time.perf_counter()
                    rc = cli(["train", f"run.out_dir={tmp}/{name}{rep}", "run.progress=false"])
                    times[name].append(time.perf_counter() - t0)
                if rc:
                    sys.exit(f"jetflow train ({name}) exited {rc}")
                print(f"default run {name}: {times[name][-1]:.1f} s", flush=True)
    tree, chain = statistics.median(times["tree"]), statistics.median(times["chain"])
    return [{"what": "default_run", "model": "smollm2", "mode": "unified", "tree_s": tree, "chain_s": chain,
             "tree_vs_chain": tree / chain, "tree_s_all": times["tree"], "chain_s_all": times["chain"]}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=2)
    ap.add_argument("--run-reps", type=int, default=1, help="default runs per structure")
    ap.add_argument("--out", default="results/megatron-exact")
    args = ap.parse_args()
    with LoadAverage() as load:
        gemms = gemm_rows(args.reps)
        steps = train_step_rows(args.reps, args.train_steps)
        runs = default_run_rows(args.run_reps)
    cols_g = ["model", "layer", "kind", "M", "N", "K", "groups_tree", "tree_us", "chain_us", "tree_vs_chain", "gflops_tree"]
    cols_t = ["what", "model", "mode", "tree_s", "chain_s", "tree_vs_chain"]
    md = (f"Tree (G = tree_width(K) groups, pairwise tree) vs chain (G = 1) in the exact CPU kernels, one run, "
          f"{torch.get_num_threads()} torch threads; medians of {args.reps} interleaved repetitions "
          f"(default run: {args.run_reps} per structure). tree_vs_chain above 1: the tree is slower.\n\n"
          f"GEMMs:\n\n{markdown_table(gemms, cols_g)}\n\nTrain step (exact numerics, forward + backward + AdamW) "
          f"and the default run:\n\n{markdown_table(steps + runs, cols_t)}\n\n{load.sentence()}")
    write_results("tree-cost", {"args": vars(args), "rows": gemms + steps + runs, "load": load.record()}, md, args.out)
    print(md)


if __name__ == "__main__":
    main()
