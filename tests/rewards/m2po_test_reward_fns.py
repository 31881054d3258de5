"""Custom reward functions used by the reward tests (imported by dotted path in the workers)."""

import os
import threading
import time

from megatron_m2po.rewards import batch_reward


def exact(response, answer):
    """1.0 for an exact match; misbehaves on purpose for a few trigger responses."""
    if response == "sleep":
        time.sleep(3600)  # a scorer that hangs: the pool's timeout (elapsed time is the behaviour under test)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("scorer bug")
    if response == "not-a-number":
        return "high"
    if response == "nan":
        return float("nan")
    return 1.0 if response == answer else 0.0


def hang(response, answer):
    """Writes this worker's pid to the file ``response`` names, then never returns nor reads its
    socket again (a scorer stuck in C code): only a signal ends the worker."""
    tmp = response + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, response)
    threading.Event().wait()


def with_kwargs(response, answer, *, bonus=0.0, **kw):
    return float(response == answer) + bonus


@batch_reward
def lengths(responses, answers):
    if "sleep" in responses:
        time.sleep(3600)  # a scorer that hangs: the pool's timeout (elapsed time is the behaviour under test)
    return [float(len(r)) for r in responses]


@batch_reward
def wrong_length(responses, answers):
    return [1.0]


def three_args(response, answer, problem):
    return 0.0


def one_arg(response):
    return 0.0


async def coroutine_fn(response, answer):
    return 0.0


NOT_CALLABLE = 3


_arrived: dict[str, int] = {}
_all_here: dict = {}  # response -> asyncio.Event, set when ``answer`` items of the group are awaited


async def together(response, answer):
    """An ``async def`` item reward that scores ``answer`` once ``answer`` items of its group
    (``response``) are being awaited at once: items scored one after another never get there
    (they time out)."""
    import asyncio

    _arrived[response] = _arrived.get(response, 0) + 1
    here = _all_here.setdefault(response, asyncio.Event())
    if _arrived[response] >= int(answer):
        here.set()
    await here.wait()  # the group's other items, awaited on this same loop
    if response == "hang":
        await asyncio.Event().wait()  # a service that never answers: the item's timeout (behaviour under test)
    return float(answer)


@batch_reward
async def async_lengths(responses, answers):
    return [float(len(r)) for r in responses]
