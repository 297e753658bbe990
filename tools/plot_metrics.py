"""Plot a run's metrics.jsonl as a grid of training curves (megatron_dapo/plotting.py).

    python tools/plot_metrics.py --metrics runs/x/metrics.jsonl --out curves.png [--keys K ...]
"""

import sys

from megatron_dapo.plotting import main

if __name__ == "__main__":
    sys.exit(main())
