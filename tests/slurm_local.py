"""A real Slurm on this machine for the tests: Debian's slurm-wlm 22.05 (slurmctld + one slurmd) and
munge, with a generated slurm.conf, every file and socket in a temporary directory, free ports.

    with LocalSlurm(tmp_path) as slurm:
        job = slurm.sbatch(["--nodes=1", "scripts/slurm/m2po.sbatch", ...], cwd=REPO)
        slurm.wait_state(job, "RUNNING"); slurm.scontrol("requeue", job); ...

:func:`missing` says why it cannot run here (packages absent, not root): the test skips with that
reason; ``.ci/run`` installs the packages (``apt-get install slurm-wlm munge``), so CI runs it.
One machine hosts one slurmd, so the cluster has one node (its CPUs and memory as this machine's).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

from megatron_m2po.utils.net import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def missing() -> Optional[str]:
    if os.environ.get("M2PO_TEST_SLURM") == "0":
        return "local Slurm switched off (M2PO_TEST_SLURM=0)"
    absent = [d for d in DAEMONS if not shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin")]
    if absent:
        return f"no local Slurm: {', '.join(absent)} not installed (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "no local Slurm: slurmd runs jobs as their user only when started as root"
    return None


class LocalSlurm:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    # ----------------------------------------------------------------- set-up
    def __enter__(self) -> "LocalSlurm":
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.socket"
        sbin = "/usr/sbin"
        self.procs.append(subprocess.Popen(
            [f"{sbin}/munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}", f"--pid-file={r / 'munge/pid'}",
             f"--log-file={r / 'log/munged.log'}", f"--seed-file={r / 'munge/seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True))
        self._wait(sock.exists, "munged's socket", 30)
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        conf = r / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=m2po-test", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log/slurmctld.log'}", f"SlurmdLogFile={r / 'log/slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "JobRequeue=1", "ReturnToService=2", "KillWait=20", "MinJobAge=300",
            "SchedulerType=sched/builtin", "SlurmctldParameters=enable_configless",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem_mb} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            ""]))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        for daemon in ("slurmctld", "slurmd"):
            self.procs.append(subprocess.Popen(
                [f"{sbin}/{daemon}", "-D", "-f", str(conf)] + (["-N", self.host] if daemon == "slurmd" else []),
                env=self.env, stdout=open(r / "log" / f"{daemon}.out", "wb"), stderr=subprocess.STDOUT,
                start_new_session=True))
        self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T").stdout, "the node idle in sinfo", 60)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # ----------------------------------------------------------------- commands
    def run(self, *cmd: str, cwd: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                              timeout=60)

    def sbatch(self, args: list[str], cwd: Path, env: Optional[dict] = None) -> str:
        r = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env)
        assert r.returncode == 0, r.stdout + r.stderr + self.logs()
        return r.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job`` as key -> value (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                       for p in sorted((self.root / "log").glob("*")))

    @staticmethod
    def _wait(cond, what: str, timeout: float) -> None:
        from waiting import wait_until

        wait_until(cond, what=what, timeout=timeout)
