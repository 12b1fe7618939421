"""The cluster and what runs on it: the census of every rank (census, profile), the decisions it
settles before the engine is built (survey: precision, balanced stages, proportional batches, the
fp16 loss scale), the memory model and what fits (memory, fit, oom), and the planner: every
candidate's predicted step, priced by its engine's spec (predict), searched (search, stages,
batch_split, balance), --engine auto (auto), and `python -m vit.planner` (cli, inputs, links;
docs/planner.md)."""
