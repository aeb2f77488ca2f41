"""V-trace off-policy targets (Espeholt et al. 2018, "IMPALA", section 4.1, eq. 1) over a time-major chunk.

A decoupled actor acts with the behaviour policy mu (weights some versions behind the learner's pi); V-trace
corrects the value targets with truncated importance weights ``rho_t = min(rho_bar, pi/mu)`` and trace cutters
``c_t = lambda * min(c_bar, pi/mu)`` (lambda: the paper's remark 2, "Note that ... lambda in [0, 1]"):

    vs_t = V(x_t) + delta_t + gamma * c_t * (vs_{t+1} - V(x_{t+1})),   delta_t = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))

and the policy-gradient advantage is ``rho_t (r_t + gamma vs_{t+1} - V(x_t))`` (the paper's eq. 4, the form
APPO takes into PPO's clipped surrogate). On-policy (``pi == mu``, so ``rho = c = 1``) with ``lambda = 1``,
``vs`` is the n-step return bootstrapped at the end of the chunk, the same as ``gae(..., lambda=1)``'s returns.

Episode ends follow ``advantages.gae``: a termination cuts the bootstrap, a truncation bootstraps from
``next_values`` (V of the true final observation) but, like a termination, cuts the trace, since the next step
of that env belongs to a new episode. The recursion is ``advantages._recursion``, the one GAE runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.core.advantages import _recursion

__all__ = ["PG_FORMS", "vtrace"]

# "vtrace": rho_t (r_t + gamma vs_{t+1} - V(x_t)), IMPALA's eq. 4 and APPO's; "gae": vs_t - V(x_t), which
# on-policy is exactly GAE(lambda)'s advantage (the synchronous loop's), off-policy its V-trace-corrected form.
PG_FORMS = ("vtrace", "gae")


def vtrace(behaviour_logp: Tensor, target_logp: Tensor, rewards: Tensor, values: Tensor, next_values: Tensor,
           terminated: Tensor, truncated: Tensor, gamma: float, lam: float = 1.0, rho_bar: float = 1.0,
           c_bar: float = 1.0, pg_form: str = "vtrace") -> tuple[Tensor, Tensor]:
    """``(vs, pg_advantages)``, both ``[T, N]``; every input ``[T, N]``.

    ``values[t]`` is V(x_t) and ``next_values[t]`` V of the observation that followed step t, both under the
    target policy (``buffer.next_values(bootstrap)``: the last row is the bootstrap value, a truncated step's is
    its final observation's). ``behaviour_logp``/``target_logp``: log mu(a_t|x_t) and log pi(a_t|x_t).
    """
    if pg_form not in PG_FORMS:
        raise ValueError(f"vtrace: pg_form must be one of {PG_FORMS}, got {pg_form!r}")
    shape = rewards.shape
    if rewards.dim() != 2:
        raise ValueError(f"vtrace: expected [T, N] tensors, got {rewards.dim()} dims")
    for name, t in (("behaviour_logp", behaviour_logp), ("target_logp", target_logp), ("values", values),
                    ("next_values", next_values), ("terminated", terminated), ("truncated", truncated)):
        if t.shape != shape:
            raise ValueError(f"vtrace: {name} has shape {tuple(t.shape)}, rewards has {tuple(shape)}; all must be [T, N]")
    with torch.no_grad():
        ratio = torch.exp(target_logp - behaviour_logp).to(rewards.dtype)
        rho = ratio.clamp(max=rho_bar)
        c = lam * ratio.clamp(max=c_bar)
        not_terminated = 1.0 - terminated.to(rewards.dtype)
        not_done = 1.0 - (terminated | truncated).to(rewards.dtype)
        deltas = rho * (rewards + gamma * not_terminated * next_values - values)
        corrections = _recursion(deltas, gamma * c * not_done)  # vs_t - V(x_t)
        vs = values + corrections
        if pg_form == "gae":
            return vs, corrections
        # vs_{t+1} where the trace goes on; at a chunk's or an episode's end the bootstrap V(next obs) itself.
        later = torch.cat([corrections[1:], torch.zeros_like(corrections[:1])])
        vs_next = next_values + not_done * later
        return vs, rho * (rewards + gamma * not_terminated * vs_next - values)
