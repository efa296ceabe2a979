"""``python -m torchturbo``: the same as the ``torchturbo`` command (and what torchrun runs)."""

from torchturbo.cli import main

raise SystemExit(main())
