"""FedMF (Chai et al. 2020): federated explicit-rating MF with a defense chosen by configuration.

Parties:
    * one client per user, holding its ratings and its user vector ``p_u`` (never sent);
    * the server, holding the item matrix ``Q`` (in plaintext, or encrypted under HE).

Round ``t`` (every user takes part in every round, as in FedMF):
    1. the server broadcasts the item matrix (kind ``"model"``; plaintext, or ciphertexts);
    2. each client runs one local pass over its ratings (:func:`recmodels.mf.local_updates`:
       FedMF's item-by-item update by default) and uploads its item update ``delta = -g``
       (kind ``"update"``). Variant ``"full"`` uploads a dense ``[n_items, dim]`` update (zeros for
       unrated items, FedMF's "fake zeros"); variant ``"part"`` uploads the rated rows only, with
       their item ids in the clear;
    3. the server validates EVERY upload (round, sender, replay, item ids, shape, finiteness or
       ciphertext checks) before folding any in, then sets ``Q <- Q + sum_u delta_u``.

Defenses (``FedMFConfig.defense``):
    * ``"none"``: plaintext updates. Adversary: honest-but-curious server. Promise: none beyond
      data locality; :mod:`attacks.fedmf` recovers the ratings from the uploads.
    * ``"paillier"``: FedMF's design. All clients share one Paillier key pair; the server holds
      ``Enc(Q)`` and the public key, adds packed ciphertexts (:mod:`secagg.he.backends`) and never
      decrypts. A designated client (client 0) re-encrypts the new ``Enc(Q)`` every round
      (kind ``"refresh"``) so that the packed carry headroom is never exhausted. Promise: the
      server learns sizes and, in ``"part"``, the rated ids, but no value. Limit (shared key):
      any client, or the server colluding with one client, decrypts every upload.
    * ``"ckks"``: the same key model with TenSEAL CKKS (server has the public context only);
      sums are approximate within :func:`secagg.he.ckks.sum_error_bound`.
    * ``"secagg"``: the dense updates go through the ``secagg`` pairwise-mask protocol
      (an exchange's :class:`protocols.exchange.SecureSum`, :func:`protocols.secure_sum.secure_sum`
      in process) over all clients; the transcript records the masked vectors the server received. Promise: the server learns only the sum over >= 2 clients.
      In ``"part"`` the rated ids still travel in the clear (the variant's metadata), and the
      values travel as a dense masked vector (a masking protocol needs equal lengths).
    * ``"ldp"``: every client perturbs its update with :func:`dp.ldp.ldp_laplace`
      (``clip_L1(delta, clip) + Laplace(2 clip / epsilon)``). Promise: each upload is
      ``epsilon``-LDP; ``rounds`` uploads compose (basic: ``rounds * epsilon``).

On separate devices (:mod:`protocols.exchange`; docs/fedmf.md "On separate devices"): a round is
the exchanges ``"train"`` (every user; the model down, the update up: plaintext, LDP, HE ciphertexts
as uint8 arrays, or a secure sum), ``"refresh"`` (HE: one key-holding client re-encrypts the sum)
and ``"loss"`` (every user; the new model down, each client's squared-error sum and rating count
up: in plaintext under ``"none"``, through secure aggregation under every other defense), plus
``"items"`` before ``"train"`` for ``"part"`` under secure aggregation (the ids in the clear). The
same generator runs in one process (:meth:`FedMF.run_round`). The rating scale comes from
``rating_scale`` (default: the training ratings' range, in process only); HE needs the shared key
files of :func:`write_he_keys` (``he_keys``): the server half reads only the public key.

Stated limits: ``"part"`` reveals each user's rated set under every defense; HE protects only
against the server alone; secure aggregation over one client would reveal it (we always
aggregate all ``n >= 2`` clients). Simulation: clients are batched (numpy); an encrypted
broadcast is decrypted once per batch of clients (every client would obtain the same plaintext).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp.events import Laplace, NonPrivate
from dp.ldp import ldp_laplace
from protocols.base import Release, RoundStats
from protocols.exchange import Exchange, Replies, SecureSum, run_exchanges
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from protocols.fedmf_config import DEFENSES, VARIANTS, FedMFConfig, UpdateError  # noqa: F401  (re-exported)
from protocols.fedmf_device import FedMFDevice
from protocols.fedmf_he import (  # noqa: F401  (re-exported: they were defined here)
    HE_PUBLIC,
    HE_SECRET,
    _ct_arrays,
    _ct_from,
    _load_he_keys,
    _new_he,
    _size,
    write_he_keys,
)
from recmodels.data import Interactions
from recmodels.mf import init_factors, mae, predict, rating_lists, rmse
from secagg.encoding import check_budget
from secagg.errors import SecAggError
from secagg.he.backends import HEClient, HEServer

__all__ = [
    "BROADCAST",
    "DEFENSES",
    "VARIANTS",
    "FedMF",
    "FedMFConfig",
    "RoundStats",
    "UpdateError",
    "Upload",
    "check_devices",
    "write_he_keys",
]

#: Receiver name of the server's broadcast to all clients.
BROADCAST = "clients"
#: The secure sum of the training loss (every defense but ``"none"``): each client's
#: ``[mean squared error, 1, 1 if non-finite]``, through SecAgg+ (cheap at any n: the server learns
#: the three totals only; the round's loss is the mean over the clients of their own mean squared
#: error). A client's mean squared error is at most ``(hi - lo)^2`` (predictions are clipped to the
#: scale), far below 2^24; 2^-20 per value keeps the reported loss within ~1e-7 of the exact one.
LOSS_SECURE, LOSS_CLIP, LOSS_FRAC_BITS = "secagg+", 2.0**24, 20
#: How many key-holding clients the server asks, in user order, to refresh ``Enc(Q)`` (HE).
REFRESH_TRIES = 3


@dataclass(frozen=True)
class Upload:
    """One client's upload as the server receives it.

    Attributes:
        user: the sending client's user index.
        round: the round it belongs to.
        items: ``"part"``: int64 sorted rated item ids (in the clear); ``"full"``: ``None``.
        body: float64 ``[k, dim]`` (none/ldp), ``bytes`` (HE full), ``tuple[bytes, ...]`` one per
            row (HE part), or uint64 masked vector (secagg).
    """

    user: int
    round: int
    items: np.ndarray | None
    body: Any

    @property
    def nbytes(self) -> int:
        """Size on the wire (ids as int32, floats as float64, ciphertexts as serialised)."""
        ids = 0 if self.items is None else 4 * len(self.items)
        if isinstance(self.body, bytes):
            return ids + len(self.body)
        if isinstance(self.body, tuple):
            return ids + sum(len(b) for b in self.body)
        return ids + int(np.asarray(self.body).nbytes)


def _server_keeps(record: Any) -> bool:
    return record.receiver == SERVER or record.sender == SERVER


class FedMF(FedMFDevice):
    """FedMF simulation (see the module docstring).

    Args:
        train: training ratings (explicit): every user's in one process, one placeholder row per
            user on the server half (a census), the client's own rows on a device.
        config: the configuration.
        seed: seeds initialisation (simulation randomness; keys, masks and noise use the CSPRNG).
        transport: where messages go (default: an in-process transport that keeps the payloads
            of everything the server received or sent, i.e. the server's view).
        he_client: pre-made HE key material for ``paillier``/``ckks`` (default: the key files in
            ``config.he_keys``, else fresh keys).
        on_device: a client's half built on its own rows (``Exchanges.build_client``): only the
            users with rows here must have ratings, and HE keys come from the secret key file.
        server_half: the server's half on a census (``Exchanges.build_server``): HE keys come
            from the public key file only (in one process, which plays the clients too, and on
            a device the secret key file is read).
    """

    def __init__(
        self,
        train: Interactions,
        config: FedMFConfig,
        *,
        seed: int,
        transport: InProcessTransport | None = None,
        he_client: HEClient | None = None,
        on_device: bool = False,
        server_half: bool = False,
    ):
        self.train, self.config = train, config
        self.transport = transport or InProcessTransport(Transcript(keep_payloads=_server_keeps))
        self.lists = rating_lists(train)
        self.users = np.flatnonzero(self.lists.counts > 0)
        if on_device and not len(self.users):
            raise ValueError("a FedMF client half needs its user's training ratings; found none.")
        if not on_device and (self.lists.counts == 0).any():
            raise ValueError(
                f"FedMF needs at least one training rating per user; {(self.lists.counts == 0).sum()} users have none."
            )
        self.n_users, self.n_items, self.dim = train.n_users, train.n_items, config.mf.dim
        rng = np.random.default_rng(seed)
        # every half draws every user's initial row and Q from the seed (a device knows n_users)
        self.p, q = init_factors(self.n_users, self.n_items, config.mf, rng)
        self.round = 0
        if config.rating_scale:
            self.scale = (float(config.rating_scale[0]), float(config.rating_scale[1]))
            if on_device and len(train.ratings):
                lo, hi = float(train.ratings.min()), float(train.ratings.max())
                if lo < self.scale[0] or hi > self.scale[1]:
                    raise ValueError(f"this client's ratings span [{lo:g}, {hi:g}], outside fedmf.rating_scale "
                                     f"{list(self.scale)}.")
        else:
            self.scale = (float(train.ratings.min()), float(train.ratings.max()))
        self._client_seconds = 0.0  # work done in device_step (the clients' work when run in process)
        self._trained = np.full(self.n_users, -1, np.int64)  # the last round each client trained in (its state)
        self.he: HEClient | None = None
        self.he_server: HEServer | None = None
        if config.defense in ("paillier", "ckks"):
            if he_client is not None:
                self.he = he_client
            elif config.he_keys:
                if server_half:
                    self.he_server = _load_he_keys(config, self.n_users, secret=False)
                else:
                    self.he = _load_he_keys(config, self.n_users, secret=True)
            else:
                self.he = self._make_he()
            if self.he is not None:
                self.he_server = self.he.server()
            self._enc_q = self._encrypt_model(q)
            # what the key-holding clients obtained by decrypting the last broadcast (None: the server half)
            self._q_clients: np.ndarray | None = q if self.he is not None else None
        else:
            self.q = q
        if config.defense == "secagg":
            check_budget(n_summands=self.n_users, clip=config.value_clip, frac_bits=config.frac_bits)
            if self.n_users < 2:
                raise ValueError("secure aggregation needs >= 2 clients per sum; found 1 user.")

    # -- key material and the encrypted model -------------------------------------------------
    def _make_he(self) -> HEClient:
        return _new_he(self.config, self.n_users)

    def _encrypt_model(self, q: np.ndarray) -> bytes | tuple[bytes, ...]:
        """``Enc(Q)``: a key holder encrypts with its secret key (faster), the server half with the public key."""
        enc = self.he.encrypt if self.he is not None else self.he_server.encrypt  # type: ignore[union-attr]
        if self.config.variant == "full":
            return enc(q.ravel())
        return tuple(enc(row) for row in q)

    def _decrypt_model(self, enc: bytes | tuple[bytes, ...]) -> np.ndarray:
        if self.he is None:
            raise UpdateError("this FedMF half holds only the public HE key (the server's half): it cannot decrypt.")
        if isinstance(enc, bytes):
            return self.he.decrypt(enc, self.n_items * self.dim).reshape(self.n_items, self.dim)
        return np.stack([self.he.decrypt(b, self.dim) for b in enc])

    @property
    def item_matrix(self) -> np.ndarray:
        """The current plaintext item matrix (for HE: what the key-holding clients decrypt)."""
        if self.he_server is not None:
            if self._q_clients is None:
                raise UpdateError("the server half of an HE run holds only Enc(Q); a key-holding client decrypts it.")
            return self._q_clients
        return self.q

    # -- one round: the server's half (a generator of exchanges) -------------------------------
    def run_round(self) -> RoundStats:
        """Run one round in this process: the same exchanges as on devices, this trainer playing every client."""
        return run_exchanges(self, self.device_step)

    def device_round(self):  # type: ignore[no-untyped-def]
        """The server's half of one round (see the module docstring): never reads client data."""
        t0 = time.perf_counter()
        cfg, t, send = self.config, self.round, self.transport.send
        users = self.users
        client_s0 = self._client_seconds
        model, down = self._model_message()
        send(SERVER, BROADCAST, t, "model", model, _size(model))
        ids_bytes = 0.0
        server_s = 0.0
        aborted: str | None = None
        if cfg.defense == "secagg":
            if cfg.variant == "part":  # the variant's metadata: the rated ids in the clear
                got_ids: Replies = yield Exchange("items", users, reply_keys=frozenset({"items"}),
                                                  validate=self._check_ids)
                for u, ids in got_ids.values.items():
                    send(client(u), SERVER, t, "items", ids, 4 * len(ids))
                ids_bytes = 4.0 * sum(len(v) for v in got_ids.values.values()) / max(len(users), 1)
            got: Replies = yield Exchange("train", users, broadcast=down, secure=SecureSum(
                "secagg", width=self.n_items * self.dim, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
                where="fedmf.value_clip", kind="update"))
            ts = time.perf_counter()
            contributors = len(got.survivors)
            up_bytes = got.bytes_per_client + ids_bytes
            if got.total is None:
                aborted = got.aborted
            else:
                self.q = self.q + got.total.reshape(self.n_items, self.dim)
            server_s += time.perf_counter() - ts + got.server_seconds
        else:
            got = yield Exchange("train", users, broadcast=down, reply_keys=self._reply_keys(),
                                 validate=self._check_upload)
            ts = time.perf_counter()
            uploads = [got.values[u] for u in users.tolist() if u in got.values]
            for up in uploads:
                send(client(up.user), SERVER, t, "update", up, up.nbytes)
            contributors = len(uploads)
            up_bytes = sum(up.nbytes for up in uploads) / max(len(users), 1)
            if not uploads:
                aborted = "no client sent a valid update"
            elif self.he_server is None:
                self.q = self.q + self.aggregate(uploads)
            else:
                total = self.aggregate(uploads)
                server_s += time.perf_counter() - ts
                fresh = yield from self._refresh(total, users)
                ts = time.perf_counter()
                self._enc_q = fresh
            server_s += time.perf_counter() - ts
        self.round += 1
        # the training loss of the round's model (the new Q, the clients' new p), from the clients: the
        # mean over the clients that trained this round of each one's own mean squared error
        model, down = self._model_message()
        send(SERVER, BROADCAST, t, "eval", model, _size(model))
        if cfg.defense == "none":
            lost: Replies = yield Exchange("loss", users, broadcast=down, reply_keys=frozenset({"loss"}),
                                           validate=self._check_loss)
            for u, v in lost.values.items():
                send(client(u), SERVER, t, "loss", v, 24)
            parts = [lost.values[u] for u in users.tolist() if u in lost.values]
            sums = np.sum(parts, axis=0) if parts else None
        else:
            lost = yield Exchange("loss", users, broadcast=down, secure=SecureSum(
                LOSS_SECURE, width=3, frac_bits=LOSS_FRAC_BITS, value_clip=LOSS_CLIP,
                where="the FedMF training loss (LOSS_CLIP)", kind="loss"))
            sums = lost.total
        if sums is None or sums[1] < 0.5 or sums[2] > 0.5:
            loss = math.nan
        else:
            loss = float(sums[0] / np.round(sums[1]))
        extra: dict[str, Any] = {"bytes_up_per_client": up_bytes, "train_rmse": math.sqrt(loss),
                                 "bytes_eval_per_client": float(_size(model) + (24 if cfg.defense == "none" else
                                                                                lost.bytes_per_client))}
        for name, gone in (("dropped", got.dropped), ("loss_dropped", lost.dropped)):
            if gone:  # who was left out of the update, and of the loss, with the reasons
                extra[name] = {str(u): why for u, why in sorted(gone.items())}
        if aborted is not None:
            extra["aborted"] = aborted
        client_s = self._client_seconds - client_s0
        return RoundStats(
            round=t,
            loss=loss,
            clients=contributors,
            bytes_per_client=up_bytes + _size(model),
            seconds={"round": time.perf_counter() - t0, "client": client_s / max(len(users), 1), "server": server_s},
            extra=extra,
            releases=(self._release(),),
        )

    def _refresh(self, total: Any, users: np.ndarray):  # type: ignore[no-untyped-def]
        """HE: a key-holding client (the first of the users that answers) re-encrypts ``Enc(Q) + sum``."""
        t, send = self.round, self.transport.send
        reasons = []
        for r in users[:REFRESH_TRIES].tolist():
            send(SERVER, client(r), t, "sum", total, _size(total))
            got: Replies = yield Exchange("refresh", np.array([r]), per_user={r: _ct_arrays(total)},
                                          reply_keys=self._ct_keys(), validate=self._check_model_ct)
            if r in got.values:
                fresh = got.values[r]
                send(client(r), SERVER, t, "refresh", fresh, _size(fresh))
                return fresh
            reasons.append(f"client {r}: {got.dropped.get(r, 'no reply')}")
        raise UpdateError(f"round {t}: no key-holding client refreshed Enc(Q) ({'; '.join(reasons)}).")

    def _model_message(self) -> tuple[Any, dict[str, np.ndarray]]:
        """The model as the transcript records it (as before) and as arrays on the wire."""
        if self.he_server is None:
            q = self.q.copy()
            return q, {"q": q}
        return self._enc_q, _ct_arrays(self._enc_q)

    # (the client's half of a round and its device state: protocols.fedmf_device)

    # -- the replies the server accepts ------------------------------------------------------------
    def _ct_keys(self) -> frozenset[str]:
        return frozenset({"ct"} if self.config.variant == "full" else {"ct", "ct_lengths"})

    def _reply_keys(self) -> frozenset[str]:
        cfg = self.config
        keys = {"delta"} if cfg.defense in ("none", "ldp") else set(self._ct_keys())
        return frozenset(keys | ({"items"} if cfg.variant == "part" else set()))

    def _check_ids(self, u: int, reply: dict) -> np.ndarray:
        ids = reply["items"]
        self.validate(Upload(u, self.round, ids, np.zeros((len(ids) if ids.ndim == 1 else 0, self.dim))), set())
        return ids

    def _check_upload(self, u: int, reply: dict) -> Upload:
        cfg = self.config
        items = reply.get("items")
        if cfg.defense in ("none", "ldp"):
            body: Any = reply["delta"]
        else:
            n_rows = self.n_items if items is None or items.ndim != 1 else len(items)
            body = _ct_from(reply, cfg.variant, n_rows, who=f"client {u}")
        up = Upload(u, self.round, items, body)
        self.validate(up, set())
        if self.he_server is not None:  # parse every ciphertext under the public key (key, layout, length)
            length = self.n_items * self.dim if cfg.variant == "full" else self.dim
            try:
                for blob in (body,) if isinstance(body, bytes) else body:
                    self.he_server.add([blob], length)
            except SecAggError as exc:
                raise UpdateError(f"client {u}: {type(exc).__name__}: {exc}") from None
        return up

    def _check_model_ct(self, u: int, reply: dict) -> Any:
        enc = _ct_from(reply, self.config.variant, self.n_items, who=f"client {u}")
        length = self.n_items * self.dim if isinstance(enc, bytes) else self.dim
        try:
            for blob in (enc,) if isinstance(enc, bytes) else enc:
                self.he_server.add([blob], length)  # type: ignore[union-attr]
        except SecAggError as exc:
            raise UpdateError(f"client {u}: refreshed model refused: {type(exc).__name__}: {exc}") from None
        return enc

    def _check_loss(self, u: int, reply: dict) -> np.ndarray:
        v = reply["loss"]
        lo, hi = self.scale
        if v.shape != (3,) or v.dtype != np.float64 or not np.isfinite(v).all():
            raise ValueError(f"client {u}: the loss must be 3 finite float64 values; found {v.dtype} {v.shape}.")
        mse, one, bad = (float(x) for x in v)
        if bad not in (0.0, 1.0) or one != (0.0 if bad else 1.0) or mse < 0 or mse > (hi - lo) ** 2 * (1 + 1e-9) + 1e-9:
            raise ValueError(f"client {u}: impossible loss reply [{mse:g}, {one:g}, {bad:g}] (a mean squared error "
                             f"of clipped predictions on the scale {[lo, hi]}, at most {(hi - lo) ** 2:g}; then 1; "
                             "then the non-finite flag).")
        return v

    def _release(self) -> Release:
        """This round's release for the privacy ledger (every user uploads once per round)."""
        cfg = self.config
        if cfg.defense == "ldp":
            return Release(Laplace.from_epsilon(cfg.epsilon), who="clients",
                           what="each user's item update, clipped (L1) and Laplace-noised on the device",
                           params={"epsilon_per_upload": cfg.epsilon, "ldp_clip": cfg.ldp_clip})
        what = {
            "none": "each user's item update in plaintext",
            "secagg": "the sum of all users' item updates (secure aggregation, no DP noise)",
            "paillier": "item updates under a Paillier key every client holds (no DP noise)",
            "ckks": "item updates under a CKKS key every client holds (no DP noise)",
        }[cfg.defense]
        return Release(NonPrivate(), who="clients", what=what)

    def fit(self, progress: Any = None) -> list[RoundStats]:
        """Run ``config.rounds`` rounds; ``progress`` (optional) is called with each RoundStats."""
        stats = []
        for _ in range(self.config.rounds):
            stats.append(self.run_round())
            if progress is not None:
                progress(stats[-1])
        return stats

    def _client_upload(self, u: int, rows: np.ndarray, round_: int | None = None) -> Upload:
        """User ``u``'s upload from its update rows (LDP noise and HE encryption happen here, on the device)."""
        cfg = self.config
        round_ = self.round if round_ is None else round_
        k = int(self.lists.counts[u])
        ids = self.lists.items[u, :k]
        rows = rows[:k]
        if cfg.variant == "full":
            dense = np.zeros((self.n_items, self.dim))
            dense[ids] = rows
            values, items = dense, None
        else:
            values, items = rows, ids.copy()
        if cfg.defense == "ldp":
            rel = ldp_laplace(values.ravel(), clip_bound=cfg.ldp_clip, epsilon=cfg.epsilon)
            values = rel.values.reshape(values.shape)
        if cfg.defense in ("none", "ldp"):
            return Upload(u, round_, items, values)
        if cfg.defense == "secagg":
            return Upload(u, round_, items, values)  # summed through the exchange's SecureSum
        assert self.he is not None
        if cfg.variant == "full":
            return Upload(u, round_, None, self.he.encrypt(values.ravel()))
        return Upload(u, round_, items, tuple(self.he.encrypt(r) for r in values))

    # -- the server --------------------------------------------------------------------------------
    def validate(self, upload: Upload, seen: set[int]) -> None:
        """Refuse a malformed upload with :class:`UpdateError` (nothing is changed).

        Checks: it is an :class:`Upload` of this round from a known, not-yet-seen client; in
        ``"part"`` its ids are unique, sorted, in ``0..n_items-1``; in ``"full"`` it has no ids;
        the body has the defense's type and shape, with finite values.
        """
        cfg = self.config
        if not isinstance(upload, Upload):
            raise UpdateError(f"expected an Upload; found {type(upload).__name__}.")
        if type(upload.round) is not int or upload.round != self.round:
            raise UpdateError(f"upload for round {upload.round!r} refused: the server is in round {self.round}.")
        if type(upload.user) is not int or not 0 <= upload.user < self.n_users:
            raise UpdateError(f"upload from unknown client {upload.user!r}; clients are 0..{self.n_users - 1}.")
        if upload.user in seen:
            raise UpdateError(f"second upload from client {upload.user} in round {self.round} (replay) refused.")
        if cfg.variant == "full":
            if upload.items is not None:
                raise UpdateError(f"client {upload.user}: the full variant uploads no item ids; found some.")
            n_rows = self.n_items
        else:
            ids = upload.items
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
                raise UpdateError(f"client {upload.user}: part uploads need a non-empty 1-D int id array; found {ids!r}.")
            if ids.min() < 0 or ids.max() >= self.n_items:
                raise UpdateError(
                    f"client {upload.user}: update for item {int(ids.max() if ids.max() >= self.n_items else ids.min())}, "
                    f"which it was not asked about (items are 0..{self.n_items - 1})."
                )
            if np.any(np.diff(ids) <= 0):
                raise UpdateError(f"client {upload.user}: item ids must be unique and ascending.")
            n_rows = len(ids)
        body = upload.body
        if cfg.defense in ("none", "ldp", "secagg"):
            if not isinstance(body, np.ndarray) or body.dtype != np.float64 or body.shape != (n_rows, self.dim):
                raise UpdateError(
                    f"client {upload.user}: expected a float64 update of shape {(n_rows, self.dim)}; "
                    f"found {getattr(body, 'dtype', type(body).__name__)} {getattr(body, 'shape', '')}."
                )
            if not np.isfinite(body).all():
                raise UpdateError(f"client {upload.user}: update holds non-finite values.")
        elif cfg.variant == "full":
            if not isinstance(body, bytes):
                raise UpdateError(f"client {upload.user}: expected ciphertext bytes; found {type(body).__name__}.")
        elif not (isinstance(body, tuple) and len(body) == n_rows and all(isinstance(b, bytes) for b in body)):
            raise UpdateError(f"client {upload.user}: expected {n_rows} row ciphertexts.")

    def aggregate(self, uploads: list[Upload]) -> Any:
        """Validate every upload, then return the aggregate (a ``[n_items, dim]`` sum, or ``Enc(Q')``).

        Raises:
            UpdateError: a malformed upload (see :meth:`validate`).
            secagg.errors.SecAggError: a ciphertext under another key, modified, truncated or
                overflowing (raised by the HE server before anything is added).
        """
        seen: set[int] = set()
        for up in uploads:
            self.validate(up, seen)
            seen.add(up.user)
        if self.he_server is None:
            total = np.zeros((self.n_items, self.dim))
            for up in uploads:
                if up.items is None:
                    total += up.body
                else:
                    total[up.items] += up.body
            return total
        server = self.he_server
        assert server is not None
        if self.config.variant == "full":
            return server.add([self._enc_q, *(up.body for up in uploads)], self.n_items * self.dim)
        per_item: list[list[bytes]] = [[b] for b in self._enc_q]
        for up in uploads:
            for i, blob in zip(up.items, up.body):
                per_item[int(i)].append(blob)
        # parse and validate every row before adding: HEServer.add validates all of its inputs first
        return tuple(server.add(blobs, self.dim) for blobs in per_item)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, test: Interactions) -> dict[str, float]:
        """RMSE and MAE of the clipped predictions on held-out ratings."""
        return self.metrics_from_predictions(test, predict(self.p, self.item_matrix, test.users, test.items))

    def metrics_from_predictions(self, test: Interactions, predictions: np.ndarray) -> dict[str, float]:
        """RMSE and MAE of ``predictions`` (``p_u . q_i`` per test row, e.g. each client's own
        :meth:`score` on its device) clipped to the public rating scale."""
        pred = np.clip(np.asarray(predictions, np.float64), *self.scale)
        return {"rmse": rmse(pred, test.ratings), "mae": mae(pred, test.ratings)}

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Predicted ratings (each client with its own ``p_u`` and the item matrix)."""
        users, items = np.asarray(users), np.asarray(items)
        return np.einsum("bd,bkd->bk", self.p[users], self.item_matrix[items])

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self.p[np.asarray(users)] @ self.item_matrix.T

    def state_dict(self) -> dict[str, Any]:
        """Model state: ``p``, the plaintext item matrix and the round.

        HE key material is deliberately not saved: a resumed run draws a fresh shared key pair
        and re-encrypts the item matrix (every client would receive the new key; the server
        never holds a secret key either way).
        """
        if self.he_server is not None and self.he is None:  # the server half of a device run: Enc(Q) only
            return {"round": self.round, "p": self.p.copy(), "enc_q": _ct_arrays(self._enc_q)}
        return {"round": self.round, "p": self.p.copy(), "q": self.item_matrix.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "enc_q" in state:  # (a server half's checkpoint: the ciphertexts it holds, under the same keys)
            if self.he_server is None or self.he is not None:
                raise ValueError("this checkpoint holds Enc(Q) only: resume it as the server half of an HE device run")
            p = np.asarray(state["p"], dtype=np.float64)
            if p.shape != self.p.shape:
                raise ValueError(f"checkpoint shape {p.shape} does not match this FedMF run")
            enc = {k: np.asarray(v) for k, v in state["enc_q"].items()}
            self.round, self.p = int(state["round"]), p.copy()
            self._enc_q = _ct_from(enc, self.config.variant, self.n_items, who="the checkpoint")
            return
        p, q = np.asarray(state["p"], dtype=np.float64), np.asarray(state["q"], dtype=np.float64)
        if p.shape != self.p.shape or q.shape != (self.n_items, self.dim):
            raise ValueError(f"checkpoint shapes {p.shape}, {q.shape} do not match this FedMF run")
        self.round, self.p = int(state["round"]), p.copy()
        if self.he_server is not None:
            self._enc_q = self._encrypt_model(q)
            self._q_clients = q.copy() if self.he is not None else None
        else:
            self.q = q.copy()

    def public_info(self) -> dict[str, Any]:
        """What the server knows besides the transcript: protocol parameters and public statistics."""
        m = self.config.mf
        return {
            "n_users": self.n_users,
            "n_items": self.n_items,
            "dim": self.dim,
            "lr": m.lr,
            "reg_user": m.reg_user,
            "reg_item": m.reg_item,
            "user_update": m.user_update,
            "variant": self.config.variant,
            "defense": self.config.defense,
            "rating_scale": sorted({float(r) for r in np.unique(self.train.ratings)}),
            "mean_count": float(self.lists.counts.mean()),
            "frac_bits": self.config.frac_bits,
        }


def check_devices(config: FedMFConfig) -> None:
    """Refuse, in words, a configuration whose parties cannot run on separate devices."""
    if not config.rating_scale:
        raise ValueError(
            "FedMF on separate devices needs fedmf.rating_scale = [lo, hi]: in one process the scale is the training "
            "ratings' range, which the server half (built on a census, without ratings) does not have and each client "
            "only knows for its own ratings; give the dataset's public scale (ml-latest-small: [0.5, 5.0])."
        )
    if config.defense in ("paillier", "ckks") and not config.he_keys:
        raise ValueError(
            f"FedMF with defense {config.defense!r} on separate devices needs fedmf.he_keys: the clients must share "
            "one secret key that the server never holds, and fresh in-process keys would differ on every device; "
            "write the key files with protocols.fedmf.write_he_keys(DIR, config, n_users), give every client the "
            "folder and the server a copy holding only the public key file."
        )


register(ProtocolSpec(
    name="fedmf",
    summary="FedMF: explicit-rating MF with a defense (none, Paillier, CKKS, SecAgg, LDP)",
    build=lambda ctx: FedMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="fedmf",
    config_cls=FedMFConfig,
    task="rating",
    keeps_ratings=True,
    exchanges=Exchanges(
        check=check_devices,
        build_client=lambda ctx: FedMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, on_device=True),
        build_server=lambda ctx: FedMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport,
                                       server_half=True),
    ),
))
