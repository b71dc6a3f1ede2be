"""The gym's exception tree: one root, ``EnvError``.

    EnvError (ValueError)   root; raised itself for caller mistakes
      CalcError             the calculator tool refused an expression (envs/calculator.py)

Bad *actions* never raise: an environment scores them and answers with a message.
``EnvError`` is for caller mistakes (unknown environment name, wrong keyword
arguments, stepping a finished episode), which retrying cannot fix; its message reads
``env.field: expected X, got Y``. ``CalcError`` never leaves the calculator: the tool
turns it into the ``<result>error: …</result>`` the model reads.
"""

from __future__ import annotations


class EnvError(ValueError):
    """An environment was asked for something it cannot do; names the field."""
