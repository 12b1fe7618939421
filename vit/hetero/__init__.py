"""Mixed GPUs and memory: the census of every rank (census), per-layer costs and times (profile), the planners
(stages, batch_split: pure, tested against brute force), the fp16 loss-scale probe (loss_scale), what a rank holds
(footprint) and what fits (memory); adapt() runs them before the engine is built (adapt.time_each_rank: at a
freeze point, for the re-plan)."""
