"""Cost of the chunked log-probs' recompute backward (jetflow.model.chunked_logprobs) against plain autograd
through the head, at SmolLM2-135M's head shape (576 -> 49152, fp32 nn.Linear), N positions, forward +
backward of sum(log-probs), median of 3 after a warm-up (wall and this process's CPU seconds), with the
process peak RSS:

    PYTHONPATH=. python scripts/analysis/train_step_long_head_backward_cost.py [N]"""

import json
import resource
import statistics
import subprocess
import sys
import time


def child(variant: str, N: int) -> None:
    import torch

    from jetflow.model.chunked_logprobs import chunked_token_logprobs
    from jetflow.model.logprobs import token_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(576, 49152, bias=False)
    h = torch.randn(N, 576, requires_grad=True)
    tokens = torch.randint(0, 49152, (N,))

    def run():
        if variant == "plain":
            lp = token_logprobs(head(h), tokens)
        else:
            lp = chunked_token_logprobs(head, h, tokens, chunk_tokens=int(variant))
        lp.sum().backward()

    run()
    times, cpu = [], []
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": "plain autograd" if variant == "plain" else f"chunked, chunk_tokens={variant}",
                      "N": N, "fwd_bwd_s_median": round(statistics.median(times), 3),
                      "fwd_bwd_cpu_s_median": round(statistics.median(cpu), 3),
                      "process_peak_MiB": round(peak / 1024, 1), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
        for variant in ("plain", "0", "256"):
            subprocess.run([sys.executable, __file__, "--child", variant, str(N)], check=True)
