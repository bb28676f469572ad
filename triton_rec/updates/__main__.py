"""``python -m triton_rec.updates``: :func:`triton_rec.updates.cli.main`."""

import sys

from triton_rec.updates.cli import main

sys.exit(main())
