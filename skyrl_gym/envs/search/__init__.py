"""Search-augmented question answering (``search``): the environment, exact-match
scoring, and a local BM25 retriever with a demo corpus for offline runs."""

from skyrl_gym.envs.search.env import MissingGroundTruthError, SearchEnv, SearchEnvConfig
from skyrl_gym.envs.search.local_retriever import BM25Index, load_corpus, serve_retriever
from skyrl_gym.envs.search.utils import compute_score, em_check, extract_solution

__all__ = [
    "BM25Index",
    "MissingGroundTruthError",
    "SearchEnv",
    "SearchEnvConfig",
    "compute_score",
    "em_check",
    "extract_solution",
    "load_corpus",
    "serve_retriever",
]
