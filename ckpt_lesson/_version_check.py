"""Refuse torch releases whose weights-only loader can be bypassed."""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 6)


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` for torch older than 2.6 (CVE-2025-32434).

    Before 2.6, ``torch.load(weights_only=True)`` could be made to run code
    by a crafted file, which defeats the whole point of a weights-only load.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"ckpt_lesson cannot parse the torch version {version!r}; install torch>=2.6.")
    if (int(match.group(1)), int(match.group(2))) < MIN_TORCH:
        raise ImportError(
            f"ckpt_lesson needs torch>=2.6, found {version}: older releases are affected by "
            "CVE-2025-32434 (a bypass of torch.load(weights_only=True)). "
            "Upgrade with: pip install 'torch>=2.6'."
        )
