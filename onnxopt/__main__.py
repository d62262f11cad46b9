import sys

from onnxopt.cli import main

sys.exit(main())
