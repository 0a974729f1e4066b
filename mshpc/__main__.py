import sys

from mshpc.cli import main

sys.exit(main())
