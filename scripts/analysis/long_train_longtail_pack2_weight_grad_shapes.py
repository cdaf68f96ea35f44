import time

import torch

from jetflow.kernels import invariant as inv
torch.set_num_threads(2)


def t(f, n=2):
    best = 1e9
    for _ in range(n):
        s = time.process_time()
        f()
        best = min(best, time.process_time() - s)
    return best


g = torch.randn(256, 49152)
x = torch.randn(256, 576)
print("head wgrad  torch %.3f  weight_grad %.3f" % (t(lambda: g.t() @ x), t(lambda: inv.weight_grad(g, x))))
p = torch.randn(1280, 576)
print("norm wgrad  torch %.4f  weight_grad %.4f" % (t(lambda: p.sum(0)), t(lambda: inv.weight_grad(p.new_ones(1280, 1), p)[0])))
g2 = torch.randn(1280, 1536)
x2 = torch.randn(1280, 576)
print("mlp up wgrad torch %.3f  weight_grad %.3f" % (t(lambda: g2.t() @ x2), t(lambda: inv.weight_grad(g2, x2))))
