"""A SecAgg/SecAgg+ client's state between Flower messages, kept in the node's ``Context.state``.

A Flower ClientApp may be rebuilt for every message (simulation actors, SuperNode subprocesses),
so :func:`fedflower.secagg_mod.secagg_mod` cannot keep a :class:`secagg.bonawitz.MaskingClient`
object alive between stages. Instead it stores the client's state as typed values (``bytes``,
``int``, ``list``) in a ``ConfigRecord`` under :data:`fedflower.records.STATE_KEY` of the node's
own ``Context.state`` and rebuilds the client from it for the next message. Nothing is pickled;
the record never leaves the node (it holds the client's private keys and secret shares, as
Flower's own ``secaggplus_mod`` state does) and is deleted when the round ends or fails.

The client's safety settings (:class:`secagg.bonawitz.ClientPolicy`) are its node's own
configuration, never a field of a server message (issue 23, item 4): :func:`node_policy` reads them
from Flower's ``Context.node_config`` (what ``flower-supernode --node-config`` sets) at the setup
stage, and the state record keeps the policy the node had then (raised, never lowered, by the
ClientApp's own per-aggregation floor), so later stages re-read nothing.

The client does not know the whole SecAgg+ graph, only its own neighbourhood, which the server
sends in the setup record: :class:`ClientView` is the :class:`~secagg.bonawitz.MaskingConfig` a
client can check (its row of the graph, ``t`` against its own holders, including the refusal of
an unsafe ``t`` unless the node's own policy opted into it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
)
from flwr.app import ConfigRecord

from fedflower.records import RecordError, SetupConfig
from protocols.guard import DevicePolicy
from secagg import bonawitz
from secagg.bonawitz import ClientPolicy, ClientStage, MaskingClient, MaskingConfig, SigningKey
from secagg.keys import KeyPair
from secagg.messages import INSTANCE_BYTES
from secagg.params import DEFAULT_DROPOUT, min_safe_threshold

__all__ = ["NODE_KEYS", "ClientView", "dump_client", "identity_bytes", "load_client", "load_identity", "node_policy"]

#: The node-config keys of a client's safety settings, with their defaults (see :func:`node_policy`).
NODE_KEYS = {"min-survivors": 2, "unsafe-threshold": False, "max-dropout": DEFAULT_DROPOUT}


def node_policy(node_config: Mapping[str, object]) -> ClientPolicy:
    """The client's own :class:`~secagg.bonawitz.ClientPolicy` from its node's configuration
    (:meth:`protocols.guard.DevicePolicy.from_node_config`, the one parser of node settings).

    Keys (:data:`NODE_KEYS`): ``min-survivors`` (int >= 2, default 2): take part only in an
    aggregation announced for at least this many clients, and never sign a survivor set smaller;
    ``unsafe-threshold`` (bool, default false): accept a ``t`` at or below half of this client's
    holders (attack demonstrations only; the server cannot switch it on); ``max-dropout`` (float
    in [0, 1), default :data:`secagg.params.DEFAULT_DROPOUT`): never sign a survivor set missing
    more than ``ceil(max-dropout * n)`` of the ``n`` announced clients (set it to the dropout the
    deployment's SecAgg+ parameters were chosen for, ``SecAggWorkflow(dropout=...)``).

    Raises:
        ValueError: a value of another type or out of range, naming the key.
    """
    try:
        return DevicePolicy.from_node_config(node_config).secagg()
    except ValueError as exc:
        raise ValueError(f"this node's secure-aggregation settings: {exc}") from None


class _OwnRow(Sequence):
    """The graph as one client sees it: only its own adjacency list."""

    def __init__(self, n: int, me: int, neighbours: tuple[int, ...]) -> None:
        self._n, self._me, self.row = n, me, tuple(neighbours)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if i != self._me:
            raise LookupError(f"client {self._me} knows only its own neighbourhood, not client {i}'s")
        return self.row


@dataclass(frozen=True)
class ClientView(MaskingConfig):
    """A client's view of the public parameters: its own neighbourhood instead of the whole graph."""

    def __post_init__(self) -> None:
        g = self.graph
        if not isinstance(g, _OwnRow):
            raise TypeError("ClientView needs the client's own row (use ClientView.from_setup)")
        if type(self.n) is not int or self.n < 2 or type(self.dim) is not int or not 0 < self.dim < 2**31:
            raise RecordError(f"stage SETUP: n = {self.n!r} or dim = {self.dim!r} out of range")
        if not isinstance(self.instance, bytes) or len(self.instance) != INSTANCE_BYTES:
            raise RecordError(f"stage SETUP: instance must be {INSTANCE_BYTES} bytes")
        holders = len(g.row) + 1
        if not 1 <= self.t <= holders:
            raise RecordError(f"stage SETUP: threshold t = {self.t} must lie in [1, {holders}] (this client's holders)")
        if not self.unsafe_threshold and self.t < min_safe_threshold(holders):
            raise RecordError(
                f"stage SETUP: threshold t = {self.t} is at or below half of this client's {holders} holders "
                f"(needs t >= {min_safe_threshold(holders)}); the client refuses to share its secrets under it"
            )

    @property
    def k(self) -> int:  # type: ignore[override]
        """This client's degree."""
        return len(self.graph.row)  # type: ignore[attr-defined]

    @classmethod
    def from_setup(cls, s: SetupConfig, policy: ClientPolicy) -> ClientView:
        """The view described by a validated setup record, checked against the node's own ``policy``.

        ``unsafe_threshold`` comes from the node's policy, never from the server: a ``t`` at or
        below half of this client's holders is refused unless the node's operator opted in.
        """
        return cls(s.n, s.dim, s.t, _OwnRow(s.n, s.index, s.neighbours), s.instance, s.round,  # type: ignore[arg-type]
                   policy.unsafe_threshold)


def identity_bytes(key: SigningKey) -> bytes:
    """The raw 32-byte private key of an identity (node-local storage only)."""
    return key._sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())  # noqa: SLF001


def load_identity(raw: bytes) -> SigningKey:
    """Rebuild an identity from :func:`identity_bytes`."""
    return SigningKey(Ed25519PrivateKey.from_private_bytes(raw))


_SETUP_FIELDS = ("protocol", "n", "dim", "t", "round", "instance", "index", "neighbours", "frac_bits", "clip",
                 "max_weight", "rounding")
_POLICY_FIELDS = ("min_survivors", "unsafe_threshold", "max_dropout")


def dump_client(setup: SetupConfig, client: MaskingClient, pki: dict[int, bytes]) -> ConfigRecord:
    """The client's state as a ConfigRecord (see the module docstring), its policy included."""
    out: dict[str, object] = {f"cfg_{f}": getattr(setup, f) for f in _SETUP_FIELDS}
    out.update({f"policy_{f}": getattr(client.policy, f) for f in _POLICY_FIELDS})
    out["cfg_neighbours"] = list(setup.neighbours)
    out["client_stage"] = int(client.stage)
    out["pki_ids"] = list(pki)
    out["pki_keys"] = list(pki.values())
    st = client._state  # noqa: SLF001 - this module is the MaskingClient's persistence
    if isinstance(st, bonawitz._Advertised | bonawitz._Shared):  # noqa: SLF001
        out["c_sk"], out["s_sk"] = st.c.private_bytes(), st.s.private_bytes()
    if isinstance(st, bonawitz._Shared):  # noqa: SLF001
        ids = sorted(st.peers_s_pk)
        out.update(b=st.b, peer_ids=ids, peer_s_pk=[st.peers_s_pk[v] for v in ids],
                   enc_ids=sorted(st.enc_keys), enc_keys=[st.enc_keys[v] for v in sorted(st.enc_keys)],
                   own_b_share=st.own_b_share, own_s_share=st.own_s_share)
    if isinstance(st, bonawitz._Masked | bonawitz._Signed):  # noqa: SLF001
        ids = sorted(st.received)
        out.update(recv_ids=ids, recv_b=[st.received[v][0] for v in ids], recv_s=[st.received[v][1] for v in ids],
                   u2=sorted(st.u2), own_b_share=st.own_b_share)
    if isinstance(st, bonawitz._Signed):  # noqa: SLF001
        out["u3"], out["u3_digest"] = sorted(st.u3), st.digest  # U3 within the neighbourhood, and what was signed
    return ConfigRecord(out)


def load_client(rec: ConfigRecord, identity: SigningKey) -> tuple[SetupConfig, MaskingClient, dict[int, bytes]]:
    """Rebuild ``(setup, client, pki)`` from :func:`dump_client`'s record."""
    setup = SetupConfig(**{f: rec[f"cfg_{f}"] for f in _SETUP_FIELDS if f != "neighbours"},  # type: ignore[arg-type]
                        neighbours=tuple(rec["cfg_neighbours"]))  # type: ignore[arg-type]
    pki = dict(zip(rec["pki_ids"], rec["pki_keys"], strict=True))  # type: ignore[arg-type]
    policy = ClientPolicy(**{f: rec[f"policy_{f}"] for f in _POLICY_FIELDS})  # type: ignore[arg-type]
    client = MaskingClient(ClientView.from_setup(setup, policy), setup.index, identity, pki, policy)
    stage = ClientStage(int(rec["client_stage"]))  # type: ignore[call-overload]
    state: object = None
    if stage == ClientStage.ADVERTISED:
        state = bonawitz._Advertised(KeyPair.from_private_bytes(rec["c_sk"]), KeyPair.from_private_bytes(rec["s_sk"]))  # type: ignore[arg-type]  # noqa: SLF001
    elif stage == ClientStage.SHARED:
        state = bonawitz._Shared(  # noqa: SLF001
            KeyPair.from_private_bytes(rec["c_sk"]), KeyPair.from_private_bytes(rec["s_sk"]), rec["b"],  # type: ignore[arg-type]
            dict(zip(rec["peer_ids"], rec["peer_s_pk"], strict=True)),  # type: ignore[arg-type]
            dict(zip(rec["enc_ids"], rec["enc_keys"], strict=True)),  # type: ignore[arg-type]
            rec["own_b_share"], rec["own_s_share"],  # type: ignore[arg-type]
        )
    elif stage in (ClientStage.MASKED, ClientStage.SIGNED):
        received = {v: (b, s) for v, b, s in zip(rec["recv_ids"], rec["recv_b"], rec["recv_s"], strict=True)}  # type: ignore[arg-type]
        u2 = frozenset(rec["u2"])  # type: ignore[arg-type]
        if stage == ClientStage.MASKED:
            state = bonawitz._Masked(received, u2, rec["own_b_share"])  # type: ignore[arg-type]  # noqa: SLF001
        else:
            state = bonawitz._Signed(received, u2, frozenset(rec["u3"]), rec["own_b_share"],  # type: ignore[arg-type]  # noqa: SLF001
                                     rec["u3_digest"])  # type: ignore[arg-type]
    client.stage = stage
    client._state = state  # noqa: SLF001
    return setup, client, pki
