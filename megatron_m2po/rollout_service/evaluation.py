"""Evaluation, in one home: held-out accuracy during training (:class:`Evaluator`, rank 0's, with the
engines' weights) and ``m2po eval``, pass@1 as avg@k over math benchmarks, like the paper's Table 1.
Both count a sample correct by :func:`is_correct` and average by :func:`avg_at_k`.

    m2po eval CONFIG [key=value ...] [--engine-url URL] [--k K] [--out results.json]

Benchmarks are the files of ``data.eval`` (DeepScaleR schema; benchmark name = file stem:
``math500.jsonl`` -> ``math500``; Math500, AIME24/25, AMC23/24, Minerva, Gaokao,
OlympiadBench style), plus the held-out synthetic problems when ``data.train=synthetic``
(:func:`megatron_m2po.data.build_eval_sets`). Each problem is sampled ``k`` times at
temperature 1 (``--temperature``) through the rollout client, against ``--engine-url`` or an
engine fleet launched from ``rollout`` for the model (``--model``, default ``model.hf_path``).
Responses are graded by the configured reward (``reward.fn``; math-verify by default).

Metrics per benchmark (pure functions below, testable without an engine):

- ``avg@k`` = mean over problems of (correct samples / k): the unbiased pass@1 estimate the
  paper reports. A sample is correct when the reward's status is ``"correct"`` (math reward) or,
  for custom reward functions, when its score reaches ``reward.correct``.
- ``pass@k`` = fraction of problems with at least one correct sample.
- Average row: the unweighted mean of ``avg@k`` over benchmarks (the paper's "Avg.").

Output: a rich table on stdout and a JSON file (``--out``, default
``<trainer.run_dir>/eval_results.json``) with the settings, every benchmark's metrics and
per-problem correct counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.rollout_service.scheduled import ScheduledGeneration
from megatron_m2po.utils.aio import gather_or_cancel
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.faults import fault_point

__all__ = ["Evaluator", "BenchmarkResult", "avg_at_k", "pass_at_k", "is_correct", "summarize_benchmark", "average_of",
           "results_table", "results_to_json", "evaluate_sets", "register", "run"]


# --------------------------------------------------------------------------------------------
# During training (rank 0)
# --------------------------------------------------------------------------------------------


class Evaluator:
    """Samples ``samples`` responses per item of every evaluation set and scores them.

    ``eval_sets``: name -> prompt items (``data.eval_*``); ``correct``: the reward at which a
    response counts as correct (``reward.correct``; :func:`is_correct` of a score, as ``m2po eval``
    counts a custom reward's samples; the accuracy is the fraction of correct samples, :func:`avg_at_k`
    when every problem has its ``samples``); ``scheduled``: scheduled generation, drained
    first (an evaluation must not overlap a scheduled step's generation) and whose bounded,
    interruptible wait (:func:`~.waiting.wait_future`) the evaluation waits with."""

    def __init__(self, eval_sets: dict[str, list], *, samples: int, correct: float, sampler: GroupSampler,
                 bg: BackgroundLoop, scheduled: ScheduledGeneration):
        self.eval_sets, self.samples, self.correct = eval_sets, samples, correct
        self.sampler, self.bg, self.scheduled = sampler, bg, scheduled

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/<set>/acc`` for every evaluation set, after ``step`` steps."""
        self.scheduled.drain()
        out = {}
        for name, items in self.eval_sets.items():
            ctx = self.sampler.context(group_ids.eval_prefix(name, step), n_samples=self.samples)
            groups = self.scheduled.wait(self.bg.submit(self.sampler.producer(ctx, items)),
                                         f"the evaluation on {name!r}", interruptible=True)
            fault_point("evaluation")
            flags = [is_correct("ok", float(t.reward), self.correct) for g in groups for t in g.trajectories]
            out[f"eval/{name}/acc"] = sum(flags) / max(1, len(flags))
        return out


# --------------------------------------------------------------------------------------------
# Pure aggregation
# --------------------------------------------------------------------------------------------


@dataclass
class BenchmarkResult:
    """Metrics of one benchmark (fractions in [0, 1])."""

    name: str
    n_problems: int
    k: int
    avg_at_k: float
    pass_at_k: float
    mean_reward: float
    mean_response_tokens: float
    n_timeouts: int = 0
    n_errors: int = 0
    n_no_answer: int = 0
    n_truncated: int = 0
    correct_per_problem: list[int] = field(default_factory=list)
    samples: Optional[list[dict]] = None  # per problem {index, answer, responses, statuses} (--save-responses)


def _check_grid(correct: Sequence[Sequence[bool]]) -> int:
    if not correct:
        raise ValueError("no problems to aggregate")
    k = len(correct[0])
    if k == 0 or any(len(row) != k for row in correct):
        raise ValueError(f"every problem needs the same number k >= 1 of samples, got {sorted({len(r) for r in correct})}")
    return k


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the fraction of correct samples (pass@1 estimated from k samples)."""
    k = _check_grid(correct)
    return sum(sum(bool(c) for c in row) / k for row in correct) / len(correct)


def pass_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Fraction of problems with at least one correct sample among their k."""
    _check_grid(correct)
    return sum(any(row) for row in correct) / len(correct)


def is_correct(status: str, score: float, correct_value: float) -> bool:
    """Correctness of one graded sample (see module docstring)."""
    if status == "correct":
        return True
    if status == "ok":  # custom reward function: no status of its own
        return score >= correct_value
    return False


def summarize_benchmark(name: str, statuses: Sequence[str], scores: Sequence[float], k: int, *,
                        correct_value: float = 1.0, response_tokens: Optional[Sequence[int]] = None,
                        truncated: Optional[Sequence[bool]] = None) -> BenchmarkResult:
    """Metrics of one benchmark from its graded samples, laid out problem-major
    (sample ``j`` of problem ``i`` at ``i * k + j``)."""
    n = len(statuses)
    if len(scores) != n or k < 1 or n % k:
        raise ValueError(f"{name}: {n} statuses / {len(scores)} scores do not form problems of k={k} samples")
    flags = [is_correct(s, sc, correct_value) for s, sc in zip(statuses, scores)]
    grid = [flags[i:i + k] for i in range(0, n, k)]
    toks = list(response_tokens or [])
    return BenchmarkResult(
        name=name, n_problems=len(grid), k=k, avg_at_k=avg_at_k(grid), pass_at_k=pass_at_k(grid),
        mean_reward=sum(scores) / n, mean_response_tokens=(sum(toks) / len(toks)) if toks else 0.0,
        n_timeouts=sum(s == "timeout" for s in statuses), n_errors=sum(s == "error" for s in statuses),
        n_no_answer=sum(s == "no_answer" for s in statuses), n_truncated=sum(bool(t) for t in (truncated or [])),
        correct_per_problem=[sum(row) for row in grid])


def average_of(results: dict[str, BenchmarkResult]) -> float:
    """Unweighted mean of avg@k over benchmarks (the paper's Avg. column)."""
    if not results:
        raise ValueError("no benchmark results to average")
    return sum(r.avg_at_k for r in results.values()) / len(results)


def results_table(results: dict[str, BenchmarkResult], title: str = "pass@1 (avg@k)"):
    """A rich Table: one row per benchmark and an Average row; accuracies in percent."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("Benchmark", no_wrap=True)
    for col in ("N", "k", "avg@k %", "pass@k %", "Reward", "Tokens", "Timeouts"):
        table.add_column(col, justify="right")
    for r in results.values():
        table.add_row(r.name, str(r.n_problems), str(r.k), f"{100 * r.avg_at_k:.1f}", f"{100 * r.pass_at_k:.1f}",
                      f"{r.mean_reward:.3f}", f"{r.mean_response_tokens:.0f}", str(r.n_timeouts))
    if results:
        table.add_section()
        table.add_row("Average", str(sum(r.n_problems for r in results.values())), "",
                      f"{100 * average_of(results):.1f}", "", "", "", "")
    return table


def results_to_json(results: dict[str, BenchmarkResult], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON document written by ``m2po eval`` (``samples`` only when they were kept)."""
    benchmarks = {}
    for name, r in results.items():
        d = asdict(r)
        if d["samples"] is None:
            del d["samples"]
        benchmarks[name] = d
    return {"settings": settings, "average_avg_at_k": average_of(results) if results else None,
            "benchmarks": benchmarks}


# --------------------------------------------------------------------------------------------
# Generation + grading through the rollout client
# --------------------------------------------------------------------------------------------


async def evaluate_sets(client: Any, sets: dict[str, list], *, k: int, sampling_params: dict, tokenizer: Any,
                        reward: Any, log: Any = None, keep_responses: bool = False) -> dict[str, BenchmarkResult]:
    """Sample every prompt of every set ``k`` times with ``client.generate`` and grade with
    ``reward.score_batch``. ``sets``: name -> list of PromptItem. Returns name -> result
    (with the response texts in ``result.samples`` when ``keep_responses``)."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    results: dict[str, BenchmarkResult] = {}
    for name, items in sets.items():
        if not items:
            raise ValueError(f"benchmark {name!r} has no problems")
        t0 = time.perf_counter()
        outs = await gather_or_cancel(*(client.generate(it.prompt_ids, sampling_params, return_logprob=False)
                                      for it in items for _ in range(k)))
        texts = [o.text if o.text else tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        answers = [it.answer for it in items for _ in range(k)]
        res = await asyncio.to_thread(reward.score_batch, texts, answers)
        results[name] = summarize_benchmark(
            name, res.statuses, res.scores, k, correct_value=getattr(reward, "correct", 1.0),
            response_tokens=[len(o.output_ids) for o in outs],
            truncated=[str((o.finish_reason or {}).get("type", "")) == "length" for o in outs])
        if keep_responses:
            results[name].samples = [
                {"index": it.index, "answer": it.answer, "responses": texts[i * k:(i + 1) * k],
                 "statuses": res.statuses[i * k:(i + 1) * k]} for i, it in enumerate(items)]
        if log is not None:
            r = results[name]
            log(f"{name}: avg@{k} {100 * r.avg_at_k:.1f}% over {r.n_problems} problems "
                f"({time.perf_counter() - t0:.1f} s)")
    return results


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def model_name(requested: str, path: str) -> str:
    """How ``m2po eval`` names the model it evaluates: as the user gave it (``--model``, else
    ``model.hf_path``); the tiny base with the name of the cache directory it resolved to."""
    return f"tiny ({Path(path).name})" if requested == "tiny" else requested


def register(sub) -> None:
    p = sub.add_parser("eval", help="pass@1 (avg@k) on math benchmarks through a rollout engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (data.eval lists the benchmark files)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.eval=a.jsonl,b.jsonl "
                   "(put them before the --options)")
    p.add_argument("--engine-url", default=None, help="existing engine or router; default: launch rollout engines")
    p.add_argument("--model", default=None, help="HF model directory (default: model.hf_path; 'tiny' builds it)")
    p.add_argument("--k", type=int, default=None, help="samples per problem (default: trainer.eval_samples)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (paper: 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_new_tokens")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark")
    p.add_argument("--benchmarks", default=None, help="comma-separated subset of benchmark names")
    p.add_argument("--save-responses", action="store_true", help="also write every response text to the JSON")
    p.add_argument("--out", default=None, help="JSON output (default: <trainer.run_dir>/eval_results.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``m2po eval``; a user's mistake raises ``ValueError`` (the ``m2po`` entry point prints it in one line)."""
    from rich.console import Console

    from megatron_m2po.config import load_config
    from megatron_m2po.data import build_eval_sets
    from megatron_m2po.rewards import get_reward_fn
    from megatron_m2po.utils.errors import UserError
    from megatron_m2po.utils.hf_dir import resolve_model_path
    from megatron_m2po.utils.net import unreachable

    console = Console()
    cfg = load_config(args.config, args.overrides)
    if args.engine_url is not None:  # before the model and the data are loaded
        why = unreachable(args.engine_url)
        if why:
            raise UserError(f"--engine-url {args.engine_url}: nothing answers there ({why}): start the engine or "
                            "router first (scripts/launch_sglang_fleet.sh), correct the address, or leave "
                            "--engine-url out to launch engines from the config's rollout settings")
    k = args.k if args.k is not None else cfg.trainer.eval_samples
    if k < 1:
        raise ValueError(f"--k={k} must be >= 1")
    model_path = resolve_model_path(cfg.model, args.model, progress=True)
    name = model_name(args.model or cfg.model.hf_path, model_path)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sets = build_eval_sets(cfg.data, tokenizer, cfg.trainer.seed)
    if args.benchmarks:
        wanted = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        unknown = [b for b in wanted if b not in sets]
        if unknown:
            raise ValueError(f"--benchmarks {unknown} not among the configured sets {list(sets)}")
        sets = {b: sets[b] for b in wanted}
    if args.limit is not None:
        sets = {name: items[:args.limit] for name, items in sets.items()}
    if not sets:
        raise ValueError("no benchmarks to evaluate: set data.eval=path/a.jsonl,path/b.jsonl "
                         "(or data.train=synthetic for the held-out synthetic set)")
    sampling = {"temperature": float(args.temperature), "top_p": cfg.rollout.top_p,
                "max_new_tokens": int(args.max_new_tokens or cfg.rollout.max_new_tokens)}

    fleet = None
    reward = None
    t0 = time.perf_counter()
    try:
        reward = get_reward_fn(cfg.reward)
        url = args.engine_url
        if url is None:
            from megatron_m2po.rollout.engines import EngineFleet

            # soft_wrap: a long path is never moved to a line of its own (the name read as empty)
            console.print(f"launching {cfg.rollout.num_engines} {cfg.rollout.engine} engine(s) for {name}",
                          soft_wrap=True)
            fleet = EngineFleet(cfg.rollout, model_path, run_dir=cfg.trainer.run_dir).start()
            url = fleet.url if fleet.router_url or len(fleet.engines) == 1 else fleet
        results = asyncio.run(_evaluate_at(url, cfg, sets, k, sampling, tokenizer, reward, console,
                                           keep_responses=args.save_responses))
    finally:
        if reward is not None:
            reward.close()
        if fleet is not None:
            fleet.stop()

    console.print(results_table(results, title=f"pass@1 as avg@{k} (T={args.temperature:g}) - {name}"))
    out = Path(args.out) if args.out else Path(cfg.trainer.run_dir) / "eval_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"model": model_path, "model_name": name, "engine_url": args.engine_url, "k": k, "sampling_params": sampling,
                "reward": cfg.reward.fn, "template": cfg.data.template, "limit": args.limit,
                "elapsed_s": round(time.perf_counter() - t0, 3)}
    out.write_text(json.dumps(results_to_json(results, settings), indent=2) + "\n")
    console.print(f"wrote {out}", soft_wrap=True)
    return 0


async def _evaluate_at(url, cfg, sets, k, sampling, tokenizer, reward, console,
                       keep_responses: bool = False) -> dict[str, BenchmarkResult]:
    """``url``: an engine or router address, or a started ``EngineFleet`` of several engines without a
    router (its ``client()`` dispatches over them, ``rollout/dispatch.py``)."""
    from megatron_m2po.rollout.client import SGLangClient

    if not isinstance(url, str):  # several engines and no router: the fleet's dispatching client
        async with url.client() as client:
            return await evaluate_sets(client, sets, k=k, sampling_params=sampling, tokenizer=tokenizer,
                                       reward=reward, log=console.print, keep_responses=keep_responses)
    concurrency = cfg.rollout.concurrency
    if concurrency is None:  # derived from what the engine (or the router's engines) report
        from megatron_m2po.rollout.engines import FALLBACK_MAX_RUNNING
        async with SGLangClient(url, max_retries=cfg.rollout.max_retries) as probe:
            limits = await probe.fleet_max_running()
        concurrency = sum(v or FALLBACK_MAX_RUNNING for v in limits.values())
        console.print(f"concurrency {concurrency} in-flight requests (derived from {len(limits)} engine(s); "
                      "set rollout.concurrency to choose)")
    async with SGLangClient(url, concurrency=concurrency, timeout_s=cfg.rollout.request_timeout_s,
                            max_retries=cfg.rollout.max_retries) as client:
        return await evaluate_sets(client, sets, k=k, sampling_params=sampling, tokenizer=tokenizer,
                                   reward=reward, log=console.print, keep_responses=keep_responses)

