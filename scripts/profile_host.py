"""cProfile of eager flashsys attention calls on a GPU, backward on the calling thread so the profile sees it.

    python scripts/profile_host.py [N]
"""

import cProfile
import pstats
import sys

import torch

from flashsys.ops.attention import FlashAttention2Triton

n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
torch.autograd.set_multithreading_enabled(False)
g = torch.Generator(device="cpu").manual_seed(0)
q, k, v, do = (torch.randn(1, 16, n, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
for _ in range(5):
    FlashAttention2Triton.apply(q, k, v, True).backward(do)
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
for _ in range(200):
    FlashAttention2Triton.apply(q, k, v, True).backward(do)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)
