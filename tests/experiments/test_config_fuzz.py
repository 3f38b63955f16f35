"""Fuzzing the TOML config loader: any file content ends in a config or a ValueError that says why.

``experiments.config.load_config_file`` reads user files (``--config``) and the ``config.toml`` of
a run directory (``--resume``), both of which a user can edit. Random text, random bytes, mutated
presets and well-formed TOML with random sections, keys and values must give a
:class:`~experiments.config.RunConfig` or a ``ValueError`` with a message (the CLI turns it into
one line and exit code 2), never another exception. A missing file is a ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments import config as cfgmod

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


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        cfgmod.load_config_file(tmp_path / "absent.toml")
