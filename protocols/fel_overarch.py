"""FEL's over-arch trained by federated learning, with DP-FedSGD (notes §2.4, §2.6, §8.1-8.3).

The over-arch (:class:`recmodels.ensemble.OverArch`, a one-hidden-layer MLP on every leaf's
prediction and last hidden layer) is trained by FedSGD after every round of the leaves:
``over_arch_steps`` steps, each over a cohort of ``over_arch_clients`` clients drawn from the
over-arch's *population*. Every client computes its features on the device (its leaf vectors,
its positives plus sampled negatives) and uploads one gradient.

Parties: the population's clients (their labels are private), the server (steps Adam on the
aggregate). Adversary: the honest-but-curious server and every observer of the over-arch.

Populations, and how the over-arch composes with the leaves (``fel.over_arch_composition``):

* ``"sequential"``: the leaves' own clients. A user's privacy loss is its leaf's plus the
  over-arch's: the over-arch's releases have no cohort label, so the ledger composes them with
  every leaf (``epsilon = max_c eps(leaf_c + over-arch)``, RDP).
* ``"parallel"``: held-out users (``fel.over_arch_holdout`` of the non-opt-in users, a seeded
  choice) who train no leaf. The over-arch's releases carry ``cohort="over-arch"``, disjoint from
  every ``"leaf:<c>"``: ``epsilon = max(max_c eps(leaf_c), eps(over-arch))``. The leaves' releases
  the held-out clients compute their features from are public outputs (post-processing).

Promise with ``fel.dp`` (``"central"`` or ``"distributed"``, the leaves' noise placement):
every client's upload is the gradient of its *mean* loss (unweighted, as the leaves' DP-FedAvg),
L2-clipped to ``over_arch_clip``; the sum gets Gaussian noise of standard deviation
``z * over_arch_clip`` (central: CSPRNG float noise added by a trusted aggregator; distributed:
each client's discrete Gaussian share on the fixed-point grid, sized, as a leaf's, so that the
honest survivors alone (the survivors minus ``floor(secagg_corrupt m)`` colluders) reach it, and
accounted for them; summed through SecAgg/SecAgg+, with
the leaves' dropout margin, refuse-or-reaccount rule and noise-tail bit budget: under ``"refuse"``
every client's own floor, :attr:`OverArchDp.survivor_floor`, is enforced inside the secure sum, so
a step with fewer survivors than the noise was sized for is never unmasked, and is not applied);
the server divides
by the fixed denominator ``m`` and steps Adam (post-processing). Each step is one
``Gaussian(z)`` release (``sampling = "fixed"``) or ``PoissonSampled(q, Gaussian(z))``
(``"poisson"``, ``q = m / N``), so the over-arch alone is ``(eps_o, delta)``-DP at the user level.
``z`` is ``over_arch_noise_multiplier`` or, with ``calibration = "epsilon"``, the smallest one
meeting ``over_arch_target_epsilon`` over ``dp_rounds * over_arch_steps`` steps. Limits: as the
leaves' (the central aggregator is trusted; amplification does not hold against the server).
Without DP the uploads are plaintext summed gradients (non-private releases, epsilon infinite).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dp.clipping import clip_rows_l2
from dp.discrete import discrete_gaussian_noise
from dp.events import DpEvent, Gaussian, NonPrivate, PoissonSampled
from dp.mechanisms import gaussian_noise
from protocols.base import Release
from protocols.fel_leaf import colluders
from protocols.secure_sum import SecureSumAborted, secure_sum
from protocols.transport import SERVER, client
from recmodels.ensemble import OverArch
from secagg.encoding import check_budget
from secagg.params import choose as choose_secagg_plus

__all__ = ["OVER_ARCH_COHORT", "OverArchDp", "client_gradients", "over_arch_release"]

#: Ledger cohort of the over-arch's releases in ``"parallel"`` mode (disjoint from every leaf).
OVER_ARCH_COHORT = "over-arch"


def client_gradients(model: OverArch, z: torch.Tensor, y: torch.Tensor, owner: np.ndarray, n_clients: int,
                     *, reduction: str = "sum", chunk: int = 4096) -> torch.Tensor:
    """Every client's gradient of its BCE loss w.r.t. ``model``'s parameters, batched (no loop per client).

    The over-arch is ``l2(relu(l1(z)))``, so the gradient has a closed form; per-example terms are
    summed per client with ``index_add`` (``chunk`` examples at a time for the ``l1`` weight).

    Args:
        model: the over-arch.
        z, y: the examples' features ``[n, n_in]`` and labels ``[n]``.
        owner: ``[n]`` client slot ``0..n_clients-1`` of every example.
        n_clients: number of clients (rows of the output).
        reduction: ``"sum"`` (the gradient of the client's summed loss) or ``"mean"`` (of its mean loss).

    Returns:
        ``[n_clients, n_params]`` float64, parameters flattened in ``model.parameters()`` order.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean'; found {reduction!r}")
    with torch.no_grad():
        w1, b1 = model.l1.weight.double(), model.l1.bias.double()
        w2, b2 = model.l2.weight.double(), model.l2.bias.double()
        zz = z.double()
        own = torch.as_tensor(np.asarray(owner, dtype=np.int64))
        a = zz @ w1.T + b1
        r = torch.relu(a)
        s = (r @ w2.T).squeeze(-1) + b2
        e = torch.sigmoid(s) - y.double()
        if reduction == "mean":
            counts = torch.bincount(own, minlength=n_clients).double()
            e = e / counts.clamp(min=1)[own]
        hidden, n_in = w1.shape
        g_w1 = torch.zeros(n_clients, hidden * n_in, dtype=torch.float64)
        delta = e.unsqueeze(-1) * w2[0] * (a > 0)
        for lo in range(0, len(e), chunk):
            outer = delta[lo:lo + chunk].unsqueeze(2) * zz[lo:lo + chunk].unsqueeze(1)
            g_w1.index_add_(0, own[lo:lo + chunk], outer.reshape(len(outer), -1))
        g_b1 = torch.zeros(n_clients, hidden, dtype=torch.float64).index_add_(0, own, delta)
        g_w2 = torch.zeros(n_clients, hidden, dtype=torch.float64).index_add_(0, own, e.unsqueeze(-1) * r)
        g_b2 = torch.zeros(n_clients, 1, dtype=torch.float64).index_add_(0, own, e.unsqueeze(-1))
    return torch.cat([g_w1, g_b1, g_w2, g_b2], dim=1)


@dataclass(frozen=True)
class OverArchDp:
    """The over-arch's DP-FedSGD aggregation (see the module docstring).

    Attributes:
        mode: ``"central"`` or ``"distributed"``.
        clip: per-client L2 clip of the uploaded gradient.
        z: noise multiplier of every step.
        sampling: ``"fixed"`` or ``"poisson"``.
        population: number of clients the cohort is drawn from.
        expected: the fixed denominator ``m`` (expected cohort size).
        width: parameters of the over-arch.
        frac_bits, value_clip, secure: the fixed-point grid, its bound and the secure protocol.
        dropout_margin, on_excess_dropout: as the leaves' (distributed noise).
        noise_tail: noise standard deviations budgeted in ``value_clip`` (distributed noise).
        corrupt: the fraction of a step's planned cohort that may collude with the server
            (``secagg_corrupt``): the noise is sized and accounted for the survivors minus
            ``colluders = floor(corrupt expected)`` (as a leaf's; refused if none is guaranteed honest).
        cohort: the ledger cohort (``None``: sequential with the leaves; ``"over-arch"``: parallel).
    """

    mode: str
    clip: float
    z: float
    sampling: str
    population: int
    expected: int
    width: int
    frac_bits: int
    value_clip: float
    secure: str
    dropout_margin: float
    on_excess_dropout: str
    noise_tail: float
    corrupt: float
    cohort: str | None

    def __post_init__(self) -> None:
        if self.mode == "distributed" and self.honest_survivors < 1:
            raise ValueError(
                f"fel.secagg_corrupt={self.corrupt:g} and fel.dropout_margin={self.dropout_margin:g} guarantee no "
                f"honest survivor in an over-arch step: of its {self.expected} clients {self.min_survivors} must "
                f"survive, and up to {self.colluders} may collude with the server and remove their noise shares; "
                "lower one of them, or raise fel.over_arch_clients")

    @property
    def q(self) -> float:
        return self.expected / max(self.population, 1)

    @property
    def min_survivors(self) -> int:
        return max(1, math.ceil((1 - self.dropout_margin) * self.expected)) if self.mode == "distributed" else 0

    @property
    def colluders(self) -> int:
        """The collusion bound ``floor(corrupt expected)`` (distributed noise; 0 otherwise)."""
        return colluders(self.corrupt, self.expected) if self.mode == "distributed" else 0

    @property
    def honest_survivors(self) -> int:
        """``min_survivors - colluders``: the shares the target noise is sized for (distributed; 0 otherwise)."""
        return self.min_survivors - self.colluders if self.mode == "distributed" else 0

    @property
    def survivor_floor(self) -> int:
        """The fewest survivors the step's clients help unmask (as a leaf's
        :meth:`protocols.fel_leaf.FelLeaf.survivor_floor`): under distributed noise (``z > 0``)
        ``min_survivors`` (``"refuse"``) or ``colluders + 1`` (``"reaccount"``); at least 2."""
        if self.mode != "distributed" or self.z <= 0:
            return 2
        return max(2, self.min_survivors if self.on_excess_dropout == "refuse" else self.colluders + 1)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one upload as summed: the clip, plus nearest rounding on the grid (distributed)."""
        return self.clip + (math.sqrt(self.width) * 2.0**-self.frac_bits / 2 if self.mode == "distributed" else 0.0)

    @property
    def sigma_client(self) -> float:
        """Each client's discrete Gaussian standard deviation, ``z * sensitivity / sqrt(honest_survivors)``
        (distributed; 0 otherwise)."""
        if self.mode != "distributed":
            return 0.0
        return self.z * self.sensitivity / math.sqrt(self.honest_survivors)

    def check_budget(self, *, secagg_dropout: float = 0.1, secagg_corrupt: float = 0.05) -> None:
        """Refuse, before training, what the secure sums could not carry.

        A ``value_clip`` below a clipped gradient plus the noise tail (distributed); a cohort whose
        fixed-point sum could overflow the 64-bit ring; a SecAgg+ cohort too small for the
        configured dropout and corruption fractions.
        """
        need = self.clip + self.noise_tail * self.sigma_client
        if self.mode == "distributed" and self.value_clip < need:
            raise ValueError(f"fel.value_clip={self.value_clip:g} cannot hold a clipped over-arch gradient plus "
                             f"{self.noise_tail:g} noise standard deviations ({need:.4g}); raise fel.value_clip "
                             "or lower fel.over_arch_clip")
        if self.secure != "none":
            most = self.population if self.sampling == "poisson" else self.expected
            check_budget(n_summands=most, clip=self.value_clip, frac_bits=self.frac_bits)
        if self.secure == "secagg+":
            choose_secagg_plus(self.expected, dropout=secagg_dropout, corrupt=secagg_corrupt)

    def event(self, z: float) -> DpEvent:
        if z <= 0:
            return NonPrivate()
        return PoissonSampled(self.q, Gaussian(z)) if self.sampling == "poisson" else Gaussian(z)

    def sample(self, population: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The step's cohort: ``expected`` clients (fixed) or each w.p. ``q`` (Poisson), sorted."""
        if self.sampling == "poisson":
            return population[rng.random(len(population)) < self.q]
        return np.sort(rng.choice(population, size=self.expected, replace=False))

    def noisy_sum(self, grads: np.ndarray, cohort: np.ndarray, *, t: int, transport,  # noqa: ANN001
                  secagg_dropout: float | None = None, secagg_corrupt: float | None = None,
                  drop: np.ndarray | None = None, preclipped: bool = False,
                  node_floor: int = 2) -> tuple[np.ndarray | None, float, dict[str, Any]]:
        """Clip ``grads`` (one row per cohort client), sum them with the noise; returns ``(sum, z_eff, extra)``.

        ``preclipped``: each client clipped its own row on its device (FEL's over-arch step): the
        rows are summed as they are and ``extra`` has no ``clipped_fraction`` (the server cannot know it).
        ``drop``: rows whose clients drop before their masked input (distributed; simulation).
        ``node_floor``: the clients' operators' own ``min_survivors``. Under distributed noise a
        step the clients refuse to unmask (fewer survivors than ``max(survivor_floor, node_floor)``)
        returns ``sum = None`` with ``extra["refused"]`` saying why; so does a sum decoded below
        ``min_survivors`` under ``"refuse"`` (clients that did not enforce their floor), whose
        ``z_eff`` and ``survivors`` are then what must be accounted.
        """
        grads = np.asarray(grads, dtype=np.float64).reshape(len(cohort), self.width)
        if preclipped:
            clipped, extra = grads, {}
        else:
            clipped, scales = clip_rows_l2(grads, self.clip)
            extra = {"clipped_fraction": float(np.mean(scales < 1)) if len(cohort) else 0.0}
        senders = [client(u) for u in cohort]
        if self.mode == "central" or len(cohort) == 0:
            if self.secure == "none" or len(cohort) == 0:
                total = clipped.sum(0)
                for s in senders:
                    transport.send(s, SERVER, t, "over-arch-update", None, 4 * self.width)
            else:
                total = secure_sum(clipped, protocol=self.secure, frac_bits=self.frac_bits, value_clip=self.value_clip,
                                   round=t, transport=transport, senders=senders, kind="over-arch-update",
                                   where="fel.value_clip", dropout=secagg_dropout, corrupt=secagg_corrupt).total
            if self.z > 0:  # central, or an empty Poisson cohort: the server adds the whole noise
                total = total + gaussian_noise(self.width, self.z * self.sensitivity)
            return total, self.z, extra
        f = self.frac_bits
        noise = (discrete_gaussian_noise((len(cohort), self.width), self.sigma_client, f).astype(np.float64) / 2.0**f
                 if self.z > 0 else np.zeros_like(clipped))
        n_drop = 0 if drop is None else len(drop)
        try:
            res = secure_sum(clipped + noise, protocol=self.secure, frac_bits=f, value_clip=self.value_clip, round=t,
                             transport=transport, senders=senders, kind="over-arch-update", where="fel.value_clip",
                             dropouts={"masked_input": frozenset(int(i) for i in drop)} if n_drop else None,
                             dropout=secagg_dropout, corrupt=secagg_corrupt,
                             min_survivors=max(self.survivor_floor, int(node_floor)))
        except SecureSumAborted as exc:  # the clients refused to unmask (their floor), or too many dropped
            extra["refused"] = (
                f"{len(cohort) - n_drop} of {len(cohort)} clients stayed until their masked input; {exc}; no sum was "
                f"unmasked (the clients' floor: {self.survivor_floor} survivors, the {self.min_survivors} the "
                f"distributed noise was sized for under fel.dropout_margin={self.dropout_margin:g}); the step was "
                "not applied. Raise fel.dropout_margin or set fel.on_excess_dropout = \"reaccount\"")
            return None, 0.0, extra
        n_surv = len(res.survivors)
        honest = max(n_surv - self.colluders, 0)  # (the colluders' shares are known to the server)
        z_eff = math.sqrt(honest) * self.sigma_client / self.sensitivity if self.z > 0 else 0.0
        extra.update(survivors=n_surv, colluders=self.colluders, honest_survivors=honest,
                     sigma_client=self.sigma_client)
        if self.z > 0 and n_surv < self.min_survivors and self.on_excess_dropout == "refuse":
            # (devices that did not enforce their floor: the decoded sum is accounted, and not applied)
            extra["refused"] = (f"{n_surv} of {len(cohort)} clients survived, below the {self.min_survivors} the "
                                "distributed noise was sized for, yet the sum was unmasked (the clients did not "
                                "enforce their floor): accounted, not applied")
            return None, z_eff, extra
        return res.total, z_eff, extra

    def info(self) -> dict[str, Any]:
        """Public parameters (for public_info)."""
        return {"mode": self.mode, "clip": self.clip, "noise_multiplier": self.z, "sampling": self.sampling,
                "population": self.population, "denominator": self.expected, "q": self.q,
                "min_survivors": self.min_survivors, "colluders": self.colluders,
                "honest_survivors": self.honest_survivors, "survivor_floor": self.survivor_floor,
                "sigma_client": self.sigma_client, "cohort": self.cohort}


def over_arch_release(event: DpEvent, *, composition: str, cohort: str | None, params: dict[str, Any]) -> Release:
    """One over-arch step's release, labelled for the ledger (``params.over_arch = "fl"``)."""
    users = "held-out users, disjoint from the leaves' (parallel)" if composition == "parallel" \
        else "the leaves' own users (sequential)"
    private = "clipped, noised gradients (DP-FedSGD)" if not isinstance(event, NonPrivate) else \
        "plaintext gradients (FedSGD)"
    return Release(event, who="clients", what=f"over-arch {private} of {users}", cohort=cohort,
                   params={**params, "over_arch": "fl", "composition": composition})
