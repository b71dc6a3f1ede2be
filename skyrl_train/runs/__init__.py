"""What a run leaves on disk, and the rules that protect it: ``folder`` (a run's folder,
claimed by ``run.json``, refused to a second run), ``checkpoint`` (step folders written
whole or not at all, verified against their manifest), a rank's checkpoint
(``rank_contract``, ``rank_file``, ``reshard``, ``resume``: docs/design.md), ``export``
(Hugging Face folders of the trained model, written aside and renamed into place).
Below ``config`` in the package order: launch validation checks a run folder before
anything starts."""
