"""ppokit's GRPOTrainer vs TRL's GRPOTrainer on the same saved tiny GPT-2, back to back in one process.

The task is the language-model demo's (``ppokit.lm.demo``): prompt ``X:``, reward count(X) / max(len, 8), malformed
-1, starting from the same supervised-fine-tuned model directory (SFT on the weak prior, ~0.35 reward). Both
libraries get the same settings:

- 8 prompts x G = 8 completions per iteration, 16 new tokens, temperature 1, pure sampling (top_k 0, top_p 1);
- 2 epochs over each rollout in 2 minibatches of 32 completions (TRL: ``steps_per_generation=2``,
  ``num_iterations=2``, ``per_device_train_batch_size=32``), so 4 optimizer steps per iteration on both sides;
- AdamW at a constant learning rate (1e-3, the Llamas 1e-4: ``LR_LLAMA``; TRL's default schedule is linear
  decay, set to constant), no weight decay, gradient norm clipped at 1, clip range 0.2, group-normalised advantages (std + 1e-4), ``beta = 0.04``
  times the k3 KL to the reference model (TRL's importance-sampling correction of that KL off, so both use plain
  k3), token-mean loss (TRL ``loss_type="dapo"``, ppokit ``loss_reduction="token_mean"``);
- gradient checkpointing off on both (TRL's default is on, which recomputes every forward: slower, not different
  math), dropout off (the model has none), one torch thread, CPU (TRL: ``use_cpu=True``, ``report_to=[]``; the
  model is given to TRL as the saved directory, from which it also builds its reference model).

Measured per library: seconds per iteration over ``train`` (construction apart), as wall time and as the
process's CPU time (one thread: on a shared, loaded machine the CPU time is the steadier number, since a busy
neighbour stretches the wall time of whichever library happens to run then), and the eval reward after the
iterations (256 samples by the same sampler for both: ``demo.evaluate``). ppokit's own split of an iteration
(rollout vs update, its ``perf/time_*`` columns) is printed beside it. The order of the two libraries alternates
between seeds, so neither always runs first on a warmer (or busier) machine.

Each library runs with its own defaults beyond these settings. ppokit's: its own sampling loop over the KV cache
(``LMConfig.sampler="cached"``, with a lean GPT-2 step), the model's tanh-GELU run as torch's fused kernel
(``fused_activations``; the same function to rounding) and fused AdamW; every forward and backward the two do
is the same list (generation, pi_old and pi_ref log-probs, four minibatch steps). ``sampler="hf"`` and
``fused_activations=False`` give ppokit's earlier path for an ablation.

TRL 1.16 ships no PPO trainer any more (neither ``trl`` nor ``trl.experimental`` has one), so PPO is not compared.

Model sizes (``--sizes``): ``tiny`` (a GPT-2 of 2 layers, 64 wide, ~0.1M parameters; per-call overheads of
generation, the forwards and the optimizer dominate), ``10m`` (a GPT-2 of 6 layers, 384 wide, ~10.7M parameters; the
model's arithmetic dominates, and the split printed for ppokit says whether the rollout (generation and the
pi_old/pi_ref forwards) or the update takes more of it), and two Llamas with real vocabularies, where the
full-vocabulary logits weigh: ``llama8m`` (4 layers x 256, an 8k vocabulary, 8.4M parameters) and ``llama50m``
(8 layers x 512, a 32k vocabulary, 58.1M parameters). Their vocabularies are the demo's characters plus filler tokens
(``<t0>``, ``<t1>``, ...): the logits, the log-softmax and the embedding are those of a real 8k / 32k vocabulary,
and the fine-tuning step teaches the model the demo's format, as for the GPT-2s.

Each library runs in a fresh process (``--worker``, spawned by this script), so that each one's peak memory is its
own: ``peak MiB`` is the process's peak resident memory (``ru_maxrss``) and ``train MiB`` how far training raised
it above the resident memory of the built trainer (model, reference, tokenizer and the library's imports loaded).

    pip install -e '.[lm,bench-lm]'
    python benchmarks/bench_vs_trl.py [--smoke] [--sizes tiny,10m,llama8m,llama50m] [--seeds 2]
                                      [--iterations 40] [--iterations-10m 10]

The tiny and 10m rows take ~3-5 minutes on an idle 2-core machine, the llama rows about as long again. Without trl
installed the ppokit side runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

SETTINGS = dict(batch_prompts=8, group_size=8, max_new_tokens=16, update_epochs=2, num_minibatches=2,
                learning_rate=1e-3, beta=0.04, clip_coef=0.2, max_grad_norm=1.0)


# The Llama rows (issue: speed must hold past the tiny GPT-2): (layers, width, heads, MLP width, vocabulary).
LLAMAS = {"llama8m": (4, 256, 4, 1024, 8192), "llama50m": (8, 512, 8, 1376, 32000)}
SIZE_NAMES = ("tiny", "10m", *LLAMAS)
# Fine-tuning steps and learning rate per size (the GPT-2s keep the flags' values): enough for the Llamas to write
# the demo's format; the comparison on them is speed and memory at equal settings.
SFT_LLAMA = {"llama8m": (60, 1e-3), "llama50m": (40, 5e-4)}
# GRPO's learning rate on the Llamas: at the GPT-2s' 1e-3 both libraries leave the trust region in the first
# iteration on the 58M Llama (measured, seed 0, 2026-12-07: per-token KL to pi_ref 65 for ppokit and 125 for TRL
# after one optimizer step, eval reward -0.04 and 0.02 after 3 iterations), so a reward comparison there is noise;
# at 1e-4 both stay in it (clip fractions 0.005-0.58, KL 0.01-0.13) and learn (0.450 and 0.524 after 3 iterations).
LR_LLAMA = 1e-4


def _rss_mib() -> float:
    """This process's resident memory now, in MiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    """This process's peak resident memory so far, in MiB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_llama(size: str, seed: int):
    """``(model, tokenizer)``: a ``LlamaForCausalLM`` of ``LLAMAS[size]`` over the demo's characters plus filler
    tokens up to the vocabulary size, initialised from ``seed`` (no download)."""
    from ppokit.lm import demo
    from ppokit.lm.tiny import build_char_tokenizer, build_tiny_llama

    layers, width, heads, mlp, vocab = LLAMAS[size]
    tok = build_char_tokenizer(demo.ALPHABET)
    tok.add_tokens([f"<t{i}>" for i in range(vocab - len(tok))])
    model = build_tiny_llama(tok, hidden=width, layers=layers, heads=heads, mlp=mlp, positions=64, seed=seed)
    return model, tok


def build_model(size: str, seed: int = 0):
    """``(model, tokenizer)`` of any benchmarked size."""
    if size in LLAMAS:
        return build_llama(size, seed)
    from ppokit.lm import demo
    from ppokit.lm.tiny import build_tiny

    return build_tiny(demo.ALPHABET, size=size, seed=seed)


def trl_module():
    """The ``trl`` module, or None when it is not installed (or hidden by ``PPOKIT_BENCH_HIDE_TRL=1``)."""
    if os.environ.get("PPOKIT_BENCH_HIDE_TRL") == "1":
        return None
    try:
        import trl
    except ImportError:
        return None
    return trl


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import warnings

    warnings.filterwarnings("ignore")


def sft_model_dir(size: str, sft_steps: int, seed: int, root: Path) -> Path:
    """Build the model of ``size``, fine-tune it on the demo's SFT data, save it as a model directory."""
    from ppokit.lm import demo
    from ppokit.lm.tiny import save_tiny

    model, tok = build_model(size, seed)
    demo.supervised_finetune(model, tok, steps=sft_steps, learning_rate=SFT_LLAMA.get(size, (0, 3e-3))[1],
                             seed=seed)
    return save_tiny(model, tok, root / f"sft_{size}_s{seed}")


def run_ppokit(model_dir: Path, iterations: int, seed: int, s: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppokit.core import schema as S
    from ppokit.lm import GRPOTrainer, LMConfig, demo

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = LMConfig(seed=seed, temperature=1.0, scale_rewards="group", loss_reduction="token_mean", torch_threads=1,
                   console=False, tensorboard=False, **s)
    trainer = GRPOTrainer(model, tok, reward=demo.reward, prompts=[demo.PROMPT] * s["batch_prompts"], config=cfg)
    rss_built = _rss_mib()
    t1, c1 = time.perf_counter(), time.process_time()
    history = trainer.train(iterations)
    t2, c2 = time.perf_counter(), time.process_time()
    peak = _peak_mib()
    ev = demo.evaluate(trainer.policy, tok, seed=12345)
    split = {p: sum(m.get(S.perf_time(p), 0.0) for m in history) / iterations for p in ("rollout", "update")}
    return {"build": t1 - t0, "per_iter": (t2 - t1) / iterations, "cpu_per_iter": (c2 - c1) / iterations,
            "reward": ev["reward"], "well_formed": ev["well_formed"], "split": split, "peak_mib": peak,
            "train_mib": peak - rss_built,
            "train_score_last": history[-1][S.SCORE_MEAN] if history else float("nan")}


def run_trl(model_dir: Path, iterations: int, seed: int, s: dict, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppokit.lm import demo

    completions = s["batch_prompts"] * s["group_size"]
    per_step = completions // s["num_minibatches"]
    steps_per_iteration = s["num_minibatches"] * s["update_epochs"]
    t0 = time.perf_counter()
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, report_to=[], seed=seed, disable_tqdm=True, save_strategy="no",
        logging_steps=steps_per_iteration, bf16=False, fp16=False,
        per_device_train_batch_size=per_step, steps_per_generation=s["num_minibatches"],
        num_generations=s["group_size"], num_iterations=s["update_epochs"],
        max_completion_length=s["max_new_tokens"], temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=s["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"], epsilon=s["clip_coef"], beta=s["beta"], scale_rewards="group",
        loss_type="dapo", use_bias_correction_kl=False, gradient_checkpointing=False, disable_dropout=True,
        max_steps=iterations * steps_per_iteration,
    )
    dataset = Dataset.from_dict({"prompt": [demo.PROMPT] * (s["batch_prompts"] * s["group_size"] * iterations)})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=demo.reward, args=args, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # its per-log dict on stdout; the numbers stay in state.log_history
    rss_built = _rss_mib()
    t1, c1 = time.perf_counter(), time.process_time()
    trainer.train()
    t2, c2 = time.perf_counter(), time.process_time()
    peak = _peak_mib()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ev = demo.evaluate(trainer.model, tok, seed=12345)  # evaluate() samples in eval mode
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"build": t1 - t0, "per_iter": (t2 - t1) / iterations, "cpu_per_iter": (c2 - c1) / iterations,
            "reward": ev["reward"], "well_formed": ev["well_formed"], "peak_mib": peak, "train_mib": peak - rss_built,
            "train_score_last": rewards[-1] if rewards else float("nan")}


def run_in_child(lib: str, model_dir: Path, iterations: int, seed: int, s: dict, out: Path) -> dict:
    """One library's run in a fresh process of this script (its peak memory its own); its result dict."""
    spec = json.dumps({"lib": lib, "model_dir": str(model_dir), "iterations": iterations, "seed": seed,
                       "settings": s, "out": str(out)})
    done = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{lib} worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def worker(spec: str) -> int:
    """``--worker SPEC``: run one library as ``run_in_child`` asked, print its result as one JSON line."""
    job = json.loads(spec)
    _quiet()
    model_dir, out = Path(job["model_dir"]), Path(job["out"])
    if job["lib"] == "ppokit":
        res = run_ppokit(model_dir, job["iterations"], job["seed"], job["settings"])
    else:
        res = run_trl(model_dir, job["iterations"], job["seed"], job["settings"], out)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def _table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "n/a" if v != v else f"{v:.3f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    p = argparse.ArgumentParser(description="ppokit vs TRL GRPO on saved local GPT-2 and Llama models (one thread, "
                                            "CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny budgets: checks the script runs (numbers mean nothing)")
    p.add_argument("--sizes", default="tiny,10m",
                   help="model sizes, comma-separated: tiny, 10m, llama8m, llama50m (default: tiny,10m)")
    p.add_argument("--seeds", type=int, default=2, help="seeds of the tiny model (default: 2)")
    p.add_argument("--seeds-large", type=int, default=1,
                   help="seeds of the 10m and llama models (default: 1; the eval reward of one seed is noisy)")
    p.add_argument("--iterations", type=int, default=40, help="iterations on the tiny model (default: 40)")
    p.add_argument("--iterations-10m", type=int, default=10,
                   help="iterations on the 10m and the llama models (default: 10)")
    p.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the tiny model (default: 300)")
    p.add_argument("--sft-steps-10m", type=int, default=30,
                   help="SFT steps of the 10m model (default: 30, ~1 s each on one thread; it only needs the format, "
                        "the comparison there is speed)")
    args = p.parse_args(argv)
    _quiet()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppokit.lm import demo
    from ppokit.lm.tiny import count_parameters

    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    unknown = [x for x in sizes if x not in SIZE_NAMES]
    if unknown:
        print(f"error: --sizes: unknown {unknown}; choose from {', '.join(SIZE_NAMES)}", file=sys.stderr)
        return 2
    settings = dict(SETTINGS)
    if args.smoke:
        settings.update(batch_prompts=2, group_size=4, max_new_tokens=6)
        args.iterations, args.iterations_10m, args.sft_steps, args.sft_steps_10m, args.seeds = 2, 1, 5, 2, 1
        args.seeds_large = 1
    trl = trl_module()
    import transformers

    print("# ppokit vs TRL: GRPO on saved local models (GPT-2 and Llama)")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"versions: python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, trl {trl.__version__ if trl else 'not installed'}; {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}")
    print(f"command: python {' '.join(sys.argv)}")
    try:
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    except OSError:  # pragma: no cover
        pass
    print(f"settings: {settings} (the llama models: learning_rate {LR_LLAMA})")
    sys.stdout.flush()

    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in sizes:
            seeds = range(1, 1 + (args.seeds if size == "tiny" else args.seeds_large))
            size_settings = {**settings, "learning_rate": LR_LLAMA} if size in LLAMAS else settings
            iterations = args.iterations if size == "tiny" else args.iterations_10m
            sft_steps = (args.sft_steps if size == "tiny" else args.sft_steps_10m if size == "10m" else
                         args.sft_steps_10m if args.smoke else SFT_LLAMA[size][0])
            n_params = count_parameters(build_model(size)[0])  # the benchmarked shape
            for seed in seeds:
                t0 = time.perf_counter()
                model_dir = sft_model_dir(size, sft_steps, seed, root)
                sft_seconds = time.perf_counter() - t0
                start = demo.evaluate(AutoModelForCausalLM.from_pretrained(model_dir),
                                      AutoTokenizer.from_pretrained(model_dir), seed=12345)["reward"]
                order = ["ppokit", "trl"] if seed % 2 else ["trl", "ppokit"]
                res = {}
                for lib in order:
                    if lib == "trl" and trl is None:
                        continue
                    res[lib] = run_in_child(lib, model_dir, iterations, seed, size_settings,
                                            root / f"trl_{size}_{seed}")
                pk = res["ppokit"]
                line = [size, f"{n_params / 1e6:.2f}M", seed, iterations, start, pk["per_iter"], pk["cpu_per_iter"],
                        pk["split"]["rollout"], pk["split"]["update"], pk["reward"], round(pk["peak_mib"]),
                        round(pk["train_mib"])]
                if "trl" in res:
                    tr = res["trl"]
                    wall, cpu = tr["per_iter"] / pk["per_iter"], tr["cpu_per_iter"] / pk["cpu_per_iter"]
                    line += [tr["per_iter"], tr["cpu_per_iter"], tr["reward"], round(tr["peak_mib"]),
                             round(tr["train_mib"]), wall, cpu]
                    ratios.append((size, wall, cpu, pk["reward"], tr["reward"], pk["train_mib"], tr["train_mib"]))
                else:
                    line += [float("nan")] * 7
                rows.append(line)
                print(f"  {size} seed {seed}: SFT {sft_seconds:.1f} s, order {'/'.join(order)}, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    headers = ["model", "params", "seed", "iters", "SFT reward", "ppokit s/iter", "CPU s/iter", "  rollout",
               "  update", "ppokit reward", "peak MiB", "train MiB", "TRL s/iter", "CPU s/iter", "TRL reward",
               "peak MiB", "train MiB", "ratio wall", "ratio CPU"]
    print()
    print(_table(headers, rows))
    print()
    for size in sizes:
        rs = [r for r in ratios if r[0] == size]
        if rs:
            print(f"RATIO {size} speed ppokit vs TRL (TRL s/iter / ppokit s/iter, median): wall "
                  f"{statistics.median(r[1] for r in rs):.2f}x, CPU {statistics.median(r[2] for r in rs):.2f}x; "
                  f"eval reward ppokit {statistics.mean(r[3] for r in rs):.3f} vs TRL "
                  f"{statistics.mean(r[4] for r in rs):.3f}; training's memory ppokit "
                  f"{statistics.median(r[5] for r in rs):.0f} MiB vs TRL {statistics.median(r[6] for r in rs):.0f} MiB")
    if trl is None:
        print("RATIO n/a: trl is not installed (pip install -e '.[bench-lm]'); ppokit side only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
