"""``python -m kvvmm``: the same as the ``kvvmm`` command."""

from kvvmm.cli import main

raise SystemExit(main())
