import sys

from luban.cli import main

sys.exit(main())
