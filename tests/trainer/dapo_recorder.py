"""A rollout producer for the dynamic-sampling end-to-end tests (``rollout.producer=dapo_recorder:recording_producer``
with this directory on PYTHONPATH): the default producer, and one JSON line per group it made (id, prompt index,
rewards) appended to ``$M2PO_TEST_DAPO_RECORD``, before the trainer's filter sees the group.

Groups with equal rewards are made on purpose, so the filter has something to drop on any machine
(which groups the tiny model happens to answer all right or all wrong depends on the CPU's rounding):
``$M2PO_TEST_DAPO_FLAT=N`` scores every trajectory of a group whose prompt index is a multiple of N
with 0 (a function of the prompt, so a resumed run makes the same groups), ``all`` every group."""

from __future__ import annotations

import json
import os

from megatron_m2po.rollout.producer import ProducerContext, default_producer


def _flat(prompt_index: int) -> bool:
    spec = os.environ.get("M2PO_TEST_DAPO_FLAT", "")
    if not spec:
        return False
    return spec == "all" or prompt_index % int(spec) == 0


async def recording_producer(ctx: ProducerContext, prompts: list):
    groups = await default_producer(ctx, prompts)
    with open(os.environ["M2PO_TEST_DAPO_RECORD"], "a") as f:
        for g in groups:
            prompt = int(g.trajectories[0].metadata["prompt_index"])
            if _flat(prompt):
                for t in g.trajectories:
                    t.reward = 0.0
            f.write(json.dumps({"gid": g.group_id, "prompt": prompt,
                                "rewards": [float(t.reward) for t in g.trajectories]}) + "\n")
    return groups
