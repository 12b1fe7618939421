"""The planner: one cost model for every engine, from the measured cluster (docs/planner.md).

cost: the inputs (ranks, links, the job's layers, the calibration) and the communication primitives;
predict: one candidate's step time (compute / link / bubble / fixed) and per-rank memory; search:
the candidates (engine, ZeRO stage, stages and partition, micro-batch, batch split, compression)
ranked by predicted time per image; inputs: a run's cluster.json and config.json and a link file
read into the model's inputs; cli: `python -m vit.planner`. Pure except inputs (which builds the
model's layers on the CPU to profile them)."""
