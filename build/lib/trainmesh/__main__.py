"""``python -m trainmesh ...``: the CLI with whichever interpreter runs it (how submitted jobs
run on a cluster whose PATH has no ``trainmesh`` script)."""

import sys

from trainmesh.cli.main import main

sys.exit(main())
