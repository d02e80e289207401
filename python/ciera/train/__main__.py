import sys

from ciera.train.launcher import main

sys.exit(main())
