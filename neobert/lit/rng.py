"""Every random number generator a run draws from (Python, NumPy, torch CPU, CUDA), captured and put back.

Used where work must not disturb the run around it: an evaluation inside pretraining (the run draws the same
masks and dropout with or without it) and GradCache's second pass (each chunk's dropout repeats exactly).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class RngState:
    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: Optional[list]

    @classmethod
    def capture(cls) -> "RngState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

    @contextlib.contextmanager
    def restored(self):
        """Runs the block from this state, then puts back the state the generators had before it."""
        before = RngState.capture()
        self.restore()
        try:
            yield
        finally:
            before.restore()
