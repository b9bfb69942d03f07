"""`python -m llmgw …`: the `llmgw` program (llmgw.main)."""

import sys

from llmgw.main import main

if __name__ == "__main__":
    sys.exit(main())
