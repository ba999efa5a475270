"""`python -m radixlm.launch_server [options]`, the same as `radixlm serve`."""

from __future__ import annotations

import sys

from radixlm.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
