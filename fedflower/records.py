"""Flower records <-> our secure-aggregation wire bytes, and the validation at the Flower boundary.

Every message of :class:`fedflower.secagg_workflow.SecAggWorkflow` and
:func:`fedflower.secagg_mod.secagg_mod` travels as one Flower ``ConfigRecord`` under
:data:`RECORD_KEY` in the message's ``RecordDict``. Apart from the one-off setup values, the
record carries exactly one ``bytes`` value, ``"msg"``: a :mod:`secagg.bonawitz_wire` message in
its wire form, which the receiving party parses with our strict decoder (fixed header binding the
protocol instance, round, sender, receiver and stage; fixed-size records; explicit limits).

What is checked here, before our decoders see anything (:func:`read_record`):

* the record exists and is a ``ConfigRecord``;
* its keys are *exactly* those of the stage and direction (:data:`TO_CLIENT` / :data:`TO_SERVER`;
  a missing or an extra key is refused);
* each value has the expected type (``bytes``, ``int``, ``list[int]``, ...) and, for fixed-size
  values (identity key), the expected length;
* the ``"stage"`` value names the stage the receiver is in.

A failure raises :class:`RecordError` (a :class:`secagg.errors.MessageError`, so callers that
already treat a bad wire message as "drop this client" need no new case). The message names the
stage, the key and what was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flwr.app import ConfigRecord, RecordDict

from secagg.errors import MessageError
from secagg.messages import INSTANCE_BYTES

__all__ = [
    "IDENTITY_BYTES",
    "IDENTITY_KEY",
    "RECORD_KEY",
    "STAGES",
    "STATE_KEY",
    "TO_CLIENT",
    "TO_SERVER",
    "RecordError",
    "check_record",
    "SetupConfig",
    "make_record",
    "read_record",
]

#: Key of our ConfigRecord in every Flower message of the protocol.
RECORD_KEY = "secagg-fedrec"
#: Key of the client's protocol state in ``Context.state.config_records`` (node-local).
STATE_KEY = "secagg-fedrec.state"
#: Key of the client's long-term Ed25519 identity in ``Context.state.config_records`` (node-local).
IDENTITY_KEY = "secagg-fedrec.identity"
#: The stages, in protocol order (one Flower round trip each).
STAGES = ("setup", "share_keys", "masked_input", "consistency", "unmask")
#: Raw Ed25519 public key length.
IDENTITY_BYTES = 32
#: Protocols the setup record may name.
PROTOCOL_NAMES = ("secagg", "secagg+")
ROUNDINGS = ("stochastic", "nearest")

_SETUP_TYPES: dict[str, type | tuple[type, type]] = {
    "stage": str,
    "protocol": str,
    "n": int,
    "dim": int,
    "t": int,
    "round": int,
    "instance": bytes,
    "index": int,
    "neighbours": list,
    "frac_bits": int,
    "clip": float,
    "max_weight": float,
    "rounding": str,
}
#: stage -> {key: type} of the server -> client record.
TO_CLIENT: dict[str, dict[str, type | tuple[type, type]]] = {
    "setup": _SETUP_TYPES,
    "share_keys": {"stage": str, "msg": bytes, "pki_ids": list, "pki_keys": list},
    "masked_input": {"stage": str, "msg": bytes},
    "consistency": {"stage": str, "msg": bytes},
    "unmask": {"stage": str, "msg": bytes},
}
#: stage -> {key: type} of the client -> server record.
TO_SERVER: dict[str, dict[str, type | tuple[type, type]]] = {
    "setup": {"stage": str, "identity": bytes, "msg": bytes},
    **{s: {"stage": str, "msg": bytes} for s in STAGES[1:]},
}


class RecordError(MessageError):
    """A Flower record that is not a well-formed message of the expected stage.

    Raised for a missing record, a missing or extra key, a value of the wrong type or length, or a
    record of another stage. The sender is dropped from the round; nothing else changes.
    """


def make_record(values: Mapping[str, object]) -> ConfigRecord:
    """A ConfigRecord of ``values`` (bytes, ints, floats, strs, bools and lists of them)."""
    return ConfigRecord(dict(values))


def check_record(content: RecordDict, key: str, spec: Mapping[str, type], stage: str, head: str) -> dict[str, object]:
    """The ConfigRecord ``key`` of ``content`` with exactly ``spec``'s keys and types, for ``stage``.

    Raises:
        RecordError: no such record, a missing or extra key, a value of another type (an int is
            accepted for a float, a bool never for an int), or a ``"stage"`` other than ``stage``.
    """
    try:
        rec = content.config_records.get(key)
    except AttributeError as exc:
        raise RecordError(f"{head}: content is {type(content).__name__}, not a RecordDict") from exc
    if rec is None:
        raise RecordError(f"{head}: the message carries no '{key}' ConfigRecord")
    keys = set(rec.keys())
    missing, extra = sorted(set(spec) - keys), sorted(keys - set(spec))
    if missing or extra:
        raise RecordError(
            f"{head}: record keys differ from the stage's: missing {missing}, unexpected {extra}"
        )
    got = rec.get("stage")
    if got != stage:
        raise RecordError(f"{head}: record is for stage {got!r}, expected {stage!r} (out-of-order or replayed)")
    out: dict[str, object] = {}
    for name, typ in spec.items():
        value = rec[name]
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise RecordError(f"{head}: '{name}' must be {typ.__name__}; found {type(value).__name__}")
        out[name] = value
    return out


def read_record(
    content: RecordDict, *, stage: str, direction: str, where: str = ""
) -> dict[str, object]:
    """Validate and return our record of ``stage`` from a Flower message's content.

    Args:
        content: the message's ``RecordDict``.
        stage: the stage the receiver is in (one of :data:`STAGES`).
        direction: ``"to_client"`` or ``"to_server"``.
        where: who is reading, for the error message (e.g. ``"node 12"``).

    Raises:
        RecordError: see the module docstring.
    """
    spec = (TO_CLIENT if direction == "to_client" else TO_SERVER)[stage]
    head = f"stage {stage.upper()}{' at ' + where if where else ''}"
    out = check_record(content, RECORD_KEY, spec, stage, head)
    if direction == "to_server" and stage == "setup" and len(out["identity"]) != IDENTITY_BYTES:  # type: ignore[arg-type]
        raise RecordError(
            f"{head}: 'identity' must be a {IDENTITY_BYTES}-byte Ed25519 key; found {len(out['identity'])} bytes"  # type: ignore[arg-type]
        )
    if stage == "share_keys" and direction == "to_client":
        ids, pks = out["pki_ids"], out["pki_keys"]
        if len(ids) != len(pks) or not all(type(i) is int for i in ids) or not all(  # type: ignore[arg-type]
            isinstance(k, bytes) and len(k) == IDENTITY_BYTES for k in pks  # type: ignore[union-attr]
        ):
            raise RecordError(f"{head}: 'pki_ids'/'pki_keys' must be equal-length lists of ints and 32-byte keys")
    return out


@dataclass(frozen=True)
class SetupConfig:
    """The public parameters the server sends each client in the setup stage.

    Attributes:
        protocol: ``"secagg"`` or ``"secagg+"``.
        n, dim, t, round, instance: as in :class:`secagg.bonawitz.MaskingConfig`.
        index: this client's index in ``0..n-1`` (the sender id in our wire headers).
        neighbours: this client's neighbours (sorted; all other clients for SecAgg).
        frac_bits, clip: the fixed-point encoding of ``weight * parameters`` (values are clipped
            to ``[-clip, clip]`` first, as Flower's quantisation does).
        max_weight: ``num_examples / max_weight`` is the client's weight, which must be ``<= 1``.
        rounding: ``"stochastic"`` (unbiased, CSPRNG) or ``"nearest"`` (deterministic).

    No safety setting travels here: whether a client accepts an unsafe ``t``, how few survivors
    and how many dropouts it tolerates are its node's own configuration
    (:func:`fedflower.client_state.node_policy`). The record once carried ``unsafe_threshold``,
    which let a server switch the consistency check off (issue 23, item 4); a record that still
    carries it is refused as having an unexpected key.
    """

    protocol: str
    n: int
    dim: int
    t: int
    round: int
    instance: bytes
    index: int
    neighbours: tuple[int, ...]
    frac_bits: int
    clip: float
    max_weight: float
    rounding: str = "stochastic"

    def to_record(self) -> ConfigRecord:
        """The setup ConfigRecord."""
        return make_record({
            "stage": "setup", "protocol": self.protocol, "n": self.n, "dim": self.dim, "t": self.t,
            "round": self.round, "instance": self.instance, "index": self.index,
            "neighbours": list(self.neighbours), "frac_bits": self.frac_bits, "clip": float(self.clip),
            "max_weight": float(self.max_weight), "rounding": self.rounding,
        })

    @classmethod
    def from_values(cls, v: Mapping[str, object]) -> SetupConfig:
        """Build from validated record values, checking ranges; raises :class:`RecordError`."""
        head = "stage SETUP"
        if v["protocol"] not in PROTOCOL_NAMES:
            raise RecordError(f"{head}: unknown protocol {v['protocol']!r}; expected one of {PROTOCOL_NAMES}")
        if v["rounding"] not in ROUNDINGS:
            raise RecordError(f"{head}: unknown rounding {v['rounding']!r}; expected one of {ROUNDINGS}")
        n, dim, t, idx = (int(v[k]) for k in ("n", "dim", "t", "index"))  # type: ignore[call-overload]
        if not (2 <= n < 2**31 and 1 <= dim < 2**31 and 0 <= idx < n and 1 <= t <= n and 0 <= int(v["round"]) < 2**32):  # type: ignore[call-overload]
            raise RecordError(f"{head}: out-of-range n={n}, dim={dim}, t={t}, index={idx} or round={v['round']}")
        inst = v["instance"]
        if len(inst) != INSTANCE_BYTES:  # type: ignore[arg-type]
            raise RecordError(f"{head}: instance must be {INSTANCE_BYTES} bytes; found {len(inst)}")  # type: ignore[arg-type]
        nbrs = v["neighbours"]
        if not all(type(u) is int for u in nbrs):  # type: ignore[union-attr]
            raise RecordError(f"{head}: neighbours must be ints")
        nb = tuple(nbrs)  # type: ignore[arg-type]
        if list(nb) != sorted(set(nb)) or idx in nb or (nb and not (0 <= nb[0] and nb[-1] < n)):
            raise RecordError(f"{head}: neighbours must be sorted, distinct, in [0, n) and exclude this client")
        return cls(
            protocol=str(v["protocol"]), n=n, dim=dim, t=t, round=int(v["round"]), instance=bytes(inst),  # type: ignore[call-overload, arg-type]
            index=idx, neighbours=nb, frac_bits=int(v["frac_bits"]), clip=float(v["clip"]),  # type: ignore[call-overload, arg-type]
            max_weight=float(v["max_weight"]), rounding=str(v["rounding"]),  # type: ignore[arg-type]
        )
