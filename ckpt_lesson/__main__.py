import sys

from ckpt_lesson.cli import main

sys.exit(main())
