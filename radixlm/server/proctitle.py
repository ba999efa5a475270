"""Process titles (`ps`, `top`, `htop`): `radixlm::api`,
`radixlm::scheduler_DP{d}_TP{t}`, `radixlm::detokenizer`,
`radixlm::dp_controller`, as SGLang names its processes, so an operator can
tell a server's processes apart instead of seeing `python3` several times."""

from __future__ import annotations

import setproctitle

PREFIX = "radixlm::"


def set_process_title(name: str) -> None:
    setproctitle.setproctitle(PREFIX + name)


def scheduler_title(dp_rank: int, tp_rank: int) -> str:
    return f"scheduler_DP{dp_rank}_TP{tp_rank}"
