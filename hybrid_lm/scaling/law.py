"""The fitted law L(N, D) = E + A N^-alpha + B D^-beta evaluated: predictions and the compute-optimal
allocation (used by the fit, its reports and its figures; the fitting itself is ``fit.py``, fit.json ``fit_table.py``)."""

from __future__ import annotations

import numpy as np

EXTRAPOLATION_LIMIT = 10.0  # reports rank architectures at most this many times beyond the largest run


def compute_optimal(params: dict, C, k: float = 6.0) -> dict:
    """N*(C), D*(C), L*(C) minimising L(N, D) subject to k N D = C (arrays follow C's shape)."""
    al, be, A, B = params["alpha"], params["beta"], params["A"], params["B"]
    C = np.asarray(C, float)
    if not (al > 0 and be > 0):
        return {"valid": False, "reason": f"alpha={al:.4g}, beta={be:.4g}: both must be > 0"}
    s = al + be
    G = (al * A / (be * B)) ** (1.0 / s)
    a, b = be / s, al / s
    N = G * (C / k) ** a
    D = (C / k) ** b / G
    L = A * N ** -al + B * D ** -be + (params.get("E") or 0.0)
    return {"valid": True, "a": a, "b": b, "G": G, "N": N, "D": D, "L": L}


def predict(params: dict, N, D):
    N, D = np.asarray(N, float), np.asarray(D, float)
    return params["A"] * N ** -params["alpha"] + params["B"] * D ** -params["beta"] + (params.get("E") or 0.0)
