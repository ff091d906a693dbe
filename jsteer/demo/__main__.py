import sys

from jsteer.demo import main

sys.exit(main())
