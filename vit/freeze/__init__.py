"""Freeze training: the rules that decide how many layers are frozen (rules, measures), the engine
rebuilt at a freeze point (freezer), the pipeline re-planned for the layers still training (replan),
and the frozen prefix's activation cache (activation_cache)."""
