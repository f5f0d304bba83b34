import sys

from moemesh.entrypoints.cli import main

sys.exit(main())
