"""parallel/groups.py: the actor's ProcessGroupCollection and what it reads from it equal what
Megatron's parallel_state says for the same layout (4 gloo ranks: PP=2 x DP=2, then CP=2 x DP=2)."""

import pytest
import torch.distributed as dist

from megatron_m2po.standins.dist_testing import run_distributed


def _layout_worker(rank, world, pp, cp):
    from megatron.core import parallel_state as ps

    from megatron_m2po.parallel.groups import ACTOR_GROUPS, is_last, last_rank, nontrivial, process_groups

    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=cp)
    try:
        pg = process_groups()
        assert all(hasattr(pg, name) for name in ACTOR_GROUPS)
        got = {"tp": dist.get_world_size(pg.tp), "pp": dist.get_world_size(pg.pp), "cp": dist.get_world_size(pg.cp),
               "dp": dist.get_world_size(pg.dp), "dp_cp": dist.get_world_size(pg.dp_cp),
               "dp_rank": dist.get_rank(pg.dp), "cp_rank": dist.get_rank(pg.cp),
               "last": is_last(pg.pp), "last_rank": last_rank(pg.pp),
               "no_tp": nontrivial(pg.tp) is None, "dp_kept": nontrivial(pg.dp) is pg.dp}
        want = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
                "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
                "dp_rank": ps.get_data_parallel_rank(), "cp_rank": ps.get_context_parallel_rank(),
                "last": ps.is_pipeline_last_stage(ignore_virtual=True),
                "last_rank": ps.get_pipeline_model_parallel_last_rank(), "no_tp": True, "dp_kept": True}
        return got, want
    finally:
        ps.destroy_model_parallel()


@pytest.mark.multiproc
@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)])
def test_groups_read_what_parallel_state_says(pp, cp):
    for got, want in run_distributed(_layout_worker, world_size=4, args=(pp, cp)):
        assert got == want
