"""In-process simulation of one key setup reused by a round's instances (:mod:`secagg.reuse`).

:class:`ReuseSession` plays ``n`` :class:`~secagg.reuse.ReuseClient` and one
:class:`~secagg.reuse.ReuseServer`: its first :meth:`ReuseSession.run` runs the setup and the first
instance, every later call one more instance over the clients still live (the previous instance's
survivors; a client given an input but no longer live counts as dropped). Every message crosses as
wire bytes, as in :mod:`secagg.runner`, and each call returns a :class:`secagg.runspec.RunResult`
indexed by the rows of that call's inputs.

Dropouts (``spec.dropouts``, indices into the call's rows): ``"advertise"`` (first call only: the
client takes no part in the setup), ``"share_keys"`` (before the instance's shares), and
``"masked_input"``, ``"consistency"``, ``"unmask"`` as in :mod:`secagg.runner`. A client that drops
in an instance takes no part in the setup's later ones.

:meth:`ReuseSession.check_cohort` is the check a protocol makes before it runs a sum as the next
instance: the cohorts of one setup must nest (every client of a later instance survived the previous
one) and stay within the dropout budget the clients signed up for; a cohort that does not is refused in
words (:class:`SetupCohortError`) instead of being run, where its outsiders would be counted as dropped
and a cohort shrunk beyond the budget would abort at the clients' consistency check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from secagg import simshare
from secagg.bonawitz import ClientPolicy, MaskingConfig, make_pki
from secagg.errors import AbortError
from secagg.reuse import ReuseClient, ReuseServer
from secagg.runspec import RunResult, RunSpec

__all__ = ["ReuseSession", "SetupCohortError"]

_STAGES = ("advertise", "share_keys", "masked_input", "consistency", "unmask")


class SetupCohortError(ValueError):
    """A sum asked to run as the next instance of a key setup over a cohort that does not nest in the
    previous instance's survivors, or that drops more of the setup's clients than they accept: run it
    with its own setup (docs/secagg.md, "One setup per round")."""


class ReuseSession:
    """One setup, many instances (see the module docstring).

    Args:
        protocol: ``"secagg"`` (complete graph) or ``"secagg+"`` (k-regular graph, ``k``/``t`` as
            :func:`secagg.runner.run_secagg_plus` chooses them), fixed by the setup; ``None``: set
            :attr:`protocol` before the first :meth:`run`.
    """

    def __init__(self, protocol: str | None = "secagg+") -> None:
        if protocol not in ("secagg", "secagg+", None):
            raise ValueError(f"a reused setup runs 'secagg' or 'secagg+'; found {protocol!r}")
        self.protocol = protocol
        self.cfg: MaskingConfig | None = None
        self.names: list[str] | None = None
        self.instances = 0  #: instances run (or attempted) so far
        self.last_ran_setup = False  #: whether the last :meth:`run` paid the setup
        #: names of the last instance's survivors (U3; empty once an instance aborted)
        self.survivors: frozenset[str] = frozenset()
        self.policy: ClientPolicy | None = None
        self._clients: list[ReuseClient] = []
        self._server: ReuseServer | None = None

    def _build(self, n: int, spec: RunSpec) -> None:
        if self.protocol == "secagg":
            cfg = MaskingConfig.secagg(n, 1, t=spec.t, round=spec.round, unsafe_threshold=spec.unsafe_threshold)
        else:
            cfg = MaskingConfig.secagg_plus(n, 1, k=spec.k, t=spec.t, round=spec.round,
                                            dropout=spec.planned_dropout(n), corrupt=spec.corrupt,
                                            unsafe_threshold=spec.unsafe_threshold)
        identities, pki = make_pki(n)
        policy = ClientPolicy(min_survivors=spec.min_survivors, unsafe_threshold=spec.unsafe_threshold,
                              max_dropout=min(spec.planned_dropout(n), (n - 1) / n))
        self.cfg, self.policy = cfg, policy
        self._clients = [ReuseClient(cfg, i, identities[i], pki, policy) for i in range(n)]
        self._server = ReuseServer(cfg, pki)

    def check_cohort(self, names: Sequence[str]) -> None:
        """Refuse (:class:`SetupCohortError`) to run the next instance over ``names`` unless they nest:
        every one survived the previous instance (a client outside it would take no part and count as
        dropped: its input silently left out), and at most the clients' ``max_dropout`` of the setup's
        ``n`` clients are missing (more and every client refuses to sign the survivor set). Nothing to
        check before the first instance, which fixes the clients."""
        if self.names is None:
            return
        given = list(names)
        prev = self.instances - 1
        if not self.survivors:
            raise SetupCohortError(f"instance {prev} of this key setup did not complete (it aborted): no later "
                                   "instance can run on it; run this sum with its own setup")
        outside = [g for g in given if g not in self.survivors]
        if outside:
            raise SetupCohortError(
                f"{len(outside)} of the {len(given)} clients of this sum ({outside[:5]}) are not among the "
                f"{len(self.survivors)} survivors of instance {prev} of its key setup: the cohorts of one setup "
                "must nest (docs/secagg.md, 'One setup per round'); run this sum with its own setup")
        assert self.policy is not None
        n = len(self.names)
        missing, allowed = n - len(set(given)), self.policy.max_dropped(n)
        if missing > allowed:
            raise SetupCohortError(
                f"this sum's {len(set(given))} clients leave out {missing} of the key setup's n = {n}, more than the "
                f"{allowed} its clients accept (max_dropout {self.policy.max_dropout:g}): they would refuse to sign "
                "its survivor set; run this sum with its own setup")

    def run(self, inputs, spec: RunSpec, *, names: Sequence[str] | None = None,  # noqa: ANN001 (array or EncodedRows)
            record: list | None = None) -> RunResult:
        """Run the next instance on ``inputs`` (``(rows, dim)`` uint64, or :class:`secagg.runner.EncodedRows`).

        ``names`` identify the rows' clients: the first call's names are the setup's ``n`` clients,
        a later call's must be among them (default: the first call's rows are clients ``0..n-1`` and a
        later call must give the same number of rows, in the same order). ``record`` receives
        ``(stage, row, wire bytes)`` of every message the server got.
        """
        rows, dim = inputs.shape
        with simshare.shared_work(spec.shared_work):
            return self._run(inputs, int(rows), int(dim), spec, names, record)

    def _run(self, inputs, rows: int, dim: int, spec: RunSpec, names, record) -> RunResult:  # noqa: ANN001
        first = self._server is None
        if first:
            if self.protocol not in ("secagg", "secagg+"):
                raise ValueError(f"a reused setup runs 'secagg' or 'secagg+'; found {self.protocol!r}")
            self.names = list(names) if names is not None else [str(i) for i in range(rows)]
            if len(set(self.names)) != rows:
                raise ValueError("a reused setup needs one distinct name per row")
            self._build(rows, spec)
            ids = list(range(rows))
        else:
            assert self.names is not None
            given = list(names) if names is not None else self.names[:rows]
            index = {name: i for i, name in enumerate(self.names)}
            unknown = [g for g in given if g not in index]
            if unknown or len(set(given)) != len(given):
                raise ValueError(f"an instance of a reused setup runs over the setup's clients only; found {unknown[:5]} "
                                 "or a repeated name")
            ids = [index[g] for g in given]
        server, clients = self._server, self._clients
        assert server is not None and self.cfg is not None
        pos = {cid: j for j, cid in enumerate(ids)}
        client_s = np.zeros(rows)
        sent = np.zeros(rows, dtype=np.int64)
        acct = {"server_s": 0.0, "recv": 0, "sent": 0}
        gone = {ids[j] for j in range(rows) if ids[j] not in server.live} if not first else set()

        def dropped(stage: str) -> set[int]:
            return {ids[j] for j in spec.dropped_before(stage) if j < rows}

        def deliver(stage: str, make: Callable[[int], object], who: Sequence[int]) -> None:
            gone.update(dropped(stage))
            for cid in who:
                if cid in gone or cid not in pos:
                    continue
                j = pos[cid]
                t0 = time.perf_counter()
                try:
                    out = make(cid)
                except AbortError:
                    gone.add(cid)
                    client_s[j] += time.perf_counter() - t0
                    continue
                if out is None:  # the setup's second stage sends nothing
                    client_s[j] += time.perf_counter() - t0
                    continue
                blob = out.to_bytes()  # type: ignore[attr-defined]
                t1 = time.perf_counter()
                client_s[j] += t1 - t0
                sent[j] += len(blob)
                acct["recv"] += len(blob)
                if record is not None:
                    record.append((stage, j, blob))
                server.receive(blob)
                acct["server_s"] += time.perf_counter() - t1

        def close(method: str, *args: object) -> dict[int, bytes]:
            t0 = time.perf_counter()
            try:
                out = getattr(server, method)(*args)
            finally:
                acct["server_s"] += time.perf_counter() - t0
            if isinstance(out, dict):
                acct["sent"] += sum(len(b) for b in out.values())
            return out

        total, abort = None, None
        self.last_ran_setup = first
        index = self.instances
        self.instances += 1
        self.survivors = frozenset()  # set again below only if this instance completes
        try:
            if first:
                deliver("advertise", lambda i: clients[i].advertise(), list(range(rows)))
                inbox = close("broadcast_keys")
                deliver("advertise", lambda i: clients[i].setup(inbox[i]), sorted(inbox))
            close("start", dim)
            deliver("share_keys", lambda i: clients[i].share(index, dim), sorted(server.live))
            inbox = close("forward_shares")
            deliver("masked_input", lambda i: clients[i].mask_input(inbox[i], inputs[pos[i]]), sorted(inbox))
            inbox = close("request_consistency")
            deliver("consistency", lambda i: clients[i].sign_survivors(inbox[i]), sorted(inbox))
            inbox = close("request_unmask")
            deliver("unmask", lambda i: clients[i].unmask(inbox[i]), sorted(inbox))
            t0 = time.perf_counter()
            try:
                total = server.finish()
            finally:
                acct["server_s"] += time.perf_counter() - t0
        except AbortError as exc:
            abort = str(exc)
        survivors = frozenset(pos[c] for c in server.u3) if total is not None else frozenset()
        self.survivors = frozenset(self.names[c] for c in server.u3) if total is not None else frozenset()
        return RunResult(self.protocol, total, survivors, abort, client_s, acct["server_s"], sent, acct["recv"],
                         acct["sent"], server.masks_expanded, self.cfg.k, self.cfg.t, 0, server.signatures_verified)
