import sys

from moemesh.cli import main

sys.exit(main())
