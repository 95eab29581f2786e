"""`python -m clipbench.commands.worker MANIFEST RUN_ID ...`: the former name of `clipbench.sweep.worker`
(the unit of work of every launcher, which lives with the sweep), kept so that job arrays written
for earlier releases keep working."""

import sys

from clipbench.sweep.worker import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
