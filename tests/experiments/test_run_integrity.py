"""Run-directory integrity: resume verifies what it continues, one writer at a time, no pickles,
append-only per-round files, and a privacy ledger (and report) for every run."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.cli import main
from protocols.state import StateError, state_from_bytes, state_to_bytes

TINY = """
[run]
rounds = {rounds}
eval_every = 2
[data]
synthetic_users = 40
synthetic_items = 80
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fedavg]
dim = 4
"""


def cfg(tmp_path: Path, rounds: int = 4, extra: str = "", name: str = "tiny.toml") -> str:
    path = tmp_path / name
    path.write_text(TINY.format(rounds=rounds) + extra)
    return str(path)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def summary_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def csv_data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = [f"{u},{i},{rng.integers(1, 6)},{100 * u + k}"
            for u in range(30) for k, i in enumerate(rng.choice(60, 8, replace=False))]
    path = tmp_path / "data" / "ratings.csv"
    path.parent.mkdir(exist_ok=True)
    path.write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")
    return path


# -- resume verifies what it continues ------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("seed = 0", "seed = 7", "run.seed"),
        ("synthetic_users = 40", "synthetic_users = 41", "data.synthetic_users"),
        ("negatives = 20", "negatives = 21", "eval.negatives"),
        ("lr = 0.01", "lr = 0.02", "fedavg.lr"),
    ],
)
def test_resume_refuses_an_edited_config_naming_the_key(tmp_path, capsys, old, new, key):
    run = tmp_path / "run"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 2), "--out", str(run), "--quiet")[0] == 0
    toml = (run / "config.toml").read_text()
    assert old in toml
    (run / "config.toml").write_text(toml.replace(old, new))
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and key in err and "only run.rounds may change" in err
    assert len((run / "costs.jsonl").read_text().splitlines()) == 2  # nothing ran


def test_a_key_added_after_the_run_was_created_resumes_at_its_default(tmp_path, capsys):
    """A run made before ``data.sep`` existed has no such key in run.json: at its default value
    the resume goes on; set to anything else it is refused like any edit."""
    run = tmp_path / "run"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 1), "--out", str(run), "--quiet")[0] == 0
    ident = json.loads((run / "run.json").read_text())
    del ident["config"]["data"]["sep"]
    (run / "run.json").write_text(json.dumps(ident))
    assert cli(capsys, "run", "--resume", str(run), "--rounds", "2", "--quiet")[0] == 0
    toml = (run / "config.toml").read_text()
    (run / "config.toml").write_text(toml.replace('sep = ""', 'sep = ";"'))
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and "data.sep" in err


def test_resume_refuses_a_changed_data_file_naming_both_hashes(tmp_path, capsys):
    data = csv_data(tmp_path)
    run = tmp_path / "run"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 1), "--data", str(data), "--out", str(run), "--quiet")[0] == 0
    before = json.loads((run / "run.json").read_text())["data_files"][str(data.resolve())]
    data.write_text(data.read_text().replace("\n0,", "\n1000,", 1))
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "2", "--quiet")
    assert code == 2 and "changed since the run was created" in err and before in err


def test_resume_refuses_a_deleted_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 2), "--out", str(run), "--quiet")[0] == 0
    (run / "checkpoint.safetensors").unlink()
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and "checkpoint.safetensors is missing" in err


def test_resume_refuses_a_checkpoint_from_another_run(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert cli(capsys, "run", "--config", cfg(tmp_path, 2), "--out", str(d), "--quiet")[0] == 0
    (a / "checkpoint.safetensors").write_bytes((b / "checkpoint.safetensors").read_bytes())
    code, _, err = cli(capsys, "run", "--resume", str(a), "--rounds", "3", "--quiet")
    assert code == 2 and "belongs to another run" in err


def test_resume_after_a_crash_mid_write_repairs_the_files(tmp_path, capsys):
    """Rows past the checkpoint and a torn last line (a kill between append and checkpoint)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 4), "--out", str(whole), "--quiet")[0] == 0
    assert cli(capsys, "run", "--config", cfg(tmp_path, 4), "--rounds", "2", "--out", str(part), "--quiet")[0] == 0
    # What a kill in round 3, after its rows were appended but before the checkpoint, leaves behind:
    with open(part / "costs.jsonl", "a") as fh:
        fh.write(json.dumps({"round": 2, "bytes_per_client": 1}) + "\n")
    with open(part / "transcript.csv", "a") as fh:
        fh.write("2,server,1,1\n2,clie")
    with open(part / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "loss": 0.5}\n{"round": 4, "lo')
    code, out, _ = cli(capsys, "run", "--resume", str(part), "--rounds", "4", "--json", "--quiet")
    assert code == 0
    assert (part / "transcript.csv").read_text() == (whole / "transcript.csv").read_text()

    def costs(run):  # wall seconds differ between two runs; everything else must not
        return [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in (run / "costs.jsonl").read_text().splitlines()]

    assert costs(part) == costs(whole)
    assert all(set(json.loads(x)["seconds"]) == {"round", "client", "server"} for x in (part / "costs.jsonl").read_text().splitlines())
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert summary_of(out)["metrics"] == json.loads((whole / "summary.json").read_text())["metrics"]


# -- one writer at a time ----------------------------------------------------------------------------


def test_two_processes_cannot_share_a_run_directory(tmp_path, capsys):
    run = tmp_path / "busy"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "run", "--config", cfg(tmp_path, 100_000), "--out", str(run), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "costs.jsonl").exists():
            time.sleep(0.05)
        assert (run / "costs.jsonl").exists(), "the first run never started"
        code, _, err = cli(capsys, "run", "--resume", str(run), "--quiet")
        assert code == 2 and "in use by another process" in err and f"pid {proc.pid}" in err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The kernel released the lock with the killed process: the directory can be taken again.
    from experiments.run.rundir import RunDir

    rd = RunDir(run)
    rd.lock()
    rd.unlock()


# -- nothing is unpickled --------------------------------------------------------------------------------


class _Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_checkpoint_never_runs(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "run", "--config", cfg(tmp_path, 2), "--out", str(run), "--quiet")[0] == 0
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"trainer": _Boom(str(marker))})
    (run / "checkpoint.safetensors").write_bytes(payload)
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and "cannot read checkpoint" in err
    (run / "checkpoint.safetensors").unlink()
    (run / "checkpoint.pt").write_bytes(payload)  # an old-style pickle
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2
    assert not marker.exists()


def test_checkpoints_round_trip_the_trainer_state():
    import torch

    state = {"a": torch.arange(3.0), "b": np.arange(4, dtype=np.int16), "rng": np.random.default_rng(1).bit_generator.state,
             "t": (1, 2.5, float("inf")), "n": {0: {"x": [torch.ones(2), None, True]}}, "s": "x"}
    back = state_from_bytes(state_to_bytes(state))
    assert torch.equal(back["a"], state["a"]) and back["b"].dtype == np.int16 and (back["b"] == state["b"]).all()
    assert back["rng"] == state["rng"] and back["t"] == state["t"] and back["s"] == "x"
    assert torch.equal(back["n"][0]["x"][0], torch.ones(2)) and back["n"][0]["x"][1:] == [None, True]


_VALID = state_to_bytes({"round": 3, "w": np.arange(6.0).reshape(2, 3), "rng": {"state": 2**100}})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=400),
    st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)).map(
        lambda p: _VALID[: p[0]] + bytes([p[1]]) + _VALID[p[0] + 1 :]),
    st.integers(0, len(_VALID) - 1).map(lambda n: _VALID[:n]),
    st.binary(min_size=1, max_size=40).map(lambda b: _VALID + b),
))
def test_fuzzed_checkpoints_raise_only_state_errors(data):
    try:
        state = state_from_bytes(data)
    except StateError:
        return
    assert isinstance(state, dict)  # a mutation that still parses must still be a state table


# -- costs that do not grow -------------------------------------------------------------------------------


def test_the_checkpoint_holds_model_state_only(tmp_path, capsys):
    sizes = {}
    for rounds in (2, 6):
        run = tmp_path / f"r{rounds}"
        assert cli(capsys, "run", "--config", cfg(tmp_path, rounds), "--out", str(run), "--quiet")[0] == 0
        state = state_from_bytes((run / "checkpoint.safetensors").read_bytes())
        assert set(state) == {"run_id", "seconds", "trainer"}
        sizes[rounds] = (run / "checkpoint.safetensors").stat().st_size
    assert abs(sizes[2] - sizes[6]) < 64  # only the JSON numbers (elapsed seconds, RNG state) differ in length


@pytest.mark.parametrize("argv, message", [
    (["--rounds", str(10**20)], "more than the 1,000,000 rounds"),
    (["--seed", str(10**30)], "--seed must be an integer"),
    (["--rounds", "-1"], "--rounds must be >= 0"),
])
def test_absurd_numbers_are_refused_in_words(tmp_path, capsys, argv, message):
    code, _, err = cli(capsys, "run", "--config", cfg(tmp_path), *argv, "--out", str(tmp_path / "never"))
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "never").exists()


# -- evaluation options that used to break ---------------------------------------------------------------


def test_cutoffs_without_10_and_full_ranking_only(tmp_path, capsys):
    path = tmp_path / "ks.toml"
    path.write_text(TINY.format(rounds=2).replace("negatives = 20", "negatives = 20\nks = [5, 20]"))
    code, out, _ = cli(capsys, "run", "--config", str(path), "--out", str(tmp_path / "ks"), "--json", "--quiet")
    assert code == 0
    s = summary_of(out)
    assert "HR@5" in s["metrics"] and "HR@10" not in s["metrics"]
    assert (tmp_path / "ks" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    code, out, err = cli(capsys, "run", "--config", cfg(tmp_path, 2), "--eval-negatives", "0",
                         "--out", str(tmp_path / "full"), "--json", "--quiet")
    assert code == 0, err
    s = summary_of(out)
    assert s["metrics"] is None and 0 <= s["metrics_full"]["HR@10"] <= 1
    assert "full ranking only" in s["evaluation"]["sampled"]


# -- a privacy ledger and report for every run -------------------------------------------------------------


def test_every_run_writes_a_ledger_and_the_report_says_the_truth(tmp_path, capsys):
    run = tmp_path / "plain"
    code, out, _ = cli(capsys, "run", "--config", cfg(tmp_path, 2), "--out", str(run), "--json", "--quiet")
    s = summary_of(out)
    assert s["privacy"]["epsilon"] is None and s["privacy"]["unprotected"] is True
    assert "epsilon is infinite" in s["privacy"]["statement"]
    code, out, _ = cli(capsys, "privacy", "report", str(run), "--json")
    assert code == 0
    rep = summary_of(out)
    assert rep["epsilon"] == "inf" and rep["entries"] == 2 and "without differential privacy" in rep["statement"]
    assert (run / "privacy.png").is_file()
    base = tmp_path / "pop"
    assert cli(capsys, "run", "itempop", "--config", cfg(tmp_path, 0), "--out", str(base), "--quiet")[0] == 0
    code, out, _ = cli(capsys, "privacy", "report", str(base), "--json")
    assert code == 0 and summary_of(out)["epsilon"] == 0.0


FEDMF = """
[run]
protocol = "fedmf"
rounds = {rounds}
[data]
synthetic_users = 30
synthetic_items = 60
synthetic_mean_interactions = 8
[fedmf]
defense = "{defense}"
epsilon = 0.5
[fedmf.mf]
dim = 4
"""


def test_fedmf_runs_through_the_registry_with_its_ldp_accounted(tmp_path, capsys):
    path = tmp_path / "fedmf.toml"
    path.write_text(FEDMF.format(rounds=3, defense="ldp"))
    code, out, err = cli(capsys, "run", "--config", str(path), "--out", str(tmp_path / "mf"), "--json", "--quiet")
    assert code == 0, err
    s = summary_of(out)
    assert set(s["metrics"]) == {"RMSE", "MAE"} and s["metrics_full"] is None
    assert s["privacy"]["dp_noise"] is True and s["privacy"]["reproducible_from_seed"] is False
    # three epsilon=0.5 Laplace uploads per user: at most basic composition (1.5), more than one upload
    assert 0.5 < s["privacy"]["epsilon"] <= 1.5 + 1e-9
    code, out, _ = cli(capsys, "privacy", "report", str(tmp_path / "mf"), "--json")
    assert code == 0 and summary_of(out)["epsilon"] == pytest.approx(s["privacy"]["epsilon"], rel=1e-6)


def test_a_privacy_budget_stops_the_run_before_it_is_exceeded(tmp_path, capsys):
    path = tmp_path / "fedmf.toml"
    path.write_text(FEDMF.format(rounds=10, defense="ldp") + "[privacy]\nbudget_epsilon = 1.2\n")
    code, out, err = cli(capsys, "run", "--config", str(path), "--out", str(tmp_path / "mf"), "--json", "--quiet")
    assert code == 0, err
    s = summary_of(out)
    assert s["stopped"] and s["rounds"] < 10
    assert s["privacy"]["epsilon"] <= 1.2
    assert len((tmp_path / "mf" / "costs.jsonl").read_text().splitlines()) == s["rounds"]


# -- nesting: bounded at save and load, refused in words (issue 23, item 9) --------------------------------

#: The documented bound on a state tree's nesting (protocols/state.py, docs/security.md): the root
#: table is level 1; every dict, list or tuple below it adds one.
STATE_DEPTH_LIMIT = 64
_OPEN = {"list": ("[", "]"), "dict": ('{"k": ', "}"), "tuple": ('{"__tuple__": [', "]}")}


def _nested_state(kinds: list[str]) -> dict:
    """A state table whose deepest path holds ``1 + len(kinds)`` containers."""
    node: object = 7
    for kind in reversed(kinds):
        node = [node] if kind == "list" else {"k": node} if kind == "dict" else (node,)
    return {"s": node}


def _skeleton_checkpoint(skeleton: str) -> bytes:
    from safetensors.torch import save

    return save({}, metadata={"format": "secagg-fedrec-state/1", "state": skeleton})


@settings(max_examples=60, deadline=None)
@given(st.integers(0, STATE_DEPTH_LIMIT + 40).flatmap(
    lambda n: st.lists(st.sampled_from(sorted(_OPEN)), min_size=n, max_size=n)))
def test_state_depth_is_bounded_at_save_and_load(kinds):
    """Up to 64 levels round-trip; deeper is refused at save with a ValueError naming the limit,
    so every checkpoint written can be read back."""
    state = _nested_state(kinds)
    if 1 + len(kinds) <= STATE_DEPTH_LIMIT:
        assert state_from_bytes(state_to_bytes(state)) == state
    else:
        with pytest.raises(ValueError, match=f"nested deeper than {STATE_DEPTH_LIMIT} levels"):
            state_to_bytes(state)


@settings(max_examples=80, deadline=None)
@given(
    depth=st.one_of(st.integers(STATE_DEPTH_LIMIT, 3000), st.sampled_from([STATE_DEPTH_LIMIT, 998, 100_000])),
    kinds=st.lists(st.sampled_from(sorted(_OPEN)), min_size=1, max_size=3),
    where=st.sampled_from(["skeleton", "header"]),
)
def test_deeply_nested_checkpoint_json_raises_only_a_state_error(depth, kinds, where):
    """A crafted checkpoint nesting lists, tables or tuple markers 64 to 100,000 deep, in the JSON
    skeleton or in the safetensors header itself, is refused with StateError naming the nesting
    (it used to escape as RecursionError, or load 900 levels and overflow later)."""
    opens = "".join(_OPEN[kinds[i % len(kinds)]][0] for i in range(depth))
    closes = "".join(_OPEN[kinds[i % len(kinds)]][1] for i in reversed(range(depth)))
    nest = opens + "1" + closes
    if where == "skeleton":
        data = _skeleton_checkpoint('{"s": ' + nest + "}")
    else:
        header = ('{"__metadata__": {"format": "secagg-fedrec-state/1", "state": "{}"}, "x": ' + nest + "}").encode()
        data = len(header).to_bytes(8, "little") + header
    with pytest.raises(StateError, match="nested"):
        state_from_bytes(data)


def test_malformed_int_keys_in_a_checkpoint_raise_state_errors():
    for key in ("#int:x", "#int:" + "9" * 5000, "#int:"):
        with pytest.raises(StateError, match="int key"):
            state_from_bytes(_skeleton_checkpoint(json.dumps({key: 1})))


DEEP = "[" * 100_000 + "]" * 100_000


def _deep_ledger_params(run: Path) -> None:
    import sqlite3

    db = sqlite3.connect(run / "privacy_ledger.sqlite")
    db.execute("UPDATE entries SET params = ? WHERE round = 0", (DEEP,))
    db.commit()
    db.close()


def _replace_line(run: Path, name: str, index: int, text: str) -> None:
    lines = (run / name).read_text().splitlines()
    lines[index] = text
    (run / name).write_text("\n".join(lines) + "\n")


_DEEP_EDITS = {
    "run.json": lambda run: (run / "run.json").write_text(DEEP),
    "metrics.jsonl": lambda run: _replace_line(run, "metrics.jsonl", 0, DEEP),
    "costs.jsonl": lambda run: _replace_line(run, "costs.jsonl", 0, '{"round": 0, "x": ' + DEEP + "}"),
    "checkpoint.safetensors": lambda run: (run / "checkpoint.safetensors").write_bytes(
        _skeleton_checkpoint('{"run_id": ' + DEEP + "}")),
    "privacy_ledger.sqlite": _deep_ledger_params,
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A two-round run directory to copy and damage (made once: each copy resumes in well under a second)."""
    base = tmp_path_factory.mktemp("finished")
    run = base / "run"
    assert main(["run", "--config", cfg(base, 2), "--out", str(run), "--quiet"]) == 0
    return run


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("run.lock"))
    return dst


@pytest.mark.parametrize("name", sorted(_DEEP_EDITS))
def test_deep_json_in_a_run_directory_file_fails_resume_in_words(tmp_path, capsys, finished_run, name):
    """100,000 nested lists in any JSON a resume reads back (run.json, metrics.jsonl, costs.jsonl,
    the checkpoint, the ledger's params) give exit code 2 and one line naming the file, not a
    RecursionError; and nothing is appended to the run directory."""
    run = _copy_run(finished_run, tmp_path / "run")
    _DEEP_EDITS[name](run)
    costs_before = (run / "costs.jsonl").read_text()
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and name in err and "nested" in err, err
    assert err.startswith("secagg: error:") and len(err.strip().splitlines()) == 1
    assert (run / "costs.jsonl").read_text() == costs_before


@pytest.mark.parametrize("command, name", [
    (["privacy", "report"], "run.json"), (["privacy", "report"], "privacy_ledger.sqlite"),
    (["compare"], "metrics.jsonl"),
])
def test_deep_json_is_refused_by_the_commands_that_read_a_run_directory(tmp_path, capsys, finished_run, command, name):
    run = _copy_run(finished_run, tmp_path / "run")
    _DEEP_EDITS[name](run)
    code, _, err = cli(capsys, *command, str(run))
    assert code == 2 and name in err and "nested" in err, err


@pytest.mark.parametrize("name", ["run.json", "config.toml", "metrics.jsonl", "costs.jsonl"])
def test_bytes_that_are_not_utf8_in_a_run_directory_file_fail_resume_in_words(tmp_path, capsys, finished_run, name):
    run = _copy_run(finished_run, tmp_path / "run")
    (run / name).write_bytes((run / name).read_bytes().replace(b"round", b"r\xffund", 1).replace(b"[run]", b"[r\xffn]"))
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and name in err and "0xff" in err and "\ufffd" not in err, err


def test_a_damaged_ledger_fails_resume_in_words(tmp_path, capsys, finished_run):
    """The ledger's own error (LedgerError, a RuntimeError) used to reach the user as a traceback."""
    run = _copy_run(finished_run, tmp_path / "run")
    (run / "privacy_ledger.sqlite").write_bytes(b"not a database" * 100)
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code == 2 and "privacy_ledger.sqlite" in err and "not a privacy ledger" in err


_KEYS = st.sampled_from(["round", "loss", "seconds", "HR@10", "NDCG@10", "bytes_per_client", "clients", "client",
                         "config", "run_id", "preset", "data_files", "run", "x"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS | st.text(max_size=3), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def _run_dir_edit(draw):
    """(file, how): a whole file or line replaced by random JSON, or one key of a real row or of
    run.json given a random value."""
    name = draw(st.sampled_from(["run.json", "metrics.jsonl", "costs.jsonl", "checkpoint.safetensors"]))
    value = draw(_JSON)
    how = draw(st.sampled_from(["whole", "key"]))
    key = draw(st.sampled_from(["seconds", "trainer", "run_id"]) if name == "checkpoint.safetensors" else _KEYS)
    line = draw(st.integers(0, 1))
    return name, how, key, line, value


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_run_dir_edit())
def test_random_json_in_run_directory_files_resumes_or_fails_in_words(tmp_path, capsys, finished_run, edit):
    """Any JSON value in run.json, in a metrics/costs row, or as the checkpoint's seconds, trainer
    state or run id, either resumes or is refused with the command's one-line error (exit 2);
    never a KeyError, TypeError or AttributeError traceback."""
    import shutil

    name, how, key, line, value = edit
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    _copy_run(finished_run, run)
    if name == "run.json":
        ident = json.loads((run / name).read_text())
        (run / name).write_text(json.dumps(value if how == "whole" else {**ident, key: value}))
    elif name == "checkpoint.safetensors":
        state = state_from_bytes((run / name).read_bytes())
        (run / name).write_bytes(state_to_bytes({**state, key: value}))
    else:
        row = json.loads((run / name).read_text().splitlines()[line])
        _replace_line(run, name, line, json.dumps(value if how == "whole" else {**row, key: value}))
    code, _, err = cli(capsys, "run", "--resume", str(run), "--rounds", "3", "--quiet")
    assert code in (0, 2), err
    if code == 2:
        assert err.startswith("secagg: error:") and len(err.strip().splitlines()) == 1, err
