"""A/B in one process: host-made descriptors (HEAD, pingpong_old) vs device-made (working tree)."""
import statistics, time, torch
from triton.testing import do_bench_cudagraph
from fused_ops import pingpong as new, pingpong_old as old

def host_us(fn, n=50, repeats=9):
    for _ in range(20): fn()
    r = []
    for _ in range(repeats):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): fn()
        r.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(r)

dt = torch.bfloat16
rows = []
for act, H, gated, up in (("gelu", 3072, False, "identity"), ("silu", 2048, True, "identity")):
    M, C = 12288, 768
    W = 2 * H if gated else H
    x = torch.randn(M, C, device="cuda", dtype=dt); w = torch.randn(W, C, device="cuda", dtype=dt) / C ** 0.5
    g = torch.randn(M, C, device="cuda", dtype=dt); w2 = torch.randn(C, H, device="cuda", dtype=dt) / H ** 0.5
    h = torch.empty(M, H, device="cuda", dtype=dt); s = torch.randn(M, W, device="cuda", dtype=dt); gr = torch.empty(M, W, device="cuda", dtype=dt)
    for name, mod in (("host desc", old), ("device desc", new), ("host desc", old), ("device desc", new)):
        f = lambda: mod.linear_act_forward(x, w, None, act, up, gated, True, h, s) if mod is new else \
            (mod.linear_act_forward(x, w, None, act, up, gated, True, h, s))
        d = lambda: mod.dgrad(g, w2, s, gr, gated, False)
        f(); d()
        rows.append((act, name, do_bench_cudagraph(f) * 1e3, do_bench_cudagraph(d) * 1e3, host_us(f), host_us(d)))
print(f"{'act':6s} {'descriptors':12s} {'fwd us':>8s} {'dgrad us':>9s} {'fwd host':>9s} {'dgrad host':>10s}")
for r in rows:
    print(f"{r[0]:6s} {r[1]:12s} {r[2]:8.1f} {r[3]:9.1f} {r[4]:9.1f} {r[5]:10.1f}")
