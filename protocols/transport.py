"""The in-process transport and the transcript of who saw what.

Every message a protocol sends goes through a :class:`Transport`. The in-process transport
delivers it at once and appends a :class:`Record` to the :class:`Transcript`: sender,
receiver, round, kind, size in bytes and, when the transcript keeps payloads, the payload *as
the receiver saw it* (ciphertexts stay ciphertexts, masked vectors stay masked). An
adversary's view is a filter of the transcript (:meth:`Transcript.view`); attacks consume
views, never private client state.

Payload retention is a choice because a dense FedAvg upload of a 10k-item table is ~1 MB per
client per round: runs keep only sizes by default (enough for the cost report), while attack
experiments ask for the payloads of the rounds they need.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SERVER", "Record", "Transcript", "InProcessTransport", "client"]

#: Party name of the aggregation server.
SERVER = "server"


def client(index: int) -> str:
    """Party name of the client that holds user ``index``."""
    return f"client:{int(index)}"


@dataclass(frozen=True, slots=True)
class Record:
    """One delivered message.

    Attributes:
        sender: party that sent it (``"server"`` or ``"client:<u>"``).
        receiver: party that received it.
        round: protocol round (0-based).
        kind: message kind, e.g. ``"model"`` or ``"update"``.
        nbytes: size on the wire in bytes (as the protocol would serialise it).
        payload: what the receiver saw, or ``None`` when payloads are not kept.
    """

    sender: str
    receiver: str
    round: int
    kind: str
    nbytes: int
    payload: Any = None


@dataclass
class Transcript:
    """Append-only log of delivered messages.

    Args:
        keep_payloads: ``True`` keeps every payload; a callable ``(record) -> bool`` keeps the
            payloads it selects (e.g. only what the server received in rounds 3 and 4);
            ``False`` keeps sizes only.
    """

    keep_payloads: bool | Callable[[Record], bool] = False
    records: list[Record] = field(default_factory=list)

    def append(self, record: Record) -> None:
        keep = self.keep_payloads(record) if callable(self.keep_payloads) else self.keep_payloads
        if not keep and record.payload is not None:
            record = Record(record.sender, record.receiver, record.round, record.kind, record.nbytes, None)
        self.records.append(record)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def view(self, party: str | None = None, *, round: int | None = None, kind: str | None = None) -> list[Record]:
        """Records received by ``party`` (all parties if ``None``), optionally one round / kind."""
        return [
            r
            for r in self.records
            if (party is None or r.receiver == party)
            and (round is None or r.round == round)
            and (kind is None or r.kind == kind)
        ]

    def bytes_by_party(self, round: int | None = None) -> dict[str, dict[str, int]]:
        """``{party: {"sent": bytes, "received": bytes}}`` over one round or all."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0})
        for r in self.records:
            if round is None or r.round == round:
                out[r.sender]["sent"] += r.nbytes
                out[r.receiver]["received"] += r.nbytes
        return dict(out)

    def round_summary(self, round: int) -> dict[str, float | int]:
        """Cost summary of one round: messages, total bytes, bytes per participating client."""
        recs = [r for r in self.records if r.round == round]
        # Every party that is not a client is a server (``server``, or e.g. STTFedRec's ``rs``/``sas``).
        clients = {p for r in recs for p in (r.sender, r.receiver) if p.startswith("client:")}
        up = sum(r.nbytes for r in recs if not r.receiver.startswith("client:"))
        down = sum(r.nbytes for r in recs if not r.sender.startswith("client:"))
        n = max(len(clients), 1)
        return {
            "round": round,
            "messages": len(recs),
            "clients": len(clients),
            "bytes_up": up,
            "bytes_down": down,
            "bytes_per_client": (up + down) / n,
        }

    def drop_before(self, round: int) -> None:
        """Forget records of rounds before ``round`` (long runs keep memory bounded)."""
        self.records = [r for r in self.records if r.round >= round]


class InProcessTransport:
    """Delivers messages immediately within one process and records them."""

    def __init__(self, transcript: Transcript | None = None):
        self.transcript = transcript if transcript is not None else Transcript()

    def send(self, sender: str, receiver: str, round: int, kind: str, payload: Any, nbytes: int) -> Any:
        """Record the message and return the payload as delivered to ``receiver``."""
        if nbytes < 0:
            raise ValueError(f"message size must be non-negative; found {nbytes}")
        self.transcript.append(Record(sender, receiver, int(round), kind, int(nbytes), payload))
        return payload
