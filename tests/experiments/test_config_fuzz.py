"""Fuzzing the TOML config loader: any file content ends in a config or a ValueError that says why.

``experiments.run.config.load_config_file`` reads user files (``--config``) and the ``config.toml`` of
a run directory (``--resume``), both of which a user can edit. Random text, random bytes, mutated
presets and well-formed TOML with random sections, keys and values must give a
:class:`~experiments.run.config.RunConfig` or a ``ValueError`` with a message (the CLI turns it into
one line and exit code 2), never another exception. A missing file is a ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.run import config as cfgmod

FIXTURE_OK = [HealthCheck.function_scoped_fixture]
PRESET_TEXTS = [resources.files("experiments.presets").joinpath(f"{n}.toml").read_text() for n in cfgmod.PRESETS]
DEFAULT_TEXT = cfgmod.to_toml(cfgmod.RunConfig())
SECTION_KEYS = {name: [f.name for f in cfgmod.dataclasses.fields(cls)] for name, cls in cfgmod.all_sections().items()}


def _load(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "user.toml"
    path.write_bytes(content)
    try:
        loaded = cfgmod.load_config_file(path)
    except ValueError as exc:
        assert str(exc).strip(), "a ValueError without a message"
        return
    assert isinstance(loaded, cfgmod.RunConfig)
    # What loads also round-trips: the run directory's config.toml is read back the same way.
    again = tmp_path / "again.toml"
    again.write_text(cfgmod.to_toml(loaded))
    back = cfgmod.load_config_file(again)
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(loaded.to_dict(), sort_keys=True)


@st.composite
def mutated_text(draw: st.DrawFn) -> str:
    text = list(draw(st.sampled_from(PRESET_TEXTS + [DEFAULT_TEXT])))
    for _ in range(draw(st.integers(1, 5))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = list(draw(st.text(alphabet=st.sampled_from('[]="\'.,#\n =-+0123456789eEinfatrsul_\\x{}'), max_size=6)))
        if op == "insert":
            text[pos:pos] = piece
        elif op == "delete":
            del text[pos : pos + draw(st.integers(1, 8))]
        else:
            text[pos : pos + len(piece)] = piece
    return "".join(text)


def _toml_value(depth: int = 0) -> st.SearchStrategy[str]:
    scalars = st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.sampled_from(["0", "-1", "1", "2", "99", "9223372036854775807", "-9223372036854775808"]),
        st.floats(allow_nan=True, allow_infinity=True).map(
            lambda f: "nan" if math.isnan(f) else ("inf" if f == math.inf else "-inf" if f == -math.inf else repr(f))
        ),
        st.sampled_from(["true", "false", '"nan"', '"none"', '""', '"fedavg"', '"adam"', '"synthetic"', '"csv"']),
        st.text(max_size=10).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'),
        st.sampled_from(["1979-05-27", "07:32:00", "{}", '{ a = 1 }']),
    )
    if depth >= 2:
        return scalars
    return st.one_of(scalars, st.lists(_toml_value(depth + 1), max_size=4).map(lambda v: "[" + ", ".join(v) + "]"))


@st.composite
def structured_toml(draw: st.DrawFn) -> str:
    """Well-formed TOML: mostly known sections and keys, with values of any type."""
    lines = []
    for section in draw(st.lists(st.sampled_from(list(SECTION_KEYS) + ["extra", "run.sub"]), max_size=4, unique=True)):
        lines.append(f"[{section}]")
        keys = SECTION_KEYS.get(section, ["x"])
        for key in draw(st.lists(st.sampled_from(keys + ["unknown_key"]), max_size=5, unique=True)):
            lines.append(f"{key} = {draw(_toml_value())}")
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(content=st.one_of(st.text(max_size=300).map(str.encode), st.binary(max_size=300)))
def test_random_content_gives_a_config_or_a_value_error(tmp_path: Path, content: bytes) -> None:
    _load(tmp_path, content)


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=mutated_text())
def test_mutated_presets_give_a_config_or_a_value_error(tmp_path: Path, text: str) -> None:
    _load(tmp_path, text.encode())


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=structured_toml())
def test_random_sections_keys_and_values_give_a_config_or_a_value_error(tmp_path: Path, text: str) -> None:
    _load(tmp_path, text.encode())


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a = " + "[" * 2000 + "]" * 2000 + "\n", id="deep-nesting"),  # tomllib's RecursionError
        pytest.param('[data]\nsource = "a\\nb\\u0001c\\u007f"\n', id="control-chars"),  # to_toml must escape them
        pytest.param("[run]\nrounds = 99999999999999999999999\n", id="huge-int"),
        pytest.param("[fedavg]\nlr = inf\n", id="inf-lr"),
        pytest.param("[fedavg]\nlr = nan\n", id="nan-lr"),
        pytest.param("[eval]\nks = [10, [5]]\n", id="nested-list"),
        pytest.param("\ufeff[run]\nseed = 1\n", id="bom"),
        pytest.param("[run]\nseed = 1\n[run]\nseed = 2\n", id="duplicate-table"),
    ],
)
def test_edge_cases_give_a_config_or_a_value_error(tmp_path: Path, text: str) -> None:
    _load(tmp_path, text.encode())


#: The documented bound on a config file's nesting (experiments/run/config.py, docs/security.md).
TOML_DEPTH_LIMIT = 64


def _deep_toml(construct: str, depth: int) -> str:
    """TOML whose parsed value nests ``depth`` levels below ``[eval] ks`` (one construct per file)."""
    if construct == "array":
        return "[eval]\nks = " + "[" * depth + "]" * depth + "\n"
    if construct == "inline-table":
        return "[eval]\nks = " + "{a = " * depth + "1" + "}" * depth + "\n"
    if construct == "dotted-key":
        return "[eval]\nks" + ".a" * depth + " = 1\n"
    if construct == "table-header":
        return "[eval.ks" + ".a" * depth + "]\n"
    return "[[eval.ks" + ".a" * depth + "]]\n"  # array of tables


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    construct=st.sampled_from(["array", "inline-table", "dotted-key", "table-header", "array-of-tables"]),
    depth=st.one_of(st.integers(TOML_DEPTH_LIMIT, 2000), st.sampled_from([TOML_DEPTH_LIMIT, 990, 1500])),
)
def test_deep_nesting_of_any_construct_is_refused_naming_it(tmp_path: Path, construct: str, depth: int) -> None:
    """Arrays, inline tables, dotted keys and table headers nested past 64 levels are refused with a
    ValueError that says so. Dotted keys and headers used to parse, then escape as RecursionError
    from the error message's repr of the nested table."""
    path = tmp_path / "deep.toml"
    path.write_text(_deep_toml(construct, depth))
    with pytest.raises(ValueError, match=f"nested deeper than {TOML_DEPTH_LIMIT} levels"):
        cfgmod.load_config_file(path)


@st.composite
def mixed_nesting(draw: st.DrawFn) -> tuple[str, int]:
    """A TOML document mixing a dotted header, arrays, inline tables and dotted inline keys over
    several lines, and its true depth (the document is level 1; each table or array adds one)."""
    parts = draw(st.integers(0, 70))
    depth = 1 + parts  # the document, then the header's tables
    value = draw(st.sampled_from(["1.5", '"a.b[c]{d}"', "'x.y'", "2024-05-01T10:00:00.5", "[]"]))
    depth += value == "[]"
    for kind in draw(st.lists(st.sampled_from(["array", "inline", "dotted"]), max_size=70)):
        sep = draw(st.sampled_from([", ", ",\n  "]))
        if kind == "array":
            value, depth = f"[{value}{sep}2]" if draw(st.booleans()) else f"[3.25{sep}{value}]", depth + 1
        elif kind == "inline":
            value, depth = f"{{x = {value}, y.z = 0.5}}", depth + 1
        else:
            value, depth = f"{{p.q = {value}}}", depth + 2
    head = ("[" + ".".join(["t"] * parts) + "]  # a [comment]. with dots\n") if parts else ""
    return f"{head}k = {value}\n", depth


@settings(max_examples=120, deadline=None, suppress_health_check=FIXTURE_OK)
@given(doc=mixed_nesting())
def test_the_depth_bound_refuses_deep_files_and_no_shallow_one(tmp_path: Path, doc: tuple[str, int]) -> None:
    """The depth scan runs before tomllib and must never under-count (a deeper file gets through to
    the recursive parser) nor refuse a file within the bound (it over-counts by at most two)."""
    text, depth = doc
    assert tomllib.loads(text)  # the generator writes valid TOML (at most 212 levels: tomllib copes)
    path = tmp_path / "mixed.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        cfgmod.load_config_file(path)
    nested = f"nested deeper than {TOML_DEPTH_LIMIT} levels" in str(info.value)
    if depth > TOML_DEPTH_LIMIT:
        assert nested, (depth, str(info.value)[:200])
    elif depth <= TOML_DEPTH_LIMIT - 2:
        assert not nested, (depth, str(info.value)[:200])  # refused for its unknown section or key instead


def test_a_100000_level_dotted_key_is_refused_without_exhausting_memory(tmp_path: Path) -> None:
    """tomllib keeps every prefix of a dotted key: 100,000 levels (a 200 KB line) wanted about
    40 GB. Under a 1 GiB address-space limit the loader must refuse it in words, not die."""
    path = tmp_path / "dotted.toml"
    path.write_text("a" + ".a" * 100_000 + " = 1\n")
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from experiments.run import config\n"
        "try:\n"
        "    config.load_config_file(sys.argv[1])\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.startswith("refused:") and f"nested deeper than {TOML_DEPTH_LIMIT} levels" in proc.stdout


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(value=st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12))
def test_any_string_value_is_written_so_that_it_reads_back_or_refused_before_writing(tmp_path: Path, value: str) -> None:
    """A path given on the command line may hold lone surrogates (a file name that is not UTF-8):
    the configuration refuses it with a ValueError when it is set, so ``config.toml`` is never
    written half-way (it used to fail with UnicodeEncodeError after the run directory was made)."""
    try:
        config = cfgmod.merge(cfgmod.RunConfig(), {"data": {"source": value}})
    except ValueError as exc:
        assert "data.source" in str(exc)
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in value), exc
        return
    path = tmp_path / "config.toml"
    path.write_bytes(cfgmod.to_toml(config).encode("utf-8"))
    assert cfgmod.load_config_file(path).data.source == value


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        cfgmod.load_config_file(tmp_path / "absent.toml")
