import sys

from .zoo import main

sys.exit(main())
