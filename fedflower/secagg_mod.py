"""``secagg_mod``: the client side of our SecAgg/SecAgg+ inside a Flower ClientApp.

A drop-in replacement for ``flwr.client.mod.secaggplus_mod``, paired with
:class:`fedflower.secagg_workflow.SecAggWorkflow` on the server::

    from flwr.client import ClientApp
    from fedflower.secagg_mod import secagg_mod

    app = ClientApp(client_fn=client_fn, mods=[secagg_mod])

Parties, adversary and promise: those of :mod:`secagg.bonawitz` (an honest-but-curious server that
may collude with fewer than ``t`` of a client's holders; clients may drop out at any stage); the
Flower SuperLink and ServerApp together play that server. Stages (one Flower ``TRAIN`` round trip
each, every message one :data:`fedflower.records.RECORD_KEY` ConfigRecord carrying our wire bytes):

1. ``setup``: the server's public parameters (:class:`fedflower.records.SetupConfig`: protocol,
   ``n``, ``dim``, ``t``, round, instance, this client's index and neighbours, encoding). The
   client reads its own safety settings from its node's configuration
   (:func:`fedflower.client_state.node_policy`: ``min-survivors``, ``unsafe-threshold``,
   ``max-dropout``; never from the server), checks the parameters against them
   (:class:`fedflower.client_state.ClientView`: ``t`` within its holders and above half of them
   unless the node opted into ``unsafe-threshold``; ``n`` at least ``min-survivors``; the bit
   budget) and answers with its long-term Ed25519 identity key and
   :class:`~secagg.bonawitz_wire.AdvertiseKeys`.
2. ``share_keys``: :class:`~secagg.bonawitz_wire.KeyBroadcast` plus the identity keys of its
   holders; the client checks that its own identity was relayed unchanged, then sends
   :class:`~secagg.bonawitz_wire.EncryptedShares`.
3. ``masked_input``: :class:`~secagg.bonawitz_wire.ForwardedShares` plus the FitIns; the mod runs
   the rest of the ClientApp (training), encodes ``[w, w * parameters]`` with
   ``w = num_examples / max_weight`` (parameters clipped to ``[-clip, clip]``, fixed point with
   ``frac_bits`` fractional bits, :class:`secagg.encoding.FixedPoint`), and sends the
   :class:`~secagg.bonawitz_wire.MaskedInput`; the FitRes goes back with its arrays emptied. A
   ClientApp may instead answer with a raw vector (:data:`VECTOR_KEY`, :func:`encode_vector`),
   summed as it is; the mod removes it from the reply. Beside ``"vector"`` the record may hold an
   int64 scalar array ``"min_survivors"``: the ClientApp's own floor for this aggregation (an
   input whose distributed-DP noise is sized for that many survivors), which raises the node's
   ``min-survivors`` for this instance only (kept in the node's state, never lowered; refused
   before masking when the announced ``n`` is smaller).
4. ``consistency``: the client signs the survivor set U3 only if it lies within the clients whose
   shares reached it (for its neighbours), holds at least ``max(min-survivors, the ClientApp's
   floor)`` clients, and misses at most ``ceil(max-dropout * n)`` of the ``n`` announced ones
   (:class:`secagg.bonawitz.ClientPolicy`); 5. ``unmask``: as in :mod:`secagg.bonawitz`.

What the client refuses (a typed :class:`secagg.errors.SecAggError`, which Flower turns into an
error reply, so the server drops this client): a record with missing or extra keys or wrong value
types (:class:`fedflower.records.RecordError`), a message of another stage, round or protocol
instance, a replayed or tampered message (our decoders and state machine), a ``TRAIN`` message
without our record (a client with this mod never sends its update unmasked), ``num_examples``
above ``max_weight``, a model whose size differs from the announced ``dim``, and whatever its
policy refuses (above). A node whose own settings are malformed refuses every setup
(``ValueError`` naming the node-config key).

The client's state between stages (private keys, shares) is kept in the node's own
``Context.state`` (:mod:`fedflower.client_state`) and deleted when the round ends or fails; its
long-term identity key is kept there across rounds, so the server can pin it (trust on first use).
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat

from fedflower.client_state import (
    ClientView,
    dump_client,
    identity_bytes,
    load_client,
    load_identity,
    node_policy,
)
from fedflower.records import (
    IDENTITY_KEY,
    RECORD_KEY,
    STATE_KEY,
    RecordError,
    SetupConfig,
    make_record,
    read_record,
)
from secagg.bonawitz import ClientStage, MaskingClient, SigningKey
from secagg.encoding import FixedPoint, check_budget
from secagg.errors import BudgetError, MessageError

__all__ = ["NEXT_STAGE", "VECTOR_KEY", "encode_update", "encode_vector", "secagg_mod", "vector_floor"]

#: An ArrayRecord a ClientApp may answer ``masked_input`` with instead of a FitRes: one float64
#: array ``"vector"`` of exactly ``dim`` values, summed as they are (no weight slot), for servers
#: that lay out their own sums (:meth:`fedflower.secagg_workflow.SecAggWorkflow.aggregate_vectors`);
#: optionally an int64 scalar array ``"min_survivors"`` (:func:`vector_floor`).
VECTOR_KEY = "secagg.vector"

log = logging.getLogger(__name__)

#: client state -> the server stage it accepts next (a ``setup`` is accepted at any time)
NEXT_STAGE = {
    ClientStage.ADVERTISED: "share_keys",
    ClientStage.SHARED: "masked_input",
    ClientStage.MASKED: "consistency",
    ClientStage.SIGNED: "unmask",
}


def _identity(ctxt: Context) -> SigningKey:
    rec = ctxt.state.config_records.get(IDENTITY_KEY)
    if rec is not None:
        return load_identity(rec["sk"])  # type: ignore[arg-type]
    key = SigningKey()
    ctxt.state.config_records[IDENTITY_KEY] = make_record({"sk": identity_bytes(key)})
    return key


def encode_update(setup: SetupConfig, arrays: list[np.ndarray], num_examples: int) -> np.ndarray:
    """``[w, w * clip(parameters)]`` in fixed point, ``w = num_examples / max_weight``.

    Raises:
        BudgetError: ``num_examples`` exceeds ``max_weight``, or the sizes disagree with ``dim``.
    """
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays]) if arrays else np.zeros(0)
    if flat.size + 1 != setup.dim:
        raise BudgetError(
            f"stage MASKED_INPUT: the model has {flat.size} values but the server announced {setup.dim - 1}; "
            "the ServerApp's initial parameters and the ClientApp's model must have the same shapes"
        )
    if type(num_examples) is not int or not 0 <= num_examples <= setup.max_weight:
        raise BudgetError(
            f"stage MASKED_INPUT: num_examples = {num_examples!r} is outside [0, max_weight = {setup.max_weight:g}]; "
            "raise max_weight in SecAggWorkflow (and check the bit budget)"
        )
    if not np.all(np.isfinite(flat)):
        raise BudgetError("stage MASKED_INPUT: the update holds a non-finite value; nothing was sent")
    w = num_examples / setup.max_weight
    clip = setup.clip
    vec = np.empty(setup.dim, dtype=np.float64)
    vec[0] = w
    np.clip(w * flat, -clip, clip, out=vec[1:])
    return FixedPoint(setup.frac_bits, max(clip, 1.0)).encode(vec, rounding=setup.rounding)


def encode_vector(setup: SetupConfig, vector: np.ndarray) -> np.ndarray:
    """A raw vector in fixed point: exactly ``dim`` finite values within ``[-clip, clip]``.

    Unlike :func:`encode_update` nothing is clipped: a value outside the range is refused (the
    server's sums would silently change otherwise), and the client is dropped from the round.

    Raises:
        BudgetError: wrong length, a non-finite value, or a value beyond ``clip``.
    """
    vec = np.asarray(vector)
    if vec.dtype != np.float64 or vec.ndim != 1 or vec.size != setup.dim:
        raise BudgetError(f"stage MASKED_INPUT: the input vector is {vec.dtype} of shape {vec.shape}; the server "
                          f"announced float64 ({setup.dim},)")
    if not np.all(np.isfinite(vec)):
        raise BudgetError("stage MASKED_INPUT: the update holds a non-finite value; nothing was sent")
    big = float(np.abs(vec).max(initial=0.0))
    if big > setup.clip:
        raise BudgetError(f"stage MASKED_INPUT: the update holds {big:.4g}, beyond the clipping range "
                          f"{setup.clip:g}; raise it (and check the bit budget) or lower the learning rate")
    return FixedPoint(setup.frac_bits, max(setup.clip, 1.0)).encode(vec, rounding=setup.rounding)


def vector_floor(raw: ArrayRecord, where: str) -> int | None:
    """The ClientApp's own ``min_survivors`` in a :data:`VECTOR_KEY` record (``None`` if absent).

    The record holds exactly ``"vector"`` and, optionally, ``"min_survivors"``: an int64 scalar
    array with a value >= 2 (a sum of one client is its input).

    Raises:
        RecordError: other keys, or a ``"min_survivors"`` of another dtype, shape or value.
    """
    keys = set(raw.keys())
    if keys not in ({"vector"}, {"vector", "min_survivors"}):
        raise RecordError(f"{where}: the '{VECTOR_KEY}' record must hold 'vector' (and optionally "
                          f"'min_survivors'); found {sorted(keys)}")
    if "min_survivors" not in keys:
        return None
    floor = raw["min_survivors"].numpy()
    if floor.dtype != np.int64 or floor.shape != () or int(floor) < 2:
        raise RecordError(f"{where}: '{VECTOR_KEY}' 'min_survivors' must be an int64 scalar >= 2; found "
                          f"{floor.dtype} of shape {floor.shape}" + (f" = {floor.item()!r}" if floor.shape == () else ""))
    return int(floor)


def _setup(vals: dict, ctxt: Context) -> dict[str, object]:
    setup = SetupConfig.from_values(vals)
    policy = node_policy(ctxt.node_config)  # the node's own settings, never the server's
    view = ClientView.from_setup(setup, policy)
    check_budget(n_summands=setup.n, clip=max(setup.clip, 1.0), frac_bits=setup.frac_bits)
    ident = _identity(ctxt)
    pki = {setup.index: ident.public_bytes}
    client = MaskingClient(view, setup.index, ident, pki, policy)
    advert = client.advertise().to_bytes()
    ctxt.state.config_records[STATE_KEY] = dump_client(setup, client, pki)
    return {"stage": "setup", "identity": ident.public_bytes, "msg": advert}


def secagg_mod(msg: Message, ctxt: Context, call_next) -> Message:  # noqa: ANN001 - Flower's ClientAppCallable
    """Run one stage of our SecAgg/SecAgg+ for a ``TRAIN`` message; other messages pass through."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    records = ctxt.state.config_records
    try:
        rec = msg.content.config_records.get(RECORD_KEY)
        if rec is None:
            raise RecordError(
                f"a TRAIN message without the '{RECORD_KEY}' record: this client only trains through secure "
                "aggregation (use SecAggWorkflow on the server)"
            )
        where = f"node {msg.metadata.dst_node_id}"
        if rec.get("stage") == "setup":
            records.pop(STATE_KEY, None)  # a new round replaces whatever was in progress
            vals = read_record(msg.content, stage="setup", direction="to_client", where=where)
            res = _setup(vals, ctxt)
            return Message(RecordDict({RECORD_KEY: make_record(res)}), reply_to=msg)
        state = records.get(STATE_KEY)
        if state is None:
            raise RecordError(f"stage {str(rec.get('stage')).upper()} at {where}: no round in progress (setup missing)")
        setup, client, pki = load_client(state, _identity(ctxt))
        stage = NEXT_STAGE.get(client.stage)
        if stage is None:  # pragma: no cover - DONE states are deleted
            raise MessageError(f"{where}: no stage expected in client state {client.stage.name}")
        vals = read_record(msg.content, stage=stage, direction="to_client", where=where)
        blob = vals["msg"]
        content = None
        if stage == "share_keys":
            pki = dict(zip(vals["pki_ids"], vals["pki_keys"], strict=True))  # type: ignore[arg-type]
            if pki.get(setup.index) != client._identity.public_bytes:  # noqa: SLF001
                raise RecordError(f"stage SHARE_KEYS at {where}: the server relayed a wrong identity key for this client")
            client._pki = pki  # noqa: SLF001 - the holders' directory arrives with this stage
            reply = client.share_keys(blob).to_bytes()  # type: ignore[arg-type]
        elif stage == "masked_input":
            out_msg = call_next(msg, ctxt)
            if out_msg.has_error():
                raise RecordError(f"stage MASKED_INPUT at {where}: the ClientApp failed: {out_msg.error.reason}")
            content = out_msg.content
            raw = content.array_records.get(VECTOR_KEY)
            if raw is not None:
                floor = vector_floor(raw, f"stage MASKED_INPUT at {where}")
                if floor is not None:  # this input's own floor: never unmasked over fewer survivors
                    client.require_survivors(floor)
                x = encode_vector(setup, raw["vector"].numpy())
                del content[VECTOR_KEY]  # the plaintext input never leaves the client
            else:
                fitres = compat.recorddict_to_fitres(content, keep_input=True)
                x = encode_update(setup, parameters_to_ndarrays(fitres.parameters), fitres.num_examples)
            reply = client.mask_input(blob, x).to_bytes()  # type: ignore[arg-type]
            for arr in content.array_records.values():
                arr.clear()
        elif stage == "consistency":
            reply = client.sign_survivors(blob).to_bytes()  # type: ignore[arg-type]
        else:
            reply = client.unmask(blob).to_bytes()  # type: ignore[arg-type]
        if client.stage == ClientStage.DONE:
            records.pop(STATE_KEY, None)
        else:
            records[STATE_KEY] = dump_client(setup, client, pki)
        res_rec = make_record({"stage": stage, "msg": reply})
        if content is None:
            return Message(RecordDict({RECORD_KEY: res_rec}), reply_to=msg)
        content.config_records[RECORD_KEY] = res_rec
        return Message(content, reply_to=msg)
    except Exception:
        records.pop(STATE_KEY, None)  # this client is out of the round: forget its secrets
        raise
