"""What the training loop is made of besides the engine: optimizer and schedule, EMA, evaluation,
step statistics, checkpoints, and the plain single-process reference every engine is tested against.
"""
