"""The claims ``secagg reproduce PAPER`` tests: per paper, its published figures and the comparisons they make.

Each :class:`Claim` names the paper's figure (the value(s), the metric, the paper's dataset and the table or
section it comes from), the presets compared, the metric we measure and its direction, and the condition for
"holds" (:data:`KINDS`). The runs every paper needs are the presets its claims name plus the floors
(:data:`FLOORS`, always run). A preset that does not exist (yet) makes its claims "not testable here"; the
presets are looked up when the command runs, so a baseline that lands later turns its claims live without an
edit here.

Metrics (:func:`experiments.studies.reproduce.metric_values` reads them from each run's summary):
``HR@10`` and the like are the sampled metrics (pessimistic ties, the recorded figure); ``full:M`` the
full-ranking ones; ``opt:M`` the sampled metric under the optimistic tie rule (the LightFR authors' code);
``best:M`` the test metric at the best validation round; ``rounds_ratio:M`` (kind ``faster``) the rounds ``a``
needs to reach ``b``'s best ``M`` divided by the rounds ``b`` needs to reach it; ``bytes`` the bytes per client
per round; ``load_cv`` / ``load_top1pct`` the sampler's load spread (FedFast: the coefficient of variation of
how often each client was drawn, and the share of all slots the most-drawn 1% of clients took).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CLAIMS", "FLOORS", "KINDS", "PAPERS", "Claim", "Paper"]

#: The floors every comparison runs beside its presets.
FLOORS = ("itempop", "random")

#: Claim kinds and the condition each needs to hold (the CI is the paired-seed t interval, 95%).
KINDS = {
    "better": "a beats b: the paired CI of the difference (in the metric's better direction) is above 0",
    "similar": "a matches b: the paired CI of a - b lies within +-margin",
    "value": "our mean of a is within margin of the paper's figure, on the paper's own dataset only",
    "faster": "a reaches b's best value in fewer rounds: the CI of the per-seed ratio rounds(a)/rounds(b) is below 1",
    "ratio": "b / a (per seed) is at least margin x the paper's ratio (the CI's mean)",
    "no-worse": "a is not worse than b by more than margin: the paired CI's bad end is within margin",
}


@dataclass(frozen=True)
class Claim:
    """One published comparison or figure.

    Attributes:
        id: short id, unique within the paper.
        text: the claim in one line, as the paper makes it.
        where: the table or section it comes from.
        kind: a key of :data:`KINDS`.
        a, b: the presets compared (``b`` empty for ``value``).
        metric: what is measured (module docstring); ``higher``: its better direction.
        paper_a, paper_b: the paper's figures for a and b (``None`` where it gives none).
        paper_dataset: the dataset the paper's figure is on.
        datasets: for ``value``: the datasets (:func:`experiments.studies.reproduce.dataset_name`) the
            figure can be compared on; other kinds are tested on any data.
        margin: the tolerance of ``similar``, ``value``, ``no-worse``; the factor of ``ratio``.
        needs: a reason the claim cannot be tested with this framework (a missing protocol option), or "".
    """

    id: str
    text: str
    where: str
    kind: str
    a: str
    b: str = ""
    metric: str = "HR@10"
    higher: bool = True
    paper_a: float | None = None
    paper_b: float | None = None
    paper_dataset: str = ""
    datasets: tuple[str, ...] = ()
    margin: float = 0.0
    needs: str = ""

    def presets(self) -> tuple[str, ...]:
        return tuple(p for p in (self.a, self.b) if p)


@dataclass(frozen=True)
class Paper:
    """A paper's comparison: the claims, and the core-section overrides every run of it gets (so the floors are
    evaluated exactly as the compared presets), per dataset kind where they differ."""

    name: str
    title: str
    claims: tuple[Claim, ...]
    common: dict = field(default_factory=dict)
    per_dataset: dict = field(default_factory=dict)
    #: extra presets run (and reported) beside the claims' presets
    extra: tuple[str, ...] = ()
    #: the metrics the table of runs shows
    metrics: tuple[str, ...] = ("HR@10", "NDCG@10")

    def presets(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for c in self.claims:
            for p in c.presets() if not c.needs else ():  # a claim we cannot test runs nothing
                seen.setdefault(p)
        for p in (*self.extra, *FLOORS):
            seen.setdefault(p)
        return tuple(seen)


_ML = ("ml-100k",)

FEDFAST = Paper(
    name="fedfast",
    title="FedFast (Muhammad et al., KDD 2020)",
    common={"data": {"min_user_interactions": 5}, "eval": {"negatives": 50, "ks": [10]}},
    extra=("fedfast-paper-fedavg-copy", "fedfast-paper-balanced"),
    metrics=("HR@10", "NDCG@10", "load_cv", "load_top1pct"),
    claims=(
        Claim("F3-hr", "FedFast beats FedAvg in HR@10", "Table 2 (ML100K)", "better", "fedfast-paper",
              "fedfast-paper-fedavg", "HR@10", paper_a=0.89, paper_b=0.79, paper_dataset="ML100K"),
        Claim("F3-ndcg", "FedFast beats FedAvg in NDCG@10", "Table 2 (ML100K)", "better", "fedfast-paper",
              "fedfast-paper-fedavg", "NDCG@10", paper_a=0.62, paper_b=0.51, paper_dataset="ML100K"),
        Claim("F3-copy", "FedFast beats FedAvg in HR@10, against the improved FedAvg (delegates keep their user rows)",
              "Table 2 (ML100K), control of issue 25", "better", "fedfast-paper", "fedfast-paper-fedavg-copy",
              "HR@10", paper_a=0.89, paper_b=0.79, paper_dataset="ML100K"),
        Claim("F5", "FedFast reaches FedAvg's best HR@10 in about 6% of FedAvg's rounds (round 30; '94% more rounds')",
              "RQ2 text", "faster", "fedfast-paper", "fedfast-paper-fedavg", "rounds_ratio:HR@10",
              paper_a=0.06, paper_dataset="ML100K"),
        Claim("F8-samp", "ActvSAMP alone hardly changes FedAvg", "Fig. 5 / RQ4 text", "similar",
              "fedfast-paper-sampling-only", "fedfast-paper-fedavg", "HR@10", paper_b=0.79, paper_dataset="ML100K",
              margin=0.02),
        Claim("F8-agg", "ActvAGG alone gives a large gain over FedAvg", "Fig. 5 / RQ4 text", "better",
              "fedfast-paper-aggregation-only", "fedfast-paper-fedavg", "HR@10", paper_b=0.79, paper_dataset="ML100K"),
        Claim("F8-both", "FedFast beats FedAvg + ActvAGG (the two parts are complementary)", "Fig. 5 / RQ4 text",
              "better", "fedfast-paper", "fedfast-paper-aggregation-only", "HR@10", paper_a=0.89, paper_dataset="ML100K"),
        Claim("F-gmf", "centralised GMF is above FedFast in HR@10", "Table 2 (ML100K)", "better", "centralized-gmf",
              "fedfast-paper", "HR@10", paper_a=0.91, paper_b=0.89, paper_dataset="ML100K"),
        Claim("F-bpr", "centralised BPR is above FedFast in HR@10", "Table 2 (ML100K)", "better", "bpr",
              "fedfast-paper", "HR@10", paper_a=0.92, paper_b=0.89, paper_dataset="ML100K"),
        Claim("F-load", "ActvSAMP spreads the training load over the clients (intent of Section 3.3: every cluster "
              "represented, no client over-used): load no less even than uniform sampling",
              "Section 3.3 (ActvSAMP)", "no-worse", "fedfast-paper", "fedfast-paper-fedavg", "load_cv",
              higher=False, margin=0.1),
        Claim("F-floor", "FedFast is well above the popularity floor (0.89 HR@10 on ML100K)", "Table 2 (ML100K)",
              "better", "fedfast-paper", "itempop", "HR@10", paper_a=0.89, paper_dataset="ML100K"),
        Claim("F3-value", "FedFast HR@10 0.89 on ML100K", "Table 2", "value", "fedfast-paper", metric="HR@10",
              paper_a=0.89, paper_dataset="ML100K", datasets=_ML, margin=0.02),
        Claim("F3-value-fedavg", "FedAvg HR@10 0.79 on ML100K", "Table 2", "value", "fedfast-paper-fedavg",
              metric="HR@10", paper_a=0.79, paper_dataset="ML100K", datasets=_ML, margin=0.02),
    ),
)

LIGHTFR = Paper(
    name="lightfr",
    title="LightFR (Zhang et al., ACM TOIS 2023)",
    common={"eval": {"negatives": 49, "ks": [10]}},
    # the authors' code treats low ratings as unobserved (r' <= 0: below the scale's middle); on MovieLens every
    # run of the comparison gets the same threshold, so every preset is tested on the same held-out items
    per_dataset={"movielens": {"data": {"threshold": 3.0}}},
    extra=("lightfr-paper-para", "lightfr-paper-init", "lightfr-random"),
    metrics=("HR@10", "NDCG@10", "opt:HR@10", "opt:NDCG@10"),
    claims=(
        Claim("T4-floor", "LightFR is a useful recommender: above the popularity floor (FilmTrust 0.8615 HR@10)",
              "Table 4", "better", "lightfr-paper", "itempop", "HR@10", paper_a=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-authors-floor", "the authors' code is above the popularity floor", "Table 4 / authors' code",
              "better", "lightfr-authors", "itempop", "opt:HR@10", paper_a=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-code", "the authors' code's choices (stickiness 0.6, add-back per sampled client, sweeps to a fixed "
              "point, sampling with replacement, early stop) beat the paper's description, both scored by the raw "
              "b.d with the code's optimistic ties", "Table 4 / authors' code, control of issue 25", "better",
              "lightfr-authors", "lightfr-paper-raw", "opt:HR@10", paper_a=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-value", "LightFR HR@10 0.8615 on FilmTrust (the authors' split; their optimistic ties)", "Table 4",
              "value", "lightfr-authors", metric="opt:HR@10", paper_a=0.8615, paper_dataset="FilmTrust",
              datasets=("filmtrust-authors",), margin=0.02),
        Claim("T4-value-1m", "LightFR HR@10 0.5014 on ML-1M", "Table 4", "value", "lightfr-paper", metric="HR@10",
              paper_a=0.5014, paper_dataset="ML-1M", datasets=("ml-1m",), margin=0.02),
        Claim("T6-para", "Agg_grad beats Agg_para", "Table 6", "better", "lightfr-paper", "lightfr-paper-para",
              "HR@10", paper_a=0.8615, paper_b=0.8589, paper_dataset="FilmTrust"),
        Claim("T6-init", "federated training beats its MF initialisation (LightFR_para > LightFR_init)", "Table 6",
              "better", "lightfr-paper-para", "lightfr-paper-init", "HR@10", paper_a=0.8589, paper_b=0.6129,
              paper_dataset="FilmTrust"),
        Claim("T6-random", "MF initialisation beats random codes (LightFR_init > Random)", "Table 6", "better",
              "lightfr-paper-init", "lightfr-random", "HR@10", paper_a=0.6129, paper_b=0.5793,
              paper_dataset="FilmTrust"),
        Claim("T4-ncf", "centralised NCF is above LightFR", "Table 4", "better", "ncf-central", "lightfr-paper",
              "HR@10", paper_a=0.8827, paper_b=0.8615, paper_dataset="FilmTrust"),
        # the rating baselines trained on the explicit ratings and ranked by predicted rating (LightFR's
        # evaluation, docs/baselines.md): the rating presets report RMSE, not HR@10
        Claim("T4-pmf", "centralised PMF is above LightFR", "Table 4", "better", "pmf-rank", "lightfr-paper", "HR@10",
              paper_a=0.8704, paper_b=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-svdpp", "centralised SVD++ is above LightFR", "Table 4", "better", "svdpp-rank", "lightfr-paper",
              "HR@10", paper_a=0.8793, paper_b=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-ddl", "centralised DDL (hashing) is above LightFR", "Table 4", "better", "ddl", "lightfr-paper",
              "HR@10", paper_a=0.8630, paper_b=0.8615, paper_dataset="FilmTrust"),
        Claim("T4-fcf", "LightFR beats FCF", "Table 4", "better", "lightfr-paper", "fcf", "HR@10", paper_a=0.8615,
              paper_b=0.8543, paper_dataset="FilmTrust"),
        Claim("T4-fedrec", "LightFR beats FedRec", "Table 4", "better", "lightfr-paper", "fedrec-rank", "HR@10",
              paper_a=0.8615, paper_b=0.8503, paper_dataset="FilmTrust"),
        # metamf-rank: MetaMF trained on the ratings and ranked by predicted rating (the rating preset `metamf`
        # reports RMSE, not HR@10); our MetaMF differs from the paper's as docs/baselines.md states
        Claim("T4-metamf", "LightFR beats MetaMF", "Table 4", "better", "lightfr-paper", "metamf-rank", "HR@10",
              paper_a=0.8615, paper_b=0.8566, paper_dataset="FilmTrust"),
        Claim("T4-privrec", "LightFR beats PrivRec", "Table 4", "better", "lightfr-paper", "privrec", "HR@10",
              paper_a=0.8615, paper_b=0.8605, paper_dataset="FilmTrust"),
        Claim("T4-fedmf", "LightFR beats FedMF", "Table 4", "better", "lightfr-paper", "fedmf", "HR@10",
              paper_a=0.8615, paper_b=0.8601, paper_dataset="FilmTrust",
              needs="FedMF here is a rating model (RMSE/MAE on an 80/20 split); it has no ranking evaluation"),
    ),
)

FEL = Paper(
    name="fel",
    title="FEL (Hejazinia et al., 2022)",
    metrics=("AUC", "HR@10", "NDCG@10"),
    claims=(
        Claim("T2-nn", "FEL (over-arch NN) beats vanilla FL trained on the same users (+2.31% AUC)", "Table 2 (Taobao)",
              "better", "fel-paper", "fel-paper-fl", "AUC", paper_a=0.5544, paper_b=0.5418, paper_dataset="Taobao"),
        Claim("T2-mean", "FEL (mean) beats vanilla FL trained on the same users (+1.92% AUC)", "Table 2 (Taobao)",
              "better", "fel-paper-mean", "fel-paper-fl", "AUC", paper_a=0.5522, paper_b=0.5418,
              paper_dataset="Taobao"),
        Claim("cap-nn", "the gain comes from the ensemble, not its size: FEL (NN) beats one model of the ensemble's "
              "size (dim 64) on the same users", "Section 1 ('high capacity'), control of issue 25", "better",
              "fel-paper", "fel-paper-fl-wide", "AUC", paper_dataset="Taobao"),
        Claim("cap-mean", "FEL (mean) beats one model of the ensemble's size (dim 64) on the same users",
              "Section 1, control of issue 25", "better", "fel-paper-mean", "fel-paper-fl-wide", "AUC",
              paper_dataset="Taobao"),
        Claim("bag", "the gain comes from clustering, not from ensembling: FEL (mean) beats a bag of 4 unclustered "
              "models of a leaf's size (each trained on every user, the same mean)", "control of issue 25",
              "better", "fel-paper-mean", "fel-paper-bag", "AUC", paper_dataset="Taobao"),
        Claim("bag-nn", "FEL (over-arch NN) beats a bag of 4 unclustered models combined by the same over-arch",
              "control of issue 25", "better", "fel-paper", "fel-paper-bag-nn", "AUC", paper_dataset="Taobao"),
        Claim("T2-order", "the over-arch NN is the best aggregator, above the mean", "Table 2", "better", "fel-paper",
              "fel-paper-mean", "AUC", paper_a=0.5544, paper_b=0.5522, paper_dataset="Taobao"),
        Claim("T2-floor", "FL and FEL learn: above the popularity floor in AUC", "Table 2", "better", "fel-paper-fl",
              "itempop", "AUC", paper_a=0.5418, paper_dataset="Taobao"),
    ),
)

STTFEDREC = Paper(
    name="sttfedrec",
    title="STTFedRec (Qin et al., 2022)",
    metrics=("AUC", "Precision@10", "NDCG@10", "HR@10", "bytes"),
    claims=(
        Claim("RQ1-auc", "no performance loss: STTFedRec-DSSM matches FL-DSSM (AUC 69.05 vs 69.34)",
              "Table 2 (MovieLens-1M), RQ1", "similar", "sttfedrec-paper", "fl-dssm-paper", "AUC",
              paper_a=0.6905, paper_b=0.6934, paper_dataset="ML-1M", margin=0.01),
        Claim("RQ1-ndcg", "no performance loss in NDCG@10 (22.61 vs 22.86)", "Table 2 (MovieLens-1M)", "similar",
              "sttfedrec-paper", "fl-dssm-paper", "NDCG@10", paper_a=0.2261, paper_b=0.2286, paper_dataset="ML-1M",
              margin=0.01),
        Claim("T2-central", "centralised DSSM is above STTFedRec-DSSM (AUC 78.55 vs 69.05)", "Table 2 (MovieLens-1M)",
              "better", "centralized-dssm-paper", "sttfedrec-paper", "AUC", paper_a=0.7855, paper_b=0.6905,
              paper_dataset="ML-1M"),
        Claim("T2-fcf", "FCF is above FL-DSSM (AUC 73.56 vs 69.34)", "Table 2 (MovieLens-1M)", "better", "fcf",
              "fl-dssm-paper", "AUC", paper_a=0.7356, paper_b=0.6934, paper_dataset="ML-1M"),
        Claim("T2-fedmvmf", "FedMVMF is above FL-DSSM (AUC 74.75 vs 69.34)", "Table 2 (MovieLens-1M)", "better",
              "fedmvmf", "fl-dssm-paper", "AUC", paper_a=0.7475, paper_b=0.6934, paper_dataset="ML-1M"),
        Claim("T3-comm", "STTFedRec halves the training communication of FL-DSSM (5.42 vs 2.71 MB: 2x)",
              "Table 3 (MovieLens-1M)", "ratio", "sttfedrec-paper", "fl-dssm-paper", "bytes", higher=False,
              paper_a=2.71, paper_b=5.42, paper_dataset="ML-1M", margin=0.9),
        Claim("T2-floor", "the towers learn: STTFedRec-DSSM above the popularity floor in AUC", "Table 2",
              "better", "sttfedrec-paper", "itempop", "AUC", paper_a=0.6905, paper_dataset="ML-1M"),
        Claim("T2-value", "STTFedRec-DSSM AUC 0.6905 on MovieLens-1M", "Table 2", "value", "sttfedrec-paper",
              metric="AUC", paper_a=0.6905, paper_dataset="ML-1M", datasets=("ml-1m",), margin=0.02),
    ),
)

FEDCL = Paper(
    name="fedcl",
    title="FedCL (Wu et al., 2022)",
    # full ranking only (negatives 0), as the paper ranks against every item: the recorded metrics and the
    # best-validation round are then the full-ranking ones
    common={"split": {"validation": True}, "eval": {"ks": [5, 10], "full_ranking": True, "negatives": 0}},
    metrics=("HR@10", "NDCG@10", "best:HR@10"),
    claims=(
        Claim("T3-fed", "GRU4Rec+FedCL beats GRU4Rec+Fed (HR@10 0.2013 vs 0.1025)", "Table 3 (ML-1M)", "better",
              "fedcl-paper", "fed-paper", "HR@10", paper_a=0.2013, paper_b=0.1025, paper_dataset="ML-1M"),
        Claim("T3-fed-ndcg", "GRU4Rec+FedCL beats GRU4Rec+Fed in NDCG@10 (0.0940 vs 0.0531)", "Table 3 (ML-1M)",
              "better", "fedcl-paper", "fed-paper", "NDCG@10", paper_a=0.0940, paper_b=0.0531,
              paper_dataset="ML-1M"),
        Claim("T3-central", "GRU4Rec+FedCL beats centralised GRU4Rec (0.2013 vs 0.1662)", "Table 3 (ML-1M)", "better",
              "fedcl-paper", "centralized-gru-paper", "HR@10", paper_a=0.2013, paper_b=0.1662,
              paper_dataset="ML-1M"),
        Claim("T3-fedloss", "federated training loses to centralised (GRU4Rec 0.1662 vs +Fed 0.1025)",
              "Table 3 (ML-1M)", "better", "centralized-gru-paper", "fed-paper", "HR@10", paper_a=0.1662,
              paper_b=0.1025, paper_dataset="ML-1M"),
        Claim("T3-ncf", "NCF+FedCL beats NCF+Fed (0.0675 vs 0.0275)", "Table 3 (ML-1M)", "better", "fedcl-ncf",
              "ncf-fed", "HR@10", paper_a=0.0675, paper_b=0.0275, paper_dataset="ML-1M"),
        Claim("T3-floor", "FedCL is above the popularity floor", "Table 3", "better", "fedcl-paper", "itempop",
              "HR@10", paper_a=0.2013, paper_dataset="ML-1M"),
        Claim("T3-value", "GRU4Rec+FedCL HR@10 0.2013 on ML-1M", "Table 3", "value", "fedcl-paper",
              metric="HR@10", paper_a=0.2013, paper_dataset="ML-1M", datasets=("ml-1m",), margin=0.02),
    ),
)

PAPERS: dict[str, Paper] = {p.name: p for p in (FEDFAST, LIGHTFR, FEL, STTFEDREC, FEDCL)}
CLAIMS: dict[str, tuple[Claim, ...]] = {name: p.claims for name, p in PAPERS.items()}
