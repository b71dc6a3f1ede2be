"""AIME-style competition math, single-turn (SkyRL's ``aime``)."""

from skyrl_gym.envs.aime.env import AIMEEnv

__all__ = ["AIMEEnv"]
