import sys

from pipeline_ext.demo.cli import main

sys.exit(main())
