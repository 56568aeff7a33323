"""`python -m jaxsync`: the `jaxsync` console command."""

import sys

from jaxsync._cli import main


sys.exit(main())
