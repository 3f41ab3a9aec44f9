"""Quick GPU probe: eager and torch.compile paths of FlashAttention2Triton on a small shape."""
import torch
from flashsys.ops.attention import FlashAttention2Triton
q, k, v = torch.randn(3, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True).unbind(0)
for name, fn in (("eager", FlashAttention2Triton.apply), ("compiled", torch.compile(FlashAttention2Triton.apply))):
    try:
        fn(q, k, v, True).sum().backward(); torch.cuda.synchronize(); print(name, "ok")
    except Exception as e:
        print(name, "FAILED:", str(e)[-3000:])
