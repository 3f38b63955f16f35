"""Plugins (issue 28, item 5): a protocol and an attack from outside the repository, registered through
``--plugin MODULE`` or an entry point, run, resume and get attacked like the built-in ones.

The plugin package is the one docs/plugins.md shows: this test writes the page's code blocks into a
temporary package, so the page's examples are exactly what runs here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attacks import registry as attack_registry
from experiments.cli import main
from protocols import registry

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "plugins.md"

TOY = """
[run]
protocol = "toy"
rounds = 3
[data]
synthetic_users = 40
synthetic_items = 120
synthetic_mean_interactions = 8
[eval]
negatives = 20
[toy]
smoothing = 0.5
"""


def page_files() -> dict[str, str]:
    """``{relative path: code}`` of the page's Python blocks that open with ``# toy_plugin/<name>.py``."""
    out = {}
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S):
        m = re.match(r"# (toy_plugin/\w+\.py)\n", block)
        if m:
            out[m.group(1)] = block
    return out


def forget_toy() -> None:
    """Undo what importing the plugin did in this process (as if a new process started)."""
    registry._REGISTRY.pop("toy", None)
    registry._ORIGIN.pop("toy", None)
    if "toy_plugin" in registry._PLUGINS:
        registry._PLUGINS.remove("toy_plugin")
    attack_registry._REGISTRY.pop(("toy", "toy-counts"), None)
    for name in [m for m in sys.modules if m == "toy_plugin" or m.startswith("toy_plugin.")]:
        del sys.modules[name]


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "site"
    for rel, code in page_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    monkeypatch.syspath_prepend(str(root))
    forget_toy()
    yield root
    forget_toy()


@pytest.fixture
def toy_config(tmp_path: Path) -> Path:
    path = tmp_path / "toy.toml"
    path.write_text(TOY)
    return path


def test_the_page_shows_a_short_protocol_and_attack() -> None:
    files = page_files()
    assert set(files) == {"toy_plugin/protocol.py", "toy_plugin/attack.py", "toy_plugin/__init__.py"}
    lines = {rel: len(code.strip().splitlines()) for rel, code in files.items()}
    assert 25 <= lines["toy_plugin/protocol.py"] <= 60 and 15 <= lines["toy_plugin/attack.py"] <= 35, lines
    assert "secagg_fedrec.protocols" in PAGE.read_text() and "secagg_fedrec.attacks" in PAGE.read_text()


def test_builtin_protocol_names_match_the_registry() -> None:
    """``secagg run --help`` lists :data:`BUILTIN_PROTOCOLS` without importing them: they must be the
    names the built-in modules register, in order."""
    builtin = [n for n, s in registry.all_protocols().items() if getattr(s.build, "__module__", "").startswith("protocols.")]
    assert builtin == list(registry.BUILTIN_PROTOCOLS)
    assert all(registry.plugin_of(n) is None for n in builtin)


def test_run_resume_report_and_attack_a_plugin_protocol(plugin_dir: Path, toy_config: Path, tmp_path: Path,
                                                         capsys) -> None:
    out = tmp_path / "toy-run"
    assert main(["run", "--plugin", "toy_plugin", "--config", str(toy_config), "--out", str(out), "--rounds", "2",
                 "--quiet"]) == 0
    assert json.loads((out / "run.json").read_text())["plugins"] == ["toy_plugin"]
    assert registry.plugin_of("toy") == "toy_plugin"
    forget_toy()  # a new process: nothing registered, only the run directory remembers the plugin
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--rounds", "3", "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["protocol"] == "toy" and summary["rounds"] == 3
    assert "each client's item counts, in plaintext" in summary["privacy"]["statement"]
    assert [json.loads(x)["round"] for x in (out / "costs.jsonl").read_text().splitlines()] == [0, 1, 2]
    forget_toy()
    assert main(["attack", str(out), "--json"]) == 0  # no views recorded: a replay of its first round
    printed = capsys.readouterr().out
    result = json.loads(printed.splitlines()[-1])
    assert result["protocol"] == "toy" and result["source"] == "replay of 1 round(s)" and result["skipped"] == []
    assert result["replay_matches_run"] is True  # no DP noise: the replay is the run's own view
    [a] = result["findings"]
    assert a["attack"] == "toy-counts" and a["role"] == "server" and a["metric"] == "f1"
    assert a["value"] == 1.0 and a["random"] < 0.2 and a["advantage"] == 1.0 and a["status"] == "every rated set recovered"
    assert json.loads((out / "attacks.json").read_text()) == result
    assert main(["privacy", "report", str(out)]) == 0
    assert "each client's item counts, in plaintext" in capsys.readouterr().out


def test_a_missing_plugin_is_refused_in_words(plugin_dir: Path, toy_config: Path, tmp_path: Path, capsys,
                                             monkeypatch) -> None:
    out = tmp_path / "toy-run"
    assert main(["--plugin", "toy_plugin", "run", "--config", str(toy_config), "--out", str(out), "--rounds", "1",
                 "--quiet"]) == 0  # --plugin before the sub-command works too
    forget_toy()
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    sys.path.remove(str(plugin_dir))  # the package is gone from this machine
    capsys.readouterr()
    for argv in (["run", "--resume", str(out), "--rounds", "2"], ["attack", "run-dir", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"cannot continue {out}" in err and "plugin module 'toy_plugin'" in err, err
        assert "No module named 'toy_plugin'" in err and "Traceback" not in err
    assert main(["run", "--plugin", "no_such_plugin_module", "--config", str(toy_config)]) == 2
    assert "plugin module 'no_such_plugin_module' (--plugin) cannot be imported" in capsys.readouterr().err
    assert len((out / "costs.jsonl").read_text().splitlines()) == 1  # the refused resume changed nothing


def test_a_plugin_cannot_take_a_builtin_name(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "bad_plugin.py").write_text(
        "from protocols.registry import ProtocolSpec, register\n"
        "register(ProtocolSpec(name='fedavg', summary='impostor', build=lambda ctx: None))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["run", "--plugin", "bad_plugin", "--rounds", "1"]) == 2
    finally:
        sys.modules.pop("bad_plugin", None)
    assert "protocol 'fedavg' is registered twice" in capsys.readouterr().err
    assert registry.get_protocol("fedavg").summary != "impostor"


def test_entry_points_register_without_a_flag(plugin_dir: Path, toy_config: Path, tmp_path: Path) -> None:
    """An installed package (here: a dist-info directory on the path) is found through its entry points
    by a fresh ``secagg`` process: run, then attack, with no --plugin anywhere."""
    dist = plugin_dir / "toy_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[secagg_fedrec.protocols]\ntoy = toy_plugin\n\n[secagg_fedrec.attacks]\ntoy = toy_plugin\n")
    out = tmp_path / "ep-run"
    script = (
        "import sys\nfrom experiments.cli import main\n"
        f"assert main(['run', '--config', {str(toy_config)!r}, '--out', {str(out)!r}, '--quiet']) == 0\n"
        f"sys.exit(main(['attack', 'run-dir', {str(out)!r}, '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": f"{plugin_dir}:{ROOT}"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "run.json").read_text())["plugins"] == ["toy_plugin"]  # the entry point's module
    assert json.loads(proc.stdout.strip().splitlines()[-1])["findings"][0]["value"] == 1.0
