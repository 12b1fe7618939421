"""Freeze training: the freeze rules and the engine rebuild at a freeze point, the pipeline
re-planned for the layers still training, and the frozen prefix's activation cache."""
