"""What every engine trains with besides itself: the optimizer and LR schedule, the EMA, evaluation,
the step statistics, and the plain single-process reference loop every engine is tested against."""
