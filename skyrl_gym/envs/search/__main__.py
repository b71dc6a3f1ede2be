"""``python -m skyrl_gym.envs.search``: serve a corpus over ``/retrieve`` (BM25) until
interrupted; ``--help`` lists the options."""

from skyrl_gym.envs.search.local_retriever import main

main()
