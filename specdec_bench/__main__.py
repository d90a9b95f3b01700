import sys

from specdec_bench.cli import main

sys.exit(main())
