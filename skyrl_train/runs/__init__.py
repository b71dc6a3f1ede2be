"""What a run leaves on disk, and the rules that protect it: ``folder`` (a run's folder,
claimed by ``run.json``, refused to a second run), ``checkpoint`` (step folders written
whole or not at all, verified against their manifest), ``rank_state`` (each trainer
rank's plain-data file), ``export`` (Hugging Face folders of the trained model, written
aside and renamed into place). Below ``config`` in the package order: launch validation
checks a run folder before anything starts."""
