"""Command-line entry kept at its documented name: ``python -m triton_rec.runtime
serve|prepare ...`` runs :func:`triton_rec.triton.runtime.main` (the launcher lives in
:mod:`triton_rec.triton.runtime`; import it from there)."""

import sys

from triton_rec.triton.runtime import main

if __name__ == "__main__":
    sys.exit(main())
