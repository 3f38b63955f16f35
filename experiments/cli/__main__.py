"""``python -m experiments.cli``: the same as the ``secagg`` console command."""

import sys

from experiments.cli import main

sys.exit(main())
