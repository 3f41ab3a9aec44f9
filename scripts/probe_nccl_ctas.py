"""NCCL on this host: transport and protocol of a 300 MB all-reduce, and its time at several max_ctas."""
import os, torch, torch.distributed as dist, torch.multiprocessing as mp

def w(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    x = torch.randn(300 * 2**20 // 4, device="cuda")
    for ctas in (0, 2, 4, 8, 16, 32):
        if ctas:
            o = dist.ProcessGroupNCCL.Options(); o.config.max_ctas = ctas
            g = dist.new_group(backend="nccl", pg_options=o)
        else:
            g = None
        for _ in range(3): dist.all_reduce(x, group=g)
        torch.cuda.synchronize(); dist.barrier()
        ts = []
        for _ in range(10):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); dist.all_reduce(x, group=g); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        if rank == 0:
            ms = sorted(ts)[len(ts)//2]
            print(f"max_ctas={ctas or 'default'}: 300 MB all-reduce {ms:.2f} ms, algbw {300*2**20/ms/1e6:.1f} GB/s", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(w, args=(2,), nprocs=2)
