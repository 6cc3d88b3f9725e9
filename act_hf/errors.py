"""Errors and warnings raised by act_hf.

Every error subclasses :class:`ActHFError` *and* the natural builtin (``ValueError``, ``RuntimeError``,
``TypeError``), so callers can catch either.
"""

from __future__ import annotations

__all__ = ["ActHFError", "ActHFRuntimeError", "ActHFTypeError", "ActHFValueError", "ActHFWarning", "NoMatchingModuleError"]


class ActHFError(Exception):
    """Base class of every act_hf error."""


class ActHFValueError(ActHFError, ValueError):
    """An argument has a value act_hf does not accept."""


class ActHFTypeError(ActHFError, TypeError):
    """An argument has a type act_hf does not accept."""


class ActHFRuntimeError(ActHFError, RuntimeError):
    """Something act_hf needs at run time is missing (the CUDA extension, say)."""


class NoMatchingModuleError(ActHFValueError):
    """``patch`` found nothing to patch in the model."""


class ActHFWarning(UserWarning):
    """A warning the user can act on (a silent fallback would lose memory savings)."""
