"""What a run records as it goes: JSON-lines metrics, the GPU/CPU monitor and the trackers. Reading
them back is vit.reports'."""
