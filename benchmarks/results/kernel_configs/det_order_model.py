"""stop 49: list-scheduling models of the deterministic causal one pass (B 1, H 16, N 16384, D 128: 128 key tiles a
head, key tile n visiting 256 - 2n query tiles of 64 rows, 132 SMs, programs started in launch order as SMs free).
current: each head lightest first, heads one after another (what the kernel launches); lpt: heaviest first (the
unordered kind); split: key tiles below 64 cut in two pieces, [2n, 2n + 128) and the rest, the second pieces of
each head launched `gap` heads later (not built); interleaved: all heads' key tile n before any head's n - 1
(tried in the kernel before and 1.5-1.8x slower: L2). ov: a per-program overhead in tile units."""
import heapq
def makespan(weights, sms=132, overhead=0):
    free=[0.0]*sms; heapq.heapify(free); end=0
    for w in weights:
        t=heapq.heappop(free); t2=t+w+overhead; end=max(end,t2); heapq.heappush(free,t2)
    return end
H=16; NK=128
w=lambda n: 256-2*n
cur=[w(n) for h in range(H) for n in reversed(range(NK))]
lpt=sorted(cur,reverse=True)
print("total/sms", sum(cur)/132, "current", makespan(cur), "lpt", makespan(lpt))
# split: lo=[2n, min(2n+128,256)), hi=[2n+128,256)
lo=lambda n: min(128,256-2*n); hi=lambda n: max(0,128-2*n)
LO=lambda h:[lo(n) for n in reversed(range(NK))]
HI=lambda h:[hi(n) for n in reversed(range(NK)) if hi(n)>0]
for gap in (1,2,3):
    seq=[]
    for h in range(H+gap):
        if h<H: seq+=LO(h)
        if h-gap>=0: seq+=HI(h-gap)
    for ov in (0,2):
        print("split gap",gap,"ov",ov, makespan(seq,overhead=ov), "cur ov", makespan(cur,overhead=ov))
spt = [w(n) for n in reversed(range(NK)) for h in range(H)]
print("interleaved", makespan(spt))
