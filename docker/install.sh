#!/usr/bin/env bash
# Installs megatron_m2po's GPU stack into an NGC PyTorch image; docker/Dockerfile runs it.
#
#   docker/install.sh [SRC_DIR]            install (inside the NGC container)
#   docker/install.sh --dry-run [SRC_DIR]  print the commands, run nothing
#   docker/install.sh --check              validate the pinned requirement lines (any CPU machine)
#   docker/install.sh --print-requirements
#
# Two Python environments, because SGLang pins its own torch (sglang 0.5.23: torch==2.14.1,
# transformers==5.19.0) while Megatron-Core must keep the NGC build of torch, transformer-engine
# and apex:
#   * the NGC python (trainer): megatron-core, mbridge, math-verify, ray, sglang-router,
#     nvidia-modelopt and this package, installed under the image's PIP_CONSTRAINT so pip can never
#     replace the NGC torch; transformer-engine and apex are never pip-installed (they come with the
#     image; PyPI `apex` is an unrelated project);
#   * /opt/sglang (a venv): the SGLang engines, which only talk HTTP (and NCCL for weight sync) to
#     the trainer. Engine launchers use $SGLANG_PYTHON.
set -euo pipefail

TRAIN_REQS=(
  "megatron-core==0.16.1"
  "mbridge==0.15.1"
  "math-verify==0.9.0"
  "ray[default]==2.60.0"
  "sglang-router==0.3.2"
  "nvidia-modelopt[torch]==0.47.0"
)
SGLANG_REQS=("sglang==0.5.23")
SGLANG_VENV=${SGLANG_VENV:-/opt/sglang}
# megatron-core 0.16.1 is tested with transformer-engine >=2.9,<2.12 (its [dev] extra).
TE_MIN=2.9 TE_MAX=2.12
PY=${PYTHON:-python3}

mode=install
src=
for a in "$@"; do
  case "$a" in
    --dry-run) mode=dry ;;
    --check) mode=check ;;
    --print-requirements) mode=print ;;
    -*) echo "install.sh: unknown option $a" >&2; exit 2 ;;
    *) src=$a ;;
  esac
done
src=${src:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

if [ "$mode" = print ]; then
  printf 'train %s\n' "${TRAIN_REQS[@]}"
  printf 'sglang %s\n' "${SGLANG_REQS[@]}"
  exit 0
fi

if [ "$mode" = check ]; then
  # Every line parses, is pinned exactly, names nothing the base image owns, and agrees with the
  # CPU pins in constraints-cpu.txt (the versions CI tests).
  "$PY" - "$src/constraints-cpu.txt" "${TRAIN_REQS[@]}" "${SGLANG_REQS[@]}" <<'PYEOF'
import re, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
owned = {"torch", "apex", "transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
         "transformer-engine-cu13", "flash-attn", "triton"}
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        n, v = line.split("==", 1)
        pins[canonicalize_name(n)] = v.strip()
bad = []
reqs = sys.argv[2:]
if not reqs:
    sys.exit("install.sh --check: no requirement lines")
for line in reqs:
    r = Requirement(line)
    name = canonicalize_name(r.name)
    spec = list(r.specifier)
    if name in owned or name.startswith("transformer-engine"):
        bad.append(f"{line}: {name} comes with the NGC base image and must not be pip-installed")
    if len(spec) != 1 or spec[0].operator != "==":
        bad.append(f"{line}: pin an exact version (==)")
    elif name in pins and pins[name] != spec[0].version:
        bad.append(f"{line}: constraints-cpu.txt pins {name}=={pins[name]}; keep CPU and GPU in step")
if bad:
    print("install.sh --check failed:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"install.sh --check: {len(reqs)} requirement lines ok")
PYEOF
  exit $?
fi

run() {
  echo "+ $*"
  if [ "$mode" = install ]; then "$@"; fi
}

if [ "$mode" = install ]; then
  "$PY" - "$TE_MIN" "$TE_MAX" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.version import Version
missing = []
for mod in ("torch", "transformer_engine", "apex"):
    try:
        __import__(mod)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{mod} ({e.__class__.__name__}: {e})")
if missing:
    sys.exit("install.sh: the base image lacks " + ", ".join(missing) +
             "; build FROM an NGC PyTorch image (nvcr.io/nvidia/pytorch:YY.MM-py3)")
te = None
for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
    try:
        te = Version(version(dist)); break
    except PackageNotFoundError:
        pass
lo, hi = Version(sys.argv[1]), Version(sys.argv[2])
if te is not None and not (lo <= Version(te.base_version) < hi):
    msg = f"transformer-engine {te} is outside megatron-core 0.16.1's tested range [{lo}, {hi})"
    import os
    if os.environ.get("M2PO_ALLOW_TE_MISMATCH") != "1":
        sys.exit(f"install.sh: {msg}; pick an NGC tag whose TE is in range or set M2PO_ALLOW_TE_MISMATCH=1")
    print("warning:", msg)
PYEOF
  torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
fi

# Trainer side, into the NGC python, under the image's PIP_CONSTRAINT (keeps its torch).
run "$PY" -m pip install --no-cache-dir "${TRAIN_REQS[@]}"
run "$PY" -m pip install --no-cache-dir "$src"

# Engines: a separate venv with SGLang's own torch (NGC's constraint file must not apply there).
run "$PY" -m venv "$SGLANG_VENV"
run env PIP_CONSTRAINT= "$SGLANG_VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
run env PIP_CONSTRAINT= "$SGLANG_VENV/bin/python" -m pip install --no-cache-dir "${SGLANG_REQS[@]}"

if [ "$mode" = install ]; then
  torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
  if [ "$torch_before" != "$torch_after" ]; then
    echo "install.sh: pip replaced the NGC torch ($torch_before -> $torch_after); a requirement pulled another torch" >&2
    exit 1
  fi
  "$PY" -c 'import megatron.core, mbridge, math_verify, ray, sglang_router, modelopt.torch, transformer_engine, apex, megatron_m2po; print("trainer env ok")'
  "$SGLANG_VENV/bin/python" -c 'import sglang; print("sglang", sglang.__version__, "ok")'
fi
