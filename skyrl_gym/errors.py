"""The gym's one exception class.

Bad *actions* never raise: an environment scores them and answers with a message.
``EnvError`` is for caller mistakes only (unknown environment name, wrong keyword
arguments, stepping a finished episode), which retrying cannot fix.
"""

from __future__ import annotations


class EnvError(ValueError):
    """An environment was asked for something it cannot do; names the field."""
