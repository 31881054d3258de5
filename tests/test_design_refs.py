"""Every "docs/design.md §N" reference in the code, tests and docs names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def test_design_references_resolve():
    sections = set(re.findall(r"^#{2,3} (\d+[a-z]?)\.", DESIGN.read_text(), flags=re.M))
    assert {"1", "1b", "2", "3", "4"} <= sections
    refs, stale = [], []
    for path in [*ROOT.glob("megatron_m2po/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("tools/**/*.py"),
                 *ROOT.glob("examples/*"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        if path.is_dir():
            continue
        text = path.read_text(errors="replace")
        refs += [(path.name, s) for s in re.findall(r"docs/design\.md §(\d+[a-z]?)", text)]
        if path != Path(__file__) and re.search(r"DESIGN §", text):
            stale.append(path.name)
    assert len(refs) >= 20, refs
    assert not [r for r in refs if r[1] not in sections], [r for r in refs if r[1] not in sections]
    assert not stale, f"references to a design document that is not in the repository: {stale}"
    assert "docs/design.md" in (ROOT / "README.md").read_text()
