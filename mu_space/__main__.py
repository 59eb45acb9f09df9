import sys

from mu_space.selfcheck import main

sys.exit(main())
