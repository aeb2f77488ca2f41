"""V-trace (core/vtrace.py) against a per-step loop written from IMPALA's eq. 1, and its on-policy identities."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.core.advantages import gae
from ppokit.core.vtrace import vtrace

T, N = 7, 3


def reference(mu, pi, r, v, nv, term, trunc, gamma, lam, rho_bar, c_bar):
    """vs_s = V(x_s) + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t, summed term by term in python floats,
    cut at the first episode end; pg_s = rho_s (r_s + gamma vs_{s+1} - V(x_s))."""
    vs = [[0.0] * N for _ in range(T)]
    pg = [[0.0] * N for _ in range(T)]
    for n in range(N):
        for s in range(T):
            total, coef = 0.0, 1.0
            for t in range(s, T):
                ratio = math.exp(pi[t][n] - mu[t][n])
                rho, c = min(rho_bar, ratio), lam * min(c_bar, ratio)
                boot = 0.0 if term[t][n] else nv[t][n]
                total += coef * rho * (r[t][n] + gamma * boot - v[t][n])
                if term[t][n] or trunc[t][n]:
                    break
                coef *= gamma * c
            vs[s][n] = v[s][n] + total
        for s in range(T):
            rho = min(rho_bar, math.exp(pi[s][n] - mu[s][n]))
            done = term[s][n] or trunc[s][n]
            nxt = nv[s][n] if (done or s == T - 1) else vs[s + 1][n]
            pg[s][n] = rho * (r[s][n] + gamma * (0.0 if term[s][n] else nxt) - v[s][n])
    return torch.tensor(vs, dtype=torch.float64), torch.tensor(pg, dtype=torch.float64)


def chunk(seed=0, lag=0.5):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(T, N, generator=g, dtype=torch.float64) - 0.1
    pi = mu + lag * torch.randn(T, N, generator=g, dtype=torch.float64)
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    v = torch.randn(T, N, generator=g, dtype=torch.float64)
    boot = torch.randn(N, generator=g, dtype=torch.float64)
    nv = torch.cat([v[1:], boot[None]])
    term = torch.zeros(T, N, dtype=torch.bool)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    term[2, 0] = True
    trunc[4, 1] = True
    nv[4, 1] = 0.7  # a truncated step bootstraps from its final observation's value, not the reset obs's
    return mu, pi, r, v, nv, term, trunc


@pytest.mark.parametrize("lam,rho_bar,c_bar", [(1.0, 1.0, 1.0), (0.9, 1.0, 1.0), (1.0, 2.0, 0.5)])
def test_vtrace_matches_the_per_step_loop(lam, rho_bar, c_bar):
    mu, pi, r, v, nv, term, trunc = chunk()
    vs, pg = vtrace(mu, pi, r, v, nv, term, trunc, 0.97, lam, rho_bar, c_bar)
    ref_vs, ref_pg = reference(mu.tolist(), pi.tolist(), r.tolist(), v.tolist(), nv.tolist(), term.tolist(),
                               trunc.tolist(), 0.97, lam, rho_bar, c_bar)
    torch.testing.assert_close(vs, ref_vs)
    torch.testing.assert_close(pg, ref_pg)


def test_on_policy_targets_are_the_n_step_return():
    mu, _, r, v, nv, term, trunc = chunk()
    vs, pg = vtrace(mu, mu, r, v, nv, term, trunc, 0.97, 1.0)
    _, returns = gae(r, v, nv, term, trunc, 0.97, 1.0)
    torch.testing.assert_close(vs, returns)
    # The n-step return of env 2 (no episode end): rewards discounted to the chunk's end, then the bootstrap.
    n_step = sum(0.97 ** k * r[k, 2] for k in range(T)) + 0.97 ** T * nv[-1, 2]
    torch.testing.assert_close(vs[0, 2], n_step)
    # APPO's advantage on-policy: r_t + gamma vs_{t+1} - V(x_t) = vs_t - V(x_t) when lambda = 1.
    torch.testing.assert_close(pg, returns - v)


def test_on_policy_gae_form_is_gae_lambda():
    mu, _, r, v, nv, term, trunc = chunk()
    vs, adv = vtrace(mu, mu, r, v, nv, term, trunc, 0.97, 0.8, pg_form="gae")
    ref_adv, ref_ret = gae(r, v, nv, term, trunc, 0.97, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(vs, ref_ret)


def test_lag_shrinks_the_targets_toward_the_value():
    # The target policy gives the taken actions less weight than the behaviour did (rho < 1 everywhere): each
    # correction vs - V is a damped copy of the on-policy one, so the targets move toward V.
    mu, _, r, v, nv, term, trunc = chunk()
    r = r.abs() + 1.0  # every TD error positive, so the on-policy corrections are too
    v = torch.zeros_like(v)
    nv = torch.zeros_like(nv)
    on, _ = vtrace(mu, mu, r, v, nv, term, trunc, 0.97)
    off, _ = vtrace(mu, mu - 0.5, r, v, nv, term, trunc, 0.97)
    assert bool(((off - v).abs() < (on - v).abs()).all())
    assert bool((off - v > 0).all())


def test_importance_weights_are_clipped_at_rho_bar():
    # The target policy likes the taken actions far more than the behaviour (ratio e^3): with rho_bar = c_bar = 1
    # V-trace is exactly the on-policy target; unclipped (rho_bar = 100) it is not.
    mu, _, r, v, nv, term, trunc = chunk()
    on, on_pg = vtrace(mu, mu, r, v, nv, term, trunc, 0.97)
    clipped, clipped_pg = vtrace(mu, mu + 3.0, r, v, nv, term, trunc, 0.97)
    torch.testing.assert_close(clipped, on)
    torch.testing.assert_close(clipped_pg, on_pg)
    loose, _ = vtrace(mu, mu + 3.0, r, v, nv, term, trunc, 0.97, rho_bar=100.0, c_bar=100.0)
    assert not torch.allclose(loose, on)


def test_shapes_are_checked():
    mu, pi, r, v, nv, term, trunc = chunk()
    with pytest.raises(ValueError, match="values has shape"):
        vtrace(mu, pi, r, v[:-1], nv, term, trunc, 0.99)
    with pytest.raises(ValueError, match="pg_form"):
        vtrace(mu, pi, r, v, nv, term, trunc, 0.99, pg_form="retrace")
