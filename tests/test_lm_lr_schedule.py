"""Learning-rate schedules with warmup (``LMConfig.lr_scheduler``, ``warmup_steps``): the LR of each step equals
transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``, it is logged, and a resumed run continues
the schedule."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.config.ppo_config import ConfigError  # noqa: E402
from ppokit.core import schema as S  # noqa: E402
from ppokit.lm import GRPOTrainer, LMConfig, SFTTrainer  # noqa: E402
from ppokit.lm.lr_schedule import LR_SCHEDULERS, lr_factor  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402

DATA = [{"prompt": "A:", "completion": "AB"}, {"prompt": "B:", "completion": "BA"}, {"prompt": "AB:", "completion": "B"}]
LR = 1e-3


def _transformers_lrs(kind: str, warmup: int, total: int, steps: int) -> list[float]:
    """The LR transformers' scheduler gives at each of ``steps`` optimizer steps (base LR ``LR``)."""
    import transformers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    make = {"constant": lambda: transformers.get_constant_schedule_with_warmup(opt, warmup),
            "linear": lambda: transformers.get_linear_schedule_with_warmup(opt, warmup, total),
            "cosine": lambda: transformers.get_cosine_schedule_with_warmup(opt, warmup, total)}[kind]
    sched = make()
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", LR_SCHEDULERS)
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 5), (2, 1)])
def test_the_factor_is_transformers_schedule_step_by_step(kind, warmup, total):
    want = _transformers_lrs(kind, warmup, total, total + 3)  # past the end too
    got = [LR * lr_factor(kind, k, warmup, total) for k in range(total + 3)]
    assert got == pytest.approx(want, abs=1e-15)


@pytest.fixture(scope="module")
def base():
    return build_tiny("AB:", seed=0)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_sft_logs_transformers_learning_rate_at_every_step(base, kind):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, learning_rate=LR, lr_scheduler=kind, warmup_steps=2)
    t = SFTTrainer(copy.deepcopy(model), tok, data=DATA, config=cfg)
    history = t.train(7)
    assert [m[S.LEARNING_RATE] for m in history] == pytest.approx(_transformers_lrs(kind, 2, 7, 7), abs=1e-15)


def test_grpo_minibatch_steps_share_the_iteration_learning_rate(base):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=3, learning_rate=LR, beta=0.0,
                   lr_scheduler="linear", warmup_steps=1, schedule_iterations=4)
    t = GRPOTrainer(copy.deepcopy(model), tok, reward=lambda p, c: [float(len(x)) for x in c], prompts=["A:"],
                    config=cfg)
    seen = []
    original = t.optimizer.step

    def spy(*args, **kwargs):
        seen.append((t.iteration, t.optimizer.param_groups[0]["lr"]))
        return original(*args, **kwargs)

    t.optimizer.step = spy
    history = [t.step() for _ in range(4)]  # schedule_iterations: no train() needed
    want = _transformers_lrs("linear", 1, 4, 4)
    assert [m[S.LEARNING_RATE] for m in history] == pytest.approx(want, abs=1e-15)
    assert all(lr == pytest.approx(want[k], abs=1e-15) for k, lr in seen) and len(seen) > 4


def test_a_resumed_run_continues_the_schedule(base, tmp_path):
    model, tok = base
    cfg = LMConfig(batch_prompts=2, learning_rate=LR, lr_scheduler="cosine", warmup_steps=1, save_every=1)
    straight = SFTTrainer(copy.deepcopy(model), tok, data=DATA, config=cfg).train(6)
    # A run of 6 iterations killed after its 3rd checkpoint: its horizon is the 6 of its train(6) call.
    stopped = SFTTrainer(copy.deepcopy(model), tok, data=DATA, config=cfg, run_dir=tmp_path / "stopped")
    stopped._lr_horizon = 6
    part1 = stopped.train(3)
    stopped.close()
    back = SFTTrainer.resume(tmp_path / "stopped", copy.deepcopy(model), tok, data=DATA)
    assert back._lr_horizon == 6
    part2 = back.train(2)  # fewer than planned: the horizon stays the checkpoint's, not 3 + 2
    back.close()
    lrs = [m[S.LEARNING_RATE] for m in part1 + part2]
    assert lrs == pytest.approx([m[S.LEARNING_RATE] for m in straight[:5]], abs=1e-15)
    assert lrs == pytest.approx(_transformers_lrs("cosine", 1, 6, 5), abs=1e-15)


def test_a_decaying_schedule_without_a_horizon_and_bad_values_are_refused(base):
    model, tok = base
    t = SFTTrainer(copy.deepcopy(model), tok, data=DATA, config=LMConfig(batch_prompts=2, lr_scheduler="linear"))
    with pytest.raises(ValueError, match="schedule_iterations"):
        t.step()
    for field, value in [("lr_scheduler", "step"), ("warmup_steps", -1), ("schedule_iterations", 0)]:
        with pytest.raises(ConfigError, match=field):
            LMConfig(**{field: value}).validate()
