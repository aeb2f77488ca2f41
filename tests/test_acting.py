"""The acting kernel on its own (``acting.ActingKernel`` without ``FlatAdam``): it follows a policy trained by a
plain ``torch.optim`` optimizer, so acting does not depend on the fused update. The kernel's agreement with
``ActorCritic.act`` under ``FlatAdam`` is in ``tests/test_fused.py``."""

from __future__ import annotations

import pytest
import torch

from ppokit.kernels.acting import ActingKernel
from ppokit.policies import ActorCritic
from ppokit.update.autograd import UpdateSettings, ppo_update
from ppokit.update.epochs import Batch


@pytest.mark.parametrize("kind", ["discrete", "continuous"])
def test_standalone_kernel_follows_an_autograd_trained_policy(kind):
    torch.manual_seed(0)
    policy = ActorCritic(5, kind, [3] if kind == "discrete" else [2], [16, 12], "tanh").to(torch.float64)
    kernel = ActingKernel(policy)
    obs = torch.randn(9, 5, dtype=torch.float64)

    def same_as_policy():
        out = []
        for fn in (policy.act, kernel.act):
            torch.manual_seed(3)
            with torch.inference_mode():
                out.append(fn(obs, None, None)[:3])
        (a_ref, lp_ref, v_ref), (a, lp, v) = out
        torch.testing.assert_close(a, a_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)
        return v

    v0 = same_as_policy()  # builds and caches the acting weights
    with torch.no_grad():
        actions, logp, values, _ = policy.act(obs, None, None)
    batch = Batch(obs, actions, logp, values, torch.randn(9, dtype=torch.float64), values + 1.0)
    s = UpdateSettings("ppo", 2, 1, 0.2, False, True, 0.0, 0.5, 0.5, None)
    ppo_update(policy, torch.optim.Adam(policy.parameters(), lr=1e-2), batch, s)
    v1 = same_as_policy()  # Adam's in-place steps bump the parameters' version counters: weights rebuilt
    assert not torch.equal(v0, v1)


def test_unsupported_policy_is_refused_with_the_reason():
    policy = ActorCritic(4, "multidiscrete", [2, 3], [8], "tanh")
    with pytest.raises(ValueError, match="acting kernel does not support this policy: .*multidiscrete"):
        ActingKernel(policy)
