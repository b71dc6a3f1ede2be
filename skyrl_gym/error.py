"""The gym's exception tree, rooted where SkyRL's is (``skyrl_gym.error.Error``).

    Error (Exception)                 SkyRL's root
      EnvError (ValueError)           a caller's mistake; names the field
        RegistrationError             a bad or duplicate ``register`` call (SkyRL's name)
        EnvTypeError (TypeError)      ``make``: kwargs don't fit the factory, or no ``Env`` came back
        CalcError                     the calculator tool refused an expression
        SandboxError                  the sandbox could not start (not the program's fault)

Bad *actions* never raise: an environment scores them and answers with a message.
``EnvError`` is for caller mistakes (an unknown environment id, a missing
``reward_spec``, a malformed step output), which retrying cannot fix; its message reads
``env.field: expected X, got Y``. ``CalcError`` never leaves the calculator: the tool
turns it into the observation the model reads. ``EnvTypeError`` is also a
``TypeError`` because SkyRL's ``make`` raises that for the same mistakes.
"""

from __future__ import annotations


class Error(Exception):
    """Root of every exception the gym raises."""


class EnvError(Error, ValueError):
    """An environment was asked for something it cannot do; names the field."""


class RegistrationError(EnvError):
    """``register`` refused an id or entry point (SkyRL raises it for a duplicate id)."""


class EnvTypeError(EnvError, TypeError):
    """``make(id, **kwargs)``: the keyword arguments don't fit the environment's factory,
    or it returned something other than a ``skyrl_gym.Env``."""


class SandboxError(EnvError):
    """The sandbox itself failed (could not create its directory or start the process).

    A program that misbehaves inside the sandbox never raises this: it gets a result
    saying how it ended. This means the host is misconfigured, and retrying won't help.
    """
