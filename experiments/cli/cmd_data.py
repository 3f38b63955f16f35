"""``secagg data ...``: download MovieLens archives and inspect interaction files.

Sub-commands:

* ``secagg data download {ml-100k,ml-1m,ml-latest-small} [--data-dir DIR] [--base-url URL] [--json]``
* ``secagg data info PATH [--format F] [--columns user=..,item=..,rating=..,timestamp=..] [--sep S] [--json]``:
  loads any CSV/TSV (the format, delimiter, header and columns are inferred from the content) and
  prints what it inferred beside the statistics
* ``secagg data bench [--data PATH] [--seed S] [--json]``: times the data pipeline and the
  evaluation (load, split, candidate sampling, ItemPop sampled and full ranking, and a
  6,000 x 4,000 full ranking on synthetic data).
"""

from __future__ import annotations

import argparse
import sys

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg data download`` and ``secagg data info``."""
    parser = subparsers.add_parser(
        "data",
        help="download MovieLens archives and describe interaction files",
        description="Datasets. Every --json output is one JSON object on the last line of stdout.",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])

    dl = sub.add_parser(
        "download",
        help="fetch an official GroupLens archive, verify its checksum, extract it",
        description="Fetch an official GroupLens MovieLens archive, verify it against a pinned "
        "SHA-256 (ml-100k, ml-1m) or the checksum GroupLens publishes beside it, and extract it "
        "atomically into DATA_DIR/<name>/.",
    )
    dl.add_argument("name", choices=["ml-100k", "ml-1m", "ml-latest-small"], help="dataset name")
    dl.add_argument(
        "--data-dir",
        default=None,
        help="target folder (default: $SECAGG_DATA_DIR or ~/.cache/secagg/datasets)",
    )
    dl.add_argument(
        "--base-url",
        default=None,
        help="mirror serving <name>.zip (default: https://files.grouplens.org/datasets/movielens)",
    )
    dl.add_argument("--force", action="store_true", help="re-download even if already present")
    dl.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    dl.set_defaults(func=_cmd_download)

    info = sub.add_parser(
        "info",
        help="load an interaction file and print its size and statistics",
        description="Load an interaction file (u.data, ratings.dat, ratings.csv, any CSV/TSV, or a "
        "folder holding one of them), print how it was read (format, delimiter, header, columns; "
        "inferred from the content unless given) and its statistics.",
    )
    info.add_argument("path", help="file or folder")
    info.add_argument(
        "--format",
        dest="fmt",
        default=None,
        choices=["ml-100k", "ml-1m", "ml-csv", "csv"],
        help="file format (default: inferred from the name and the content)",
    )
    info.add_argument(
        "--columns",
        default=None,
        metavar="user=NAME,item=NAME[,rating=NAME][,timestamp=NAME]",
        help="which column holds each role: header names or 0-based indices, 'none' for absent "
        "(default: inferred from the header names, e.g. userId/user_id, movieId/item_id, rating, timestamp)",
    )
    info.add_argument("--sep", default=None, help="delimiter, one character or '::' (default: inferred)")
    info.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser(
        "bench",
        help="time loading, splitting, sampling and evaluation (ItemPop as the scorer)",
        description="Time the data pipeline and the evaluation: load PATH (default: the "
        "synthetic data), binarise (every rating positive), keep users with >= 2 interactions, "
        "leave-one-out, 99 sampled negatives, ItemPop sampled and full-ranking metrics, and a "
        "6000 x 4000 full ranking of a random 32-dim factor model on synthetic data.",
    )
    bench.add_argument("--data", default=None, help="interaction file or folder (default: synthetic)")
    bench.add_argument("--format", dest="fmt", default=None, choices=["ml-100k", "ml-1m", "ml-csv", "csv"])
    bench.add_argument("--seed", type=int, default=0, help="split and sampling seed (default 0)")
    bench.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    bench.set_defaults(func=_cmd_bench)


def _cmd_download(args: argparse.Namespace) -> int:
    from recmodels.download import DownloadError, download_dataset

    try:
        result = download_dataset(
            args.name,
            data_dir=args.data_dir,
            base_url=args.base_url,
            force=args.force,
            progress=sys.stderr,
        )
    except DownloadError as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        print(jsonio.dumps(result.as_dict(), sort_keys=True))
    else:
        print(result.message())
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from recmodels.data import interaction_stats
    from recmodels.loaders import load_with_format
    from recmodels.sniff import parse_columns, parse_sep

    columns = parse_columns(args.columns) if args.columns is not None else None
    sep = parse_sep(args.sep) if args.sep is not None else None
    data, layout = load_with_format(args.path, fmt=args.fmt, columns=columns, sep=sep)
    stats = interaction_stats(data)
    stats["format"] = layout.as_dict()
    if args.json:
        print(jsonio.dumps(stats, sort_keys=True))
    else:
        print(data.describe())
        print(f"  read as: {layout.describe()}")
        if layout.fmt == "csv":
            print(f"  to read it the same way: --format csv --sep {layout.delimiter!r} --columns {layout.columns_spec()}")
        for key, value in stats.items():
            if key not in ("source", "format"):
                print(f"  {key}: {value}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    from recmodels.data import binarize, filter_min_interactions
    from recmodels.loaders import load_interactions
    from recmodels.metrics import evaluate_full, evaluate_sampled
    from recmodels.sampling import sample_eval_candidates, sample_train_negatives
    from recmodels.splits import leave_one_out
    from recmodels.synthetic import generate_synthetic

    seconds: dict[str, float] = {}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        seconds[name] = round(time.perf_counter() - start, 4)
        return out

    if args.data is None:
        raw = timed("load", lambda: generate_synthetic(seed=args.seed))
    else:
        raw = timed("load", lambda: load_interactions(args.data, fmt=args.fmt))
    data = timed("binarize_filter", lambda: filter_min_interactions(binarize(raw), min_user=2))
    split = timed("leave_one_out", lambda: leave_one_out(data, seed=args.seed))
    rng = np.random.default_rng(args.seed)
    cands = timed("eval_candidates_99", lambda: sample_eval_candidates(split, n_negatives=99, rng=rng))
    timed("train_negatives_x4", lambda: sample_train_negatives(split.train, n_neg=4, rng=rng))
    pop = np.bincount(split.train.items, minlength=data.n_items).astype(np.float64)
    sampled = timed("itempop_sampled_eval", lambda: evaluate_sampled(lambda u, i: pop[i], cands))
    full = timed(
        "itempop_full_eval",
        lambda: evaluate_full(lambda u: np.broadcast_to(pop, (len(u), pop.size)), split),
    )
    big = generate_synthetic(n_users=6000, n_items=4000, mean_interactions=150, seed=1)
    big_split = leave_one_out(big, seed=0)
    frng = np.random.default_rng(0)
    w = frng.standard_normal((6000, 32)).astype(np.float32)
    h = frng.standard_normal((4000, 32)).astype(np.float32)
    timed("full_ranking_6000x4000", lambda: evaluate_full(lambda u: w[u] @ h.T, big_split))
    result = {
        "data": data.describe(),
        "protocol": split.protocol,
        "itempop_sampled": {k: sampled[k] for k in ("HR@10", "NDCG@10")},
        "itempop_full": {k: full[k] for k in ("HR@10", "NDCG@10")},
        "seconds": seconds,
        "note": "wall-clock seconds on this machine; noisy under shared load",
    }
    if args.json:
        print(jsonio.dumps(result, sort_keys=True))
    else:
        print(result["data"])
        print(f"  ItemPop sampled (99 neg): HR@10 {sampled['HR@10']:.4f}  NDCG@10 {sampled['NDCG@10']:.4f}")
        print(f"  ItemPop full ranking:     HR@10 {full['HR@10']:.4f}  NDCG@10 {full['NDCG@10']:.4f}")
        for name, value in seconds.items():
            print(f"  {name}: {value:.3f} s")
    return 0
