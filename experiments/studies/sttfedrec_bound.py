"""How far above ItemPop can STTFedRec's features take a ranking? (issue 10, "well above ItemPop").

``python -m experiments.studies.sttfedrec_bound --data PATH [--config TOML] [--run RUN_DIR ...] [--json]``

No training: three cheap reference scorers on the framework's split and sampled candidates (the
same seed, leave-one-out split and 99 negatives as ``secagg run``), each scored with
``recmodels.metrics.evaluate_sampled``:

* ``content``: ItemPop blended with the content profile the two-tower model sees,
  ``log(1 + popularity_i) + beta * cos(user_x, item_x)`` over the letter-trigram vectors of
  :func:`protocols.twotower_data.build_features` (``user_features`` ``"clicks"``: the first five
  clicks' titles, the presets' rule; ``"history"``: all the user's training clicks), for a grid
  of ``beta`` (``beta = 0`` is ItemPop). The best ``beta`` bounds what a scorer combining
  popularity with the title/genre profile linearly can add.
* ``item-knn``: a collaborative reference, item-item cosine over the training clicks
  (``score(u, i) = sum_{j in clicks(u)} cos(i, j)``): what a user signal made of click *ids*
  reaches.
* ``--run RUN_DIR`` (a finished ``sttfedrec`` or ``fl-twotower`` run): the trained model with the
  device's user vector blended with the mean of the (downloaded, normalised) item embeddings of
  its own training clicks, ``u / |u| + lam * h / |h|``, for a grid of ``lam`` (``lam = 0`` is the
  model as trained). Device-local (the inference payload holds every embedding), so nothing
  about the user moves; measured to see whether the trained embeddings carry collaborative
  structure the user tower does not use.

Prints one JSON line per point and (``--json``) one object with every row last.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np
import scipy.sparse as sp

from experiments import jsonio

__all__ = ["main"]

BETAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def _unit_rows(m: sp.spmatrix) -> sp.csr_matrix:
    m = sp.csr_matrix(m, dtype=np.float64)
    n = np.sqrt(np.asarray(m.multiply(m).sum(1)).ravel())
    n[n == 0] = 1.0
    return sp.csr_matrix(sp.diags(1.0 / n) @ m)


def _pairwise(a: sp.csr_matrix, b: sp.csr_matrix, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """``[len(users), n_candidates]`` of ``a[u] . b[i]`` for each user's candidates."""
    rows = a[np.asarray(users)]
    return np.stack([(rows[k] @ b[it].T).toarray().ravel() for k, it in enumerate(np.asarray(items))])


def content_rows(prep: Any, source: str, base: Any) -> list[dict[str, Any]]:
    """ItemPop + beta * content-profile cosine, for both user-feature rules."""
    from protocols.twotower_data import build_features
    from recmodels.metrics import evaluate_sampled

    train = prep.split.train
    logpop = np.log1p(np.bincount(train.items, minlength=train.n_items).astype(np.float64))
    out = []
    for rule in ("clicks", "history"):
        d = build_features(train, source, replace(base, tower="dssm", user_features=rule), prep.exclude)
        ux, ix = _unit_rows(d.user_x), _unit_rows(d.item_x)
        for beta in BETAS:
            def score(users, items, beta=beta, ux=ux, ix=ix):
                return logpop[np.asarray(items)] + beta * _pairwise(ux, ix, users, items)
            m = evaluate_sampled(score, prep.candidates, ks=(10,))
            out.append({"scorer": "content", "user_features": rule, "beta": beta,
                        "HR@10": round(m["HR@10"], 4), "NDCG@10": round(m["NDCG@10"], 4)})
            print(jsonio.dumps(out[-1]), flush=True)
    return out


def knn_row(prep: Any) -> dict[str, Any]:
    """Item-item cosine over the training clicks (the collaborative reference)."""
    from recmodels.metrics import evaluate_sampled

    train = prep.split.train
    clicks = sp.csr_matrix((np.ones(len(train)), (train.users, train.items)), shape=(train.n_users, train.n_items))
    items = _unit_rows(clicks.T)
    sim = sp.csr_matrix(items @ items.T)
    m = evaluate_sampled(lambda u, i: _pairwise(clicks, sim, u, i), prep.candidates, ks=(10,))
    row = {"scorer": "item-knn", "HR@10": round(m["HR@10"], 4), "NDCG@10": round(m["NDCG@10"], 4)}
    print(jsonio.dumps(row), flush=True)
    return row


def blend_rows(run_dir: str) -> list[dict[str, Any]]:
    """A trained run's model with the device's click-embedding mean blended into its user vector."""
    import torch

    from experiments.run.config import load_config_file
    from experiments.run.prepare import prepare_data
    from protocols.state import load_state
    from protocols.sttfedrec import STTFedRec
    from recmodels.metrics import evaluate_sampled

    cfg = load_config_file(f"{run_dir}/config.toml")
    mode = {"sttfedrec": "split", "fl-twotower": "fl"}.get(cfg.run.protocol)
    if mode is None:
        raise SystemExit(f"{run_dir} is a {cfg.run.protocol!r} run; --run takes sttfedrec or fl-twotower runs")
    prep = prepare_data(cfg)
    model = STTFedRec(prep.split.train, cfg.protocol_config, seed=cfg.run.seed, source=cfg.data.source,
                      exclude=prep.exclude, mode=mode)
    model.load_state_dict(load_state(f"{run_dir}/checkpoint.safetensors")["trainer"])
    emb = model.item_embeddings()
    train = prep.split.train  # every click the device holds (feature clicks included)
    clicks = torch.zeros(train.n_users, train.n_items)
    clicks[torch.as_tensor(train.users), torch.as_tensor(train.items)] = 1.0
    hist = clicks @ emb
    hist = hist / hist.norm(dim=1, keepdim=True).clamp_min(1e-12)
    user = model.user_embeddings(np.arange(train.n_users))
    out = []
    for lam in LAMBDAS:
        v = user + lam * hist
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)

        def score(users, items, v=v):
            return (emb[torch.as_tensor(np.asarray(items))] * v[torch.as_tensor(np.asarray(users))].unsqueeze(1)).sum(-1).numpy()
        m = evaluate_sampled(score, prep.candidates, ks=(10,))
        out.append({"scorer": "model+click-embedding-mean", "run": run_dir, "lambda": lam,
                    "HR@10": round(m["HR@10"], 4), "NDCG@10": round(m["NDCG@10"], 4)})
        print(jsonio.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.sttfedrec_bound", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="ratings file or folder (its movies.csv gives the item texts)")
    p.add_argument("--config", default=None, help="TOML layered on the fl-dssm preset (split, eval, data sizes)")
    p.add_argument("--run", action="append", default=[], metavar="RUN_DIR", help="a finished sttfedrec/fl-twotower run")
    p.add_argument("--json", action="store_true", help="print every row as one JSON object last")
    args = p.parse_args(argv)
    from experiments.run.config import load_config_file, load_preset, merge
    from experiments.run.prepare import prepare_data

    base = load_preset("fl-dssm") if args.config is None else load_config_file(args.config, load_preset("fl-dssm"))
    cfg = merge(base, {"data": {"source": args.data}})
    prep = prepare_data(cfg)
    rows = content_rows(prep, cfg.data.source, cfg.protocol_config) + [knn_row(prep)]
    for run_dir in args.run:
        rows += blend_rows(run_dir)
    if args.json:
        print(jsonio.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
