"""The metric schema: every name the trainer logs and every threshold, defined once.

The trainer writes these names, the monitor and the doctor judge them with these thresholds, and the plots,
the report, the experiments, the planner and the console read them from here, so a live alert and
``ppokit doctor`` cannot disagree about what a column means or where "too large" starts.

Namespaces (CleanRL/TRL's convention): ``charts/`` what the run achieves, ``losses/`` the signed terms that get
summed, ``diag/`` the health diagnostics (means over every minibatch of the update), ``perf/`` timings (the
only columns that differ between two runs of one seed).

Thresholds are the standard PPO debugging bands (docs/diagnostics.md, "Live alerts"): approx KL should stay in
[0, 0.02] and an update past 0.1 has left the trust region; the clip fraction is healthy at 0.1-0.3, ~0 means
the clip never fires, sustained above 0.4 means over-fitting the rollout (drift); explained variance should
climb towards 1; KL early stopping fires at 1.5 x target_kl.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Metric", "METRICS", "LM_METRICS", "STALE_SOURCE_METRICS", "ATARI_METRICS", "THRESHOLDS", "perf_time", "perf_frac", "reward_term", "KL_WARN", "KL_ALERT", "CLIPFRAC_HEALTHY",
           "CLIPFRAC_HIGH", "CLIPFRAC_NEVER_FIRES", "KL_NEGLIGIBLE", "KL_STOP_FACTOR", "EV_MIN"]


@dataclass(frozen=True)
class Metric:
    """One logged column: its name, what it means, and what a healthy run shows."""

    name: str
    meaning: str
    good: str = ""


METRICS: dict[str, Metric] = {}


def _metric(name: str, meaning: str, good: str = "") -> str:
    METRICS[name] = Metric(name, meaning, good)
    return name


# ---------------------------------------------------------------- thresholds (docs/diagnostics.md lists them)
KL_WARN = 0.02  # mean approx KL above this: the update moves pi_theta far from pi_old (the standard KL band [0, 0.02])
KL_ALERT = 0.1  # above this the trust region is blown (the fix: lower K or the learning rate)
KL_STOP_FACTOR = 1.5  # KL early stop: the epochs end once approx KL > 1.5 * target_kl (SB3's margin)
# Decoupled actors (rollout/actors.py): above this fraction of dropped chunks the actors' work is largely wasted.
DROPPED_CHUNKS_WARN = 0.1
KL_NEGLIGIBLE = 1e-6  # approx KL below this: pi_theta is pi_old to ~0.1% per action, the policy does not move
CLIPFRAC_HEALTHY = (0.1, 0.3)  # the usual healthy band of the clip fraction
CLIPFRAC_HIGH = 0.4  # sustained above this: over-fitting the rollout (drift)
CLIPFRAC_NEVER_FIRES = 1e-3  # clip fraction below this: the clip never fires
EV_MIN = 0.0  # explained variance never above this: the critic predicts no better than a constant

# The live monitor's table (its keys are what ``Monitor(thresholds=...)`` accepts) and the doctor's thresholds.
THRESHOLDS: dict[str, float] = {
    "kl_warn": KL_WARN,
    "kl_alert": KL_ALERT,
    "clipfrac_low": CLIPFRAC_NEVER_FIRES,  # clip never fires (with kl_negligible)
    "kl_negligible": KL_NEGLIGIBLE,  # ... and the policy does not move
    "clipfrac_high": CLIPFRAC_HIGH,
    "clipfrac_patience": 5,  # updates a clip-fraction condition must persist
    "lr_tail_frac": 0.1,  # an annealed LR below this fraction of its start: a ~0 clip fraction is expected
    "ev_patience": 20,  # updates after which explained variance must have risen above ev_min
    "ev_min": EV_MIN,
    "entropy_collapse_frac": 0.05,  # discrete: entropy below this fraction of its first value
    "entropy_collapse_nats_per_dim": 2.5,  # continuous: drop from the first value, per action dimension
    "reward_patience": 5,  # updates a zero-reward condition must persist
    # policy_lag_growing: the mean diag/policy_lag of the last lag_window / 2 updates exceeds the mean of the
    # lag_window / 2 before by more than lag_growth versions.
    # K actors ahead of a keeping-up learner hold a steady lag of about K - 1; a learner falling behind grows it.
    "lag_window": 10,
    "lag_growth": 4.0,
}
LR_ZERO = 1e-10  # a learning rate at or below this cannot move the weights
GRAD_ZERO = 1e-6  # median gradient norm below this: no gradient reaches the weights
ADV_CONST = 1e-8  # advantage std below this: every advantage is the same
# Language models: KL(pi_theta || pi_ref) per sequence, nats. InstructGPT-style runs keep it at a few nats
# (Ziegler et al. 2019 target 6 with their adaptive controller; ppokit's kl_target default is the same); past 10
# nats per sequence the policy is no longer "the SFT model, sharpened".
KL_REF_RUNAWAY = 10.0
ZERO_STD_FRAC = 0.5  # GRPO: half the groups or more with equal rewards (no advantage signal in them)
KL_BLOWUP_MIN_UPDATES = 2  # KL > kl_alert on at least this many updates (or 5%) is a blow-up over a whole run
ENTROPY_PINNED = 0.02  # entropy within 2% of its start (relative to the start) all run: the policy never moved
# Below this many updates (Gymnasium) or iterations (LM) the doctor gives no verdict ("too short to judge"): the
# trend compares a start window with the last quarter, which needs two or more values per quarter to be apart
# from the start, and the live rules' patience (``reward_patience``, ``clipfrac_patience``) is 5 updates.
MIN_UPDATES_TO_JUDGE = 8
ENT_COEF_DOMINANT = 0.1  # an entropy bonus this large (typical 0-0.01) can pin the entropy at its start

# ---------------------------------------------------------------- metric names
UPDATE = _metric("update", "update number, 1-based")
GLOBAL_STEP = _metric("global_step", "environment steps so far (all envs)")

EPISODIC_RETURN = _metric("charts/episodic_return", "mean raw return of the episodes that finished in the update "
                          "(NaN: none finished)", "rises towards the task's threshold")
EPISODIC_LENGTH = _metric("charts/episodic_length", "mean length of the episodes that finished in the update")
EPISODES = _metric("charts/episodes", "episodes that finished in the update")
# Logged only where the episodes are whole games (Atari; tests/test_atari.py checks it is).
LIFE_RETURN = _metric("charts/life_return", "Atari only: mean clipped return (reward signs) of the training episodes "
                      "that finished in the update, one life each; charts/episodic_return and episodic_length are "
                      "there the whole games' unclipped score and length (CleanRL's figures)")
ATARI_METRICS = (LIFE_RETURN,)
LEARNING_RATE = _metric("charts/learning_rate", "the update's learning rate (annealed or constant)", "> 0")
CLIP_COEF = _metric("charts/clip_coef", "the update's clip range eps", "0.1-0.3, typical 0.2")
KL_BETA = _metric("charts/kl_beta", "the KL penalty's coefficient beta (ppo-kl's adaptive rule)")
EVAL_RETURN = _metric("charts/eval_return", "mean return of the evaluation gate, greedy or sampled by eval_deterministic "
                      "(NaN between gates)")

POLICY_LOSS = _metric("losses/policy_loss", "signed clipped-surrogate term (minimized)", "finite")
VALUE_LOSS = _metric("losses/value_loss", "signed value-function term", "finite")
ENTROPY_LOSS = _metric("losses/entropy_loss", "signed entropy term, -entropy", "finite")

ENTROPY = _metric("diag/entropy", "mean policy entropy (nats)", "decreases slowly while the return rises")
APPROX_KL = _metric("diag/approx_kl", "k3 approx KL(pi_old || pi_theta), mean over minibatches before each step",
                    f"0 - {KL_WARN}; above {KL_ALERT} the trust region is blown")
APPROX_KL_K1 = _metric("diag/approx_kl_k1", "k1 approx KL, mean(logp_old - logp_new)")
APPROX_KL_AFTER = _metric("diag/approx_kl_after", "k3 approx KL of pi_theta after the update vs pi_old, whole batch")
CLIPFRAC = _metric("diag/clipfrac", "fraction of samples whose ratio left [1 - eps, 1 + eps]",
                   f"{CLIPFRAC_HEALTHY[0]} - {CLIPFRAC_HEALTHY[1]}; sustained > {CLIPFRAC_HIGH}: drift")
EXPLAINED_VARIANCE = _metric("diag/explained_variance", "1 - Var(returns - values) / Var(returns)",
                             "climbs towards 1 as the critic learns")
GRAD_NORM = _metric("diag/grad_norm", "global gradient norm before clipping, mean over minibatches", "finite, > 0")
EPOCHS_RUN = _metric("diag/epochs_run", "epochs the update ran (fewer when KL early stopping fired)")
EARLY_STOPPED = _metric("diag/early_stopped", "1 when KL early stopping ended the update's epochs")
MINIBATCHES = _metric("diag/minibatches", "minibatch steps taken")
SKIPPED_MINIBATCHES = _metric("diag/skipped_minibatches", "minibatches skipped for a non-finite loss or gradient",
                              "0")
NONFINITE_ENV = _metric("diag/nonfinite_env", "env steps with NaN/Inf observations or rewards (dropped)", "0")
ADVANTAGES_NONFINITE = _metric("diag/advantages_nonfinite", "NaN/Inf advantages", "0")
REWARD_STD = _metric("diag/reward_std", "std of the rollout's raw per-step rewards (0 for CartPole's constant +1)")
POLICY_LAG = _metric("diag/policy_lag", "the learner's policy version (updates so far) minus the oldest version that "
                     "acted in the update's batch (in process it is 0, and not logged)",
                     "small and steady; growing: the actors fall behind the learner")
POLICY_LAG_MEAN = _metric("diag/policy_lag_mean", "the learner's policy version minus the mean version that acted "
                          "in the update's batch", "small and steady")
DROPPED_CHUNKS_FRAC = _metric("diag/dropped_chunks_frac", "fraction of the actors' chunks dropped so far in the run "
                              "(older than max_policy_lag versions)", f"0; above {DROPPED_CHUNKS_WARN}: the "
                              "learner is too slow for its actors (fewer actors, or a larger max_policy_lag)")
ACTOR_REPLACEMENTS = _metric("diag/actor_replacements", "rollout workers that died and were replaced so far", "0")
# Logged only with a rollout source whose actors may act with older weights (``rollout.source``, ``stale``).
STALE_SOURCE_METRICS: list[str] = [POLICY_LAG, POLICY_LAG_MEAN, DROPPED_CHUNKS_FRAC, ACTOR_REPLACEMENTS]
ADVANTAGE_STD = _metric("diag/advantage_std", "std of the batch's advantages before normalization", "> 0")

SPS = _metric("perf/sps", "environment steps per second since the run (or resume) started")
# The phases of the Gymnasium loop whose seconds are logged as perf/time_<phase> and perf/frac_<phase>.
PERF_PHASES = ("env", "inference", "advantages", "update", "logging")


def perf_time(phase: str) -> str:
    """``perf/time_<phase>``: seconds spent in a loop phase so far."""
    return f"perf/time_{phase}"


def perf_frac(phase: str) -> str:
    """``perf/frac_<phase>``: that phase's share of the time so far."""
    return f"perf/frac_{phase}"

# ---------------------------------------------------------------- language models (ppokit.lm)
# The LM trainers (PPO-RLHF, GRPO, DPO) log the shared names above where the quantity is the same one along the
# token axis (losses/*, diag/approx_kl (k3 to pi_old, mean over response tokens), diag/approx_kl_k1, diag/clipfrac,
# diag/entropy, diag/explained_variance, diag/grad_norm, diag/epochs_run, diag/early_stopped, diag/minibatches,
# diag/skipped_minibatches, diag/advantage_std, charts/learning_rate) and these for what only a LM run has. Their
# global_step is the number of completions sampled so far; ``update`` is the iteration. ``LM_METRICS`` lists the
# names only a LM run logs (the Gymnasium trainer logs every other name of ``METRICS``).
LM_METRICS: list[str] = []


def _lm_metric(name: str, meaning: str, good: str = "") -> str:
    LM_METRICS.append(name)
    return _metric(name, meaning, good)


def reward_term(name: str) -> str:
    """``lm/reward/<name>``: mean unweighted value of one term of a weighted reward (a function or a reward model,
    ``--reward`` / ``--reward-model`` given several times), logged beside lm/reward_mean (the weighted sum)."""
    return f"lm/reward/{name}"


SCORE_MEAN = _lm_metric("charts/score_mean", "mean score of the iteration's completions (the reward, minus "
                     "missing_eos_penalty where no EOS was emitted)", "rises")
SCORE_STD = _lm_metric("charts/score_std", "std of the completions' scores", "> 0 (0: nothing to rank)")
LM_REWARD_MEAN = _lm_metric("lm/reward_mean", "mean reward of the completions before the missing-EOS penalty")
KL_REF = _lm_metric("lm/kl_ref", "KL(pi || pi_ref) per sequence: sum over response tokens of log pi_old - log pi_ref "
                 "(k1), mean over the completions", "grows slowly; running away while the score rises: reward "
                 "hacking")
KL_REF_TOKEN = _lm_metric("lm/kl_ref_token", "GRPO: the loss's k3 KL(pi_theta || pi_ref) per response token, mean "
                       "over the applied minibatches")
KL_COEF = _lm_metric("lm/kl_coef", "PPO: coefficient of the per-token KL penalty (moves with adaptive_kl)")
RESPONSE_LENGTH = _lm_metric("lm/response_length", "mean completion length in tokens (the EOS counted)",
                          "stable; collapsing towards 1 or pinned at max_new_tokens is a failure")
EOS_FRAC = _lm_metric("lm/eos_frac", "fraction of completions that emitted the EOS token", "near 1")
DISTINCT_FRAC = _lm_metric("lm/distinct_frac", "distinct completions / completions in the iteration",
                        "falling towards 1/B: the responses collapse to one answer")
FRAC_REWARD_ZERO_STD = _lm_metric("lm/frac_reward_zero_std", "GRPO: fraction of prompt groups whose G rewards are all "
                               "equal (their advantages, hence their policy gradient, are exactly 0; trl#3857)",
                               "well below 1; 1 means 'loss 0' and no learning")
RESAMPLE_ROUNDS = _lm_metric("lm/resample_rounds", "GRPO dynamic sampling: extra generation rounds this iteration "
                            "took to fill the batch with groups whose rewards differ (max_resample_rounds bounds it)",
                            "below the bound; at the bound the batch was not filled")
DROPPED_GROUPS = _lm_metric("lm/dropped_groups", "GRPO drop_zero_std_groups: prompt groups left out of the update "
                           "because their G rewards were all equal, over every round of the iteration")
TRAIN_GROUPS = _lm_metric("lm/train_groups", "GRPO: prompt groups the update trained on (batch_prompts unless "
                         "drop_zero_std_groups left some out)", "batch_prompts")
DPO_PREF_ACCURACY = _lm_metric("dpo/pref_accuracy", "DPO: fraction of the step's pairs whose implicit reward "
                            "beta * (log pi/pi_ref) is higher for chosen than rejected (before the step)", "rises")
DPO_REWARD_MARGIN = _lm_metric("dpo/reward_margin", "DPO: mean implicit reward of chosen minus rejected", "rises")
DPO_CHOSEN_REWARD = _lm_metric("dpo/chosen_reward", "DPO: mean implicit reward beta * log(pi/pi_ref) of chosen")
DPO_REJECTED_REWARD = _lm_metric("dpo/rejected_reward", "DPO: mean implicit reward of rejected")
SFT_NLL = _lm_metric("sft/nll", "SFT: mean negative log-likelihood per completion token (prompt tokens weigh 0)",
                     "falls")
RM_LOSS = _lm_metric("rm/loss", "reward model: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), mean over "
                     "the step's pairs", "falls")
RM_ACCURACY = _lm_metric("rm/accuracy", "reward model: fraction of the step's pairs scored r_chosen > r_rejected "
                         "(before the step)", "rises")
RM_MARGIN = _lm_metric("rm/margin", "reward model: mean r_chosen - r_rejected of the step's pairs", "rises")
RM_EVAL_ACCURACY = _lm_metric("rm/eval_accuracy", "reward model: fraction of the held-out pairs scored the right "
                              "way after the step (NaN: none held out)", "rises towards 1")
