"""The run viewer: an offline page of a run's metrics and rollout dumps.

``inputs`` reads run folders (metrics, the list of dumps) and turns bad input into
messages naming the file; ``site`` writes the page (a copy of the static files in
``static/``, Plotly's bundle, a manifest of the runs and one small script per dump);
``serve`` serves the same page from 127.0.0.1, reading each dump when it is asked for.
``python -m skyrl_train.entrypoints.view`` is the command.
"""
