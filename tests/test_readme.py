"""The README is a front page (issue 28): short, every link resolves, every preset and command it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.run.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(path.read_text(encoding="utf-8"))]


def test_the_readme_is_a_front_page_of_at_most_150_lines() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    # the two set-up commands come first, as CI runs the second one
    first_block = text.split("```")[1]
    assert "secagg run" in first_block and "pytest" in first_block and "torch==2.13.0" in first_block
    assert "../shared" not in text, "the front page speaks to a user who has only the repository"


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+://", target) or target.startswith(("#", "mailto:")):
            continue
        file = target.split("#", 1)[0]
        if file and not (page.parent / file).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


def test_the_presets_the_readme_names_exist() -> None:
    text = README.read_text(encoding="utf-8")
    papers = text.split("## The papers", 1)[1].split("## Threat models", 1)[0]
    named = set()
    for row in papers.splitlines():
        cells = row.split("|")
        if len(cells) > 3 and "`" in cells[2]:
            named |= {n for n in re.findall(r"`([a-z0-9+-]+)`", cells[2]) if not n.startswith("-")}
    assert len(named) >= 20, named
    assert named <= set(PRESETS), sorted(named - set(PRESETS))


def test_the_attack_commands_the_readme_names_exist(capsys) -> None:
    from experiments.cli import main

    text = README.read_text(encoding="utf-8")
    for paper in ("fedmf", "sttfedrec", "fedfast", "lightfr", "fel", "fedcl"):
        assert f"`{paper}" in text
        with pytest.raises(SystemExit) as done:
            main(["attack", paper, "--help"])
        assert done.value.code == 0
        assert "usage" in capsys.readouterr().out


def test_the_licence_is_the_one_pyproject_declares() -> None:
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
