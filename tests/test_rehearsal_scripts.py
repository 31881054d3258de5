"""The rehearsal finds the launch scripts when the package is installed non-editable (the
image's ``pip install /opt/megatron_m2po``): site-packages has no ``scripts/`` beside the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from pathlib import Path
from megatron_m2po import rehearsal
out = {"module": rehearsal.__file__}
for name, config in (("in repo", sys.argv[1]), ("outside", sys.argv[2])):
    try:
        out[name] = str(rehearsal.find_scripts(Path(config)))
    except rehearsal.RehearsalError as e:
        out[name] = "error: " + str(e)
print(json.dumps(out))
"""


def _probe(target: Path, cwd: Path, config_in_repo: Path, config_outside: Path, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("M2PO_SCRIPTS_DIR", "PYTHONPATH")}
    full.update(PYTHONPATH=str(target), **env)
    r = subprocess.run([sys.executable, "-c", PROBE, str(config_in_repo), str(config_outside)], cwd=cwd, env=full,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_rehearsal_finds_scripts_from_a_non_editable_install(tmp_path):
    src = tmp_path / "src"  # build from a copy: an in-tree build would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "megatron_m2po", src / "megatron_m2po", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site-packages"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (target / "scripts").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / "my_recipe.yaml"
    outside.write_text("model:\n  hf_path: tiny\n")
    in_repo = ROOT / "examples" / "qwen2.5-32b.yaml"

    got = _probe(target, elsewhere, in_repo, outside)
    assert Path(got["module"]).is_relative_to(target), got  # the installed copy, not this checkout
    assert got["in repo"] == str(ROOT / "scripts")  # the recipe's checkout
    # nowhere to find them: the error names every place looked at and what to set
    err = got["outside"]
    assert err.startswith("error: no scripts/ directory with train.sh and launch_sglang_fleet.sh found"), err
    for place in (f"this package's checkout: {target / 'scripts'}", f"the recipe's checkout: {tmp_path / 'scripts'}",
                  f"the working directory: {elsewhere / 'scripts'}", "set M2PO_SCRIPTS_DIR"):
        assert place in err, (place, err)

    # the image's way: M2PO_SCRIPTS_DIR (docker/Dockerfile sets it); a directory without the
    # launchers is passed over
    got = _probe(target, elsewhere, in_repo, outside, M2PO_SCRIPTS_DIR=str(ROOT / "scripts"))
    assert got["outside"] == str(ROOT / "scripts")
    got = _probe(target, elsewhere, in_repo, outside, M2PO_SCRIPTS_DIR=str(tmp_path))
    assert got["outside"].startswith("error:") and f"$M2PO_SCRIPTS_DIR: {tmp_path};" in got["outside"]
    # run from a checkout: scripts/ under the working directory
    assert _probe(target, ROOT, in_repo, outside)["outside"] == str(ROOT / "scripts")
