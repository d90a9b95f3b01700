import sys

from specdec.bench.cli import main

sys.exit(main())
