import torch, traceback
from flashsys.ops.attention import FlashAttention2Triton
for dt in (torch.float32, torch.bfloat16):
    q = torch.randn(1, 2, 100, 64, device="cuda", dtype=dt, requires_grad=True)
    try:
        o = FlashAttention2Triton.apply(q, q, q, True); o.sum().backward(); print(dt, "ok")
    except Exception as e:
        s = str(e); print(dt, "FAIL", s[-2500:])
