"""Layout planning before a launch: ``m2po plan`` and ``m2po plan --search`` (docs/planner.md).

* :mod:`megatron_m2po.plan.memory` -- per-GPU memory of a Megatron-Core layout and the checks
  Megatron and the actor apply to it (``m2po plan``).
* :mod:`megatron_m2po.plan.search` -- the layouts that fit, ranked by a stated cost model
  (``m2po plan --search``).

The command is registered by :mod:`megatron_m2po.plan.search` (``register`` / ``run``), which
extends the memory module's parser with ``--search``.
"""

from megatron_m2po.plan.memory import (MODELS, GiB, Layout, LayoutPlan, MemoryPlanError, MemoryRefusal, ModelShape,
                                       PlanError, StageMemory, estimate, layout_from_config, model_shape, plan,
                                       plan_from_config, stage_params)
from megatron_m2po.plan.search import (Candidate, CostModel, SearchResult, Workload, packing_of,
                                       parallel_section, search_config, step_time)

__all__ = ["MODELS", "GiB", "Layout", "LayoutPlan", "MemoryPlanError", "MemoryRefusal", "ModelShape", "PlanError",
           "StageMemory", "estimate", "layout_from_config", "model_shape", "plan", "plan_from_config", "stage_params",
           "Candidate",
           "CostModel", "SearchResult", "Workload", "packing_of", "parallel_section", "search_config",
           "step_time"]
