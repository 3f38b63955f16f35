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
      (:func:`secagg.runner.run_secagg`) over all clients; the transcript records the masked
      vectors the server received. Promise: the server learns only the sum over >= 2 clients.
      In ``"part"`` the rated ids still travel in the clear (the variant's metadata), and the
      values travel as a dense masked vector (a masking protocol needs equal lengths).
    * ``"ldp"``: every client perturbs its update with :func:`dp.ldp.ldp_laplace`
      (``clip_L1(delta, clip) + Laplace(2 clip / epsilon)``). Promise: each upload is
      ``epsilon``-LDP; ``rounds`` uploads compose (basic: ``rounds * epsilon``).

Stated limits: ``"part"`` reveals each user's rated set under every defense; HE protects only
against the server alone; secure aggregation over one client would reveal it (we always
aggregate all ``n >= 2`` clients). Simulation: clients are batched (numpy); an encrypted
broadcast is decrypted once for all clients (every client would obtain the same plaintext).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dp.events import Laplace, NonPrivate
from dp.ldp import ldp_laplace
from protocols.base import Release, RoundStats
from protocols.registry import ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels.data import Interactions
from recmodels.mf import MFConfig, init_factors, local_updates, mae, predict, rating_lists, rmse
from secagg.bonawitz import MaskedInput
from secagg.encoding import FixedPoint, check_budget
from secagg.he.backends import HEClient, make_backend
from secagg.he.packing import PackingSpec
from secagg.runner import RunSpec, run_secagg

__all__ = [
    "BROADCAST",
    "DEFENSES",
    "VARIANTS",
    "FedMF",
    "FedMFConfig",
    "RoundStats",
    "Upload",
    "UpdateError",
]

DEFENSES = ("none", "paillier", "ckks", "secagg", "ldp")
VARIANTS = ("full", "part")
#: Receiver name of the server's broadcast to all clients.
BROADCAST = "clients"


class UpdateError(ValueError):
    """A client upload was refused (wrong round, sender, replay, item ids, shape or values)."""


@dataclass(frozen=True)
class FedMFConfig:
    """Configuration of a FedMF run.

    Attributes:
        mf: the MF hyper-parameters (``mf.user_update`` picks FedMF's item-by-item rule or batch).
        variant: ``"full"`` (dense upload, default) or ``"part"`` (rated rows with their ids).
        defense: one of :data:`DEFENSES` (default ``"none"``).
        rounds: training rounds (default 10).
        key_bits: Paillier modulus bits (default 2048; 1024 warns).
        frac_bits: fixed-point fractional bits for Paillier packing and secure aggregation (24).
        value_clip: largest ``|delta|`` accepted per coordinate for fixed-point encodings (8.0).
        epsilon: LDP epsilon per upload (``defense="ldp"``).
        ldp_clip: L1 clipping bound of one upload before the Laplace noise (``defense="ldp"``).
    """

    mf: MFConfig = field(default_factory=MFConfig)
    variant: str = "full"
    defense: str = "none"
    rounds: int = 10
    key_bits: int = 2048
    frac_bits: int = 24
    value_clip: float = 8.0
    epsilon: float = 1.0
    ldp_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"fedmf.variant must be one of {VARIANTS}; found {self.variant!r}.")
        if self.defense not in DEFENSES:
            raise ValueError(f"fedmf.defense must be one of {DEFENSES}; found {self.defense!r}.")
        if type(self.rounds) is not int or self.rounds < 1:
            raise ValueError(f"fedmf.rounds must be an int >= 1; found {self.rounds!r}.")
        for name in ("epsilon", "ldp_clip", "value_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"fedmf.{name} must be a positive finite number; found {v!r}.")


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


class FedMF:
    """FedMF simulation (see the module docstring).

    Args:
        train: training ratings (explicit).
        config: the configuration.
        seed: seeds initialisation (simulation randomness; keys, masks and noise use the CSPRNG).
        transport: where messages go (default: an in-process transport that keeps the payloads
            of everything the server received or sent, i.e. the server's view).
        he_client: pre-made HE key material for ``paillier``/``ckks`` (default: fresh keys).
    """

    def __init__(
        self,
        train: Interactions,
        config: FedMFConfig,
        *,
        seed: int,
        transport: InProcessTransport | None = None,
        he_client: HEClient | None = None,
    ):
        self.train, self.config = train, config
        self.transport = transport or InProcessTransport(Transcript(keep_payloads=_server_keeps))
        self.lists = rating_lists(train)
        if (self.lists.counts == 0).any():
            raise ValueError(
                f"FedMF needs at least one training rating per user; {(self.lists.counts == 0).sum()} users have none."
            )
        self.n_users, self.n_items, self.dim = train.n_users, train.n_items, config.mf.dim
        rng = np.random.default_rng(seed)
        self.p, q = init_factors(self.n_users, self.n_items, config.mf, rng)
        self.round = 0
        self.scale = (float(train.ratings.min()), float(train.ratings.max()))
        self.he: HEClient | None = None
        self.codec: FixedPoint | None = None
        if config.defense in ("paillier", "ckks"):
            self.he = he_client or self._make_he()
            self._enc_q = self._encrypt_model(q)
            self._q_clients = q  # what the clients obtain by decrypting the broadcast
        else:
            self.q = q
        if config.defense == "secagg":
            self.codec = FixedPoint(config.frac_bits, config.value_clip)
            check_budget(n_summands=self.n_users, clip=config.value_clip, frac_bits=config.frac_bits)
            if self.n_users < 2:
                raise ValueError("secure aggregation needs >= 2 clients per sum; found 1 user.")

    # -- key material and the encrypted model -------------------------------------------------
    def _make_he(self) -> HEClient:
        if self.config.defense == "ckks":
            return make_backend("ckks")
        summands = 1 << (self.n_users + 1).bit_length()
        spec = PackingSpec(value_bits=self.config.frac_bits + 16, frac_bits=self.config.frac_bits, max_summands=summands)
        return make_backend("paillier", key_bits=self.config.key_bits, spec=spec)

    def _encrypt_model(self, q: np.ndarray) -> bytes | tuple[bytes, ...]:
        assert self.he is not None
        if self.config.variant == "full":
            return self.he.encrypt(q.ravel())
        return tuple(self.he.encrypt(row) for row in q)

    def _decrypt_model(self, enc: bytes | tuple[bytes, ...]) -> np.ndarray:
        assert self.he is not None
        if isinstance(enc, bytes):
            return self.he.decrypt(enc, self.n_items * self.dim).reshape(self.n_items, self.dim)
        return np.stack([self.he.decrypt(b, self.dim) for b in enc])

    @property
    def item_matrix(self) -> np.ndarray:
        """The current plaintext item matrix (for HE: what the key-holding clients decrypt)."""
        return self._q_clients if self.he is not None else self.q

    # -- one round -------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """Run one round: broadcast, local updates, validated aggregation, model update."""
        t0 = time.perf_counter()
        cfg, t, send = self.config, self.round, self.transport.send
        q_t = self.item_matrix
        model = self._enc_q if self.he is not None else q_t.copy()
        send(SERVER, BROADCAST, t, "model", model, _size(model))
        tc = time.perf_counter()
        p_new, delta = local_updates(self.p, q_t, self.lists, cfg.mf)
        uploads = [self._client_upload(u, delta[u]) for u in range(self.n_users)]
        client_s = time.perf_counter() - tc
        ts = time.perf_counter()
        if cfg.defense == "secagg":
            total = self._secure_aggregate(uploads)
        else:
            for up in uploads:
                send(client(up.user), SERVER, t, "update", up, up.nbytes)
            total = self.aggregate(uploads)
        server_s = time.perf_counter() - ts
        self.p = p_new
        if self.he is not None:
            self._enc_q = total
            tr = time.perf_counter()
            q_next = self._decrypt_model(total)  # client 0 refreshes: decrypt, re-encrypt
            fresh = self._encrypt_model(q_next)
            client_s += time.perf_counter() - tr
            send(client(0), SERVER, t, "refresh", fresh, _size(fresh))
            self._enc_q, self._q_clients = fresh, q_next
        else:
            self.q = q_t + total
        self.round += 1
        up_bytes = sum(u.nbytes for u in uploads) / self.n_users
        train = self.evaluate(self.train)
        return RoundStats(
            round=t,
            loss=train["rmse"] ** 2,
            clients=self.n_users,
            bytes_per_client=up_bytes + _size(model),
            seconds={"round": time.perf_counter() - t0, "client": client_s / self.n_users, "server": server_s},
            extra={"bytes_up_per_client": up_bytes, "train_rmse": train["rmse"]},
            releases=(self._release(),),
        )

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

    def _client_upload(self, u: int, rows: np.ndarray) -> Upload:
        cfg = self.config
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
            return Upload(u, self.round, items, values)
        if cfg.defense == "secagg":
            return Upload(u, self.round, items, values)  # encoded and masked in _secure_aggregate
        assert self.he is not None
        if cfg.variant == "full":
            return Upload(u, self.round, None, self.he.encrypt(values.ravel()))
        return Upload(u, self.round, items, tuple(self.he.encrypt(r) for r in values))

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
        if self.he is None:
            total = np.zeros((self.n_items, self.dim))
            for up in uploads:
                if up.items is None:
                    total += up.body
                else:
                    total[up.items] += up.body
            return total
        server = self.he.server()
        if self.config.variant == "full":
            return server.add([self._enc_q, *(up.body for up in uploads)], self.n_items * self.dim)
        per_item: list[list[bytes]] = [[b] for b in self._enc_q]
        for up in uploads:
            for i, blob in zip(up.items, up.body):
                per_item[int(i)].append(blob)
        # parse and validate every row before adding: HEServer.add validates all of its inputs first
        return tuple(server.add(blobs, self.dim) for blobs in per_item)

    def _secure_aggregate(self, uploads: list[Upload]) -> np.ndarray:
        assert self.codec is not None
        seen: set[int] = set()
        for up in uploads:
            self.validate(up, seen)
            seen.add(up.user)
        dense = np.zeros((self.n_users, self.n_items, self.dim))
        for up in uploads:
            if up.items is None:
                dense[up.user] = up.body
            else:
                dense[up.user, up.items] = up.body
        big = np.abs(dense).max()
        if big > self.codec.clip:
            raise UpdateError(f"an update value {big:.3g} exceeds value_clip={self.codec.clip}; raise fedmf.value_clip.")
        record: list = []
        res = run_secagg(self.codec.encode(dense.reshape(self.n_users, -1)), RunSpec(round=self.round), record=record)
        send, t = self.transport.send, self.round
        for stage, sender, blob in record:
            if stage == "masked_input":
                y = MaskedInput.from_bytes(blob).y
                up = uploads[sender]
                send(client(sender), SERVER, t, "update", Upload(sender, t, up.items, y), len(blob) + (0 if up.items is None else 4 * len(up.items)))
            else:
                send(client(sender), SERVER, t, f"secagg:{stage}", None, len(blob))
        if res.total is None:
            raise UpdateError(f"secure aggregation aborted in round {t}: {res.abort}")
        return self.codec.decode(res.total).reshape(self.n_items, self.dim)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, test: Interactions) -> dict[str, float]:
        """RMSE and MAE of the clipped predictions on held-out ratings."""
        pred = predict(self.p, self.item_matrix, test.users, test.items, clip=self.scale)
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
        return {"round": self.round, "p": self.p.copy(), "q": self.item_matrix.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        p, q = np.asarray(state["p"], dtype=np.float64), np.asarray(state["q"], dtype=np.float64)
        if p.shape != self.p.shape or q.shape != (self.n_items, self.dim):
            raise ValueError(f"checkpoint shapes {p.shape}, {q.shape} do not match this FedMF run")
        self.round, self.p = int(state["round"]), p.copy()
        if self.he is not None:
            self._enc_q, self._q_clients = self._encrypt_model(q), q.copy()
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


def _size(obj: Any) -> int:
    if isinstance(obj, bytes):
        return len(obj)
    if isinstance(obj, tuple):
        return sum(len(b) for b in obj)
    return int(np.asarray(obj).nbytes)


register(ProtocolSpec(
    name="fedmf",
    summary="FedMF: explicit-rating MF with a defense (none, Paillier, CKKS, SecAgg, LDP)",
    build=lambda ctx: FedMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport),
    section="fedmf",
    config_cls=FedMFConfig,
    task="rating",
    keeps_ratings=True,
))
