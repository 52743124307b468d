"""Fit the polynomial of activations.gelu_and_grad_16bit:
Φ(-|x|) = exp(-x²/2) · t · S(t) with t = 1 / (1 + |x| / (2√2)).

S(t) = erfcx(u) / (2t) with u = |x| / √2 = 2 (1/t - 1), a smooth function on t in (0, 1], fitted with a
polynomial by least squares on the relative error, reweighted towards the largest errors until the fit is
close to minimax. Prints the coefficients (highest power first) and the fit's largest relative error.

    python lab/fit_gelu_cdf.py [--degree 7]
"""

import argparse

import torch


def fit(degree, iterations=300):
    t = 0.5 * (1 - torch.cos(torch.linspace(0, torch.pi, 20001, dtype=torch.float64)))  # dense near both ends
    t = t[t > 0]
    target = 0.5 * torch.special.erfcx(2 * (1 / t - 1)) / t
    powers = torch.stack([t ** k for k in range(degree, -1, -1)], 1)
    weight, best = torch.ones_like(t), None
    for _ in range(iterations):
        coeffs = torch.linalg.lstsq(powers * (weight / target)[:, None], weight[:, None]).solution[:, 0]
        err = (powers @ coeffs / target - 1).abs()
        if best is None or err.max() < best[0]:
            best = (err.max().item(), coeffs)
        weight = weight * (1 + err / err.max())
        weight = weight / weight.mean()
    return best


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--degree", type=int, default=7)
    err, coeffs = fit(p.parse_args().degree)
    print("S coefficients, highest power first:", ", ".join(f"{c:.9g}" for c in coeffs.tolist()))
    print(f"largest relative error of the fit: {err:.2e}")
