"""A rollout producer for the dynamic-sampling end-to-end tests (``rollout.producer=dapo_recorder:recording_producer``
with this directory on PYTHONPATH): the default producer, and one JSON line per group it made (id, prompt index,
rewards) appended to ``$M2PO_TEST_DAPO_RECORD``, before the trainer's filter sees the group."""

from __future__ import annotations

import json
import os

from megatron_m2po.rollout.producer import ProducerContext, default_producer


async def recording_producer(ctx: ProducerContext, prompts: list):
    groups = await default_producer(ctx, prompts)
    with open(os.environ["M2PO_TEST_DAPO_RECORD"], "a") as f:
        for g in groups:
            f.write(json.dumps({"gid": g.group_id, "prompt": int(g.trajectories[0].metadata["prompt_index"]),
                                "rewards": [float(t.reward) for t in g.trajectories]}) + "\n")
    return groups
