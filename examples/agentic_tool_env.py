"""A tool-use environment on the synthetic arithmetic task: a sandboxed Python calculator.

    m2po train examples/agentic_tools.yaml       # rollout.producer=agentic, this environment

The model decides each turn whether to call the tool. A turn that is a call -- ``calculator(12*7)``
(the syntax of the tiny tool base's chat template, ``standins/tiny_tools.py``) or a Hermes/Qwen-style
``<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>`` -- runs the
expression in a separate process with CPU, memory, file-size, process and wall-time limits
(``resource.setrlimit`` in the child) and no network (a fresh network namespace, ``unshare -rn``);
its output is the next observation (a ``tool`` message of the chat template) and the step's reward
is 0. A turn that is not a call is the answer: its last ``\\boxed{...}`` is graded (1 when it is the
problem's answer, else 0) and the episode ends. ``rollout.agentic.max_turns`` bounds the calls.

With ``model.tiny_family=qwen2_tools`` the tiny base has been warmed up to call the calculator on
products and to answer sums and differences itself (docs/agentic.md, "The tiny tool base"); the
tool matters to the reward because the model cannot multiply on its own.

The calculator accepts only arithmetic (numbers, + - * / // % ** and parentheses, checked on the
syntax tree) and evaluates with no builtins; the process limits catch what arithmetic alone can do
(``9**9**9`` runs out of CPU or memory and is killed). A turn whose tool run is cancelled (the
episode's ``step_timeout_s``) kills the tool's process group before the cancellation goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import sys
from typing import Any, Optional

from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.rollout.episodes import Environment, StepResult

# Runs in the sandbox: read one expression on stdin, check it is arithmetic, print its value.
CALCULATOR = r"""
import ast, sys
ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
           ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
src = sys.stdin.read().strip()
try:
    tree = ast.parse(src, mode="eval")
except SyntaxError:
    print("error: not an expression"); sys.exit(2)
for node in ast.walk(tree):
    if not isinstance(node, ALLOWED) or (isinstance(node, ast.Constant) and type(node.value) not in (int, float)):
        print("error: only arithmetic"); sys.exit(2)
try:
    value = eval(compile(tree, "<tool>", "eval"), {"__builtins__": {}}, {})
except Exception as e:
    print("error: " + type(e).__name__); sys.exit(2)
print(repr(value))
"""


def _limits(cpu_s: int, mem_mb: int) -> Any:
    def apply() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # writes no file
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


class Sandbox:
    """Runs one program per call in a limited, network-less child process; kills it on cancel."""

    def __init__(self, *, cpu_s: int = 1, mem_mb: int = 512, wall_s: float = 10.0, isolate_network: bool = True,
                 argv: Optional[list[str]] = None) -> None:
        self.cpu_s, self.mem_mb, self.wall_s = int(cpu_s), int(mem_mb), float(wall_s)
        self.prefix = []
        if isolate_network:
            unshare = shutil.which("unshare")
            if unshare is None:
                raise ValueError("the calculator's sandbox needs `unshare` (util-linux) for a network-less namespace; "
                                 "install it or set rollout.agentic.env_args.isolate_network=false")
            self.prefix = [unshare, "--user", "--map-root-user", "--net"]
        self.argv = argv or [sys.executable, "-I", "-S", "-c", CALCULATOR]
        self.pids: list[int] = []  # every process started (tests check they are gone)
        self._live: set = set()

    async def run(self, stdin: str) -> tuple[Optional[int], str]:
        """(exit status or None when killed for wall time, stdout) of one run."""
        proc = await asyncio.create_subprocess_exec(
            *self.prefix, *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, preexec_fn=_limits(self.cpu_s, self.mem_mb), start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        self.pids.append(proc.pid)
        self._live.add(proc)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(stdin.encode()), self.wall_s)
            return proc.returncode, out.decode(errors="replace").strip()[:200]
        except asyncio.TimeoutError:
            return None, "error: the tool ran out of time"
        finally:  # also on cancellation: no tool process outlives its call
            await self._kill(proc)

    async def _kill(self, proc: Any) -> None:
        self._live.discard(proc)
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()

    async def close(self) -> None:
        for proc in list(self._live):
            await self._kill(proc)


_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.S)
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_call(text: str) -> Optional[tuple[str, str]]:
    """(tool name, expression) when the turn calls a tool, else None (the turn is an answer)."""
    m = _HERMES.search(text)
    if m:
        try:
            call = json.loads(m.group(1))
            args = call.get("arguments") or {}
            args = json.loads(args) if isinstance(args, str) else args
            return str(call.get("name", "")), str(args.get("expression", ""))
        except (ValueError, AttributeError):
            return "", ""  # a malformed call: answered with an error observation
    m = _CALL.match(text)
    return (m.group(1), m.group(2)) if m else None


class CalculatorEnv(Environment):
    """The arithmetic task with a sandboxed calculator the model may call (module docstring)."""

    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}]

    def __init__(self, cpu_s: int = 1, mem_mb: int = 512, tool_wall_s: float = 10.0, isolate_network: bool = True,
                 tool_argv: Optional[list[str]] = None) -> None:
        self.sandbox = Sandbox(cpu_s=cpu_s, mem_mb=mem_mb, wall_s=tool_wall_s, isolate_network=isolate_network,
                               argv=tool_argv)
        self.problem, self.answer, self.calls = "", "", 0

    async def reset(self, row: Any) -> Optional[str]:
        self.problem, self.answer = row.problem, str(row.answer).strip()
        return self.problem  # the user message (the chat template adds the tools and the '=')

    async def step(self, action: str) -> StepResult:
        call = parse_call(action)
        if call is None:  # an answer
            got = (extract_last_boxed(action) or "").strip()
            return StepResult("", float(got == self.answer), True, {"tool_calls": 0, "answer": got[:32]})
        name, expr = call
        self.calls += 1
        if name != "calculator":
            return StepResult(f"error: no tool {name[:32]!r}", 0.0, False, {"tool_calls": 1, "tool_rc": None})
        rc, out = await self.sandbox.run(expr)
        if rc is not None and rc < 0 and not out:
            out = f"error: the tool was killed by signal {-rc} (it exceeded its CPU or memory limit)"
        return StepResult(out, 0.0, False, {"tool_calls": 1, "tool_rc": rc, "tool_out": out, "expr": expr[:64]})

    async def close(self) -> None:
        await self.sandbox.close()
