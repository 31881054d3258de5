#!/usr/bin/env bash
# Installs megatron_m2po's GPU stack into an NGC PyTorch image; docker/Dockerfile runs it.
#
#   docker/install.sh [SRC_DIR]            install (inside the NGC container)
#   docker/install.sh --dry-run [SRC_DIR]  print the commands, run nothing
#   docker/install.sh --check              validate the requirements against constraints-cpu.txt (any CPU machine)
#   docker/install.sh --print-requirements the requirement lines, pinned, per environment
#
# Two Python environments, because SGLang pins its own torch (sglang 0.5.23: torch==2.14.1,
# transformers==5.19.0) while Megatron-Core must keep the NGC build of torch, transformer-engine
# and (where the image has it; optional) apex:
#   * the NGC python (trainer): megatron-core, mbridge, math-verify, ray, sglang-router,
#     nvidia-modelopt and this package, installed under the image's PIP_CONSTRAINT so pip can never
#     replace the NGC torch; transformer-engine and apex are never pip-installed (they come with the
#     image; PyPI `apex` is an unrelated project);
#   * /opt/sglang (a venv): the SGLang engines, which only talk HTTP (and NCCL for weight sync) to
#     the trainer. Engine launchers use $SGLANG_PYTHON.
#
# Versions: constraints-cpu.txt (the versions CI tests) is the one list of pins. TRAIN_REQS names
# packages only; each is installed at its constraints-cpu.txt version, and every trainer install
# runs with a constraints file derived from it (transformers, tokenizers, numpy ... at CI's
# versions), less the packages the base image owns (torch, triton, TE, apex, flash-attn) and any
# package the image's own PIP_CONSTRAINT pins (the image's pin wins; install.sh lists them).
#
#   docker/install.sh --print-constraints  the derived constraints file, as the install uses it
#   docker/install.sh --venv DIR           only create the engine venv at DIR (pip included)
#   docker/install.sh --check-base         only check this python's base packages (torch, TE; apex optional)
#   docker/install.sh --check-nccl         compare the NCCL the trainer's (under its preload) and the engines' torch load; exit 1 on a mismatch
#   docker/install.sh --compare-nccl       exit 1 unless the engines' NCCL is at least the trainer's own (the one to preload)
#   docker/install.sh --plugin-project DIR write the engine-side SGLang plugin's project (rollout/sglang_plugin.py) to DIR
#
# One NCCL. NCCL refuses a communicator whose ranks run different builds ("Mismatched NCCL version
# detected", NCCL src/init.cc), and a distributed weight push is one communicator of the trainer's
# sender and the engines. The engines' torch (PyPI, SGLang's pin) finds its pinned nvidia-nccl wheel
# through its DT_RPATH, which LD_LIBRARY_PATH cannot override; the NGC torch links the image's
# libnccl.so.2. NCCL keeps its ABI backward compatible within major version 2, so the newer of the
# two serves both, and only the newer may be preloaded into the other torch (an older libnccl under
# a newer torch fails with an undefined symbol). The engines' NCCL must therefore be the newer one
# (or the same): --compare-nccl (run by the install) stops the build otherwise, naming both. The
# install links the engines' libnccl.so.2 at $NCCL_LINK; the image names it in M2PO_NCCL_PRELOAD and
# scripts/train.sh preloads it (LD_PRELOAD) for the trainer's processes only -- the engines' RPATH
# already finds the same file, and nothing else in the image (compilers Triton and TE spawn, Ray's
# daemons, reward sandboxes) loads it. --check-nccl (run by the Dockerfile) asks the trainer's
# Python under that preload and the engines' Python as they start, and stops the build when their
# torch.cuda.nccl.version() differ, naming both. At run time the trainer compares again when its
# weight-update groups form (the plugin below, weights/nccl_handshake.py).
# The engine venv also gets megatron_m2po's SGLang plugin (entry point sglang.srt.plugins), which
# states each engine rank's NCCL version in the group's store.
set -euo pipefail

TRAIN_REQS=(
  "megatron-core"
  "mbridge"
  "math-verify"
  "ray[default]"
  "sglang-router"
  "nvidia-modelopt[torch]"
)
SGLANG_REQS=("sglang==0.5.23")
SGLANG_VENV=${SGLANG_VENV:-/opt/sglang}
NCCL_LINK=${NCCL_LINK:-${M2PO_NCCL_PRELOAD:-/opt/m2po-nccl/libnccl.so.2}}
# megatron-core 0.16.1 is tested with transformer-engine >=2.9,<2.12 (its [dev] extra).
TE_MIN=2.9 TE_MAX=2.12
PY=${PYTHON:-python3}

mode=install
src=
venv_dir=
want_venv=0
for a in "$@"; do
  if [ "$want_venv" = 1 ]; then venv_dir=$a; want_venv=0; continue; fi
  case "$a" in
    --dry-run) mode=dry ;;
    --check) mode=check ;;
    --print-requirements) mode=print ;;
    --print-constraints) mode=constraints ;;
    --check-base) mode=base ;;
    --check-nccl) mode=nccl ;;
    --compare-nccl) mode=compare ;;
    --plugin-project) mode=plugin; want_venv=1 ;;
    --venv) mode=venv; want_venv=1 ;;
    -*) echo "install.sh: unknown option $a" >&2; exit 2 ;;
    *) src=$a ;;
  esac
done
if [ "$mode" = venv ] && [ -z "$venv_dir" ]; then echo "install.sh: --venv needs a directory" >&2; exit 2; fi
if [ "$mode" = plugin ] && [ -z "$venv_dir" ]; then echo "install.sh: --plugin-project needs a directory" >&2; exit 2; fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)  # the checkout this script is in: its pins
src=${src:-$here}
[ -f "$here/constraints-cpu.txt" ] || { echo "install.sh: $here/constraints-cpu.txt is missing (the pins)" >&2; exit 2; }

# pins --requirements "ENV REQ"... | --constraints: resolves the trainer requirements against this
# checkout's constraints-cpu.txt and checks them (pinned exactly there, nothing the base image
# owns; SGLang lines pinned exactly here). Prints
# "train name[extras]==version" / "sglang line" rows, or the derived constraints file with
# --constraints. Reads the image's PIP_CONSTRAINT files (space-separated paths) when they exist.
pins() {
  "$PY" - "$here/constraints-cpu.txt" "$@" <<'PYEOF'
import os, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

OWNED = {"torch", "apex", "triton", "flash-attn", "flash-attn-3", "pytorch-triton"}  # the NGC image's


def owned(name):
    return name in OWNED or name.startswith("transformer-engine")


def read_pins(path):
    pins = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            r = Requirement(line)
            spec = list(r.specifier)
            if len(spec) == 1 and spec[0].operator == "==":
                pins[canonicalize_name(r.name)] = (r.name, spec[0].version)
    return pins


path, what, *reqs = sys.argv[1:]
cpu = read_pins(path)
bad = []
if what == "--constraints":
    image = {}
    for f in os.environ.get("PIP_CONSTRAINT", "").split():
        if os.path.isfile(f):
            image.update(read_pins(f))
    out, dropped = [], []
    for key, (name, ver) in sorted(cpu.items()):
        if owned(key):
            continue
        if key in image:
            if image[key][1] != ver:
                dropped.append(f"{name}=={ver} (the image pins {image[key][1]})")
            continue
        out.append(f"{name}=={ver}")
    if dropped:
        print("install.sh: warning: the base image's PIP_CONSTRAINT wins over constraints-cpu.txt for: "
              + ", ".join(dropped), file=sys.stderr)
    print(f"# derived by docker/install.sh from constraints-cpu.txt: {len(out)} pins")
    print("\n".join(out))
    sys.exit(0)
if not reqs:
    sys.exit("install.sh: no requirement lines")
rows = []
for line in reqs:
    env, _, req = line.partition(" ")
    r = Requirement(req)
    key = canonicalize_name(r.name)
    if owned(key):
        bad.append(f"{req}: {key} comes with the NGC base image and must not be pip-installed")
        continue
    if env == "sglang":
        spec = list(r.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            bad.append(f"{req}: pin an exact version (==)")
        rows.append(f"sglang {req}")
        continue
    if r.specifier:
        bad.append(f"{req}: TRAIN_REQS names packages only; the version comes from constraints-cpu.txt")
    elif key not in cpu:
        bad.append(f"{req}: constraints-cpu.txt has no exact pin for {key}; add it there (the versions CI tests)")
    else:
        extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
        rows.append(f"train {r.name}{extras}=={cpu[key][1]}")
if bad:
    print("install.sh: requirement check failed:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print("\n".join(rows))
PYEOF
}

# nccl_version [env ...] PYTHON: the NCCL version that PYTHON's torch loads (major.minor.patch).
nccl_version() {
  "$@" -c 'import torch; v = torch.cuda.nccl.version(); print(".".join(map(str, v)) if isinstance(v, tuple) else v)'
}

# check_nccl: the trainer's python ($PY, under the preload scripts/train.sh applies) and the engines'
# ($SGLANG_VENV/bin/python, as they start: no preload) load one NCCL.
check_nccl() {
  local t e
  t=$(LD_PRELOAD="$NCCL_LINK${LD_PRELOAD:+:$LD_PRELOAD}" nccl_version "$PY") || {
    echo "install.sh: could not ask $PY for its NCCL version (above)" >&2; exit 1; }
  e=$(nccl_version env -u LD_PRELOAD "$SGLANG_VENV/bin/python") || {
    echo "install.sh: could not ask $SGLANG_VENV/bin/python for its NCCL version (above)" >&2; exit 1; }
  if [ "$t" != "$e" ]; then
    echo "install.sh: NCCL mismatch: the trainer ($PY, with LD_PRELOAD=$NCCL_LINK as scripts/train.sh sets it from" \
      "M2PO_NCCL_PRELOAD) loads NCCL $t, the engines ($SGLANG_VENV/bin/python) load NCCL $e; distributed weight" \
      "pushes would all be refused. Link the engines' libnccl.so.2 at $NCCL_LINK (docker/install.sh does) or" \
      "rebuild with one torch for both" >&2
    exit 1
  fi
  echo "install.sh: one NCCL for trainer and engines: $t"
}

# compare_nccl: the engines' NCCL (what the trainer will preload) is at least the trainer's own; a
# newer image NCCL under an older preloaded one would fail with undefined symbols at import.
compare_nccl() {
  local t e
  t=$(nccl_version env -u LD_PRELOAD "$PY") || {
    echo "install.sh: could not ask $PY for its NCCL version (above)" >&2; exit 1; }
  e=$(nccl_version env -u LD_PRELOAD "$SGLANG_VENV/bin/python") || {
    echo "install.sh: could not ask $SGLANG_VENV/bin/python for its NCCL version (above)" >&2; exit 1; }
  if [ "$(printf '%s\n%s\n' "$t" "$e" | sort -V | tail -n 1)" != "$e" ]; then
    echo "install.sh: the image's NCCL $t (trainer, $PY) is newer than the engines' NCCL $e ($SGLANG_VENV/bin/python);" \
      "the trainer can only preload the newer of the two, and the engines load theirs through their torch's RPATH." \
      "Use an NGC tag whose NCCL is at most $e, or an SGLang whose torch pins NCCL $t or newer" >&2
    exit 1
  fi
  echo "install.sh: the engines' NCCL $e serves the trainer (its own: $t)"
}

# plugin_project DIR: the engine-side SGLang plugin as a pip-installable project.
plugin_project() {
  mkdir -p "$1"
  cp "$src/megatron_m2po/rollout/sglang_plugin.py" "$1/m2po_sglang_plugin.py"
  cat >"$1/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "m2po-sglang-plugin"
version = "1.0.0"
description = "megatron_m2po's SGLang plugin: states the engine's NCCL version when a weight-update group forms"
requires-python = ">=3.10"

[tool.setuptools]
py-modules = ["m2po_sglang_plugin"]

[project.entry-points."sglang.srt.plugins"]
m2po_nccl_handshake = "m2po_sglang_plugin:register"
TOML
}

if [ "$mode" = nccl ]; then
  check_nccl
  exit 0
fi
if [ "$mode" = compare ]; then
  compare_nccl
  exit 0
fi
if [ "$mode" = plugin ]; then
  plugin_project "$venv_dir"
  echo "install.sh: plugin project in $venv_dir"
  exit 0
fi

req_rows=$(pins --requirements "${TRAIN_REQS[@]/#/train }" "${SGLANG_REQS[@]/#/sglang }")
if [ "$mode" = print ]; then
  echo "$req_rows"
  exit 0
fi
if [ "$mode" = check ]; then
  pins --constraints >/dev/null
  echo "install.sh --check: $(echo "$req_rows" | wc -l) requirement lines ok"
  exit 0
fi
if [ "$mode" = constraints ]; then
  pins --constraints
  exit 0
fi
mapfile -t train_pinned < <(echo "$req_rows" | sed -n 's/^train //p')
mapfile -t sglang_pinned < <(echo "$req_rows" | sed -n 's/^sglang //p')

run() {
  echo "+ $*"
  if [ "$mode" = install ] || [ "$mode" = venv ]; then "$@"; fi
}

# make_venv DIR: a venv with pip that does not need ensurepip. `python3 -m venv DIR` runs
# ensurepip, which Debian / Ubuntu pythons (an NGC image's) ship only in the python3-venv package;
# the image need not have it. The stdlib venv module creates the venv --without-pip, and the
# image's own pip installs pip into it (`pip --python`, pip >= 22.3: pip runs under the venv's
# interpreter and installs there). No get-pip.py from the network, and nothing added to the
# trainer's python (SGLang's torch must never reach it, so it cannot go there either).
make_venv() {
  if [ "$mode" != dry ] && ! "$PY" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))'; then
    echo "install.sh: $PY's pip is older than 22.3 (no --python option); upgrade it first: $PY -m pip install -U pip" >&2
    exit 1
  fi
  run "$PY" -m venv --without-pip "$1"
  run env PIP_CONSTRAINT= "$PY" -m pip --python "$1/bin/python" install --no-cache-dir --upgrade pip
}

if [ "$mode" = venv ]; then
  make_venv "$venv_dir"
  "$venv_dir/bin/python" -m pip --version
  exit 0
fi

if [ "$mode" = install ] || [ "$mode" = base ]; then
  "$PY" - "$TE_MIN" "$TE_MAX" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.version import Version
missing = []
for mod in ("torch", "transformer_engine"):
    try:
        __import__(mod)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{mod} ({e.__class__.__name__}: {e})")
if missing:
    sys.exit("install.sh: the base image lacks " + ", ".join(missing) +
             "; build FROM an NGC PyTorch image (nvcr.io/nvidia/pytorch:YY.MM-py3)")
try:  # optional: Megatron-Core uses TE's kernels first and falls back to apex, then to torch
    __import__("apex")
except Exception as e:  # noqa: BLE001
    print(f"install.sh: note: NVIDIA apex is not importable ({e.__class__.__name__}: {e}); megatron_m2po does "
          "not need it (Transformer Engine provides the fused optimizer and kernels)")
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
print(f"install.sh: base image ok: torch, transformer-engine {te or '(version unknown)'}")
PYEOF
  if [ "$mode" = base ]; then exit 0; fi
  torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
fi

# Trainer side, into the NGC python, under the image's PIP_CONSTRAINT (keeps its torch) and the
# constraints derived from constraints-cpu.txt (CI's versions of everything else).
constraints=${TMPDIR:-/tmp}/m2po-train-constraints.txt
if [ "$mode" = install ]; then pins --constraints >"$constraints"; fi
run "$PY" -m pip install --no-cache-dir -c "$constraints" "${train_pinned[@]}"
run "$PY" -m pip install --no-cache-dir -c "$constraints" "$src"

# Engines: a separate venv with SGLang's own torch (NGC's constraint file must not apply there).
make_venv "$SGLANG_VENV"
run env PIP_CONSTRAINT= "$SGLANG_VENV/bin/python" -m pip install --no-cache-dir "${sglang_pinned[@]}"
plugin_dir=${TMPDIR:-/tmp}/m2po-sglang-plugin
if [ "$mode" = install ]; then plugin_project "$plugin_dir"; fi
run env PIP_CONSTRAINT= "$SGLANG_VENV/bin/python" -m pip install --no-cache-dir "$plugin_dir"

# One NCCL (header): link the library the engines' torch loads, for the trainer's preload.
if [ "$mode" = install ]; then
  compare_nccl
  engine_nccl=$("$SGLANG_VENV/bin/python" - <<'PYEOF'
import glob, os, site, sys
import torch  # noqa: F401 - loads libnccl.so.2 through the torch wheel's RPATH
maps = [ln.split()[-1] for ln in open("/proc/self/maps") if "libnccl.so" in ln.split()[-1]]
found = maps or [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so.2"), recursive=True)]
if not found:
    sys.exit("install.sh: the engines' torch loads no libnccl.so.2 and the engine venv has none")
print(os.path.realpath(found[0]))
PYEOF
)
  echo "install.sh: the engines' NCCL: $engine_nccl"
fi
run mkdir -p "$(dirname "$NCCL_LINK")"
run ln -sf "${engine_nccl:-<the libnccl.so.2 the engines load>}" "$NCCL_LINK"

if [ "$mode" = install ]; then
  torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
  if [ "$torch_before" != "$torch_after" ]; then
    echo "install.sh: pip replaced the NGC torch ($torch_before -> $torch_after); a requirement pulled another torch" >&2
    exit 1
  fi
  "$PY" -c 'import megatron.core, mbridge, math_verify, ray, sglang_router, modelopt.torch, transformer_engine, megatron_m2po; print("trainer env ok")'
  "$PY" -m pip check || echo "install.sh: warning: pip check reports conflicts (above)" >&2
  "$SGLANG_VENV/bin/python" -c 'import sglang; print("sglang", sglang.__version__, "ok")'
  "$SGLANG_VENV/bin/python" -c 'from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(p.name == "m2po_nccl_handshake" for p in e(group="sglang.srt.plugins")) else "install.sh: the m2po SGLang plugin is not registered in the engine venv")'
  check_nccl
fi
