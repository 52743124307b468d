"""Would a second CUDA stream shorten the FP8 MLP's backward? dW2 = gyᵀ @ h does not need the dgrad kernel, and dW1
does not need dx: run dW2 beside the dgrad and dW1 beside dx on a side stream, so that each pair's tails overlap.
The product's backward (fp8_autograd._backward) against this one, each a CUDA graph of the whole backward, on the same
inputs, rounds alternated; the outputs must be the same bit for bit. Hopper GPU.

    PYTHONPATH=. python lab/fp8/streams_probe.py [--rounds 5]
"""

import torch

from fused_ops.fp8 import autograd as fa
from fused_ops.fp8.kernels import GRAD_Y, GRAD_Z, H, X, update_scales
from lab.fp8.epilogue_probe import arguments, setup


def backward_two_streams(grad_y, xt8, ht8, saved, w_proj, w_fc_t8, w_fc_inv, w_proj_t8, w_proj_inv, inv, activation,
                         state, side):
    """fa._backward without biases, dW2 and dW1 on the side stream (outputs allocated on the main one)."""
    main = torch.cuda.current_stream()
    gy, gy8, gyt8 = fa._quantized_rows(grad_y, state, GRAD_Y)
    inv_gy = state.inv_scale[GRAD_Y, :1]
    grad_w_proj = torch.empty(w_proj.shape, device=gy.device, dtype=w_proj.dtype)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch._scaled_mm(gyt8, ht8.t(), scale_a=inv_gy, scale_b=inv[H, :1], out_dtype=w_proj.dtype, out=grad_w_proj)
    gz8, gzt8, _ = fa._calibrated(fa._second_dgrad, state, GRAD_Z, gy8, w_proj_t8, (inv_gy, w_proj_inv), saved,
                                  activation, state, False)
    inv_gz = state.inv_scale[GRAD_Z, :1]
    grad_w_fc = torch.empty((gzt8.shape[0], xt8.shape[0]), device=gy.device, dtype=w_proj.dtype)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch._scaled_mm(gzt8, xt8.t(), scale_a=inv_gz, scale_b=inv[X, :1], out_dtype=w_proj.dtype, out=grad_w_fc)
    grad_x = torch._scaled_mm(gz8, w_fc_t8.t(), scale_a=inv_gz, scale_b=w_fc_inv, out_dtype=gy.dtype)
    main.wait_stream(side)
    update_scales(state)
    return grad_x, grad_w_fc, grad_w_proj


def main():
    p = arguments(5)
    a = p.parse_args()
    side = torch.cuda.Stream()
    for gated in (False, True):
        d = setup(a.M, a.C, gated)
        st = d["state"]
        st.calibrated = True
        w1 = torch.randn(d["w18"].shape, device="cuda", dtype=torch.bfloat16) / a.C ** 0.5
        w2 = torch.randn(a.C, d["h8"].shape[1], device="cuda", dtype=torch.bfloat16) / d["h8"].shape[1] ** 0.5
        w18, w1t8, w1inv, w28, w2t8, w2inv = st.weights(w1, w2)
        act = "swiglu" if gated else "gelu"
        y, xt8, ht8, saved, inv = fa._forward(d["x"], None, None, act, st, w18, w1inv, w28, w2inv)
        args = (d["gy"], xt8, ht8, saved, w2, w1t8, w1inv, w2t8, w2inv, inv, act, st)
        snapshot = {k: v.clone() for k, v in st._buffers.items()}

        def product():
            g = fa._backward(d["gy"], xt8, ht8, saved, w1t8, w1inv, w2t8, w2inv, inv, w2.dtype, act, st, False, False)
            return g[0], g[1], g[3]

        def streams():
            return backward_two_streams(*args, side)

        graphs, outs = {}, {}
        for name, fn in (("product", product), ("two streams", streams)):
            for _ in range(2):  # warm-up (compiles), outside the graph
                fn()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = fn()
            graphs[name] = g
        for name, g in graphs.items():  # the same scale state before each replay: the same outputs
            for k, v in snapshot.items():
                st._buffers[k].copy_(v)
            g.replay()
            torch.cuda.synchronize()
            outs[name] = tuple(t.clone() for t in outs[name])
        same = all(torch.equal(u, v) for u, v in zip(outs["product"], outs["two streams"]))
        times = {k: [] for k in graphs}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(a.rounds):
            for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
                for _ in range(3):
                    graphs[name].replay()
                start.record()
                for _ in range(20):
                    graphs[name].replay()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 20 * 1e3)
        act = "swiglu" if gated else "gelu"
        print(f"\n{act} backward, one CUDA graph, GPU time per replay, us (rounds alternated); outputs equal: {same}")
        for name, v in times.items():
            print(f"{name:12s} " + " ".join(f"{t:7.1f}" for t in v) + f"   median {sorted(v)[len(v) // 2]:7.1f}")


if __name__ == "__main__":
    main()
