"""`python -m jaxsync`: the `jaxsync` console command."""

import sys

from jaxsync.harness._cli import main


sys.exit(main())
