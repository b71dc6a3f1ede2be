"""Training side of the R3 pipeline: generator, preprocessing, trainer and workers."""
