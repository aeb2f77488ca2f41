"""The epoch loop (``epochs.ppo_epochs``), tested once for every step implementation: the non-finite skip, KL early
stopping before the offending step, the means over applied minibatches, the shuffle's RNG use and the sync hook.

The loop's control flow is pinned with a scripted step (exact call order, exact means); the guards are then run
through both real steps, ``update.AutogradStep`` and ``fused_step.FusedStep``, on the same data.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.kernels.flat_adam import FlatAdam
from ppokit.kernels.fused_step import FusedStep
from ppokit.policies import ActorCritic
from ppokit.update.autograd import AutogradStep
from ppokit.update.epochs import (
    BATCH_FIELDS,
    STAT_NAMES,
    Batch,
    MinibatchResult,
    UpdateSettings,
    kl_stops,
    minibatch_sizes,
    ppo_epochs,
)

COUNTERS = ("minibatches", "skipped_minibatches", "epochs_run", "early_stopped")


def settings(**kw) -> UpdateSettings:
    base = dict(algo="ppo", update_epochs=1, num_minibatches=1, clip_coef=0.2, clip_vloss=False, norm_adv=True,
                ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None)
    base.update(kw)
    return UpdateSettings(**base)


# ------------------------------------------------------------------ the loop's control flow, on a scripted step
class ScriptedStep:
    """Returns the scripted (loss, approx_kl) of each minibatch in turn and records every call the loop makes."""

    def __init__(self, script: list[tuple[float, float]]):
        self.script = iter(script)
        self.calls: list[str] = []
        self.grad = torch.zeros(3)
        self.stat = torch.zeros(1)
        self.n = 0

    def update(self, batch, s):
        step = self

        class _Ctx:
            def __enter__(self):
                step.calls.append("enter")

            def __exit__(self, *exc):
                step.calls.append("exit")

        return _Ctx()

    def minibatches(self, perm, sizes):
        yield from torch.split(perm, sizes)

    def backward(self, mb):
        self.loss, self.kl = next(self.script)
        self.n += 1
        self.calls.append(f"backward{self.n}")

    def gradients(self):
        return [self.grad]

    def sync_stats(self):
        return [self.stat]

    def measure(self):
        self.calls.append("measure")
        stats = {name: float(self.n) for name in STAT_NAMES}  # minibatch k reports k for every statistic
        return MinibatchResult(loss=self.loss, grad_norm=1.0, approx_kl=self.kl, stats=stats)

    def apply(self, result):
        self.calls.append("apply")

    def discard(self):
        self.calls.append("discard")


def tiny_batch(B: int) -> Batch:
    z = torch.zeros(B)
    return Batch(torch.zeros(B, 2), torch.zeros(B, dtype=torch.long), z, z, z, z)


def test_nonfinite_minibatches_are_skipped_and_left_out_of_the_means():
    nan, inf = float("nan"), float("inf")
    step = ScriptedStep([(1.0, 0.0), (nan, 0.0), (1.0, inf), (1.0, 0.0)])
    out = ppo_epochs(tiny_batch(8), settings(num_minibatches=2, update_epochs=2), step)
    assert step.calls == ["enter", "backward1", "measure", "apply", "backward2", "measure", "discard",
                          "backward3", "measure", "discard", "backward4", "measure", "apply", "exit"]
    assert out["minibatches"] == 2.0 and out["skipped_minibatches"] == 2.0 and out["epochs_run"] == 2.0
    assert out["early_stopped"] == 0.0
    for name in STAT_NAMES:
        assert out[name] == (1 + 4) / 2, name  # minibatches 1 and 4 applied


def test_kl_stop_discards_the_offending_minibatch_and_drops_the_rest():
    # target 0.01 -> threshold 0.015: the third minibatch (of 4 per epoch, 3 epochs) stops the update.
    step = ScriptedStep([(1.0, 0.001), (1.0, 0.0149), (1.0, 0.0151)] + [(1.0, 0.0)] * 9)
    out = ppo_epochs(tiny_batch(8), settings(num_minibatches=4, update_epochs=3, target_kl=0.01), step)
    assert step.calls == ["enter", "backward1", "measure", "apply", "backward2", "measure", "apply",
                          "backward3", "measure", "discard", "exit"]
    assert out["early_stopped"] == 1.0 and out["epochs_run"] == 1.0 and out["minibatches"] == 2.0
    assert out["approx_kl"] == 1.5  # the mean of minibatches 1 and 2's stats, not 3's
    # A non-finite KL is a skip, never a stop.
    step = ScriptedStep([(1.0, float("nan")), (1.0, 0.0)])
    out = ppo_epochs(tiny_batch(4), settings(num_minibatches=2, target_kl=0.01), step)
    assert out["early_stopped"] == 0.0 and out["skipped_minibatches"] == 1.0 and out["minibatches"] == 1.0


def test_no_applied_minibatch_gives_nan_means_and_the_named_keys():
    step = ScriptedStep([(float("nan"), 0.0)] * 2)
    out = ppo_epochs(tiny_batch(4), settings(num_minibatches=2), step)
    assert tuple(out) == STAT_NAMES + COUNTERS
    assert all(math.isnan(out[name]) for name in STAT_NAMES)
    assert out["minibatches"] == 0.0 and out["skipped_minibatches"] == 2.0
    # No epoch asked for (ppo_epochs is callable with settings no config validated): nothing runs, and the
    # counters say so.
    step = ScriptedStep([])
    out = ppo_epochs(tiny_batch(4), settings(update_epochs=0), step)
    assert step.calls == ["enter", "exit"]
    assert out["epochs_run"] == 0.0 and out["minibatches"] == 0.0 and out["early_stopped"] == 0.0
    assert all(math.isnan(out[name]) for name in STAT_NAMES)


def test_sync_runs_between_the_backward_and_the_measurement_with_the_steps_tensors():
    step = ScriptedStep([(1.0, 0.0)] * 2)
    seen = []

    def sync(grads, stats):
        seen.append((grads, stats))
        step.calls.append("sync")

    ppo_epochs(tiny_batch(4), settings(num_minibatches=2), step, sync=sync)
    assert step.calls == ["enter", "backward1", "sync", "measure", "apply", "backward2", "sync", "measure", "apply",
                          "exit"]
    assert all(g[0] is step.grad and s[0] is step.stat for g, s in seen)


@pytest.mark.parametrize("B,parts,epochs", [(10, 3, 2), (7, 1, 3), (2, 4, 1)])
def test_one_permutation_per_epoch_and_tensor_split_chunks(B, parts, epochs):
    """The RNG stream is one randperm(B) per epoch run (also for one minibatch) and the chunks are tensor_split's,
    so a shuffle change would show up here before it shows up as a changed run."""
    g = torch.Generator().manual_seed(5)
    chunks: list[list[int]] = []

    class Recording(ScriptedStep):
        def minibatches(self, perm, sizes):
            for idx in super().minibatches(perm, sizes):
                chunks.append(idx.tolist())
                yield idx

    out = ppo_epochs(tiny_batch(B), settings(num_minibatches=parts, update_epochs=epochs),
                     Recording([(1.0, 0.0)] * 100), generator=g)
    ref = torch.Generator().manual_seed(5)
    want = [c.tolist() for _ in range(epochs) for c in torch.tensor_split(torch.randperm(B, generator=ref), parts)
            if c.numel()]
    assert chunks == want and out["minibatches"] == len(want)
    assert [len(c) for c in want[:len(minibatch_sizes(B, parts))]] == minibatch_sizes(B, parts)
    assert torch.equal(g.get_state(), ref.get_state())


def test_the_permutation_is_drawn_on_the_batchs_device():
    """A CUDA batch is indexed by a CUDA permutation (not the default device's). The "meta" device stands in for
    CUDA on a CPU-only machine: the minibatch indices must be meta tensors like the batch."""
    devices = []

    class Recording(ScriptedStep):
        def minibatches(self, perm, sizes):
            devices.append(perm.device)
            yield from super().minibatches(perm, sizes)

    z = torch.zeros(4, device="meta")
    batch = Batch(torch.zeros(4, 2, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"), z, z, z, z)
    out = ppo_epochs(batch, settings(num_minibatches=2, update_epochs=2), Recording([(1.0, 0.0)] * 4))
    assert devices == [torch.device("meta")] * 2 and out["minibatches"] == 4.0


# ------------------------------------------------------------------ the guards through both real steps
def make_policy(dtype) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(5, "discrete", [3], [16, 12], "tanh").to(dtype)


def make_batch(policy: ActorCritic, B: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    dtype = next(policy.parameters()).dtype
    obs = torch.randn(B, policy.obs_dim, generator=g, dtype=dtype)
    actions = torch.randint(0, policy.action_dims[0], (B,), generator=g)
    with torch.no_grad():
        logp, _, values = policy.evaluate(obs, actions)
    return Batch(obs, actions, logp, values, torch.randn(B, generator=g, dtype=dtype),
                 values + torch.randn(B, generator=g, dtype=dtype))


def make_step(kind: str, policy: ActorCritic, lr: float):
    if kind == "autograd":
        return AutogradStep(policy, torch.optim.Adam(policy.parameters(), lr=lr))
    return FusedStep(policy, FlatAdam(policy, lr=lr))


STEPS = ["autograd", "fused"]


def snapshot(policy):
    return [p.detach().clone() for p in policy.parameters()]


def unchanged(policy, before) -> bool:
    return all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))


@pytest.mark.parametrize("kind", STEPS)
def test_an_overflowing_ratio_skips_the_minibatch(kind):
    """logp_new - logp_old = 100 > 88 overflows r to Inf in float32; with A > 0 the clipped loss stays finite, but
    the step is not trustworthy: it is skipped and every parameter stays untouched."""
    policy = make_policy(torch.float32)
    batch = make_batch(policy, 16)
    batch.logp_old[5] -= 100.0
    batch.advantages = batch.advantages.abs() + 0.5
    before = snapshot(policy)
    out = ppo_epochs(batch, settings(norm_adv=False), make_step(kind, policy, 1e-2))
    assert out["skipped_minibatches"] == 1.0 and out["minibatches"] == 0.0
    assert unchanged(policy, before)


@pytest.mark.parametrize("kind", STEPS)
def test_a_nan_row_skips_its_minibatch_in_every_epoch_and_the_others_apply(kind):
    policy = make_policy(torch.float32)
    batch = make_batch(policy, 64)
    batch.returns[3] = float("nan")
    out = ppo_epochs(batch, settings(num_minibatches=4, update_epochs=3), make_step(kind, policy, 1e-3),
                     generator=torch.Generator().manual_seed(2))
    assert out["skipped_minibatches"] == 3.0 and out["minibatches"] == 9.0
    assert all(math.isfinite(out[name]) for name in STAT_NAMES)
    assert all(torch.isfinite(p).all() for p in policy.parameters())


@pytest.mark.parametrize("kind", STEPS)
@pytest.mark.parametrize("kl_over_target,stops", [(1.25, False), (1.75, True)])
def test_kl_early_stop_fires_above_1_5_target_before_the_step(kind, kl_over_target, stops):
    """Every logp_old is 0.1 below logp_new, so the first minibatch's approx KL (k3) is e^0.1 - 1.1 before any
    step. target_kl is set so that this KL is 1.25x or 1.75x the target: only the second stops (a factor of 1.0
    would stop both, 2.0 neither), and the stopping minibatch is not applied: nothing moves."""
    policy = make_policy(torch.float64)
    batch = make_batch(policy, 64)
    batch.logp_old = batch.logp_old - 0.1
    kl0 = math.expm1(0.1) - 0.1
    before = snapshot(policy)
    out = ppo_epochs(batch, settings(target_kl=kl0 / kl_over_target), make_step(kind, policy, 1e-3))
    assert out["early_stopped"] == float(stops)
    assert out["minibatches"] == (0.0 if stops else 1.0)
    assert unchanged(policy, before) == stops


@pytest.mark.parametrize("kind", STEPS)
def test_the_guards_and_the_step_read_what_sync_left(kind):
    """A sync hook's in-place writes are what the loop decides on and applies: NaN written into the statistics
    skips every minibatch; zeroed gradients are applied (and reported) as zero, so Adam leaves the weights."""
    policy = make_policy(torch.float32)
    batch = make_batch(policy, 32)
    before = snapshot(policy)

    def poison(grads, stats):
        for t in stats:
            t.fill_(float("nan"))

    out = ppo_epochs(batch, settings(num_minibatches=2), make_step(kind, policy, 1e-2), sync=poison)
    assert out["skipped_minibatches"] == 2.0 and out["minibatches"] == 0.0 and unchanged(policy, before)

    def zero_grads(grads, stats):
        assert grads and all(g.shape for g in grads)
        for g in grads:
            g.zero_()

    out = ppo_epochs(batch, settings(num_minibatches=2, update_epochs=2), make_step(kind, policy, 1e-2),
                     sync=zero_grads)
    assert out["minibatches"] == 4.0 and out["grad_norm"] == 0.0 and unchanged(policy, before)


@pytest.mark.parametrize("kind", STEPS)
def test_an_identity_sync_changes_nothing(kind):
    """An all-reduce over ranks that hold the same minibatch (mean of equal tensors) leaves the run as it was."""
    outs, params = [], []
    for sync in (None, lambda grads, stats: [t.copy_((t + t) / 2) for t in grads + stats]):
        policy = make_policy(torch.float32)
        outs.append(ppo_epochs(make_batch(policy, 48), settings(num_minibatches=3, update_epochs=2),
                               make_step(kind, policy, 1e-2), sync=sync, generator=torch.Generator().manual_seed(4)))
        params.append(snapshot(policy))
    assert outs[0] == outs[1]
    assert all(torch.equal(p, q) for p, q in zip(*params))


def test_kl_stops_only_strictly_above_1_5_target():
    # 0.5 * 1.5 = 0.75 exactly: a KL of exactly 1.5 x target is still allowed (SB3: approx_kl > 1.5 * target_kl),
    # the next float above it stops; no target never stops.
    assert not kl_stops(0.75, 0.5)
    assert kl_stops(math.nextafter(0.75, 1.0), 0.5)
    assert not kl_stops(1e30, None)


def test_the_optional_batch_fields_exist_exactly_when_the_run_has_them():
    # A run without action masks and with a stateless policy has neither field; a masked env's run has an
    # [n_logits] bool action mask, a stateful policy's run a per-step bool episode start.
    plain = {"obs": (4,), "action_shape": (), "action_dtype": torch.long}
    for dims in (plain, dict(plain, mask_dim=None, policy_state=None)):
        assert BATCH_FIELDS["action_mask"].layout(dims) is None
        assert BATCH_FIELDS["episode_start"].layout(dims) is None
    assert BATCH_FIELDS["action_mask"].layout(dict(plain, mask_dim=6)) == ((6,), torch.bool)
    stateful = dict(plain, policy_state={"h": ((8,), torch.float32)})
    assert BATCH_FIELDS["episode_start"].layout(stateful) == ((), torch.bool)
    assert BATCH_FIELDS["action_mask"].layout(stateful) is None
