"""stop 49: does the deterministic one pass's full-mask ring (ROTATE) lose time where a (batch, head)'s programs are
launched across two waves? Its programs launched early (the previous wave's last SMs) wait at nearly every tile
for programs of their head that start a whole program later. `grouped` models the fix that was considered and not
built: the early ones take their turns first. Run: python ring_stall_model.py (pure Python, a minute).

Event simulation of the deterministic one pass's ROTATE ring on S SMs: each program visits n_m tiles (1 time unit
each); its add at a tile waits for its predecessor's add there (+hop); compute runs at most NSTAGE tiles ahead of
its own adds. Programs launch in pid order (head-major, key tiles 0 up) as SMs free up."""
import heapq, sys

def simulate(n_heads, n_k, n_m, S, grouped, nstage=2, hop=0.05):
    stride = max(n_m // n_k, 1)
    def groups(h):
        p0 = h * n_k
        b = (p0 // S + 1) * S
        if grouped and b < p0 + n_k:
            return [(0, b - p0), (b - p0, n_k)]
        return [(0, n_k)]
    def turn(h, m, n):
        off = 0
        for lo, hi in groups(h):
            ln = hi - lo
            if lo <= n < hi:
                f = min(hi - 1, m // stride)
                if f < lo:
                    f = hi - 1
                return off + (f - n) % ln
            off += ln
    # precompute turn -> program at (h, m)
    add_time = {}  # (h, m, turn) -> time
    waiters = {}
    free = [0.0] * S
    heapq.heapify(free)
    progs = [(h, n) for h in range(n_heads) for n in range(n_k)]
    # each program: simulate sequentially but it may block on a predecessor not yet computed -> need global ordering
    # Use iterative relaxation: process events in time order with a heap of (time, pid, step)
    state = {}
    events = []
    sm_free = list(free)
    next_pid = 0
    def launch(t):
        nonlocal next_pid
        if next_pid < len(progs):
            pid = next_pid; next_pid += 1
            state[pid] = dict(step=0, c=t, adds=[])
            heapq.heappush(events, (t, pid))
    for _ in range(S):
        launch(0.0)
    end = 0.0
    while events:
        t, pid = heapq.heappop(events)
        h, n = progs[pid]
        st = state[pid]
        j = st['step']
        if j == n_m:
            end = max(end, t); launch(t); continue
        m = (n * stride + j) % n_m
        c = max(st['c'], st['adds'][j - nstage] if j >= nstage else 0) + 1 if 'pend' not in st else st['pend']
        tr = turn(h, m, n)
        if tr == 0:
            a = c
        else:
            pa = add_time.get((h, m, tr - 1))
            if pa is None:
                st['pend'] = c
                waiters.setdefault((h, m, tr - 1), []).append(pid)
                continue
            a = max(c, pa + hop)
        st.pop('pend', None)
        add_time[(h, m, tr)] = a
        for w in waiters.pop((h, m, tr), []):
            heapq.heappush(events, (a, w))
        st['adds'].append(a); st['c'] = c; st['step'] = j + 1
        heapq.heappush(events, (c if j + 1 < n_m else a, pid))
    ideal = n_heads * n_k * n_m / S
    return end, ideal

for (H, n_k, n_m) in [(16, 128, 256), (32, 64, 128), (64, 32, 64), (128, 16, 32)]:
    for grouped in (False, True):
        end, ideal = simulate(H, n_k, n_m, 132, grouped)
        print(f"heads {H} n_k {n_k} n_m {n_m} grouped={grouped}: {end:.0f} vs ideal {ideal:.0f} ({end/ideal:.3f})", flush=True)
