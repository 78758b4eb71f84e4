"""`python -m benchmarks.mlp_kernels`: the driver (driver.py), or one of its workers (--worker)."""

import sys

from benchmarks.mlp_kernels.driver import main

sys.exit(main())
