"""Typed run configuration, loaded from TOML presets and user files.

A configuration is a set of sections, each a frozen dataclass whose fields are the allowed
keys. Loading is strict: an unknown section or key, or a value of the wrong type, is refused
with a message naming it (``unknown key 'fedavg.lrr' in my.toml; known keys: ...``). Values are
checked again by the dataclasses' own validation (``fedavg.lr must be a positive number``).

Resolution order: the preset (or ``fedavg-gmf``), then ``--config FILE.toml`` (overrides only the
keys it sets), then command-line flags. The resolved configuration is written to the run
directory as ``config.toml`` and is what ``--resume`` reads back.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from protocols.fedavg import FedAvgConfig
from recmodels.train import CentralConfig

__all__ = [
    "PRESETS",
    "RunSection",
    "DataSection",
    "SplitSection",
    "EvalSection",
    "RunConfig",
    "load_preset",
    "load_config_file",
    "merge",
    "to_toml",
]

PROTOCOLS = ("itempop", "random", "centralized", "fedavg")


@dataclass(frozen=True)
class RunSection:
    """``[run]``: what to run.

    Attributes:
        protocol: ``itempop`` | ``random`` | ``centralized`` | ``fedavg``.
        rounds: federated rounds (``fedavg``) or epochs (``centralized``); 0 for baselines.
        seed: seeds every simulation choice (split, sampling, init, client selection).
        eval_every: evaluate the sampled metrics every N rounds (0: only at the end).
        checkpoint_every: write a checkpoint every N rounds (>= 1).
    """

    protocol: str = "fedavg"
    rounds: int = 20
    seed: int = 0
    eval_every: int = 5
    checkpoint_every: int = 1

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"run.protocol must be one of {PROTOCOLS}; found {self.protocol!r}")
        if self.rounds < 0 or self.eval_every < 0 or self.checkpoint_every < 1:
            raise ValueError(
                "run.rounds and run.eval_every must be >= 0 and run.checkpoint_every >= 1; "
                f"found rounds={self.rounds}, eval_every={self.eval_every}, checkpoint_every={self.checkpoint_every}"
            )


@dataclass(frozen=True)
class DataSection:
    """``[data]``: where interactions come from and how they are preprocessed.

    Attributes:
        source: ``"synthetic"`` (the embedded default) or a path to a MovieLens file/folder or CSV.
        format: ``""`` infers from the file name; else ``ml-100k`` | ``ml-1m`` | ``ml-csv`` | ``csv``.
        threshold: ratings >= threshold are positives; ``nan`` (default) counts every rating.
        min_user_interactions: users with fewer interactions are dropped (default 2: one to
            train on, one to hold out).
        min_item_interactions: items with fewer interactions are dropped (default 0: no filter).
        synthetic_users, synthetic_items, synthetic_dim, synthetic_mean_interactions: the
            generator's size when ``source = "synthetic"``.
    """

    source: str = "synthetic"
    format: str = ""
    threshold: float = math.nan
    min_user_interactions: int = 2
    min_item_interactions: int = 0
    synthetic_users: int = 1000
    synthetic_items: int = 500
    synthetic_dim: int = 8
    synthetic_mean_interactions: int = 40

    def __post_init__(self) -> None:
        if self.min_user_interactions < 2:
            raise ValueError(
                "data.min_user_interactions must be >= 2 (a user needs one interaction to train on and one "
                f"to hold out); found {self.min_user_interactions}"
            )
        if self.min_item_interactions < 0:
            raise ValueError(f"data.min_item_interactions must be >= 0; found {self.min_item_interactions}")


@dataclass(frozen=True)
class SplitSection:
    """``[split]``: leave-one-out by latest timestamp, ties broken by a seeded shuffle.

    Attributes:
        validation: also hold out the second-latest interaction as a validation item.
    """

    validation: bool = False


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: the evaluation protocol (printed with every result).

    Attributes:
        negatives: sampled negatives per held-out item (NCF 99, FedFast 50, LightFR 49).
        ks: cut-offs for HR/NDCG/Precision/Recall.
        full_ranking: also rank the held-out item among all items the user has not trained on.
    """

    negatives: int = 99
    ks: list[int] = field(default_factory=lambda: [5, 10, 20])
    full_ranking: bool = True

    def __post_init__(self) -> None:
        if self.negatives < 1:
            raise ValueError(f"eval.negatives must be >= 1; found {self.negatives}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"eval.ks must be a non-empty list of cut-offs >= 1; found {self.ks}")


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "data": DataSection,
    "split": SplitSection,
    "eval": EvalSection,
    "centralized": CentralConfig,
    "fedavg": FedAvgConfig,
}


@dataclass(frozen=True)
class RunConfig:
    """A fully resolved configuration: one instance of every section."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    split: SplitSection = field(default_factory=SplitSection)
    eval: EvalSection = field(default_factory=EvalSection)
    centralized: CentralConfig = field(default_factory=CentralConfig)
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def _check_type(where: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` converted to ``annotation`` or raise a ValueError naming ``where``."""
    origin = typing.get_origin(annotation)
    if annotation is bool:
        if type(value) is not bool:
            raise ValueError(f"{where} must be true or false; found {value!r}")
        return value
    if annotation is int:
        if type(value) is not int:
            raise ValueError(f"{where} must be an integer; found {value!r}")
        return value
    if annotation is float:
        if type(value) is str and value.lower() in ("nan", "none"):
            return math.nan
        if type(value) not in (int, float):
            raise ValueError(f"{where} must be a number; found {value!r}")
        return float(value)
    if annotation is str:
        if type(value) is not str:
            raise ValueError(f"{where} must be a string; found {value!r}")
        return value
    if origin is list:
        (inner,) = typing.get_args(annotation)
        if type(value) is not list:
            raise ValueError(f"{where} must be a list; found {value!r}")
        return [_check_type(f"{where}[{i}]", v, inner) for i, v in enumerate(value)]
    raise TypeError(f"unsupported config annotation {annotation!r} for {where}")  # programming error


def _section_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def parse_sections(raw: dict[str, Any], origin: str) -> dict[str, dict[str, Any]]:
    """Validate the section and key names and value types of a TOML document."""
    out: dict[str, dict[str, Any]] = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}] in {origin}; known sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"[{section}] in {origin} must be a table of keys")
        types_ = _section_types(SECTIONS[section])
        for key, value in values.items():
            if key not in types_:
                raise ValueError(
                    f"unknown key '{section}.{key}' in {origin}; known keys: {', '.join(sorted(types_))}"
                )
            out.setdefault(section, {})[key] = _check_type(f"{section}.{key} (in {origin})", value, types_[key])
    return out


def merge(base: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Apply validated ``overrides`` to ``base``; each section re-validates itself."""
    changes = {}
    for section, values in overrides.items():
        current = getattr(base, section)
        changes[section] = dataclasses.replace(current, **values)
    return dataclasses.replace(base, **changes)


def _read_toml(path: Path, origin: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin} is not valid TOML: {exc}") from None


def _preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("experiments.presets").iterdir() if p.name.endswith(".toml"))


PRESETS: tuple[str, ...] = tuple(_preset_names())


def load_preset(name: str) -> RunConfig:
    """The resolved configuration of a named preset (``secagg run --help`` lists them)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    text = resources.files("experiments.presets").joinpath(f"{name}.toml").read_bytes()
    raw = tomllib.loads(text.decode())
    return merge(RunConfig(), parse_sections(raw, f"preset {name}"))


def load_config_file(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """Load a user TOML file on top of ``base`` (default: the built-in defaults)."""
    path = Path(path)
    raw = _read_toml(path, str(path))
    return merge(base or RunConfig(), parse_sections(raw, str(path)))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return '"nan"'
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(config: RunConfig) -> str:
    """Serialise a resolved configuration; :func:`load_config_file` reads it back unchanged."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


