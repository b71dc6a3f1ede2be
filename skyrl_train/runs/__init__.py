"""What a run leaves on disk, and the rules that protect it: ``folder`` (a run's folder,
claimed by ``run.json``, refused to a second run), ``checkpoint`` (step folders written
whole or not at all, verified against their manifest), ``rank_state`` (each trainer
rank's plain-data file). Below ``config`` in the package order: launch validation
checks a run folder before anything starts."""
