"""The LM trainers on a real tiny GPT-2 (2 layers, 64 wide, a character tokenizer; one thread, a few iterations):
log-probs from generation equal the recomputed ones with left padding, the first minibatch's ratio is exactly 1,
pi_ref (and a LoRA policy's base weights) stay bit-identical, padded tokens have no influence on the loss or the
gradient, sampling ignores the model's generation config, one seed gives identical metrics, save -> resume
continues with identical metrics, a large kl_coef keeps the policy closer to pi_ref, and the run dir gets the
metrics."""

from __future__ import annotations

import copy
import csv
import math
import warnings

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

import torch  # noqa: E402

from ppokit.core import schema as S  # noqa: E402
from ppokit.lm import DPOTrainer, GRPOTrainer, LMConfig, PPOTrainer, RewardModelTrainer, SFTTrainer  # noqa: E402
from ppokit.lm.generation import HFGenerator, SamplingSettings  # noqa: E402
from ppokit.lm.logprobs import position_ids, response_mask, token_logprobs  # noqa: E402
from ppokit.lm.rollout import encode_prompts  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402

PROMPTS = ["X:", "AB:", "BXAX:", "A:"]
FAST = dict(learning_rate=3e-3, batch_prompts=2, group_size=4, max_new_tokens=6, update_epochs=2, num_minibatches=2)


def reward(prompts, completions):
    """The share of X's, with a length floor of 4 (so that it is not maximized by short answers)."""
    return [c.count("X") / max(len(c), 4) for c in completions]


@pytest.fixture(scope="module")
def base():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


@pytest.fixture
def model(base):
    return copy.deepcopy(base[0])


@pytest.fixture
def tok(base):
    return base[1]


def _core(metrics: dict) -> dict:
    """The metrics that must agree between two runs (timings differ)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _same(a: list[dict], b: list[dict]) -> bool:
    """Equal histories, value for value (bit for bit), NaN equal to NaN (e.g. GRPO's explained variance)."""
    def equal(x: float, y: float) -> bool:
        return x == y or (math.isnan(x) and math.isnan(y))

    return len(a) == len(b) and all(set(_core(x)) == set(_core(y)) and all(equal(x[k], y[k]) for k in _core(x))
                                    for x, y in zip(a, b))


# ---------------------------------------------------------------- log-probs and positions
def test_generation_logprobs_equal_recomputed_ones_with_left_padding_alone_and_in_a_batch(model, tok):
    torch.manual_seed(0)
    prompts = ["X:", "ABXBA:", "B:"]
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, tok.pad_token_id, torch.device("cpu"))
    assert (prompt_mask == 0).any()  # the batch really is left-padded
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, top_k=0, top_p=1.0,
                             temperature=0.7, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True)
    response = out.sequences[:, prompt_ids.shape[1]:]
    R = response.shape[1]
    mask = response_mask(response, tok.eos_token_id)
    gen_logp = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(
        -1, response.unsqueeze(-1)).squeeze(-1)
    ids = torch.cat([prompt_ids, response], 1)
    attn = torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        batch_logp, _ = token_logprobs(model, ids, attn, R, 0.7)
        assert (batch_logp - gen_logp)[mask].abs().max() < 1e-5
        for b in range(len(prompts)):  # each row alone, without any padding
            n = int(mask[b].sum())
            real = prompt_mask[b].bool()
            row = torch.cat([prompt_ids[b][real], response[b, :n]])[None]
            alone, _ = token_logprobs(model, row, torch.ones_like(row), n, 0.7)
            assert (alone[0] - gen_logp[b, :n]).abs().max() < 1e-5
        # Without position ids the left-padded row is measurably off: the test can tell.
        shifted = model(input_ids=ids, attention_mask=attn).logits[:, -(R + 1):-1]
        wrong = torch.log_softmax(shifted / 0.7, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        assert (wrong - gen_logp)[mask].abs().max() > 1e-3
        assert position_ids(attn)[1, 0] == 0


def test_sampling_ignores_the_models_generation_config_and_warns_once(model, tok):
    model.generation_config.top_k = 1  # greedy if it leaked through
    model.generation_config.repetition_penalty = 5.0
    prompt_ids, prompt_mask = encode_prompts(tok, ["X:"] * 32, tok.pad_token_id, torch.device("cpu"))
    gen = HFGenerator()
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="top_k=1.*repetition_penalty=5.0"):
        out = gen.generate(model, prompt_ids, prompt_mask, SamplingSettings(5, 1.0, tok.eos_token_id,
                                                                            tok.pad_token_id))
    assert len({tuple(r) for r in out.tolist()}) > 1  # sampled, not greedy
    assert model.generation_config.top_k == 1  # and restored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(model, prompt_ids, prompt_mask, SamplingSettings(5, 1.0, tok.eos_token_id, tok.pad_token_id))


# ---------------------------------------------------------------- the update
@pytest.mark.parametrize("cls", [PPOTrainer, GRPOTrainer])
def test_the_first_minibatch_ratio_is_exactly_one_and_pi_ref_stays_bit_identical(cls, model, tok):
    t = cls(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    ref_before = {k: v.clone() for k, v in t.ref_model.state_dict().items()}
    ratios = []
    loss_fn = t._loss

    def spy(mb, *share):
        if not ratios:
            with torch.no_grad():
                logp, _ = token_logprobs(t.policy, mb.input_ids, mb.attention_mask, mb.n_response,
                                         t.config.temperature)
            ratios.append(torch.exp(logp - mb.logp_old)[mb.response_mask])
        return loss_fn(mb, *share)

    t._loss = spy
    history = t.train(2)
    assert ratios[0].numel() > 0 and (ratios[0] == 1.0).all()
    assert history[-1][S.APPROX_KL] > 0  # the policy did move
    assert all(torch.equal(v, ref_before[k]) for k, v in t.ref_model.state_dict().items())
    assert any(not torch.equal(p, ref_before[n]) for n, p in t.policy.state_dict().items())


def test_padded_tokens_have_no_influence_on_the_loss_or_the_gradient(model, tok):
    t = PPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    s = t._sample(PROMPTS * 2, with_ref=True, value_fn=t._values)
    b = s.batch
    assert (~b.response_mask).any()
    b.advantages = torch.randn_like(b.logp_old)
    b.returns = torch.randn_like(b.logp_old)
    pad = ~b.response_mask
    other = copy.copy(b)
    # Garbage wherever the mask is 0: other tokens after the EOS, huge log-probs, advantages and values.
    resp = other.input_ids[:, -other.n_response:].clone()
    resp[pad] = tok.convert_tokens_to_ids("X")
    other.input_ids = torch.cat([other.input_ids[:, :-other.n_response], resp], 1)
    other.logp_old = torch.where(pad, 50.0, b.logp_old)
    other.advantages = torch.where(pad, 1e6, b.advantages)
    other.returns = torch.where(pad, -1e6, b.returns)
    other.values = torch.where(pad, 1e6, b.values)

    def loss_and_grads(batch):
        t.optimizer.zero_grad()
        loss, _ = t._loss(batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in t.trainable_parameters()]

    loss_a, grads_a = loss_and_grads(b)
    loss_b, grads_b = loss_and_grads(other)
    assert torch.isfinite(loss_b) and torch.allclose(loss_a, loss_b, atol=1e-6)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(grads_a, grads_b))


def test_kl_to_ref_is_smaller_with_a_large_kl_coef_than_with_none(base):
    def final_kl(kl_coef):
        model, tok = copy.deepcopy(base[0]), base[1]
        t = PPOTrainer(model, tok, reward=reward, prompts=PROMPTS,
                       config=LMConfig(**dict(FAST, learning_rate=1e-2), kl_coef=kl_coef))
        history = t.train(8)
        return sum(m[S.KL_REF] for m in history[-3:]) / 3

    free, anchored = final_kl(0.0), final_kl(2.0)
    assert anchored < free, (anchored, free)


# ---------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("cls", [PPOTrainer, GRPOTrainer])
def test_one_seed_gives_identical_metrics(cls, base):
    runs = []
    for _ in range(2):
        t = cls(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**FAST, seed=5))
        if not runs:  # evaluation draws from its own stream: training's numbers do not move
            assert t.evaluate(["X:"], 2) == t.evaluate(["X:"], 2)
            t.generate(["A:"])
        runs.append(t.train(2))
    assert _same(runs[0], runs[1])
    other = cls(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**FAST, seed=6))
    assert not _same(runs[0], other.train(2))


@pytest.mark.parametrize("cls", [PPOTrainer, GRPOTrainer])
def test_save_then_resume_continues_with_identical_metrics(cls, base, tmp_path):
    t = cls(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    t.train(2)
    t.save(tmp_path / "ckpt")
    expected = t.train(2)
    resumed = cls.resume(tmp_path / "ckpt", copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS)
    assert resumed.iteration == 2
    assert _same(resumed.train(2), expected)
    assert (tmp_path / "ckpt" / "policy" / "config.json").exists()
    assert (tmp_path / "ckpt" / "value_model.safetensors").exists() == (cls is PPOTrainer)
    if cls is PPOTrainer:  # the saved critic loads into a fresh default value model, no code run
        from safetensors.torch import load_model

        from ppokit.lm.ppo import default_value_model

        critic = default_value_model(copy.deepcopy(base[0]))
        load_model(critic, str(tmp_path / "ckpt" / "value_model.safetensors"))
        from ppokit.runtime.checkpoint import load_checkpoint

        saved = load_checkpoint(tmp_path / "ckpt" / "trainer_state.pt")["value_model"]
        assert all(torch.equal(v, saved[k]) for k, v in critic.state_dict().items())
    # A trained policy passed as the starting model would rebuild the wrong pi_ref: refused.
    with pytest.raises(ValueError, match="reference model differs"):
        cls.resume(tmp_path / "ckpt", t.policy, base[1], reward=reward, prompts=PROMPTS)


def test_dpo_raises_the_preference_accuracy_and_resumes_identically(base, tmp_path):
    pairs = [(p, "XXXX", "ABAB") for p in PROMPTS] + [(p, "XAXX", "BBAA") for p in PROMPTS]
    cfg = LMConfig(learning_rate=3e-3, batch_prompts=4, beta=0.5)
    d = DPOTrainer(copy.deepcopy(base[0]), base[1], pairs=pairs, config=cfg)
    before = d.preference_accuracy(pairs)
    d.train(3)
    d.save(tmp_path / "dpo")
    expected = d.train(5)
    assert d.preference_accuracy(pairs) == 1.0 and before < 1.0
    assert expected[-1][S.DPO_REWARD_MARGIN] > 0 and expected[-1][S.DPO_PREF_ACCURACY] == 1.0
    assert d.preference_accuracy(pairs, implicit=True) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(d.ref_model.parameters(), base[0].parameters()))
    resumed = DPOTrainer.resume(tmp_path / "dpo", copy.deepcopy(base[0]), base[1], pairs=pairs)
    assert _same(resumed.train(5), expected)


# ---------------------------------------------------------------- options
def test_grpo_refuses_groups_of_one(model, tok):
    from ppokit.lm.config import ConfigError

    with pytest.raises(ConfigError, match="group_size"):
        GRPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**dict(FAST, group_size=1)))


def test_grpo_with_beta_zero_loads_no_reference_and_logs_zero_std_groups(model, tok):
    t = GRPOTrainer(model, tok, reward=lambda p, c: [1.0] * len(c), prompts=PROMPTS,
                    config=LMConfig(**FAST, beta=0.0))
    assert t.ref_model is None and not t.has_reference
    m = t.step()
    # Every group has equal rewards: every advantage is 0, so the policy gets no gradient at all.
    assert m[S.FRAC_REWARD_ZERO_STD] == 1.0 and m[S.POLICY_LOSS] == 0.0 and m[S.GRAD_NORM] == 0.0
    t.train(int(S.THRESHOLDS["reward_patience"]) - 1)
    # The live alerts: groups with no reward variance (and, from the core monitor, a policy that does not move).
    assert {a["name"] for a in t.alerts} == {"zero_reward_variance", "clip_never_fires"}


def test_offload_and_gradient_checkpointing_compute_the_same_run(base):
    plain = PPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    opts = PPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS,
                      config=LMConfig(**FAST, offload_rollout=True, gradient_checkpointing=True))
    assert getattr(opts.policy, "is_activation_checkpointing", None) or opts.policy.is_gradient_checkpointing
    a, b = plain.train(2), opts.train(2)
    for x, y in zip(a, b):
        for k in _core(x):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6, nan_ok=True), k


@pytest.mark.parametrize("cls", [GRPOTrainer, PPOTrainer])
def test_a_lora_policy_uses_its_base_as_pi_ref_and_keeps_the_base_weights(cls, base):
    peft = pytest.importorskip("peft", reason="needs pip install -e '.[lora]'")
    model = peft.get_peft_model(copy.deepcopy(base[0]),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                init_lora_weights=False))
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    t = cls(model, base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    assert t.ref_model is None and t.has_reference  # no second copy of the weights
    ids, attn = encode_prompts(base[1], ["XA:"], base[1].pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ref = t.ref_logprobs(ids, attn, 2)
        plain, _ = token_logprobs(base[0], ids, attn, 2, 1.0)
    assert torch.allclose(ref, plain, atol=1e-6)  # pi_ref is the base model
    history = t.train(2)
    assert history[-1][S.KL_REF] != 0.0
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_run_dir_gets_the_metrics_csv_and_the_alerts(model, tok, tmp_path):
    t = GRPOTrainer(model, tok, reward=reward, prompts=PROMPTS,
                    config=LMConfig(**FAST, tensorboard=False, console=False), run_dir=tmp_path / "run")
    t.train(2)
    t.close()
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert len(rows) == 2 and float(rows[-1][S.UPDATE]) == 2.0 and S.FRAC_REWARD_ZERO_STD in rows[0]
    assert int(rows[-1]["global_step"]) == 2 * FAST["batch_prompts"] * FAST["group_size"]
    assert (tmp_path / "run" / "lm_run.json").exists()


def test_every_lm_metric_name_is_logged_by_some_trainer(base):
    logged = set()
    for cls in (PPOTrainer, GRPOTrainer):
        logged |= set(cls(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS,
                          config=LMConfig(**FAST)).step())
    logged |= set(DPOTrainer(copy.deepcopy(base[0]), base[1], pairs=[("X:", "X", "A")],
                             config=LMConfig(batch_prompts=1)).step())
    logged |= set(SFTTrainer(copy.deepcopy(base[0]), base[1], [{"prompt": "X:", "completion": "X"}],
                             config=LMConfig(batch_prompts=1)).step())
    logged |= set(RewardModelTrainer(copy.deepcopy(base[0]), base[1], [("X:", "X", "A"), ("A:", "X", "A")],
                                     config=LMConfig(batch_prompts=1)).step())
    assert set(S.LM_METRICS) <= logged
    assert {n for n in logged if not n.startswith("perf/")} <= set(S.METRICS)


class Scripted:
    """A ``Generator`` backend returning fixed responses: the learner works with any backend."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, model, prompt_ids, prompt_mask, settings):
        return torch.tensor(self.responses, dtype=torch.long).reshape(prompt_ids.shape[0], -1)


@pytest.mark.parametrize("cls", [PPOTrainer, GRPOTrainer])
def test_a_scripted_backend_with_an_immediate_eos_or_an_empty_response_trains(cls, model, tok):
    eos, x = tok.eos_token_id, tok.convert_tokens_to_ids("X")
    cfg = LMConfig(**dict(FAST, batch_prompts=1, group_size=4))
    t = cls(model, tok, reward=reward, prompts=PROMPTS, config=cfg)
    t.backend = Scripted([[eos, eos, eos], [x, eos, eos], [x, x, x], [x, x, eos]])
    m = t.step()
    assert m[S.EOS_FRAC] == 0.75 and m[S.RESPONSE_LENGTH] == (1 + 2 + 3 + 3) / 4
    assert all(v == v for k, v in m.items() if k in (S.POLICY_LOSS, S.APPROX_KL, S.GRAD_NORM))
    t.backend = Scripted([[]] * 4)  # no response token at all
    m = t.step()
    assert m[S.RESPONSE_LENGTH] == 0 and m[S.SKIPPED_MINIBATCHES] == 0 and m[S.POLICY_LOSS] == 0


def test_kl_early_stopping_and_the_non_finite_skip_are_the_epoch_loops(model, tok):
    t = GRPOTrainer(model, tok, reward=reward, prompts=PROMPTS,
                    config=LMConfig(**dict(FAST, learning_rate=3e-2, update_epochs=4), target_kl=1e-6))
    m = t.step()
    assert m[S.EARLY_STOPPED] == 1.0 and m[S.EPOCHS_RUN] < 4
    before = [p.clone() for p in t.trainable_parameters()]
    loss_fn = t._loss

    def nan_loss(mb, *share):
        loss, stats = loss_fn(mb, *share)
        return loss * float("nan"), stats

    t._loss = nan_loss
    m = t.step()
    assert m[S.SKIPPED_MINIBATCHES] == FAST["num_minibatches"] * 4 and m[S.MINIBATCHES] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, t.trainable_parameters()))


def test_the_adaptive_kl_controller_moves_kl_coef(model, tok):
    from ppokit.lm.ppo import adaptive_kl_coef

    t = PPOTrainer(model, tok, reward=reward, prompts=PROMPTS,
                   config=LMConfig(**FAST, adaptive_kl=True, kl_target=1e-3, kl_horizon=100))
    history = t.train(3)
    n = FAST["batch_prompts"] * FAST["group_size"]
    assert history[0][S.KL_COEF] == 0.05 and history[0][S.KL_REF] == 0.0  # pi == pi_ref at the start
    assert history[1][S.KL_COEF] == pytest.approx(0.05 * (1 - 0.2 * n / 100))  # below target: lowered by 20% x n/H
    for a, b in zip(history, history[1:]):
        assert b[S.KL_COEF] == pytest.approx(adaptive_kl_coef(a[S.KL_COEF], a[S.KL_REF], 1e-3, n, 100))


@pytest.mark.allow_skip
@pytest.mark.parametrize("offload", [False, True])
def test_a_cuda_run_trains_and_resumes_where_a_gpu_exists(offload, base, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = LMConfig(**FAST, device="cuda", offload_rollout=offload)
    for cls in (PPOTrainer, GRPOTrainer):
        t = cls(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=cfg)
        assert next(t.policy.parameters()).is_cuda
        t.train(1)
        t.save(tmp_path / cls.algo)
        expected = t.train(1)
        resumed = cls.resume(tmp_path / cls.algo, copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS)
        got = resumed.train(1)
        for k in _core(expected[0]):
            assert got[0][k] == pytest.approx(expected[0][k], rel=1e-4, abs=1e-6, nan_ok=True), k


def test_the_default_value_model_is_a_separate_trunk_copy_with_a_zero_head(model, tok):
    t = PPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    trunk = t.value_model.trunk
    assert type(trunk) is type(model.base_model) and trunk is not model.base_model
    assert not any(a.data_ptr() == b.data_ptr() for a in trunk.parameters() for b in model.parameters())
    s = t._sample(PROMPTS, with_ref=True, value_fn=t._values)
    assert torch.equal(s.batch.values, torch.zeros_like(s.batch.values))  # zero head: V = 0 everywhere at first
    t.train(1)
    assert t.value_model.head.weight.abs().sum() > 0  # the critic learns


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_at_ratio_one_the_grpo_loss_is_minus_the_reduced_advantage(mode, model, tok):
    # First minibatch: pi_theta == pi_old == pi_ref, so the ratio is 1, the k3 KL is 0 and the loss is -A reduced by
    # the mode (each completion's advantage on each of its n_b real tokens; L = max_new_tokens for the sum norm).
    t = GRPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**FAST, loss_reduction=mode))
    seen = []
    loss_fn = t._loss

    def spy(mb, *share):
        loss, stats = loss_fn(mb, *share)
        if not seen:
            seen.append((float(loss), mb.advantages[:, 0].clone(), mb.response_mask.sum(-1).float()))
        return loss, stats

    t._loss = spy
    t.step()
    loss, adv, n = seen[0]
    expected = {"token_mean": -(adv * n).sum() / n.sum(), "seq_mean_token_mean": -adv.mean(),
                "seq_mean_token_sum_norm": -(adv * n / FAST["max_new_tokens"]).mean()}[mode]
    assert adv.abs().sum() > 0 and loss == pytest.approx(float(expected), abs=1e-6)


def test_values_are_read_at_the_prefix_before_each_response_token(model, tok):
    from ppokit.lm.ppo import response_values

    t = PPOTrainer(model, tok, reward=reward, prompts=PROMPTS, config=LMConfig(**FAST))
    torch.nn.init.normal_(t.value_model.head.weight)  # non-zero values
    ids, attn = encode_prompts(tok, ["XA:", "B:"], tok.pad_token_id, torch.device("cpu"))
    P, R = ids.shape[1], 3
    full_ids = torch.cat([ids, torch.full((2, R), tok.convert_tokens_to_ids("X"))], 1)
    full_attn = torch.cat([attn, torch.ones(2, R, dtype=attn.dtype)], 1)
    with torch.no_grad():
        per_position = t.value_model(full_ids, full_attn)  # [B, P + R]
        lengths = []
        handle = t.value_model.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
        values = response_values(t.value_model, full_ids, full_attn, R)
        handle.remove()
    assert lengths == [P + R - 1]
    # V(s_0) is the value after the last prompt token (column P - 1), V(s_t) after response token t - 1. The critic
    # runs on [:, :-1] (the last column is never read), so the match with the full forward is to rounding only;
    # the neighbouring columns differ by whole units here.
    assert torch.allclose(values, per_position[:, P - 1:P + R - 1], atol=1e-5)
    assert not torch.allclose(values, per_position[:, P:P + R], atol=1e-2)
