"""Errors the engine raises to its callers."""

from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A model could not be read: one line naming the file and the problem.

    Args:
      path: the file or directory at fault (or a spec such as ``"dummy:xyz"``).
      problem: what is wrong with it, in words a user can act on.
    """

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(path, problem)
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{os.fspath(self.path)}: {self.problem}"
