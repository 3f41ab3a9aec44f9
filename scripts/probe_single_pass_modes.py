"""Single-pass experiment (#16, stop 30): where the single-pass kernel's time goes (DQ_MODE 0 atomics, 1 plain stores, 2 atomics masked off,
3 no dQ product, 4 atomics under dK's product)."""
import statistics, sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashsys.ops.attention import flash_gluon, flash_triton
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
modes = {0: "atomics", 1: "plain stores (racy)", 2: "atomics masked off", 3: "no dQ product", 4: "atomics under dK"}
for d, n, causal in ((128, 16384, True), (128, 16384, False), (64, 16384, True)):
    b = 16384 // n
    q, k, v, do = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    window = (-1, 0) if causal else (-1, -1); scale = d ** -0.5
    o, lse = flash_triton.flash_forward_triton(q, k, v, window, scale)
    pairs = torch.stack((-lse * flash_gluon.LOG2E, (do.float() * o.float()).sum(-1)), -1)
    dq_sum = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    runs = {}
    for var in (flash_gluon.Variant("dkdv", 64, 128, 2), flash_gluon.Variant("dkdv", 64, 64, 2)):
        kernel, grid, a, kw = flash_gluon._dkdv_launch_parts(var, q, k, v, do, dk, dv, pairs, window, scale, None)
        runs[f"{var.label()} dK/dV only"] = (kernel, grid, a, kw)
        for mode in modes:
            kernel, grid, a, kw = flash_gluon._dkdv_launch_parts(var, q, k, v, do, dk, dv, pairs, window, scale, dq_sum)
            runs[f"{var.label()} fused, {modes[mode]}"] = (kernel, grid, a, dict(kw, DQ_MODE=mode))
    times = {}
    for _ in range(3):
        for label, (kernel, grid, a, kw) in runs.items():
            times.setdefault(label, []).append(triton.testing.do_bench(lambda: kernel[grid](*a, **kw)))
    print(f"\nD {d} N {n} causal {causal}")
    for label, ts in times.items():
        print(f"  {label:<45} {statistics.median(ts):7.3f} ms")
    # mode 4 must give the mode-0 dQ
    outs = []
    for mode in (0, 4):
        kernel, grid, a, kw = runs[f"dkdv 64x128 2buf fused, {modes[mode]}"]
        dq_sum.zero_(); kernel[grid](*a, **kw); outs.append(dq_sum.clone())
    print("  mode 4 vs 0 max rel diff", ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item())
