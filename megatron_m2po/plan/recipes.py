"""The cluster a recipe's launch script runs it on, for ``m2po plan RECIPE`` without ``--nnodes``.

Each GPU recipe ``examples/<name>.yaml`` is launched by a thin script ``scripts/run_*.sh`` that
execs ``scripts/train.sh`` on it and sets its defaults as ``export NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}``. The recipe's layout is chosen for that cluster (its header
says so), so planning it on one node is planning another run; :func:`launch_cluster` reads those
defaults so that ``m2po plan examples/qwen2.5-32b.yaml``, as the README writes it, plans the run the
script launches.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["LaunchCluster", "launch_cluster"]

_DEFAULT = r"\b{name}=\$\{{{name}:-(\d+)\}}"


@dataclass(frozen=True)
class LaunchCluster:
    nnodes: int
    gpus_per_node: int
    script: Path


def launch_cluster(config: str | os.PathLike) -> Optional[LaunchCluster]:
    """The ``NNODES`` / ``GPUS_PER_NODE`` defaults of the launch script of ``config``: a
    ``run_*.sh`` in the ``scripts/`` directory beside the config's directory that names
    ``examples/<config's file name>``; None when no script launches it (or one sets no defaults)."""
    path = Path(config).resolve()
    scripts = path.parent.parent / "scripts"
    if not scripts.is_dir():
        return None
    ref = re.compile(rf"/{re.escape(path.parent.name)}/{re.escape(path.name)}\b")
    for script in sorted(scripts.glob("run_*.sh")):
        try:
            text = script.read_text()
        except OSError:
            continue
        if not ref.search(text):
            continue
        nodes = re.search(_DEFAULT.format(name="NNODES"), text)
        gpus = re.search(_DEFAULT.format(name="GPUS_PER_NODE"), text)
        if nodes and gpus:
            return LaunchCluster(int(nodes.group(1)), int(gpus.group(1)), script)
    return None
