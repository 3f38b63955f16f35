"""Configuration checks shared by the federated baselines (``fcf``, ``fedrec``, ``ncf-fed``,
``metamf``).

Each of their ``[section]`` configurations samples a fraction (or a count) of the clients per round
and optionally sums the uploads through SecAgg or SecAgg+; :class:`SampledSecureConfig` checks those
fields once for all of them, naming the offending key, says how many clients a round samples and
checks the secure sum's budget; :func:`check_checkpoint_config` is their resume check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from secagg.encoding import check_budget
from secagg.params import check_fraction

__all__ = ["SECURE_CHOICES", "SampledSecureConfig", "check_checkpoint_config"]

#: The secure-aggregation choices of the baselines (no chain, no DPF: they sum dense vectors).
SECURE_CHOICES = ("none", "secagg", "secagg+")


@dataclass(frozen=True)
class SampledSecureConfig:
    """The sampling and secure-aggregation fields every federated baseline's frozen config dataclass
    inherits (a subclass may redeclare one to change its default, as ``ncf-fed`` does for
    ``client_fraction``); each subclass's ``__post_init__`` calls :meth:`check_sampled_secure` with its section."""

    client_fraction: float = 1.0
    clients_per_round: int = 0
    secure_aggregation: str = "none"
    frac_bits: int = 24
    value_clip: float = 65536.0
    secagg_dropout: float = 0.1
    secagg_corrupt: float = 0.05

    def check_sampled_secure(self, section: str) -> None:
        """Raise ``ValueError`` naming ``section.key`` for the first field out of range."""
        if isinstance(self.client_fraction, bool) or not 0 < self.client_fraction <= 1:
            raise ValueError(f"{section}.client_fraction must be in (0, 1]; found {self.client_fraction!r}")
        if type(self.clients_per_round) is not int or self.clients_per_round < 0:
            raise ValueError(f"{section}.clients_per_round must be an int >= 0; found {self.clients_per_round!r}")
        if self.secure_aggregation not in SECURE_CHOICES:
            raise ValueError(f"{section}.secure_aggregation must be one of {SECURE_CHOICES}; "
                             f"found {self.secure_aggregation!r}")
        if not (0 < self.frac_bits < 62) or not (self.value_clip > 0 and math.isfinite(self.value_clip)):
            raise ValueError(f"{section}.frac_bits must be in 1..61 and value_clip positive; found {self.frac_bits}, "
                             f"{self.value_clip}")
        check_fraction(f"{section}.secagg_dropout", self.secagg_dropout)
        check_fraction(f"{section}.secagg_corrupt", self.secagg_corrupt, upper=0.5)

    def clients_in_round(self, n: int) -> int:
        """Clients sampled in a round out of ``n``: ``clients_per_round`` when set, else the fraction (at least 1)."""
        if self.clients_per_round:
            return min(self.clients_per_round, n)
        return max(1, min(n, math.ceil(self.client_fraction * n - 1e-9)))

    def check_secure_budget(self, clients: int) -> None:
        """Under secure aggregation, that a round's sum over ``clients`` candidates fits the ring
        (:func:`secagg.encoding.check_budget`, raising ``BudgetError`` at build time, not mid-run)."""
        if self.secure_aggregation != "none":
            check_budget(n_summands=self.clients_in_round(clients), clip=self.value_clip, frac_bits=self.frac_bits)


def check_checkpoint_config(config: Any, state: dict[str, Any], name: str) -> None:
    """Refuse a checkpoint whose saved configuration (defaults filled in for keys it predates) is not
    ``config``: resuming under other settings would silently change the run."""
    if {**asdict(type(config)()), **state["config"]} != asdict(config):
        raise ValueError(f"checkpoint was written with a different {name} configuration")
