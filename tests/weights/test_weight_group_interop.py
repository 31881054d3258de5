"""The trainer's weight-update groups against SGLang 0.5.23's own end of them (gloo).

The engine processes run SGLang's ``init_custom_process_group`` itself, read from the pinned wheel
(``sglang/srt/utils/common.py``, extracted with ast and executed without importing sglang), and
receive with ``torch.distributed.broadcast(t, src=0, group=pg)`` as
``weight_updater.py`` does, after a default process group of their own as an SGLang engine has.
Two senders (two pipeline stages) each host one group with both engines; the engines join the
groups and receive in stage order, as the weight push drives them. A sender built any other way
than SGLang's (e.g. a bare ``ProcessGroupGloo`` on a ``PrefixStore``) waits until its timeout here, and
so does one that lets torch's ``tcp://`` rendezvous pick the store under torchrun's environment.
"""

from __future__ import annotations

import ast
import datetime

import pytest
import torch
import torch.multiprocessing as mp

from megatron_m2po.parallel.side_group import broadcast, destroy_side_group, new_side_group
from megatron_m2po.utils.net import free_port
from sglang_source import wheel as _wheel

N_ENGINES, N_STAGES = 2, 2


def _sglang_init_custom_process_group(source: str):
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    ns = {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split(".")[:2])}
    exec(compile(ast.Module([fn], []), "sglang/srt/utils/common.py", "exec"), ns)  # noqa: S102 - SGLang's own code
    return ns["init_custom_process_group"]


def _engine(rank_offset: int, ports: list[int], source: str, q) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        init = _sglang_init_custom_process_group(source)
        got = []
        for stage, port in enumerate(ports):  # weight_updater.py init_weights_update_group, stage order
            pg = init(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1 + N_ENGINES,
                      rank=rank_offset, group_name=f"m2po_test_s{stage}")
            t = torch.empty(5)
            dist.broadcast(t, src=0, group=pg)  # _receive_bucketed_weights_from_distributed
            got.append(t.tolist())
            dist.destroy_process_group(pg)
        q.put((rank_offset, got))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank_offset, f"{type(e).__name__}: {e}"))


def _sender(stage: int, port: int, q) -> None:
    import os

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as under torchrun: the sender must still host
    try:
        pg = new_side_group("gloo", "127.0.0.1", port, rank=0, world_size=1 + N_ENGINES,
                            group_name=f"m2po_test_s{stage}", timeout_s=60)
        broadcast(pg, torch.arange(5.0) + 10 * stage, 60).wait(datetime.timedelta(seconds=60))
        destroy_side_group(pg)
        q.put((f"s{stage}", "ok"))
    except BaseException as e:  # noqa: BLE001
        q.put((f"s{stage}", f"{type(e).__name__}: {e}"))


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_trainer_groups_interoperate_with_sglang_init_custom_process_group():
    with _wheel() as z:  # skips (fails under CI) without the wheel
        source = z.read("sglang/srt/utils/common.py").decode()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [free_port() for _ in range(N_STAGES)]
    procs = [ctx.Process(target=_sender, args=(s, ports[s], q), daemon=True) for s in range(N_STAGES)]
    procs += [ctx.Process(target=_engine, args=(1 + i, ports, source, q), daemon=True) for i in range(N_ENGINES)]
    for p in procs:
        p.start()
    try:
        out = dict(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert out["s0"] == out["s1"] == "ok", out
    for i in range(N_ENGINES):
        assert out[1 + i] == [[float(x + 10 * s) for x in range(5)] for s in range(N_STAGES)], out
