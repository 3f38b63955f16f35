"""``secagg data ...``: download MovieLens archives and inspect interaction files.

Sub-commands:

* ``secagg data download {ml-100k,ml-1m,ml-latest-small} [--data-dir DIR] [--base-url URL] [--json]``
* ``secagg data info PATH [--format F] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys

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
        description="Load an interaction file (u.data, ratings.dat, ratings.csv, generic CSV, or a "
        "folder holding one of them) and print its one-line description and statistics.",
    )
    info.add_argument("path", help="file or folder")
    info.add_argument(
        "--format",
        dest="fmt",
        default=None,
        choices=["ml-100k", "ml-1m", "ml-csv", "csv"],
        help="file format (default: inferred from the file name)",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    info.set_defaults(func=_cmd_info)


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
        print(json.dumps(result.as_dict(), sort_keys=True))
    else:
        print(result.message())
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from recmodels.data import interaction_stats
    from recmodels.loaders import load_interactions

    data = load_interactions(args.path, fmt=args.fmt)
    stats = interaction_stats(data)
    if args.json:
        print(json.dumps(stats, sort_keys=True))
    else:
        print(data.describe())
        for key, value in stats.items():
            if key not in ("source",):
                print(f"  {key}: {value}")
    return 0
