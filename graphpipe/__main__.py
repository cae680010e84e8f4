import sys

from graphpipe.cli import main

sys.exit(main())
