"""KL to the reference of two finished runs' final policies on one fixed batch (no sampling noise in the
measurement): the run's first 16 training prompts, each continued greedily by the reference for
max_new_tokens tokens; at every response position the exact KL(pi_final || pi_ref) over the whole
vocabulary, and the sampled k3 estimator of the same tokens, averaged over positions. Plain fp32
forwards (not the runs' FP8 linears): a measurement of the weights, not of the precision.

    python scripts/analysis/kl_reference_fixed_batch_kl.py RUN_A RUN_B ...
"""

import sys
from pathlib import Path

import torch

from jetflow.config import load_config
from jetflow.model import Decoder, load_hf_dir
from jetflow.run.build import build_task, build_tokenizer, prompt_encoder
from jetflow.run.sides import REFERENCE_FILE


@torch.no_grad()
def main(runs: list[str]) -> None:
    torch.set_num_threads(2)
    cfg = load_config(Path(runs[0]) / "config.yaml")
    task, tok = build_task(cfg), build_tokenizer(cfg)
    encode = prompt_encoder(cfg, tok, task)
    policies = {run: load_hf_dir(Path(run) / "model") for run in runs}
    reference = Decoder(next(iter(policies.values())).config)
    reference.load_state_dict(torch.load(Path(runs[0]) / REFERENCE_FILE, weights_only=True), strict=False)
    for run in runs[1:]:  # every run started from the same weights
        other = torch.load(Path(run) / REFERENCE_FILE, weights_only=True)
        assert all(torch.equal(v, other[k]) for k, v in reference.state_dict().items() if k in other), run
    sums = {run: [0.0, 0.0] for run in runs}
    positions = 0
    for problem in task.problems(0, 16, cfg.run.seed):
        ids = torch.tensor([encode(problem)])  # (1, P)
        P = ids.shape[1]
        for _ in range(cfg.rollout.max_new_tokens):  # the reference's greedy continuation
            nxt = reference(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        ref_lp = torch.log_softmax(reference(ids)[0, P - 1:-1].float(), -1)  # (R, V)
        tokens = ids[0, P:]  # (R,)
        for run, policy in policies.items():
            lp = torch.log_softmax(policy(ids)[0, P - 1:-1].float(), -1)  # (R, V)
            sums[run][0] += float((lp.exp() * (lp - ref_lp)).sum())  # exact KL, summed over positions
            d = (ref_lp - lp).gather(-1, tokens[:, None])[:, 0]  # (R,) log pi_ref - log pi at the tokens
            sums[run][1] += float((d.exp() - d - 1).sum())
        positions += tokens.numel()
    print(f"| run | exact KL(pi || pi_ref) per position | k3 of the reference's greedy tokens |  ({positions} positions)")
    print("|---|---|---|")
    for run, (exact, k3) in sums.items():
        print(f"| {run} | {exact / positions:.6f} | {k3 / positions:.6f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
