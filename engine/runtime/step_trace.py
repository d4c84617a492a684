"""A per-step timeline of an engine, written to a file: when each step's model work
started and ended, and how many tokens and requests it ran.

Set ``TANDEM_STEP_TRACE=PREFIX`` in the environment of a process that builds
engines (``tandem serve`` passes its environment on to its Ray workers) and every
engine it builds appends one line per executed step to ``PREFIX.<pid>``::

    <start> <end> <num_tokens> <num_requests>

``start``/``end`` are wall-clock seconds (``time.time()``, so lines from several
processes and a client's own timestamps share one clock) around
``ModelRunner.execute`` (the forward pass, LM head and sampling; scheduling and
output handling are outside it); ``num_tokens`` is the step's scheduled tokens
(prompt chunks plus decode tokens), ``num_requests`` its requests. A step whose
tokens equal its requests is a decode-only step. Lines are written unbuffered, so a
killed worker's file ends at its last step. ``benchmarks/step_timeline.py``
summarises a file (how busy the engine was over a client's run, step times by kind,
idle gaps).

It costs one formatted write per step (a few microseconds against steps of
milliseconds); with the variable unset nothing is opened or written.
"""

from __future__ import annotations

import os
import time
from typing import TextIO

ENV_VAR = "TANDEM_STEP_TRACE"


class StepTrace:
    """Appends step lines to ``<prefix>.<pid>``; see the module docstring.

    Raises:
        OSError: the file cannot be opened (at construction).
    """

    def __init__(self, prefix: str):
        self.path = f"{prefix}.{os.getpid()}"
        self._file: TextIO = open(self.path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        """A trace for ``$TANDEM_STEP_TRACE``, or None when it is unset or empty."""
        prefix = os.environ.get(ENV_VAR)
        return cls(prefix) if prefix else None

    @staticmethod
    def now() -> float:
        """The clock of the lines: wall-clock seconds."""
        return time.time()

    def record(self, start: float, end: float, num_tokens: int, num_requests: int) -> None:
        """One executed step: ``start``/``end`` from :meth:`now`."""
        self._file.write(f"{start:.6f} {end:.6f} {num_tokens} {num_requests}\n")

    def close(self) -> None:
        self._file.close()
