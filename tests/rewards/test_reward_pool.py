"""The scoring pool: timeouts, crashes and scorer errors are counted, never block or raise,
and the pool keeps working; custom reward functions are checked at start-up."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_m2po.config import RewardConfig
from megatron_m2po.rewards import check_reward_target, get_reward_fn
from megatron_m2po.rewards.pool import ScorerSpec, ScoringPool
from leftovers import Tree
from waiting import wait_until

FNS = "m2po_test_reward_fns"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def exact_reward():
    reward = get_reward_fn(RewardConfig(fn=f"{FNS}:exact", num_workers=2, timeout_s=1.0))
    yield reward
    reward.close()


def test_custom_item_function_scores_in_order(exact_reward):
    res = exact_reward.score_batch(["a", "b", "c", "d"], ["a", "x", "c", "y"])
    assert res.scores == [1.0, 0.0, 1.0, 0.0]
    assert res.statuses == ["ok"] * 4
    assert (res.n_timeouts, res.n_errors, res.n_no_answer) == (0, 0, 0)


def test_timeout_scores_no_answer_promptly_and_pool_recovers(exact_reward):
    restarts = exact_reward.n_restarts
    t0 = time.monotonic()
    res = exact_reward.score_batch(["a", "sleep", "b", "c"], ["a", "x", "b", "z"])
    elapsed = time.monotonic() - t0
    assert res.statuses == ["ok", "timeout", "ok", "ok"]
    assert res.scores == [1.0, 0.0, 1.0, 0.0]
    assert res.n_timeouts == 1 and res.n_errors == 0
    assert "1.0 s" in res.messages[1]
    # The sleeping call costs its 1 s deadline, not an hour (slack for a loaded 2-core box).
    assert 1.0 <= elapsed < 8.0
    assert exact_reward.n_restarts == restarts + 1
    # The replaced worker serves the next batch.
    res2 = exact_reward.score_batch(["p", "q", "r"], ["p", "q", "x"])
    assert res2.scores == [1.0, 1.0, 0.0] and res2.n_timeouts == 0


def test_two_timeouts_in_one_batch_run_in_parallel(exact_reward):
    t0 = time.monotonic()
    res = exact_reward.score_batch(["sleep", "sleep", "a"], ["x", "x", "a"])
    elapsed = time.monotonic() - t0
    assert res.statuses == ["timeout", "timeout", "ok"] and res.n_timeouts == 2
    # Both workers time out side by side (~1 s), then a replacement scores "a" after start-up.
    assert elapsed < 12.0


def test_crashing_worker_is_counted_and_replaced(exact_reward):
    restarts = exact_reward.n_restarts
    res = exact_reward.score_batch(["a", "crash", "b"], ["a", "x", "b"])
    assert res.statuses == ["ok", "error", "ok"]
    assert res.scores == [1.0, 0.0, 1.0]
    assert res.n_errors == 1 and res.n_timeouts == 0
    assert "exit code 3" in res.messages[1]
    assert exact_reward.n_restarts == restarts + 1
    assert exact_reward.score_batch(["z"], ["z"]).scores == [1.0]


def test_scorer_exceptions_and_bad_returns_are_errors_without_restart(exact_reward):
    restarts = exact_reward.n_restarts
    res = exact_reward.score_batch(["raise", "not-a-number", "nan", "ok"], ["x", "x", "x", "ok"])
    assert res.statuses == ["error", "error", "error", "ok"]
    assert res.scores == [0.0, 0.0, 0.0, 1.0]
    assert res.n_errors == 3
    assert "RuntimeError: scorer bug" in res.messages[0]
    assert "must return a float" in res.messages[1]
    assert "non-finite" in res.messages[2]
    assert exact_reward.n_restarts == restarts


def test_input_validation(exact_reward):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        exact_reward.score_batch(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"responses\[1\] is int"):
        exact_reward.score_batch(["a", 3], ["a", "b"])
    assert len(exact_reward.score_batch([], [])) == 0


def test_batch_reward_function_chunks_and_timeout():
    with get_reward_fn(RewardConfig(fn=f"{FNS}:lengths", num_workers=2, timeout_s=0.5)) as reward:
        res = reward.score_batch(["a", "bb", "ccc", "dddd", "eeeee"], [""] * 5)
        assert res.scores == [1.0, 2.0, 3.0, 4.0, 5.0] and res.statuses == ["ok"] * 5
        # Chunks are [a, bb] and [sleep, dddd, eeeee]: the sleeping chunk times out as a whole
        # (deadline 3 x 0.5 s), the other is scored.
        res = reward.score_batch(["a", "bb", "sleep", "dddd", "eeeee"], [""] * 5)
        assert res.statuses == ["ok", "ok", "timeout", "timeout", "timeout"]
        assert res.scores == [1.0, 2.0, 0.0, 0.0, 0.0] and res.n_timeouts == 3


def test_batch_function_returning_wrong_length_is_an_error():
    with get_reward_fn(RewardConfig(fn=f"{FNS}:wrong_length", num_workers=1)) as reward:
        res = reward.score_batch(["a", "b"], ["a", "b"])
    assert res.statuses == ["error", "error"] and res.n_errors == 2
    assert "returned 1 scores for 2 responses" in res.messages[0]


@pytest.mark.parametrize("target,message", [
    ("bogus", "neither a built-in reward"),
    ("no_such_module_m2po:f", "cannot import the module"),
    (f"{FNS}:missing", "no such attribute"),
    (f"{FNS}:NOT_CALLABLE", "not a function"),
    (f"{FNS}:three_args", r"three_args\(response, answer, problem\).*cannot be called as"),
    (f"{FNS}:one_arg", "cannot be called as fn\\(response: str, answer: str\\)"),
])
def test_bad_custom_functions_fail_at_startup_naming_the_path(target, message):
    with pytest.raises(ValueError, match=message) as ei:
        get_reward_fn(RewardConfig(fn=target))
    assert repr(target) in str(ei.value)


def test_signature_check_accepts_keyword_extras_and_detects_batch():
    assert check_reward_target(f"{FNS}:with_kwargs")[0] == "item"
    assert check_reward_target(f"{FNS}.exact")[0] == "item"  # module.function form
    assert check_reward_target(f"{FNS}:lengths")[0] == "batch"


def test_worker_import_failure_raises_with_traceback():
    with pytest.raises(ValueError, match="failed to load scorer") as ei:
        ScoringPool(ScorerSpec("item", "no_such_module_m2po:f"), num_workers=1, timeout_s=1.0)
    assert "ModuleNotFoundError" in str(ei.value)


def test_closed_reward_refuses_work():
    reward = get_reward_fn(RewardConfig(fn=f"{FNS}:exact", num_workers=1))
    procs = [w.proc for w in reward._pool._workers]
    reward.close()
    reward.close()  # idempotent
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(ValueError, match="closed"):
        reward.score_batch(["a"], ["a"])


def test_coroutine_item_function_awaits_a_chunks_items_together():
    """``async def`` rewards (a reward that asks a service): the items of a worker's chunk are
    awaited concurrently, each under reward.timeout_s; a hanging item times out alone."""
    with get_reward_fn(RewardConfig(fn=f"{FNS}:together", num_workers=1, timeout_s=5.0)) as reward:
        assert reward.spec.coroutine and reward.spec.kind == "item"
        res = reward.score_batch(["g1"] * 4, ["4"] * 4)  # all 4 in one chunk: they meet
        assert res.statuses == ["ok"] * 4 and res.scores == [4.0] * 4
        restarts = reward.n_restarts
        res = reward.score_batch(["hang", "g2", "g2"], ["1", "2", "2"])
        assert res.statuses == ["timeout", "ok", "ok"] and res.n_timeouts == 1, res
        assert res.scores == [0.0, 2.0, 2.0] and "no score within 5 s" in res.messages[0]
        assert reward.n_restarts == restarts  # the worker answered: nothing killed
    with get_reward_fn(RewardConfig(fn=f"{FNS}:async_lengths", num_workers=2)) as reward:
        assert reward.spec.coroutine and reward.spec.kind == "batch"
        assert reward.score_batch(["a", "bb", "ccc"], ["", "", ""]).scores == [1.0, 2.0, 3.0]
        assert reward.score("dddd", "") == 4.0


# A trainer whose one reward worker hangs inside its scorer (the call's deadline: an hour).
HUNG_PARENT = """
import sys
from megatron_m2po.rewards.pool import ScorerSpec, ScoringPool
pool = ScoringPool(ScorerSpec("item", "m2po_test_reward_fns:hang"), num_workers=1, timeout_s=3600)
pool.run([([sys.argv[1]], ["x"])])
"""


def test_a_worker_hung_in_its_scorer_dies_with_the_trainer(tmp_path):
    """The trainer killed with SIGKILL while a worker is inside a scorer that never returns: the
    worker never reads its socket again (an idle worker would see EOF there), so only the
    parent-death signal it was started with (utils/lifeline.py) ends it."""
    pid_file = tmp_path / "worker.pid"
    tree = Tree({**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.Popen([sys.executable, "-c", HUNG_PARENT, str(pid_file)], env=tree.env)
    try:
        wait_until(lambda: pid_file.is_file(), what="the reward worker inside its scorer", timeout=60,
                   hopeless=lambda: proc.poll() is not None and f"the pool's parent exited ({proc.returncode})")
        assert int(pid_file.read_text()) in tree.observe(proc.pid)
        proc.kill()
        proc.wait()
        tree.wait_gone("the pool's parent was killed with SIGKILL", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tree.kill()
