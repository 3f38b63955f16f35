"""Typed run configuration, loaded from TOML presets and user files.

A configuration is a set of sections, each a frozen dataclass whose fields are the allowed
keys. Loading is strict: an unknown section or key, or a value of the wrong type, is refused
with a message naming it (``unknown key 'fedavg.lrr' in my.toml; known keys: ...``). Values are
checked again by the dataclasses' own validation (``fedavg.lr must be a positive number``).

Resolution order: the preset (or ``fedavg-gmf``), then ``--config FILE.toml`` (overrides only the
keys it sets), then command-line flags. The resolved configuration is written to the run
directory as ``config.toml`` and is what ``--resume`` reads back.

A config file is user input (``--config``, or a run directory's ``config.toml``), so it is read
as hostile: at most :data:`MAX_CONFIG_BYTES`, UTF-8 (an invalid byte is named by its line), and
nested at most :data:`MAX_TOML_DEPTH` (64) levels of tables, arrays and dotted keys, counted by a
scan before ``tomllib`` runs (``tomllib`` recurses once per array level and keeps every prefix of
a dotted key: 100,000 levels of ``a.a.a...`` wanted about 40 GB). Every problem is a ``ValueError``
naming the file. String values must be valid Unicode text (a path with undecodable bytes is
refused when it is set), so what :func:`to_toml` writes always reads back equal.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from protocols.registry import all_protocols, did_you_mean, get_protocol, sections as protocol_sections

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_TOML_DEPTH",
    "PRESETS",
    "RunSection",
    "DataSection",
    "SplitSection",
    "EvalSection",
    "PrivacySection",
    "ClientsSection",
    "AuditSection",
    "RunConfig",
    "all_sections",
    "load_preset",
    "load_config_file",
    "preset_descriptions",
    "merge",
    "to_toml",
]

@dataclass(frozen=True)
class RunSection:
    """``[run]``: what to run.

    Attributes:
        protocol: a registered protocol (``secagg run --help`` lists them): ``fedavg``,
            ``fedmf``, ``centralized``, ``itempop``, ``random``, ...
        rounds: federated rounds, or epochs for centralised trainers; 0 for fixed baselines.
        seed: seeds every simulation choice (split, sampling, init, client selection).
        eval_every: evaluate the sampled metrics every N rounds (0: only at the end).
        checkpoint_every: write a checkpoint every N rounds (>= 1).
        record_views: keep what each adversary role (each server) received or sent, payloads
            included, plus ``public_info()``, in ``RUN_DIR/views`` (``secagg attack RUN_DIR`` reads
            them; :mod:`experiments.run.views`). Default false: a run keeps message sizes only.
        record_every: with ``record_views``, record round ``r`` when ``r % record_every == 0``, and the
            last round (>= 1; default 1: every round).
    """

    protocol: str = "fedavg"
    rounds: int = 20
    seed: int = 0
    eval_every: int = 5
    checkpoint_every: int = 1
    record_views: bool = False
    record_every: int = 1

    def __post_init__(self) -> None:
        if self.protocol not in all_protocols():
            raise ValueError(f"run.protocol must be one of {tuple(all_protocols())}; found {self.protocol!r}"
                             f"{did_you_mean(self.protocol, all_protocols())}")
        if self.rounds < 0 or self.eval_every < 0 or self.checkpoint_every < 1:
            raise ValueError(
                "run.rounds and run.eval_every must be >= 0 and run.checkpoint_every >= 1; "
                f"found rounds={self.rounds}, eval_every={self.eval_every}, checkpoint_every={self.checkpoint_every}"
            )
        if self.record_every < 1:
            raise ValueError(f"run.record_every must be >= 1 (1: every round); found {self.record_every}")


@dataclass(frozen=True)
class ColumnsSection:
    """``[data.columns]``: which column of a CSV holds each role (``--columns`` on the command line).

    Each value is a header name or a 0-based column index written as text (``"0"``); ``""``
    (the default) infers the role from the header names, ``"none"`` says the file has no such
    column. Only for ``csv`` files; MovieLens formats have fixed columns.
    """

    user: str = ""
    item: str = ""
    rating: str = ""
    timestamp: str = ""

    def mapping(self) -> dict[str, str | int | None] | None:
        """The ``columns=`` argument of :func:`recmodels.loaders.load_interactions` (``None``: infer all)."""
        given = {role: value for role, value in dataclasses.asdict(self).items() if value != ""}
        if not given:
            return None
        from recmodels.sniff import parse_columns

        return parse_columns(",".join(f"{role}={value}" for role, value in given.items()))

    def __post_init__(self) -> None:
        try:
            self.mapping()
        except ValueError as exc:
            raise ValueError(f"[data.columns]: {exc}") from None


@dataclass(frozen=True)
class DataSection:
    """``[data]``: where interactions come from and how they are preprocessed.

    Attributes:
        source: ``"synthetic"`` (the embedded default) or a path to a MovieLens file/folder or CSV,
            or a folder (or prefix) holding a paper's split files (``X.train.rating`` +
            ``X.test.rating`` [+ ``X.test.negative``], or ``X_train.csv`` + ``X_test.csv`` [+
            ``X_val.csv``]; :mod:`recmodels.splitfiles`): the run then uses that split as it is.
        format: ``""`` infers from the file name and content; else ``ml-100k`` | ``ml-1m`` |
            ``ml-csv`` | ``csv``, a public dataset's published format ``filmtrust`` | ``ciao`` |
            ``yelp`` | ``douban`` | ``recbole`` (:mod:`recmodels.public_data`), or a split format
            ``ncf`` | ``lightfr-csv``.
        train, valid, test: explicit split files (a paper's released split): the training file,
            the validation file (optional) and the test file, one held-out item per user.
            Relative paths are taken inside ``source`` (its folder when it is a file; the current
            directory when ``source = "synthetic"``). Set: no re-split, no filters
            (``min_*_interactions`` do not apply: the files fix the users), ``threshold`` keeps the
            training rows rated at least it. Empty (default): leave-one-out on ``source``.
        sep: a CSV's delimiter (one character or ``"::"``); ``""`` infers it from the content.
        columns: ``[data.columns]``, which CSV column holds the user, item, rating and timestamp
            (:class:`ColumnsSection`; inferred from the header names by default).
        threshold: ratings >= threshold are positives; ``nan`` (default) counts every rating.
        min_user_interactions: users with fewer interactions are dropped (default 2: one to
            train on, one to hold out).
        min_item_interactions: items with fewer interactions are dropped (default 0: no filter).
        synthetic_users, synthetic_items, synthetic_dim, synthetic_mean_interactions: the
            generator's size when ``source = "synthetic"``.
    """

    source: str = "synthetic"
    format: str = ""
    sep: str = ""
    columns: ColumnsSection = field(default_factory=ColumnsSection)
    threshold: float = math.nan
    min_user_interactions: int = 2
    min_item_interactions: int = 0
    synthetic_users: int = 1000
    synthetic_items: int = 500
    synthetic_dim: int = 8
    synthetic_mean_interactions: int = 40
    train: str = ""
    valid: str = ""
    test: str = ""

    def __post_init__(self) -> None:
        if bool(self.train) != bool(self.test):
            raise ValueError("data.train and data.test go together (an explicit split needs both); found "
                             f"train={self.train!r}, test={self.test!r}")
        if self.valid and not self.train:
            raise ValueError(f"data.valid needs data.train and data.test; found valid={self.valid!r} alone")
        if self.min_user_interactions < 2:
            raise ValueError(
                "data.min_user_interactions must be >= 2 (a user needs one interaction to train on and one "
                f"to hold out); found {self.min_user_interactions}"
            )
        if self.min_item_interactions < 0:
            raise ValueError(f"data.min_item_interactions must be >= 0; found {self.min_item_interactions}")
        if self.sep not in ("", "::") and len(self.sep) != 1:
            raise ValueError(f"data.sep must be one character or '::' (or empty to infer); found {self.sep!r}")

    def load_kwargs(self) -> dict[str, Any]:
        """``fmt``/``sep``/``columns`` for :func:`recmodels.loaders.load_with_format`."""
        return {"fmt": self.format or None, "sep": self.sep or None, "columns": self.columns.mapping()}


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
        negatives: sampled negatives per held-out item (NCF 99, FedFast 50, LightFR 49); 0 turns
            the sampled metrics off (full ranking only).
        ks: cut-offs for HR/NDCG/Precision/Recall.
        full_ranking: also rank the held-out item among all items the user has not trained on.
        candidates: a file of per-user candidate lists for the test items (NCF's ``.test.negative``:
            ``(user,item)<TAB>neg<TAB>neg...``); the sampled metrics then rank each test item among
            exactly these, nothing sampled (``negatives`` unused). Needs ``[data] train/test``
            (relative paths as theirs). An NCF test file ``X.test.rating`` finds ``X.test.negative``
            beside it without this key; LightFR's test CSV holds its own candidate blocks.
        valid_candidates: the same for the validation items (``[data] valid``).

    Every ranking evaluation is computed under three tie rules (``summary.json``'s ``ties``):
    ``pessimistic`` (the recorded figures), ``optimistic`` (the authors' code) and ``random``.
    """

    negatives: int = 99
    ks: list[int] = field(default_factory=lambda: [5, 10, 20])
    full_ranking: bool = True
    candidates: str = ""
    valid_candidates: str = ""

    def __post_init__(self) -> None:
        if self.negatives < 0:
            raise ValueError(f"eval.negatives must be >= 0 (0: full ranking only); found {self.negatives}")
        if self.negatives == 0 and not self.full_ranking:
            raise ValueError("eval.negatives = 0 needs eval.full_ranking = true (otherwise nothing is evaluated)")
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"eval.ks must be a non-empty list of cut-offs >= 1; found {self.ks}")


@dataclass(frozen=True)
class PrivacySection:
    """``[privacy]``: how the run's privacy ledger is reported and limited.

    Attributes:
        delta: the delta at which epsilon is reported (summary.json, ``secagg privacy report``).
        budget_epsilon: stop the run before a round whose releases would push epsilon (at
            ``delta``) past this; ``inf`` (default) records without a limit.
    """

    delta: float = 1e-5
    budget_epsilon: float = math.inf

    def __post_init__(self) -> None:
        if not (0 < self.delta < 1):
            raise ValueError(f"privacy.delta must be in (0, 1); found {self.delta}")
        if not (self.budget_epsilon > 0):
            raise ValueError(f"privacy.budget_epsilon must be positive (inf: no budget); found {self.budget_epsilon}")


@dataclass(frozen=True)
class ClientsSection:
    """``[clients]``: what every simulated client insists on, whatever the server asks
    (:class:`protocols.guard.DevicePolicy`; on Flower each node sets the same keys in its node config).

    Attributes:
        min_survivors: the smallest secure sum a client takes part in and helps unmask (>= 2).
        require_secure: a client refuses every plaintext step.
        ldp_epsilon_budget: the local-DP epsilon a client spends on its uploads at most (basic
            composition; each client counts its own, and the checkpoint carries the counts across
            ``--resume``); ``inf`` (default): no operator cap, the protocol's own configuration still
            holds (FedCL: ``user_budget`` and ``upload_every``; with both budgets the smaller).
    """

    min_survivors: int = 2
    require_secure: bool = False
    ldp_epsilon_budget: float = math.inf

    def __post_init__(self) -> None:
        try:
            self.policy()
        except ValueError as exc:
            raise ValueError(f"[clients]: {exc}") from None

    def policy(self) -> Any:
        """The :class:`protocols.guard.DevicePolicy` of the simulated clients."""
        from protocols.guard import DevicePolicy

        return DevicePolicy(min_survivors=self.min_survivors, require_secure=self.require_secure,
                            ldp_epsilon_budget=self.ldp_epsilon_budget)


@dataclass(frozen=True)
class AuditSection:
    """``[audit]``: canary users for the one-run privacy audit (``secagg audit RUN_DIR``, docs/audit.md).

    Attributes:
        canaries: canary users added to the training data (0: none). Each gets two sets of fresh
            items of its own and holds one of them, chosen by a bit from the OS CSPRNG (included
            with probability 1/2); the bits are written to ``RUN_DIR/audit-secret/`` only.
        canary_items: items in each of a canary's two sets.
    """

    canaries: int = 0
    canary_items: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.canaries <= 100_000:
            raise ValueError(f"audit.canaries must be in 0..100000 (0: no audit); found {self.canaries}")
        if self.canaries == 1:
            raise ValueError("audit.canaries = 1 cannot be audited (a guess needs two canaries); use 0 or >= 2")
        if not 1 <= self.canary_items <= 1000:
            raise ValueError(f"audit.canary_items must be in 1..1000; found {self.canary_items}")


#: The sections every run has; protocol sections come from :mod:`protocols.registry`.
CORE_SECTIONS: dict[str, type] = {
    "run": RunSection,
    "data": DataSection,
    "split": SplitSection,
    "eval": EvalSection,
    "privacy": PrivacySection,
    "clients": ClientsSection,
    "audit": AuditSection,
}


def all_sections() -> dict[str, type]:
    """Every known TOML section: the core ones, then each registered protocol's."""
    return {**CORE_SECTIONS, **protocol_sections()}


@dataclass(frozen=True)
class RunConfig:
    """A fully resolved configuration: the core sections and every protocol section.

    ``config.toml`` holds the core sections and the active protocol's section only
    (:meth:`to_dict`); the other protocols' sections keep their defaults.
    """

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    split: SplitSection = field(default_factory=SplitSection)
    eval: EvalSection = field(default_factory=EvalSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    clients: ClientsSection = field(default_factory=ClientsSection)
    audit: AuditSection = field(default_factory=AuditSection)
    sections: dict[str, Any] = field(default_factory=lambda: {n: c() for n, c in protocol_sections().items()})

    def section(self, name: str) -> Any:
        """The resolved instance of section ``name`` (core or protocol)."""
        if name in CORE_SECTIONS:
            return getattr(self, name)
        if name not in self.sections:
            raise KeyError(f"unknown section [{name}]")
        return self.sections[name]

    @property
    def spec(self):
        """The :class:`protocols.registry.ProtocolSpec` of ``run.protocol``."""
        return get_protocol(self.run.protocol)

    @property
    def protocol_config(self) -> Any:
        """The active protocol's section (``None`` if it has no options)."""
        return None if self.spec.section is None else self.sections[self.spec.section]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The core sections and the active protocol's section, as plain values."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in CORE_SECTIONS}
        if self.spec.section is not None:
            out[self.spec.section] = dataclasses.asdict(self.protocol_config)
        return out


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
    if dataclasses.is_dataclass(annotation):
        if type(value) is not dict:
            raise ValueError(f"{where} must be a table; found {value!r}")
        types_ = _section_types(annotation)
        out = {}
        for key, v in value.items():
            if key not in types_:
                raise ValueError(f"unknown key '{where.split(' ')[0]}.{key}'{did_you_mean(key, types_)}; known keys: "
                                 f"{', '.join(sorted(types_))}")
            out[key] = _check_type(f"{where.split(' ')[0]}.{key}", v, types_[key])
        return out
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
    known = all_sections()
    for section, values in raw.items():
        if section not in known:
            raise ValueError(f"unknown section [{section}] in {origin}{did_you_mean(section, known)}; known sections: "
                             f"{', '.join(known)}")
        if not isinstance(values, dict):
            raise ValueError(f"[{section}] in {origin} must be a table of keys")
        types_ = _section_types(known[section])
        for key, value in values.items():
            if key not in types_:
                raise ValueError(
                    f"unknown key '{section}.{key}' in {origin}{did_you_mean(key, types_)}; known keys: "
                    f"{', '.join(sorted(types_))}"
                )
            out.setdefault(section, {})[key] = _check_type(f"{section}.{key} (in {origin})", value, types_[key])
    return out


def _replace(current: Any, values: dict[str, Any]) -> Any:
    """``dataclasses.replace`` that also merges nested dataclass fields given as tables."""
    changes = {}
    for key, value in values.items():
        sub = getattr(current, key)
        changes[key] = _replace(sub, value) if dataclasses.is_dataclass(sub) and isinstance(value, dict) else value
    return dataclasses.replace(current, **changes)


def _check_text(where: str, value: Any) -> None:
    """Refuse strings that UTF-8 cannot encode (lone surrogates: ``os.fsdecode`` of a file name in
    another encoding), which ``config.toml`` could not hold."""
    if isinstance(value, dict):
        for key, v in value.items():
            _check_text(f"{where}.{key}", v)
    elif isinstance(value, list):
        for v in value:
            _check_text(where, v)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where} is not valid text: it holds bytes that are not UTF-8 ({value!r}); rename (or link) a file "
                "whose name is in another encoding to a UTF-8 name"
            ) from None


def merge(base: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Apply validated ``overrides`` to ``base``; each section re-validates itself."""
    core, protos = {}, dict(base.sections)
    for section, values in overrides.items():
        _check_text(section, values)
        if section in CORE_SECTIONS:
            core[section] = _replace(getattr(base, section), values)
        else:
            protos[section] = _replace(base.sections[section], values)
    return dataclasses.replace(base, **core, sections=protos)


#: Largest config file read (a resolved configuration is about 2 KB).
MAX_CONFIG_BYTES = 1 << 20
#: Deepest nesting of a config file: the document is level 1; every table (a header part or a
#: dotted-key part), array and inline table below it adds one. Real configurations use 3.
MAX_TOML_DEPTH = 64
#: TOML strings and comments (skipped whole, so brackets and dots inside them do not count), then
#: the characters that open, close or separate structure.
_TOML_TOKENS = re.compile(
    r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*""""{0,2}'  # multi-line basic string
    r"|'''(?:[^']|'(?!''))*''''{0,2}"  # multi-line literal string
    r'|"(?:[^"\\\n]|\\.)*"'  # basic string
    r"|'[^'\n]*'"  # literal string
    r"|#[^\n]*"  # comment
    r"|[\[\]{},.=\n]"
)
_TOML_FIRST = re.compile(r"[^ \t\r]")


def _check_toml_depth(text: str, origin: str) -> None:
    """Raise ValueError (naming the line) if ``text`` nests deeper than :data:`MAX_TOML_DEPTH`.

    A count that never under-counts, linear in the text: a ``[table]`` header's level is its
    dotted parts plus two (so ``[[array.of.tables]]``, one level more, is covered), a key-value
    line starts at its table's level, each dot of a key and each ``[``/``{`` of a value adds one,
    and ``,`` starts the next element or inline key at its container's level. A dot after ``=`` or
    inside an array belongs to a value (a number, a date) and is not counted.
    """
    table = base = 1  # the current [table]'s level; the level the current key or element hangs from
    dots = 0  # dots of the current key (or header)
    value = False  # after "=" or inside an array: a "." belongs to a number or a date, not to a key
    stack: list[tuple[int, int, str]] = []  # (base, dots, "[" or "{") of each open array / inline table
    header, line_begin, line_first = False, 0, -1  # line_first: the line's first non-blank (-1: not looked up)
    for match in _TOML_TOKENS.finditer(text):
        token = match.group()
        if token == "\n":
            if not stack:
                header, line_begin, line_first, base, dots, value = False, match.end(), -1, table, 0, False
            continue
        if token[0] in "#\"'":
            continue
        if token == "[" and not stack and not header:
            if line_first < 0:
                line_first = _TOML_FIRST.search(text, line_begin).start()
            header = match.start() == line_first  # a "[" that opens the line opens a header
            if header:
                dots = 0
                continue
        if header:
            if token == ".":
                dots += 1
            elif token == "]":
                header, table, base, dots = False, dots + 3, dots + 3, 0
        elif token in "[{":
            stack.append((base, dots, token))
            base, dots, value = base + dots + 1, 0, token == "["
        elif token in "]}":
            if stack:
                base, dots, _ = stack.pop()
            value = True
        elif token == ",":
            dots, value = 0, bool(stack) and stack[-1][2] == "["
        elif token == "=":
            value = True
        elif token == "." and not value:
            dots += 1
        if (dots + 3 if header else base + dots) > MAX_TOML_DEPTH:
            line = text.count("\n", 0, match.start()) + 1
            raise ValueError(
                f"{origin} is not valid TOML: arrays, tables or dotted keys nested deeper than {MAX_TOML_DEPTH} "
                f"levels (line {line})"
            )


def _read_toml(path: Path, origin: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"cannot read {origin}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{origin} is larger than {MAX_CONFIG_BYTES:,} bytes; a config file holds a few keys")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{origin} is not valid TOML: line {line} holds a byte that is not UTF-8 "
                         f"(0x{data[exc.start]:02x}); save the file as UTF-8") from None
    _check_toml_depth(text, origin)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin} is not valid TOML: {exc}") from None
    except RecursionError:  # not expected after _check_toml_depth; kept so that it can never escape
        raise ValueError(f"{origin} is not valid TOML: arrays or tables nested deeper than {MAX_TOML_DEPTH} levels") from None


def _preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("experiments.presets").iterdir() if p.name.endswith(".toml"))


PRESETS: tuple[str, ...] = tuple(_preset_names())

#: A sentence ends at ". ", "! " or "? " before a letter or a quote; not after these abbreviations.
_SENTENCE_END = re.compile(r"[.!?]\s+(?=[A-Za-z\"'])")
_ABBREVIATIONS = ("al.", "e.g.", "i.e.", "cf.", "vs.", "Eq.", "Fig.", "Sec.")
#: Longest description ``secagg run --help`` prints for a preset.
DESCRIPTION_CHARS = 100


def preset_description(text: str) -> str:
    """The one-line description of a preset file's ``text``: the first sentence of its leading comment
    (the comment lines before the first table, joined), cut at a word to :data:`DESCRIPTION_CHARS`."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        lines.append(stripped.lstrip("#").strip())
    words = " ".join(x for x in lines if x)
    first = words
    for match in _SENTENCE_END.finditer(words):
        if not words[: match.start() + 1].endswith(_ABBREVIATIONS):
            first = words[: match.start() + 1]
            break
    if len(first) > DESCRIPTION_CHARS:
        first = first[: DESCRIPTION_CHARS - 3].rsplit(" ", 1)[0].rstrip(",;:(.") + "..."
    return first


def preset_descriptions() -> dict[str, str]:
    """Every preset's one-line description (:func:`preset_description`), by name; reads the preset files
    only (no protocol is imported)."""
    root = resources.files("experiments.presets")
    return {name: preset_description(root.joinpath(f"{name}.toml").read_text(encoding="utf-8")) for name in PRESETS}


def load_preset(name: str) -> RunConfig:
    """The resolved configuration of a named preset (``secagg run --help`` lists them)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; available presets: "
                         f"{', '.join(PRESETS)} (secagg run --help describes each)")
    text = resources.files("experiments.presets").joinpath(f"{name}.toml").read_bytes()
    raw = tomllib.loads(text.decode())
    return merge(RunConfig(), parse_sections(raw, f"preset {name}"))


def load_config_file(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """Load a user TOML file on top of ``base`` (default: the built-in defaults)."""
    path = Path(path)
    raw = _read_toml(path, str(path))
    return merge(base or RunConfig(), parse_sections(raw, str(path)))


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return '"nan"'
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: backslash, quote and control characters escaped
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or c == "\x7f" else c) for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_table(name: str, values: dict[str, Any], lines: list[str]) -> None:
    lines.append(f"[{name}]")
    nested = {k: v for k, v in values.items() if isinstance(v, dict)}
    lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in nested)
    lines.append("")
    for k, v in nested.items():
        _toml_table(f"{name}.{k}", v, lines)


def to_toml(config: RunConfig) -> str:
    """Serialise a resolved configuration; :func:`load_config_file` reads it back unchanged."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        _toml_table(section, values, lines)
    return "\n".join(lines)


