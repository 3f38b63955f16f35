"""A newcomer's first minutes with ``secagg`` (issue 28, item 3): help and errors that answer at once
(no torch, scipy or protocol imported for them), presets described once, "did you mean", ``--eval-every``,
help texts that print what they mean, the interrupt message, strict JSON, and the slow-round note.

Import checks, not timings: the machine is shared, so the test asserts what a fast help needs (nothing
heavy in ``sys.modules``), never a wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.run import config as cfgmod
from experiments import jsonio
from experiments.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

TINY = """
[run]
rounds = {rounds}
[data]
synthetic_users = 40
synthetic_items = 100
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fedavg]
dim = 8
"""

#: Modules whose presence in ``sys.modules`` means a help text or a user error paid seconds for nothing.
HEAVY = ("torch", "scipy", "numpy", "matplotlib", "flwr")

#: Run in a fresh interpreter: every parser's help, then user errors; print what got imported.
PROBE = r"""
import argparse, contextlib, io, json, sys
from experiments.cli import build_parser, main

def walk(parser, path):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, path + [name])

helps = {}
for argv in (["--help"], ["run", "--help"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code == 0, exc.code
    helps[" ".join(argv)] = out.getvalue()
after_help = sorted(sys.modules)
for path, parser in walk(build_parser(), []):
    helps[" ".join(path + ["--help"])] = parser.format_help()
after_every_help = sorted(sys.modules)
codes = {}
for argv in (["run", "fedavg-gmff"], ["run", "--rounds", "-1"], ["run", "--eval-every", "-2"],
             ["run", "--config", "/nonexistent/x.toml"], ["run", "--resume", "/nonexistent/run"],
             ["privacy", "report", "/nonexistent/run"], ["privacy", "account", "--mechanism", "gaussian"],
             ["compare", "/nonexistent/run"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        codes[" ".join(argv)] = [main(argv), err.getvalue()]
print(json.dumps({"after_help": after_help, "after_every_help": after_every_help, "after_errors": sorted(sys.modules),
                  "helps": helps, "codes": codes}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    from protocols.registry import PROTOCOL_MODULES

    return sorted(m for m in modules if m.split(".")[0] in HEAVY or m in PROTOCOL_MODULES
                  or m.startswith(("dp.", "attacks.", "recmodels.")) or m in ("dp", "protocols.secure_sum"))


def test_help_imports_neither_torch_nor_scipy_nor_a_protocol(probe: dict) -> None:
    assert "torch" not in probe["after_help"] and "scipy" not in probe["after_help"]
    assert _heavy(probe["after_help"]) == []
    assert _heavy(probe["after_every_help"]) == []  # every sub-command's --help too


def test_user_errors_answer_without_the_heavy_imports(probe: dict) -> None:
    for argv, (code, err) in probe["codes"].items():
        assert code == 2, argv
        assert err.startswith("secagg: error: ") and "Traceback" not in err, (argv, err)
    assert _heavy(probe["after_errors"]) == []


def test_run_help_lists_each_preset_once_with_its_description(probe: dict) -> None:
    text = probe["helps"]["run --help"]
    descriptions = cfgmod.preset_descriptions()
    lines = text.splitlines()
    for name, description in descriptions.items():
        starts = [ln for ln in lines if ln.split() and ln.split()[0] == name]
        assert len(starts) == 1, (name, starts)  # listed once, at the start of its line
        assert " ".join(description.split()[:4]) in " ".join(text.split()), name
    flat = " ".join(text.split())
    assert "Presets:" not in flat and "centralized-clsm, centralized-dssm" not in flat  # no second, bare list
    assert "preset name (default fedavg-gmf; listed below)" in flat
    assert descriptions["fedavg-gmf"].startswith("FedAvg over GMF")
    assert descriptions["lightfr"].startswith("LightFR (Zhang et al. TOIS 2023)")  # "al." does not end a sentence


def test_preset_description_is_the_first_sentence_of_the_leading_comment() -> None:
    text = "# First sentence, long enough (Wu et al. 2022). Second one.\n# more\n[run]\n# not this\n"
    assert cfgmod.preset_description(text) == "First sentence, long enough (Wu et al. 2022)."
    long = "# " + "word " * 40 + "\n[run]\n"
    out = cfgmod.preset_description(long)
    assert out.endswith("...") and len(out) <= cfgmod.DESCRIPTION_CHARS
    assert all(d for d in cfgmod.preset_descriptions().values())  # every preset has one


def test_help_texts_print_no_doubled_percent(probe: dict) -> None:
    assert "95% interval" in probe["helps"]["attack fel --help"]
    for path, text in probe["helps"].items():
        assert "%%" not in text, path


def test_flower_help_names_what_runs_on_flower(probe: dict) -> None:
    text = " ".join(probe["helps"]["flower --help"].split())
    for name in ("FedAvg-GMF", "FEL", "LightFR", "FedMF", "FedCL", "FedFast", "STTFedRec", "FL-DSSM/CLSM", "--resume"):
        assert name in text, name
    assert "Run FedAvg-GMF and FEL (GMF leaves) presets" not in text


def test_bench_aggregation_choices_are_the_runners_protocols() -> None:
    from experiments.bench.aggregation import BENCH_PROTOCOLS
    from secagg.runner import PROTOCOLS

    assert set(BENCH_PROTOCOLS) == set(PROTOCOLS) | {"chain"}


@pytest.mark.parametrize("argv, hint", [
    (["run", "fedavg-gmff"], "did you mean 'fedavg-gmf'?"),
    (["run", "fel_dp"], "did you mean 'fel-dp'?"),
])
def test_a_mistyped_preset_gets_a_suggestion(capsys, argv: list[str], hint: str) -> None:
    assert main(argv) == 2
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize("toml, hint", [
    ('[run]\nprotocol = "fedav"\n', "did you mean 'fedavg'?"),
    ("[fedavg]\nlrr = 0.1\n", "did you mean 'lr'?"),
    ("[fedavgg]\nlr = 0.1\n", "did you mean 'fedavg'?"),
    ("[run]\nroundz = 3\n", "did you mean 'rounds'?"),
])
def test_a_mistyped_protocol_or_key_gets_a_suggestion(tmp_path: Path, capsys, toml: str, hint: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert hint in err and not (tmp_path / "never").exists()


def test_eval_every_evaluates_every_round(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=3))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--eval-every", "1", "--out", str(out), "--quiet"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "HR@10" in r] == [1, 2, 3]
    assert "eval_every = 1" in (out / "config.toml").read_text()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--eval-every", "2"]) == 2  # the saved config decides on resume
    assert "only --rounds may be changed" in capsys.readouterr().err


def test_ctrl_c_names_the_run_directory_to_resume(tmp_path: Path, capsys, monkeypatch) -> None:
    from experiments.run import training

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=3))
    out = tmp_path / "run"
    real = training._Run.round

    def interrupt_in_round_two(self, r, t0):
        if r == 1:
            raise KeyboardInterrupt
        return real(self, r, t0)

    monkeypatch.setattr(training._Run, "round", interrupt_in_round_two)
    assert main(["run", "--config", str(cfg), "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert f"secagg run --resume {out}" in err and "RUN_DIR" not in err
    monkeypatch.setattr(training._Run, "round", real)
    assert main(["run", "--resume", str(out), "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rounds"] == 3


def _strict(text: str):
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_every_json_a_run_writes_is_strict(tmp_path: Path, capsys, monkeypatch) -> None:
    """run.json holds data.threshold = NaN and the budgets = inf in every default run, a round's loss
    can be NaN (not released, or diverged), a paired comparison of one seed has no standard deviation:
    all must be ``null``, in the files and in every --json line."""
    import dataclasses

    from protocols.fedavg import FedAvgGMF

    real = FedAvgGMF.run_round
    monkeypatch.setattr(FedAvgGMF, "run_round", lambda self: dataclasses.replace(real(self), loss=math.nan))
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=2))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--eval-every", "1", "--out", str(out), "--quiet", "--json"]) == 0
    summary = _strict(capsys.readouterr().out.strip().splitlines()[-1])
    for path in (out / "run.json", out / "summary.json"):
        _strict(path.read_text())
    rows = [_strict(line) for path in (out / "metrics.jsonl", out / "costs.jsonl") for line in path.read_text().splitlines()]
    ident = _strict((out / "run.json").read_text())
    assert ident["config"]["data"]["threshold"] is None and ident["config"]["privacy"]["budget_epsilon"] is None
    assert [r["loss"] for r in rows if "loss" in r] == [None, None]
    assert summary["privacy"]["epsilon"] is None
    for argv in (["privacy", "report", str(out), "--json"], ["compare", str(out), "--json"],
                 ["compare", str(out), "--paired-with", str(out), "--json"]):
        assert main(argv) == 0
        last = _strict(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["final"]["std"] is None  # one pair: no standard deviation, written as null


def test_readers_still_accept_files_with_bare_nan(tmp_path: Path, capsys) -> None:
    """A run directory written before strict JSON (bare NaN/Infinity) still resumes and compares."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=3))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--out", str(out), "--quiet", "--rounds", "2"]) == 0
    ident = json.loads((out / "run.json").read_text())
    ident["config"]["data"]["threshold"] = math.nan
    ident["config"]["privacy"]["budget_epsilon"] = math.inf
    ident["config"]["clients"]["ldp_epsilon_budget"] = math.inf
    (out / "run.json").write_text(json.dumps(ident))  # Python's json: bare NaN and Infinity
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows[0]["loss"] = math.nan
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "NaN" in (out / "metrics.jsonl").read_text() and "Infinity" in (out / "run.json").read_text()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--rounds", "3", "--quiet"]) == 0, capsys.readouterr().err
    assert main(["compare", str(out), "--json"]) == 0
    assert _strict(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]["final_round"] == 3


def test_jsonio_writes_null_for_every_non_finite_value() -> None:
    import numpy as np

    text = jsonio.dumps({"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (np.float32("nan"), np.int64(3)),
                         "d": np.array([1.0, np.inf])})
    assert _strict(text) == {"a": None, "b": [None, None, 1.5], "c": [None, 3], "d": [1.0, None]}


def test_a_slow_first_round_says_how_long_the_run_will_take(tmp_path: Path, capsys, monkeypatch) -> None:
    from experiments.run import training

    assert training.pace_note(5.0, 1, 20) is None  # fast rounds: nothing to say
    assert training.pace_note(100.0, 20, 20) is None  # no round left
    note = training.pace_note(95.0, 1, 21, now=0.0)
    assert note.startswith("round 1 took 95 s; the 20 remaining rounds will take about 32 min")
    assert "until about 00:31 UTC" in note
    monkeypatch.setattr(training, "SLOW_ROUND_SECONDS", 0.0)  # every round counts as slow
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(rounds=3))
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("note: round 1 took") == 1 and "the 2 remaining rounds will take about" in err


def test_every_parser_builds_and_formats(capsys) -> None:
    def walk(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    parsers = list(walk(build_parser()))
    assert len(parsers) > 20
    for parser in parsers:
        assert parser.format_help()
